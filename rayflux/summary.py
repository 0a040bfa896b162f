"""What a job did and where everything went: the summary the command prints at the end."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rayflux import datasets, storage
from rayflux.config import JobConfig


@dataclass
class Summary:
    """What a job did and where everything went."""

    output_dir: str = ""
    cache_dir: str = ""
    lora_path: str = ""
    checkpoint: str = ""
    ledger: str = ""
    discovered: int = 0
    cached: int = 0
    skipped: int = 0
    steps: int = 0
    losses: list = field(default_factory=list)
    history: list = field(default_factory=list)
    generations: list = field(default_factory=list)
    stage_seconds: dict = field(default_factory=dict)
    datasets: list = field(default_factory=list)
    """One dict per dataset: name, discovered, cached, skipped, unsampled, repeats, regularisation."""
    skip_reasons: dict = field(default_factory=dict)
    """Skip reason (its text up to the first colon) -> count."""
    skipped_report: str = ""
    validation_dir: str = ""
    tensorboard_dir: str = ""
    logs: str = ""
    dropped: dict = field(default_factory=dict)
    """Epoch -> samples the remainder rule left out of its bucket-pure batches."""
    eval_samples: int = 0
    """Samples held out for the eval loss (``data.eval_samples``)."""
    eval_file: str = ""
    best: tuple | None = None
    """``(step, eval loss, file)`` of the LoRA with the lowest eval loss; None without eval."""
    captions: str = ""
    """What the caption stage did (``captioned N, reused M (table)``); "" when it did not run."""

    def lines(self) -> list[str]:
        unsampled = sum(d["unsampled"] for d in self.datasets)
        out = [
            f"images: {self.discovered} discovered, {self.cached} cached, {self.skipped} skipped"
            + (f", {unsampled} left out by max_samples" if unsampled else "")
        ]
        if len(self.datasets) > 1 or unsampled:
            for d in self.datasets:
                role = "regularisation, " if d["regularisation"] else ""
                out.append(
                    f"  {d['name']}: {d['discovered']} discovered, {d['cached']} cached, {d['skipped']} skipped"
                    + (f", {d['unsampled']} left out" if d["unsampled"] else "")
                    + f" ({role}repeats {d['repeats']})"
                )
        for reason, n in sorted(self.skip_reasons.items(), key=lambda kv: -kv[1]):
            out.append(f"skipped:    {n} x {reason}")
        if self.skipped:
            out.append(f"skip list:  {self.skipped_report}")
        if self.captions:
            out.append(f"captions:   {self.captions}")
        out.append(f"cache:      {self.cache_dir}")
        if self.steps:
            out.append(f"training:   {self.steps} steps per worker, last loss {self.losses[-1]:.4f}")
            last = self.history[-1] if self.history else {}
            if "read_amplification" in last:  # the last epoch's reads, as the training loop counted them
                out.append(
                    f"reads:      {last['requests_per_sample']:.2f} requests per sample, "
                    f"{last['read_amplification']:.2f}x the tensors' bytes (epoch {last['epoch'] + 1})"
                )
            if any(self.dropped.values()):
                per_epoch = ", ".join(str(n) for _, n in sorted(self.dropped.items()))
                out.append(f"remainder:  samples left out of full batches per epoch: {per_epoch} (data.bucket_step)")
            out.append(f"LoRA:       {self.lora_path}")
            if self.eval_samples:
                out.append(f"eval:       {self.eval_samples} samples held out of training ({self.eval_file})")
            if self.best:
                out.append(f"best:       eval loss {self.best[1]:.4f} at step {self.best[0]}: {self.best[2]}")
            if self.validation_dir:
                out.append(f"validation: {self.validation_dir}")
            out.append(f"checkpoint: {self.checkpoint}")
        out.append(f"ledger:     {self.ledger}")
        if self.tensorboard_dir:
            out.append(f"metrics:    {self.tensorboard_dir} (tensorboard --logdir)")
        if self.logs:
            out.append(f"logs:       {self.logs}")
        out.append("time:       " + ", ".join(f"{k} {v:.1f}s" for k, v in self.stage_seconds.items()))
        return out


def account(summary: Summary, cfg: JobConfig, discovery: dict, gen_dir: str) -> None:
    """Per-dataset counts and grouped skip reasons, from the committed generation's skip list. ``discovery``: what
    :meth:`rayflux.generation_stages.GenerationStages.generation` kept of the generation's discovery."""
    from rayflux.cache import generations

    summary.skipped_report = storage.join(gen_dir, generations.SKIPPED)
    raw = storage.read_bytes(summary.skipped_report) if storage.exists(summary.skipped_report) else b""
    skipped = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    for s in skipped:
        reason = s["reason"].split(":", 1)[0]
        summary.skip_reasons[reason] = summary.skip_reasons.get(reason, 0) + 1
    for ds in datasets.datasets_of(cfg.data):
        key = datasets.key(cfg.data, ds)
        found = discovery["found"].get(key, 0)
        lost = sum(1 for s in skipped if s.get("dataset") == key)
        summary.datasets.append(
            {
                "name": datasets.label(ds),
                "discovered": found,
                "cached": found - lost,
                "skipped": lost,
                "unsampled": discovery["unsampled"].get(datasets.label(ds), 0),
                "repeats": ds.repeats,
                "regularisation": ds.regularisation,
            }
        )

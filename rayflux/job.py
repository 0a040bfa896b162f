"""The stage runner: validate -> cache(g0) -> train(segment 0) -> [cache(g1) -> train -> retire(g0)] ... -> export.

Every stage is recorded in the run's ledger; a rerun of the same command skips finished stages, discards a
half-built generation (or a committed one that lost a file), and resumes training from the last checkpoint. One job
at a time runs in a run directory and writes to a cache key: each holds a lease (:mod:`rayflux.lease`). Only the
``retire`` and ``discard`` stages ever delete cache files, and only at points where no worker can be reading them.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import time
from dataclasses import dataclass, field

from rayflux import console, datasets, families, lease, models, paths, progress, refresh, storage
from rayflux.connect import connect
from rayflux.config import ConfigError, JobConfig, refresh_interval, worker_range
from rayflux.ledger import Ledger

log = logging.getLogger("rayflux")


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
        out.append(f"cache:      {self.cache_dir}")
        if self.steps:
            out.append(f"training:   {self.steps} steps per worker, last loss {self.losses[-1]:.4f}")
            last = self.history[-1] if self.history else {}
            if "read_amplification" in last:  # the last epoch's reads, as the training loop counted them
                out.append(f"reads:      {last['requests_per_sample']:.2f} requests per sample, "
                           f"{last['read_amplification']:.2f}x the tensors' bytes (epoch {last['epoch'] + 1})")
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


def resolve_dirs(cfg: JobConfig) -> tuple[str, str, str]:
    """(images_dir, cache_root, output_dir), absolute, with the demo images filled in when no dataset is given.

    ``images_dir`` is "" when the job lists its datasets under ``data.datasets``."""
    images = cfg.data.images_dir
    if not images and not cfg.data.datasets:
        from rayflux.testing.images import ensure_demo_images

        images = str(ensure_demo_images())
    output = cfg.run.output_dir if storage.is_uri(cfg.run.output_dir) else os.path.abspath(cfg.run.output_dir)
    cache = cfg.cache.dir or storage.join(output, "cache")
    if not storage.is_uri(cache):
        cache = os.path.abspath(cache)
    return images, cache, output


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def run_identity(cfg: JobConfig) -> str:
    """What makes a run the same run: every config field that declares itself part of it (all but ``UNTRACKED``,
    :mod:`rayflux.config.identity`); resources, feed tuning, run length and what is written beside the weights may
    change between reruns."""
    import dataclasses
    import hashlib
    import json

    from rayflux.config import identity

    ident = {}
    for f in dataclasses.fields(cfg):
        fields = identity.values(getattr(cfg, f.name), "cache", "captions", "run")
        if fields:
            ident[f.name] = fields
    if all(ds.mask == "none" for ds in datasets.datasets_of(cfg.data)):
        # Without masks their keys say nothing: runs started before masks existed keep their identity.
        from rayflux.config.data import MASK_KEYS

        for part in (ident["data"], *ident["data"].get("datasets", [])):
            for key in MASK_KEYS:
                part.pop(key, None)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


class _Stages:
    """The stages of one job, each recorded in the ledger."""

    def __init__(self, cfg: JobConfig, facts, ledger: Ledger, cache_root: str, use_gpu: bool, summary: Summary):
        from rayflux.cache.stage import cache_key

        self.cfg, self.facts, self.ledger, self.use_gpu, self.summary = cfg, facts, ledger, use_gpu, summary
        self.cache_root = cache_root
        self.key = cache_key(cfg, facts, use_gpu)
        self.dirs: dict[int, str] = {}
        self.discoveries: dict = {}
        self.manifests: dict[int, dict] = {}

    def generation(self, g: int) -> dict:
        """Make generation ``g`` committed (reuse, or discard a half-built one and build) and return its manifest.

        Once per generation and job: discovery lists and reads the whole dataset, so a second ask is answered from
        the first."""
        if g not in self.manifests:
            with self.key_lease():
                self.manifests[g] = self._generation(g)
        return self.manifests[g]

    def key_lease(self) -> lease.Lease:
        """The cache key's lease, held around everything that may write to the key: another job building it (a
        job with another run directory and the same ``cache.dir``) is waited for, then its commit is reused."""
        key_dir = storage.join(self.cache_root, self.key)
        return lease.Lease(key_dir, f"cache key {self.key}", self.cfg.run.lease_seconds).acquire(wait=True)

    def _generation(self, g: int) -> dict:
        from rayflux.cache import generations, integrity
        from rayflux.cache.stage import build_generation, inputs_signature
        from rayflux.discovery import distributed

        seed = refresh.generation_seed(self.cfg.cache.seed, g)
        t0 = time.perf_counter()
        # The newest committed generation lends its caption files' lines to discovery and its encoded rows to the
        # build. When that is generation g itself, it is reused below and nothing is built. One listing of the key
        # tells which committed generations still hold every file they list; a broken one is no one's source.
        key_dir = storage.join(self.cache_root, self.key)
        present = set(generations.files_in(key_dir))
        previous, broken = generations.latest_intact(key_dir, present)
        discovery = distributed.discover(self.cfg, self.facts, seed, previous)
        if not self.discoveries:  # the same files every generation: say what is wrong with them once
            for problem in discovery.problems:
                log.warning("%s", problem)
        # What the summary needs, not the rows: the build consumes them (see build_generation).
        self.discoveries[g] = {"found": discovery.found_by_dataset(), "unsampled": dict(discovery.unsampled)}
        seconds = self.summary.stage_seconds
        seconds["discover"] = seconds.get("discover", 0.0) + time.perf_counter() - t0
        inputs = inputs_signature(discovery)
        gen_dir = generations.generation_dir(self.cache_root, self.key, g, inputs)
        # A generation `cache verify` found damaged is replaced by a repair build that re-encodes exactly the damaged
        # samples and captions and reuses the rest from it (rayflux.cache.integrity).
        repaired, gen_dir = gen_dir, integrity.current(gen_dir)
        if repaired != gen_dir and generations.load_manifest(gen_dir) is None:
            log.warning("cache generation %d has damaged tensors (recorded by cache verify beside %s): re-encoding "
                        "exactly those into %s", g, repaired, gen_dir)  # fmt: skip
        self.dirs[g] = gen_dir
        manifest = generations.load_manifest(gen_dir)
        reason = ""
        if manifest is not None and gen_dir in broken:
            reason = f"committed, but {broken[gen_dir]}"
            log.warning("cache generation %d (%s) is %s: building it again", g, gen_dir, reason)
        elif manifest is not None and not generations.is_retired(gen_dir):
            log.info("cache generation %d is committed and up to date (%s); nothing to encode", g, gen_dir)
            if not self.ledger.done(f"cache:g{g}", gen_dir):
                entry = self.ledger.start(f"cache:g{g}", gen_dir, dir=gen_dir, reused=True)
                self.ledger.finish(entry, cached=manifest.cached)
            return manifest
        if storage.exists(gen_dir):
            # Left half-built (or retired) by an earlier, interrupted run: nothing committed reads it, so drop it.
            entry = self.ledger.start(f"discard:g{g}", gen_dir, reason=reason or "not committed or retired")
            generations.remove_tree(gen_dir)
            self.ledger.finish(entry)
        entry = self.ledger.start(f"cache:g{g}", gen_dir, dir=gen_dir, seed=seed)
        t0 = time.perf_counter()
        # Unchanged samples and captions are referenced in the newest committed generation instead of encoded again.
        manifest = build_generation(self.cfg, self.facts, discovery, gen_dir, g, seed, self.use_gpu, previous)
        self.summary.stage_seconds[f"cache:g{g}"] = time.perf_counter() - t0
        self.ledger.finish(entry, manifest=storage.join(gen_dir, generations.MANIFEST), cached=manifest.cached)
        return manifest

    def retire(self, g: int) -> None:
        from rayflux.cache import generations

        gen_dir = self.dirs[g]
        if self.ledger.done(f"retire:g{g}", gen_dir):
            return
        with self.key_lease():
            entry = self.ledger.start(f"retire:g{g}", gen_dir)
            generations.retire(gen_dir)
            self.ledger.finish(entry)

    def room_for_overlap(self) -> bool:
        """Can generation g+1 be encoded while training runs? Only if both fit, with a CPU to spare for tasks."""
        import ray

        from rayflux.cache.fit import actor_cpus

        total = ray.cluster_resources()
        workers = worker_range(self.cfg.train.num_workers)[1]
        cpu_left = total.get("CPU", 0) - workers * self.cfg.train.cpus_per_worker
        if self.use_gpu:
            return total.get("GPU", 0) - workers >= self.cfg.cache.gpus_per_actor and cpu_left >= 2
        return cpu_left >= (actor_cpus(self.cfg.cache.actor_cpus) or 1.0) + 1


def run(cfg: JobConfig, only: str = "") -> Summary:
    """Run the job's stages. ``only="cache"`` stops after building the first cache generation."""
    images, cache_root, output = resolve_dirs(cfg)
    cfg.data.images_dir = images
    # Refuse overlapping directories before any Ray work or any write.
    for i, ds in enumerate(datasets.datasets_of(cfg.data)):
        key = datasets.images_key(cfg.data, i)
        paths.check_disjoint(ds.images_dir, key, **{"cache.dir": cache_root, "run.output_dir": output})
        if ds.reference_dir:
            ref_key = key.replace("images_dir", "reference_dir")
            paths.check_disjoint(ds.reference_dir, ref_key, **{"cache.dir": cache_root, "run.output_dir": output})
        if ds.mask_dir:
            mask_key = key.replace("images_dir", "mask_dir")
            paths.check_disjoint(ds.mask_dir, mask_key, **{"cache.dir": cache_root, "run.output_dir": output})
    # One job at a time per run directory: a second one refuses here, before any Ray work or any other write.
    held = lease.Lease(output, f"run.output_dir {output}", cfg.run.lease_seconds).acquire()
    try:
        return _run_stages(cfg, only, cache_root, output, held)
    finally:
        held.release()


def _run_stages(cfg: JobConfig, only: str, cache_root: str, output: str, held: lease.Lease) -> Summary:
    """:func:`run` once the run directory's lease is held (``held``)."""
    from rayflux.cache import index

    summary = Summary(output_dir=output)
    facts = models.model_facts(cfg.model)
    _check_edit_pairs(cfg, families.by_name(facts.family))  # facts already checked the model's family
    ledger = Ledger(output, run_identity(cfg), guard=held.check)
    summary.ledger = ledger.path

    console.quiet_ray()
    connect(cfg.run.ray_address)
    progress.quiet_operator_bars()
    console.quiet_ray()
    summary.logs = _ray_logs_dir()
    gpus = cluster_has_gpus()
    if only != "cache":
        # The training modules import torch: a cache-only run's driver never loads it (seconds of its start).
        from rayflux.train import wandb_log
        from rayflux.train.stage import check_base_dtype, check_optimizer

        check_base_dtype(cfg, gpus)
        check_optimizer(cfg, gpus)
        wandb_log.check(cfg.run.wandb_project)
    stages = _Stages(cfg, facts, ledger, cache_root, gpus, summary)
    segs = refresh.segments(cfg.train.epochs, refresh_interval(cfg.cache.refresh))

    def seg_done(seg) -> bool:
        entry = ledger.done(f"train:seg{seg.index}", f"epochs {seg.first_epoch}-{seg.end_epoch}")
        if entry is None:
            return False
        # A segment that train.max_steps stopped early is done only while the limit stays where it was reached.
        out = entry.get("outputs", {})
        return out.get("complete", True) or bool(cfg.train.max_steps and out.get("steps", 0) >= cfg.train.max_steps)

    # A rerun starts at the first unfinished segment; earlier generations may already be retired.
    pending = [seg for seg in segs if not seg_done(seg)] if only != "cache" else segs[:1]
    if not pending and only != "cache":
        done = ledger.find(f"train:seg{segs[-1].index}") or {}
        log.info("nothing to train: the run already ended at step %s (train.epochs=%d, train.max_steps=%d); raise "
                 "either to train more", done.get("outputs", {}).get("steps", "?"), cfg.train.epochs,
                 cfg.train.max_steps)  # fmt: skip
    # Report on the generation the run starts from (or, when everything is done, the last one, never retired).
    first_g = (pending[0] if pending else segs[-1]).generation
    first = stages.generation(first_g)
    summary.cache_dir = first.dir
    counts = first.skip_counts()
    summary.discovered, summary.cached, summary.skipped = counts.discovered, counts.cached, counts.skipped
    _account(summary, cfg, stages.discoveries[first_g], first.dir)
    if only == "cache":
        return summary
    if first.cached == 0:
        raise RuntimeError(f"no image could be cached (see {summary.cache_dir}/skipped.jsonl)")

    from rayflux.train import lora_files
    from rayflux.train.stage import train

    result = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        for seg in pending:
            nxt = segs[seg.index + 1] if seg.index + 1 < len(segs) else None
            name = f"train:seg{seg.index}"
            manifest = stages.generation(seg.generation)
            summary.generations.append(manifest.dir)
            prebuild = None
            if nxt is not None and nxt.generation != seg.generation and stages.room_for_overlap():
                prebuild = pool.submit(stages.generation, nxt.generation)
            entry = ledger.start(name, f"epochs {seg.first_epoch}-{seg.end_epoch}", generation=manifest.dir)
            t0 = time.perf_counter()
            result = train(cfg, manifest, facts, output, stages.use_gpu, (seg.first_epoch, seg.end_epoch))
            summary.stage_seconds[name] = time.perf_counter() - t0
            complete = bool(result.position.get("feed_done"))
            ledger.finish(entry, checkpoint=result.checkpoint_path, steps=result.steps, complete=complete,
                          eval_samples=result.eval_samples, best=result.best)  # fmt: skip
            if prebuild is not None:
                prebuild.result()
            if nxt is not None and nxt.generation != seg.generation:
                # fit() returned: every worker has finished every epoch that read this generation.
                stages.retire(seg.generation)

    lora_dest = storage.join(output, lora_files.LORA_DIR, lora_files.final_name(cfg))
    # Where the train loop writes them (rayflux.train.validation, rayflux.train.metrics).
    summary.validation_dir = storage.join(output, "validation") if cfg.train.validation_prompts else ""
    summary.tensorboard_dir = storage.join(output, "tensorboard")
    if result is not None:
        summary.steps, summary.losses, summary.history = result.steps, result.losses, result.history
        summary.dropped = {epoch: c["dropped"] for epoch, c in result.epoch_counts.items()}
        summary.checkpoint = result.checkpoint_path
        summary.eval_samples, summary.eval_file = result.eval_samples, result.eval_file
        if result.best:
            summary.best = (*result.best, storage.join(output, lora_files.LORA_DIR, lora_files.best_name(cfg)))
        entry = ledger.start("export", result.checkpoint_path)
        summary.lora_path = lora_files.export_final(
            result.checkpoint_dir, cfg, output, [index.caption_table(manifest)]
        )
        ledger.finish(entry, lora=summary.lora_path)
    else:
        summary.lora_path = lora_dest
        done = ledger.find("export")
        summary.checkpoint = done["inputs"] if done else ""
    return summary


def _check_edit_pairs(cfg: JobConfig, family) -> None:
    """Edit pairs (and edit renders) need a family that feeds reference images; a plain FLUX.1 model would learn them
    as text-to-image and silently drop the references."""
    if family.max_references != 0:
        return
    edits = [datasets.label(ds) for ds in datasets.datasets_of(cfg.data) if ds.reference_dir or ds.reference_column]
    if edits or cfg.train.validation_references:
        what = f"dataset {edits[0]} has edit pairs (reference_dir / reference_column)" if edits else \
            "train.validation_references is set"
        raise ConfigError(f"{what}, but {', '.join(family.pipelines.values())} takes no reference images: edit pairs "
                          "train FLUX.1 Kontext or FLUX.2")  # fmt: skip


def _account(summary: Summary, cfg: JobConfig, discovery: dict, gen_dir: str) -> None:
    """Per-dataset counts and grouped skip reasons, from the committed generation's skip list. ``discovery``: what
    :meth:`_Stages.generation` kept of the generation's discovery."""
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


def _ray_logs_dir() -> str:
    """The Ray session's log folder on this node (worker and Ray Data logs), or "" when Ray does not say."""
    try:
        import ray._private.worker  # no public API names the folder; a failure only drops the summary line

        return ray._private.worker.global_worker.node.get_logs_dir_path()
    except Exception:  # noqa: BLE001
        return ""

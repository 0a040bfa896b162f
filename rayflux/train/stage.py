"""Launch the training stage: plan bucket-pure batches, build the Ray Data feed, run ``TorchTrainer``."""

from __future__ import annotations

import collections
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from rayflux import datasets, models, progress, storage
from rayflux.cache import index, integrity
from rayflux.cache.manifest import Manifest
from rayflux.config import JobConfig, resource_map, worker_range
from rayflux.config.placement import Cluster, place
from rayflux.models import ModelFacts
from rayflux.train import batching, commits, metrics, optim, renderer
from rayflux.train.feed import DATASET, PlannedDataConfig, index_dataset
from rayflux.train.loop import train_loop_per_worker
from rayflux.train.loop_config import LOOP_KEY, LoopConfig

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    checkpoint_path: str
    """Where Ray Train stored the final checkpoint (local path or URI)."""
    checkpoint_dir: str
    """A local copy of it, for exporting the LoRA."""
    history: list = field(default_factory=list)
    """Per step, from the run's step log: epoch, generation, samples trained (all ranks), mean loss, plan position."""
    epoch_counts: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    """The last metrics rank 0 reported to Ray Train in this trainer run (empty when it trained nothing)."""
    position: dict = field(default_factory=dict)
    """The final checkpoint's position record (``commits.POSITION_FILE``)."""
    eval_samples: int = 0
    """Samples held out for the eval loss (``data.eval_samples``), never trained on."""
    eval_file: str = ""
    """Where their source paths are listed."""
    evals: list = field(default_factory=list)
    """The step log's records with an eval loss, the baseline (step 0) first."""

    @property
    def best(self) -> tuple[int, float] | None:
        """``(step, eval loss)`` of the best LoRA so far, from the final checkpoint; None without eval."""
        loss = self.position.get("best_eval_loss")
        return None if loss is None else (int(self.position["best_step"]), float(loss))


POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
POLL_SECONDS = "0.5"
"""How often Ray Train's controller polls the workers, unless the environment says otherwise. Ray's default, 2 s, is
paid by every run's end (the controller learns the workers finished at its next poll) and is the window in which a
reported checkpoint is not yet registered; a poll is one small call per worker. Ray Train propagates the driver's
value to its controller when ``fit`` starts it."""

EVAL_FILE = "eval_samples.txt"
"""In the output directory: the source path of every held-out sample, one a line."""


def held_out(cfg: JobConfig, refs: list[batching.SampleRef], output_dir: str) -> tuple[list, list[dict], str]:
    """``(training refs, eval plan, eval file)``: hold out ``data.eval_samples`` samples (by sample id hash with
    ``cache.seed``; see :func:`rayflux.train.batching.split_held_out`) and list their sources in ``EVAL_FILE``."""
    n = cfg.data.eval_samples
    if n <= 0:
        return refs, [], ""
    train_refs, held = batching.split_held_out(refs, n, cfg.cache.seed)
    if len(held) < n:
        raise ValueError(f"data.eval_samples={n}, but the cache holds only {len(held)} samples")
    path = storage.join(output_dir, EVAL_FILE)
    storage.write_bytes_atomic(path, "".join(f"{r.source}\n" for r in held).encode())
    log.info("eval: %d samples held out of training (listed in %s)", len(held), path)
    return train_refs, batching.plan_eval(held, cfg.train.batch_size), path


def plan_counts(cfg: JobConfig, refs: list[batching.SampleRef], world_size: int) -> dict:
    """Per-epoch sample accounting for a world size: what the data feed's plan holds, from bucket sizes alone."""
    sizes = collections.Counter(batching.group(r) for r in refs)
    t = cfg.train
    return {
        epoch: batching.epoch_counts(sizes, t.batch_size, t.seed, epoch, world_size, t.gradient_accumulation)
        for epoch in range(t.epochs)
    }


def scaling_config(cfg: JobConfig, use_gpu: bool, gpu_left: float = 0.0):
    """Ray Train's ``ScalingConfig``: fixed or elastic (``num_workers: [min, max]``) and where workers may run.
    ``gpu_left``: the share of each worker's GPU left to the validation render actor."""
    import ray.train

    lo, hi = worker_range(cfg.train.num_workers)
    resources = {"CPU": cfg.train.cpus_per_worker}
    resources.update(resource_map("train.worker_resources", cfg.train.worker_resources))
    if use_gpu:
        resources["GPU"] = 1 - gpu_left
    return ray.train.ScalingConfig(
        num_workers=hi if lo == hi else (lo, hi),
        use_gpu=use_gpu,
        resources_per_worker=resources,
        accelerator_type=cfg.train.accelerator_type or None,
        elastic_resize_monitor_interval_s=cfg.train.resize_check_seconds,
    )


def run_config(cfg: JobConfig, output_dir: str, callbacks: list):
    """Ray Train's ``RunConfig``. Its storage must be shared by every node (``s3://`` on a cloud cluster): restarts,
    resizes and resumed jobs all load the latest checkpoint from it. ``callbacks``: the trainer's callbacks (the
    commit record's, and a sweep trial's Tune reports)."""
    import ray.train

    storage_path, storage_fs = storage.for_ray_train(storage.join(output_dir, "checkpoints"))
    return ray.train.RunConfig(
        name=cfg.run.name,
        storage_path=storage_path,
        storage_filesystem=storage_fs,
        callbacks=callbacks,
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.checkpoints_to_keep),
        failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
    )


def train(
    cfg: JobConfig,
    manifest: dict,
    facts: ModelFacts,
    output_dir: str,
    cluster_gpus: bool,
    epochs: tuple[int, int] | None = None,
    *,
    callbacks: Callable[[], list] | None = None,
) -> TrainResult:
    """Train epochs ``[first, end)`` (default: all) on one committed generation; resumes from the run's checkpoint.
    ``callbacks``: makes extra Ray Train callbacks for the trainer (a sweep trial's Tune reports)."""
    manifest = Manifest.of(manifest)
    _, hi = worker_range(cfg.train.num_workers)
    refs = datasets.mix(
        batching.index_samples(manifest), datasets.sample_weights(cfg.data), datasets.mask_floors(cfg.data)
    )
    batching.check_references(refs, models.family(cfg.model))
    refs, eval_plan, eval_file = held_out(cfg, refs, output_dir)
    counts = plan_counts(cfg, refs, hi)
    if counts[0]["batches"] == 0:
        raise RuntimeError(
            f"no full set of batches for {hi} workers: {manifest.cached} samples, batch_size {cfg.train.batch_size}"
        )
    first, end = epochs or (0, cfg.train.epochs)
    _log_plan(cfg, counts, hi, first, end)
    run_storage = commits.run_storage(output_dir, cfg.run.name)
    before = commits.latest(run_storage)
    per_epoch = progress.steps_per_epoch(counts, hi, cfg.train.gradient_accumulation)
    with progress.TrainBar(per_epoch, optim.total_steps(sum(per_epoch), cfg.train.max_steps)) as bar:
        try:
            extra = callbacks() if callbacks else []
            result = _fit(cfg, manifest, facts, output_dir, cluster_gpus, refs, epochs, bar.board, eval_plan, extra)
        except Exception as exc:
            _raise_integrity(exc)
            raise
    if getattr(result, "error", None):
        _raise_integrity(result.error)
        raise RuntimeError(f"training failed: {result.error}")
    final = commits.latest(run_storage)
    if not final:
        raise RuntimeError(f"training committed no checkpoint: {result.error}")
    commits.prune(run_storage)  # Ray has registered its last checkpoint: orphans older than it can go
    position = commits.read_json(final)
    if final == before:
        log.info(
            "train: nothing to train: checkpoint at step %d is where this run ends (epochs %d-%d, train.max_steps=%d)",
            position["step"],
            first + 1,
            end,
            cfg.train.max_steps,
        )
    return _result(cfg, output_dir, final, position, counts, result, eval_plan, eval_file)


def _log_plan(cfg: JobConfig, counts: dict, hi: int, first: int, end: int) -> None:
    """One line: the epochs, workers and optimizer steps this trainer run plans, and what the remainder rule drops."""
    dropped = [counts[e]["dropped"] for e in range(first, end)]
    per_epoch = progress.steps_per_epoch(counts, hi, cfg.train.gradient_accumulation)  # optimizer steps, as the bar
    log.info(
        "train: epochs %d-%d on %d worker(s), %d planned steps per worker; the remainder rule drops %s samples "
        "per epoch",
        first + 1,
        end,
        hi,
        sum(per_epoch[first:end]),
        dropped[0] if len(set(dropped)) == 1 else "/".join(map(str, dropped)),
    )


def _result(cfg: JobConfig, output_dir: str, final: str, position: dict, counts, result, eval_plan, eval_file):
    """The stage's :class:`TrainResult`: the final checkpoint downloaded, the step log read back."""
    local = commits.download(final, tempfile.mkdtemp(prefix="rayflux-final-"))
    history = metrics.read_steps(output_dir, last_step=int(position["step"]))
    return TrainResult(
        steps=int(position["step"]),
        losses=[h["loss"] for h in history],
        history=history,
        checkpoint_path=final,
        checkpoint_dir=local,
        epoch_counts=counts,
        metrics=dict(result.metrics or {}),
        position=position,
        eval_samples=cfg.data.eval_samples if eval_plan else 0,
        eval_file=eval_file,
        evals=metrics.read_steps(output_dir, last_step=int(position["step"]), evals=True) if eval_plan else [],
    )


def _raise_integrity(error: BaseException) -> None:
    """A damaged cache tensor met by a worker's read stops the run with the read's own one-line error (which names
    the file, the sample or caption, the range, and the ``cache verify`` command), not with Ray's nested tracebacks."""
    found = integrity.find(error)
    if found is not None:
        raise found from None


def _fit(
    cfg: JobConfig,
    manifest: Manifest,
    facts: ModelFacts,
    output_dir: str,
    cluster_gpus: bool,
    refs,
    epochs,
    board,
    eval_plan=(),
    callbacks=(),
):
    import ray
    from ray.train.torch import TorchTrainer

    run_storage = commits.run_storage(output_dir, cfg.run.name)
    use_gpu = place(cfg, Cluster(gpus=cluster_gpus)).training
    os.environ.setdefault(POLL_ENV, POLL_SECONDS)
    renders, gpu_left = None, 0.0
    if cfg.train.validation_prompts:
        resources, why = renderer.choose_resources(cfg, use_gpu, ray.cluster_resources())
        gpu_left = renderer.gpu_share(resources) if use_gpu else 0.0
        renders = renderer.Renders(cfg, output_dir, resources, why)
    try:
        result = _trainer(
            cfg,
            manifest,
            facts,
            output_dir,
            run_storage,
            (use_gpu, gpu_left),
            renders,
            refs,
            epochs,
            board,
            eval_plan,
            callbacks,
        ).fit()
    finally:
        if renders:
            renders.finish()  # waits for the renders still due (bounded), then kills the actor
    return result


def _trainer(
    cfg: JobConfig,
    manifest: Manifest,
    facts: ModelFacts,
    output_dir: str,
    run_storage: str,
    gpus: tuple,
    renders,
    refs,
    epochs,
    board,
    eval_plan,
    callbacks,
):
    """The ``TorchTrainer`` of one trainer run; ``gpus``: ``(use GPUs, share of each GPU left to the renderer)``."""
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            LOOP_KEY: LoopConfig(
                job=cfg.to_dict(),
                output_dir=output_dir,
                checkpoints=run_storage,
                empty_caption=manifest.empty_caption(),
                caption_tables=(index.caption_table(manifest),),
                epochs=tuple(epochs or (0, cfg.train.epochs)),
                text_length=facts.text_length,
                eval_plan=tuple(eval_plan),
                progress=board,
                renderer=renders.actor if renders else None,
            )
        },
        scaling_config=scaling_config(cfg, *gpus),
        run_config=run_config(cfg, output_dir, [commits.CommitCallback(run_storage), *callbacks]),
        datasets={DATASET: index_dataset(refs)},
        dataset_config=PlannedDataConfig(
            cfg.train.batch_size,
            cfg.train.seed,
            epochs or (0, cfg.train.epochs),
            cfg.train.epochs,
            cfg.train.gradient_accumulation,
            batches_per_read=cfg.train.batches_per_read,
            read_run=cfg.train.read_run,
            run_storage=run_storage,
        ),
    )

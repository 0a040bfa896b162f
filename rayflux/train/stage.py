"""Launch the training stage: the trainer run's plan (:mod:`rayflux.train.plan`), the render actor and the bar
around one ``TorchTrainer`` with the planned feed; its result read back."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from rayflux import phases, progress, storage
from rayflux.cache import integrity
from rayflux.cache.manifest import Manifest
from rayflux.config import JobConfig, resource_map, worker_range
from rayflux.config.placement import Cluster, place
from rayflux.models import ModelFacts
from rayflux.train.observe import metrics, renderer
from rayflux.train.resume import commits
from rayflux.train import handoff
from rayflux.train import plan as plan_mod
from rayflux.train.data.feed import DATASET, PlannedDataConfig, handoff_dataset
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


def scaling_config(cfg: JobConfig, use_gpu: bool, gpu_left: float = 0.0):
    """Ray Train's ``ScalingConfig``: fixed or elastic (``num_workers: [min, max]``) and where workers may run.
    ``gpu_left``: the share of each worker's GPU left to the validation render actor."""
    import ray.train

    lo, hi = worker_range(cfg.train.workers.num_workers)
    resources = {"CPU": cfg.train.workers.cpus_per_worker}
    resources.update(resource_map("train.workers.worker_resources", cfg.train.workers.worker_resources))
    if use_gpu:
        resources["GPU"] = 1 - gpu_left
    return ray.train.ScalingConfig(
        num_workers=hi if lo == hi else (lo, hi),
        use_gpu=use_gpu,
        resources_per_worker=resources,
        accelerator_type=cfg.train.workers.accelerator_type or None,
        elastic_resize_monitor_interval_s=cfg.train.workers.resize_check_seconds,
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
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.checkpoint.keep),
        failure_config=ray.train.FailureConfig(max_failures=cfg.train.workers.max_failures),
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
    return TrainerRun(cfg, facts, output_dir, cluster_gpus, epochs, callbacks=callbacks).finish(manifest)


@dataclass(frozen=True)
class Launch:
    """What a trainer run's launch needs besides the config and the run's handoff."""

    output_dir: str
    """``run.output_dir``, resolved."""
    text_length: int
    """The model's padded text length (read once here; the workers need not read the model's configs)."""
    use_gpu: bool
    """Whether the workers train on GPUs (:func:`rayflux.config.placement.place`)."""
    callbacks: list = field(default_factory=list)
    """Extra Ray Train callbacks (a sweep trial's Tune reports), beside the commit record's."""
    encoder_share: float = 0.0
    """The share of each worker's GPU left to the cache stage's encoders (:mod:`rayflux.train.gpu_sharing`)."""


class TrainerRun:
    """One trainer run, its worker group started at once: the workers load the model and wait for the committed
    generation, which :meth:`finish` hands them (:mod:`rayflux.train.handoff`), or :meth:`cancel` ends them.

    A run whose latest checkpoint already ends these epochs starts nothing (no worker, no model load).
    ``encoder_share``: the share of each worker's GPU the cache stage's encoders take meanwhile (the workers reserve
    the rest for the whole run)."""

    def __init__(
        self,
        cfg,
        facts: ModelFacts,
        output_dir: str,
        cluster_gpus: bool,
        epochs=None,
        *,
        callbacks=None,
        encoder_share=0.0,
    ):
        self.cfg, self.output_dir, self.encoder_share = cfg, output_dir, encoder_share
        self.epochs = tuple(epochs or (0, cfg.train.epochs))
        self.done_at = _finished(cfg, commits.run_storage(output_dir, cfg.run.name), self.epochs)
        self.handoff, self.bar, self._thread, self._outcome = None, None, None, {}
        if self.done_at:
            return
        launch = Launch(
            output_dir=output_dir,
            text_length=facts.text_length,
            use_gpu=place(cfg, Cluster(gpus=cluster_gpus)).training,
            callbacks=callbacks() if callbacks else [],
            encoder_share=encoder_share,
        )
        self.handoff = handoff.start()
        self.bar = progress.TrainBar([], 0).__enter__()  # the plan's step counts are set when it is handed over
        self._thread = threading.Thread(target=self._fit, args=(launch,), name="rayflux-trainer", daemon=True)
        phases.mark("train_launch")
        self._thread.start()

    def _fit(self, launch: Launch) -> None:
        try:
            self._outcome["result"] = _fit(self.cfg, launch, self.handoff, self.bar.board)
        except BaseException as exc:  # raised in the driver's thread by _wait
            self._outcome["error"] = exc

    def _wait(self):
        """Ray Train's result, once ``fit`` has returned; the run's actors are gone then."""
        import ray

        self._thread.join()
        self.bar.__exit__(None, None, None)
        ray.kill(self.handoff)
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["result"]

    def cancel(self) -> None:
        """End a run whose generation will never come (the cache stage failed): its workers return untrained."""
        import ray

        if self.handoff is None:
            return
        ray.get(self.handoff.cancel.remote())
        try:
            self._wait()
        except Exception as exc:  # noqa: BLE001 - the cache's error is the one the job reports
            log.warning("train: the cancelled run ended with: %s", exc)

    def finish(self, manifest) -> TrainResult:
        """Hand the committed generation (``manifest``) to the workers, and train."""
        manifest = Manifest.of(manifest)
        try:
            plan = plan_mod.build(self.cfg, manifest, self.output_dir, self.epochs)
        except BaseException:  # noqa: BLE001 - re-raised: the waiting group must not outlive it
            self.cancel()
            raise
        if self.done_at:
            final, position = self.done_at
            log.info(
                "train: nothing to train: checkpoint at step %d is where this run ends (epochs %d-%d, "
                "train.max_steps=%d); the model was not loaded",
                position["step"],
                self.epochs[0] + 1,
                self.epochs[1],
                self.cfg.train.max_steps,
            )
            return _result(self.cfg, plan, self.output_dir, final, position, None)
        plan.log()
        self.bar.per_epoch, self.bar.total = plan.steps_per_epoch, plan.total_steps
        handoff.publish(self.handoff, handoff.generation(plan, manifest))
        phases.mark("handoff")
        try:
            result = self._wait()
        except Exception as exc:
            _raise_integrity(exc)
            raise
        return self._close(plan, result)

    def _close(self, plan: plan_mod.TrainPlan, result) -> TrainResult:
        if getattr(result, "error", None):
            _raise_integrity(result.error)
            raise RuntimeError(f"training failed: {result.error}")
        run_storage = plan.feed.run_storage
        final = commits.latest(run_storage)
        if not final:
            raise RuntimeError(f"training committed no checkpoint: {result.error}")
        commits.prune(run_storage)  # Ray has registered its last checkpoint: orphans older than it can go
        return _result(self.cfg, plan, self.output_dir, final, commits.read_json(final), result)


def _finished(cfg: JobConfig, run_storage: str, epochs: tuple[int, int]) -> tuple[str, dict] | None:
    """``(checkpoint, position)`` when the run's latest checkpoint already ends epochs ``[first, end)``: it trained
    to the end of the last one's feed, or to ``train.max_steps``; else None."""
    final = commits.latest(run_storage)
    if not final:
        return None
    position = commits.read_json(final)
    at_end = bool(position.get("feed_done")) and int(position.get("epoch", -1)) >= epochs[1] - 1
    capped = bool(cfg.train.max_steps) and int(position["step"]) >= cfg.train.max_steps
    return (final, position) if at_end or capped else None


def _result(cfg: JobConfig, plan: plan_mod.TrainPlan, output_dir: str, final: str, position: dict, result):
    """The stage's :class:`TrainResult`: the final checkpoint downloaded, the step log read back."""
    local = commits.download(final, tempfile.mkdtemp(prefix="rayflux-final-"))
    history = metrics.read_steps(output_dir, last_step=int(position["step"]))
    return TrainResult(
        steps=int(position["step"]),
        losses=[h["loss"] for h in history],
        history=history,
        checkpoint_path=final,
        checkpoint_dir=local,
        epoch_counts=plan.counts,
        metrics=dict((result.metrics if result else None) or {}),
        position=position,
        eval_samples=cfg.data.eval_samples if plan.eval_plan else 0,
        eval_file=plan.eval_file,
        evals=metrics.read_steps(output_dir, last_step=int(position["step"]), evals=True) if plan.eval_plan else [],
    )


def _raise_integrity(error: BaseException) -> None:
    """A damaged cache tensor met by a worker's read stops the run with the read's own one-line error (which names
    the file, the sample or caption, the range, and the ``cache verify`` command), not with Ray's nested tracebacks."""
    found = integrity.find(error)
    if found is not None:
        raise found from None


def _fit(cfg: JobConfig, launch: Launch, handoff_actor, board):
    """Start the render actor (when validation renders are asked for), run the trainer, finish the renders."""
    import ray

    os.environ.setdefault(POLL_ENV, POLL_SECONDS)
    renders, gpu_left = None, 0.0
    if cfg.train.validation.prompts:
        resources, why = renderer.choose_resources(cfg, launch.use_gpu, ray.cluster_resources())
        gpu_left = renderer.gpu_share(resources) if launch.use_gpu else 0.0
        renders = renderer.Renders(cfg, launch.output_dir, resources, why)
    gpu_left += launch.encoder_share if launch.use_gpu else 0.0
    loop = LoopConfig(
        job=cfg.to_dict(),
        output_dir=launch.output_dir,
        text_length=launch.text_length,
        handoff=handoff_actor,
        progress=board,
        renderer=renders.actor if renders else None,
        phases=phases.path(),
    )
    try:
        return _trainer(cfg, launch, loop, handoff_actor, gpu_left).fit()
    finally:
        if renders:
            renders.finish()  # waits for the renders still due (bounded), then kills the actor


def _trainer(cfg: JobConfig, launch: Launch, loop: LoopConfig, handoff_actor, gpu_left: float):
    """The ``TorchTrainer`` of one trainer run; ``gpu_left``: the share of each GPU left to the render actor."""
    from ray.train.torch import TorchTrainer

    run_storage = commits.run_storage(launch.output_dir, cfg.run.name)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={LOOP_KEY: loop},
        scaling_config=scaling_config(cfg, launch.use_gpu, gpu_left),
        run_config=run_config(cfg, launch.output_dir, [commits.CommitCallback(run_storage), *launch.callbacks]),
        datasets={DATASET: handoff_dataset()},  # the samples come through the handoff
        dataset_config=PlannedDataConfig(handoff=handoff_actor),
    )

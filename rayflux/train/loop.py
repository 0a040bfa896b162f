"""``train_loop_per_worker``: build the trainer, skip what a restored checkpoint already trained, then step,
log, render and checkpoint.

Every step ends with one all-reduce of a few numbers: the mean loss and total samples, plus two flags that every
rank must agree on, so that they all call ``ray.train.report`` (a barrier) at the same steps: rank 0's "a metrics
report is due" (its clock says ``train.report_seconds`` have passed) and "a preemption was announced" (any rank's
copy of Ray Train's notice). Nothing else waits on other processes per step: the per-step log and TensorBoard are
rank 0's local files, and the progress bar gets a fire-and-forget actor call. One trainer run may cover only some
epochs (a cache-refresh segment); its last step always checkpoints, so the next segment continues from it. The loop
never touches a text encoder or the VAE: everything is in the cached shards, and validation images are rendered by
a separate actor from the step's LoRA file (:mod:`rayflux.train.observe.renderer`) while training goes on. With
``data.eval_samples``, each eval (:mod:`rayflux.train.observe.evaluation`: before the first step, every
``train.eval.every`` steps and at the end) adds one more all-reduce, and its numbers join that step's record.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import tempfile
import time
from dataclasses import dataclass


from rayflux import config as config_mod
from rayflux import memory, phases, progress as progress_mod, storage
from rayflux.train import collectives, handoff, optim, sharding, step
from rayflux.train.adapter import lora_files
from rayflux.train.data import captions, elastic
from rayflux.train.observe import evaluation, metrics, validation, wandb_log
from rayflux.train.resume import checkpoint, commits
from rayflux.train.observe import renderer as renderer_mod
from rayflux.train.resume.checkpoint import Progress
from rayflux.train.data.feed import DATASET, FirstRow, planned_rows
from rayflux.train.loop_config import LOOP_KEY, LoopConfig
from rayflux.train.trainer import LoraTrainer

log = logging.getLogger(__name__)

__all__ = ["LOOP_KEY", "LoopConfig", "train_loop_per_worker"]


def grouped(rows, size: int):
    """Consecutive groups of ``size`` rows: the batches of one optimizer step."""
    it = iter(rows)
    while group := list(itertools.islice(it, size)):
        yield group


def with_last(items):
    """``(item, is_last)`` pairs: the loop must know a segment's last step before training it, to checkpoint it."""
    it = iter(items)
    prev = next(it, None)
    for cur in it:
        yield prev, False
        prev = cur
    if prev is not None:
        yield prev, True


def _debug_delay(cfg, rank: int) -> None:
    """``run.debug_slow_rank = "RANK:SECONDS"`` sleeps on one rank before each step, to expose ordering races."""
    if cfg.run.debug_slow_rank:
        slow_rank, seconds = cfg.run.debug_slow_rank.split(":")
        if int(slow_rank) == rank:
            time.sleep(float(seconds))


class ReportClock:
    """Rank 0's clock for metrics reports to Ray: due when ``seconds`` of wall time and ``steps`` steps have passed
    since the last report (checkpoints report on their own schedule and restart the clock)."""

    def __init__(self, seconds: float, steps: int):
        self.seconds, self.steps = seconds, max(steps, 1)
        self.reset(0)

    def due(self, step: int) -> bool:
        return time.monotonic() - self.last >= self.seconds and step - self.last_step >= self.steps

    def reset(self, step: int) -> None:
        self.last, self.last_step = time.monotonic(), step


@dataclass
class _Worker:
    """What one training process is: its config, rank, world and device."""

    lc: LoopConfig
    cfg: object
    rank: int
    world: int
    device: object
    local_world: int
    node_rank: int
    start_rss: float


def _worker(lc: LoopConfig) -> _Worker:
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    return _Worker(
        lc,
        config_mod.from_dict(lc.job),
        ctx.get_world_rank(),
        ctx.get_world_size(),
        ray.train.torch.get_device(),
        ctx.get_local_world_size(),
        ctx.get_node_rank(),
        memory.rss_mb(),
    )


class _NothingLeft(Exception):
    """The rank's plan is empty: it was cut at a checkpoint past this trainer run's last batch."""


def _restore(w: _Worker, ahead: FirstRow) -> tuple[LoraTrainer, Progress, int, str, dict]:
    """The trainer, restored from the checkpoint the feed cut the plan at (see :mod:`rayflux.train.data.feed`) when there
    is one; ``(trainer, progress, total steps, that checkpoint, the first planned row)``. Every row carries the run's
    planned step count, which fixes the LR schedule's horizon: the model loads while ``ahead`` reads the first row,
    and the schedule is built once both are done. Raises :class:`_NothingLeft` when there is no first row."""
    import ray.train.torch

    t = w.cfg.train
    progress = Progress(world_size=w.world)

    def total_steps() -> int:  # called by LoraTrainer after the model load
        row = ahead.get()
        if row is None:
            raise _NothingLeft
        return optim.total_steps(int(row["total_steps"]), t.max_steps)

    trainer = LoraTrainer(
        w.cfg,
        w.device,
        total_steps,
        rank=w.rank,
        wrap=ray.train.torch.prepare_model,
        topology=sharding.Topology(w.world, w.local_world, w.node_rank),
        text_length=w.lc.text_length,
    )
    first = ahead.get()  # read by now: total_steps() above waited for it (and so for the generation's handoff)
    # Caption dropout trains on the empty caption; blank output preservation's prompt is it (issue 45).
    if t.flow.caption_dropout > 0 or t.flow.preservation == "blank":
        trainer.empty = captions.load_empty(w.lc.empty_caption)
    resume_from = first["resume_from"]
    with commits.downloaded(resume_from) if resume_from else contextlib.nullcontext() as d:
        if d:
            progress = checkpoint.restore(d, trainer, w.rank, w.world)
    if progress.step != int(first["resume_step"]):
        raise RuntimeError(
            f"the data feed was planned from step {first['resume_step']}, but checkpoint "
            f"{resume_from or '(none)'} holds step {progress.step}"
        )
    return trainer, progress, trainer.total_steps, resume_from, first


class _Logs:
    """Rank 0's outputs of every step: TensorBoard (and Weights & Biases), the step log and the progress bar."""

    def __init__(self, w: _Worker, start: int):
        cfg, lc = w.cfg, w.lc
        self.tensorboard = (
            metrics.TensorBoardLog(lc.output_dir, purge_step=start + 1 if start else None) if w.rank == 0 else None
        )
        if self.tensorboard and cfg.run.wandb_project:  # the same scalars and grids, to Weights & Biases as well
            wandb = wandb_log.WandbLog(cfg.run.wandb_project, lc.plan.feed.run_storage, cfg.run.name, lc.job)
            self.tensorboard = wandb_log.Both(self.tensorboard, wandb)
        self.steps = metrics.StepLog(lc.output_dir) if w.rank == 0 else None
        self.bar = progress_mod.BoardSender(lc.progress if w.rank == 0 else None)

    def write(self, record: dict, scalars: bool = True) -> None:
        if self.tensorboard and scalars:
            self.tensorboard.scalars(record["step"], record)
        if self.steps:
            self.steps.write(record)

    def flush(self) -> None:
        if self.tensorboard:
            self.tensorboard.flush()
            self.steps.sync()

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
            self.steps.close()


def _queue_render(
    renders, trainer, cfg, output_dir: str, record: dict, *, checkpointed: bool, last: bool, caption_tables
) -> None:
    """Rank 0: hand the step's LoRA file (diffusers keys) to the render actor (:mod:`rayflux.train.observe.renderer`) and
    go on training. The LoRA is :meth:`LoraTrainer.eval_weights`' (the EMA, or schedule-free's average). A
    diffusers-format checkpoint at this step has written it already; without an EMA the live LoRA is written as that
    file; otherwise (kohya output, or an EMA at a step without a checkpoint) beside the grid
    (``validation/step-<step>.safetensors``)."""
    step, ema = record["step"], trainer.ema is not None
    diffusers = cfg.train.checkpoint.output_format != "kohya"
    if diffusers and checkpointed:
        path = storage.join(output_dir, lora_files.LORA_DIR, lora_files.step_name(cfg, step, ema=ema))
    elif diffusers and not ema:
        with trainer.optimizer_eval():  # as a checkpoint at this step would write it
            path = lora_files.keep_live_step(trainer, cfg, output_dir, record, caption_tables)
    else:
        path = validation.lora_path(output_dir, step)
        with trainer.eval_weights():
            storage.write_bytes_atomic(path, lora_files.diffusers_bytes(trainer))
    if renders.submit(record["step"], path, last):
        record["validation_image"] = validation.grid_path(output_dir, record["step"])  # where the actor writes it


@dataclass(frozen=True)
class _Due:
    """What a step must do besides training, the same on every rank."""

    last: bool
    end_of_feed: bool
    checkpoint: bool
    report: bool
    images: bool


class _Run:
    """One worker's training run: the trainer and everything each step updates."""

    def __init__(self, w: _Worker, ahead: FirstRow):
        t = w.cfg.train
        self.w, self.t = w, t
        self.trainer, self.progress, self.total, resume_from, self.first = _restore(w, ahead)
        self.start = self.progress.step
        if w.rank == 0:
            commits.record_restart(self.progress, w.lc.plan.feed.run_storage, resume_from, _offered())
        self.preemption, self.preempted_once = elastic.PreemptionNotice(), False
        self.logs = _Logs(w, self.start)
        self.clock, self.window, self.reads = (
            ReportClock(t.report_seconds, t.log_every),
            metrics.Throughput(),
            metrics.ReadTotals(),
        )
        final = int(w.lc.plan.feed.epochs[1]) >= t.epochs
        self.evals = evaluation.Evaluator(
            self.trainer, list(w.lc.plan.eval_plan), w.rank, w.world, t.eval.every, final_segment=final
        )
        renderer = w.lc.renderer if w.rank == 0 and t.validation.prompts else None
        self.renders = renderer_mod.Queue(renderer, t.validation.queue) if renderer else None

    def keep_best(self, record: dict) -> None:
        lora_files.keep_best(self.trainer, self.w.cfg, self.w.lc.output_dir, record, self.w.lc.caption_tables)

    @property
    def best_writer(self):
        return self.keep_best if self.w.rank == 0 else None

    def baseline(self) -> None:
        """The eval loss of the untrained LoRA (the base model), before a fresh run's first step: what training
        must improve on."""
        if not (self.evals.active and self.start == 0):
            return
        record = {"step": 0, "epoch": 0}
        self.evals.run(record, self.progress, self.best_writer)
        self.logs.write(record)
        self.logs.bar.send(record, force=True)
        self.window.restart()

    def step(self, group: list[dict], end_of_feed: bool) -> None:
        """Train one optimizer step on ``group``, then log, evaluate, report, checkpoint and render as due."""
        _debug_delay(self.w.cfg, self.w.rank)
        record, report_due, preempted = self._train(group)
        due = self._due(record, end_of_feed, report_due, preempted)
        due_eval = self.evals.due(self.progress.step, due.last, end_of_feed)
        if due_eval:
            self.evals.run(record, self.progress, self.best_writer)
        if self.logs.tensorboard:
            self.logs.tensorboard.scalars(self.progress.step, record)
        directory = self.save(record) if due.checkpoint else None  # writes this step's LoRA file
        if self.renders and due.images:
            _queue_render(
                self.renders,
                self.trainer,
                self.w.cfg,
                self.w.lc.output_dir,
                record,
                checkpointed=due.checkpoint,
                last=due.last,
                caption_tables=self.w.lc.caption_tables,
            )
        # Logged before it is reported: a worker that dies blocked in the report's barrier (a stopped sweep trial's
        # workers do, once Ray ends its controller) has logged its eval, and the best LoRA file that eval wrote.
        if self.logs.steps:
            self.logs.steps.write(record)
        if due.checkpoint or due.report or due_eval:  # every eval reaches Ray Train (and a sweep's scheduler)
            self.report(record, directory)
        self.logs.bar.send(record, force=due.last or end_of_feed)
        if due.checkpoint or due.images or due_eval:
            self.window.restart()  # rates exclude the time spent rendering and checkpointing

    def _train(self, group: list[dict]) -> tuple[dict, bool, bool]:
        """The optimizer step and its all-rank record; ``(record, report due, preemption announced)``."""
        w = self.w
        stats = self.trainer.train_step([step.from_item(item) for item in group])
        position = elastic.step_position(group, w.rank, w.world)
        self.progress.advance(int(group[0]["step"]), position, group)
        loss, samples, report_due, preempted, step_reads = collectives.agree(
            stats.loss,
            stats.samples,
            w.rank == 0 and self.clock.due(self.progress.step),
            self.preemption.local(),
            w.device,
            w.world,
            reads=metrics.batch_reads(group),
        )
        record = {
            "step": self.progress.step,
            "epoch": int(group[0]["epoch"]),
            "samples": samples,
            "loss": loss,
            "generation": int(group[0]["generation"]),
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            **self.window.take(samples),
        }
        record.update(position)
        record.update(self.reads.add(record["epoch"], samples, step_reads))
        return record, report_due, preempted

    def _due(self, record: dict, end_of_feed: bool, report_due: bool, preempted: bool) -> _Due:
        step_, t = self.progress.step, self.t
        last = step_ >= self.total
        every = t.checkpoint.every and step_ % t.checkpoint.every == 0
        preempted, self.preempted_once = preempted and not self.preempted_once, self.preempted_once or preempted
        if preempted:
            record["preempted"] = True
        self.progress.feed_done = end_of_feed
        images = bool(last or (t.validation.every and step_ % t.validation.every == 0))
        return _Due(last, end_of_feed, bool(last or end_of_feed or every or preempted), report_due, images)

    def save(self, record: dict) -> str:
        """Write this step's checkpoint to a local folder (every rank; rank 0 also its LoRA file) and add the memory
        facts to ``record``; returns the folder, for :meth:`report`."""
        w = self.w
        # Checkpoints carry memory facts (worst rank): encoders must never be alive in a training worker.
        record.update(collectives.worst_rank(memory.snapshot(w.start_rss), w.device, w.world))
        directory = tempfile.mkdtemp(prefix="rayflux-ckpt-")
        checkpoint.save(directory, self.trainer, w.rank, self.progress, self.t.checkpoint.output_format)
        if w.rank == 0:
            lora_files.keep_step(directory, w.cfg, w.lc.output_dir, record, w.lc.caption_tables)
        return directory

    def report(self, record: dict, directory: str | None) -> None:
        """``ray.train.report`` (a barrier of every rank) of ``record``, with the checkpoint :meth:`save` wrote to
        ``directory`` (None: none); rank 0 then commits it and prunes old ones."""
        import ray.train
        from ray.train import Checkpoint

        w = self.w
        self.logs.flush()
        ray.train.report(
            record,
            checkpoint=Checkpoint.from_directory(directory) if directory else None,
            delete_local_checkpoint_after_upload=bool(directory),
        )
        self.clock.reset(self.progress.step)
        if directory:
            # Every rank's report returned, so every rank's files are in storage: the checkpoint is whole.
            collectives.barrier(w.device, w.world)
            if w.rank == 0:
                commits.commit(ray.train.get_checkpoint())
                commits.prune(w.lc.plan.feed.run_storage)

    def close(self) -> None:
        if self.progress.step == self.start and self.w.rank == 0:
            log.info("nothing left to train: the checkpoint at step %d already reached train.max_steps", self.start)
        self.logs.close()


def _offered():
    import ray.train

    return ray.train.get_checkpoint()


def _handed_rows(w: _Worker):
    """The rank's planned rows, once the driver has handed over the committed generation (:mod:`rayflux.train.handoff`:
    the group may start while the cache stage still runs); none when it cancelled the run (the cache stage failed).
    Runs in the first read's thread, so the model loads meanwhile."""
    import ray.train

    phases.mark("handoff_wait_start")
    gen = handoff.receive(w.lc.handoff)
    phases.mark("handoff_wait_end")
    if gen is None:
        return
    w.lc = handoff.filled(w.lc, gen)
    yield from planned_rows(ray.train.get_dataset_shard(DATASET), w.cfg.train.feed.prefetch_reads)


def train_loop_per_worker(loop_config: dict) -> None:
    """One training worker: restore, evaluate the baseline, train every planned optimizer step, close."""
    import ray.train

    lc: LoopConfig = loop_config[LOOP_KEY]
    phases.follow(lc.phases)
    phases.mark("worker_start")
    w = _worker(lc)
    rows = _handed_rows(w)
    ahead = FirstRow(rows, on_read=lambda: phases.mark("first_read_end"))  # read while the model loads
    try:
        run = _Run(w, ahead)
    except _NothingLeft:  # known only once the model has loaded: a cancelled run, or a rerun past the segment's end
        if w.lc.plan is None:
            log.info("rank %d: the cache stage failed: nothing to train", w.rank)
        else:
            log.info("rank %d: nothing left to train in epochs %s", w.rank, w.lc.plan.feed.epochs)
        return
    first = run.first
    run.baseline()
    for group, end_of_feed in with_last(grouped(itertools.chain([first], rows), w.cfg.train.gradient_accumulation)):
        if run.progress.step >= run.total:
            break
        run.step(group, end_of_feed)
    run.close()

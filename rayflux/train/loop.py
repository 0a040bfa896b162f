"""``train_loop_per_worker``: build the trainer, skip what a restored checkpoint already trained, then step,
log, render and checkpoint.

Every step ends with one all-reduce of a few numbers: the mean loss and total samples, plus two flags that every
rank must agree on, so that they all call ``ray.train.report`` (a barrier) at the same steps: rank 0's "a metrics
report is due" (its clock says ``train.report_seconds`` have passed) and "a preemption was announced" (any rank's
copy of Ray Train's notice). Nothing else waits on other processes per step: the per-step log and TensorBoard are
rank 0's local files, and the progress bar gets a fire-and-forget actor call. One trainer run may cover only some
epochs (a cache-refresh segment); its last step always checkpoints, so the next segment continues from it. The loop
never touches a text encoder or the VAE outside rank 0's validation renders: everything else is in the cached
shards.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import tempfile
import time

import torch

from rayflux import config as config_mod
from rayflux import memory, progress as progress_mod
from rayflux.train import captions, checkpoint, elastic, metrics, optim, step, validation
from rayflux.train.checkpoint import METRICS_FILE, Progress
from rayflux.train.feed import DATASET, planned_rows
from rayflux.train.trainer import LoraTrainer

log = logging.getLogger(__name__)

__all__ = ["train_loop_per_worker", "METRICS_FILE"]


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


def skip_trained(rows, progress: Progress):
    """The rows after the restored step. Every row carries its planned global step, so a resumed run skips exactly
    what it trained; the restored batch log (same world size only) confirms the skipped rows are those batches."""
    logged = {(b["step"], b["index"]) for b in progress.batches}
    for row in rows:
        if int(row["step"]) > progress.step:
            yield row
        elif logged and (int(row["step"]), int(row["index"])) not in logged:
            log.warning("resumed data order differs from the checkpoint's at step %s (plan changed?)", row["step"])
            logged = set()


def _debug_delay(cfg, rank: int) -> None:
    """``run.debug_slow_rank = "RANK:SECONDS"`` sleeps on one rank before each step, to expose ordering races."""
    if cfg.run.debug_slow_rank:
        slow_rank, seconds = cfg.run.debug_slow_rank.split(":")
        if int(slow_rank) == rank:
            time.sleep(float(seconds))


def _agree(loss: float, samples: int, report_due: bool, preempted: bool, device, world: int):
    """One step's all-rank view: ``(mean loss, total samples, report due, preempted)``, the flags true on every rank
    when true on any (rank 0 alone decides when a report is due)."""
    if world == 1:
        return loss, samples, report_due, preempted
    t = torch.tensor([loss, float(samples), float(report_due), float(preempted)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return float(t[0]) / world, int(t[1]), bool(t[2] > 0), bool(t[3] > 0)


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


def _worst_rank(facts: dict, device, world: int) -> dict:
    """The largest value of each memory fact over all ranks (a collective: every rank must call it)."""
    if world == 1:
        return facts
    keys = sorted(facts)
    t = torch.tensor([float(facts[k]) for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return {k: (int(v) if isinstance(facts[k], int) else round(float(v), 1)) for k, v in zip(keys, t.tolist())}


def train_loop_per_worker(loop_config: dict) -> None:
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    cfg = config_mod.from_dict(loop_config["job"])
    t, run_dir = cfg.train, loop_config["run_dir"]
    start_rss = memory.rss_mb()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()

    rows = iter(planned_rows(ray.train.get_dataset_shard(DATASET), t.prefetch_reads))
    first = next(rows)  # every row carries the run's planned step count, which fixes the LR schedule's horizon
    empty = captions.load_empty(loop_config["text_files"]) if t.caption_dropout > 0 else None

    progress = Progress(world_size=world)
    restored = ray.train.get_checkpoint()
    with restored.as_directory() if restored else contextlib.nullcontext() as d:
        # Resume by plan position (world sizes may differ) and shift the plan's step numbers by `offset`.
        rows, offset, positioned = elastic.resume_rows(
            itertools.chain([first], rows), d, METRICS_FILE, world, t.gradient_accumulation
        )
        total = optim.total_steps(int(first["total_steps"]) + offset, t.max_steps)
        trainer = LoraTrainer(cfg, device, total, rank, empty, wrap=ray.train.torch.prepare_model)
        if d:
            progress = checkpoint.restore(d, trainer, rank, world)
    start = progress.step
    if not positioned:
        rows = skip_trained(rows, progress)
    preemption = elastic.PreemptionNotice()
    board = metrics.TensorBoardLog(run_dir) if rank == 0 else None
    steps_log = metrics.StepLog(run_dir) if rank == 0 else None
    bar = progress_mod.BoardSender(loop_config.get("progress") if rank == 0 else None)
    clock, window, preempted_once = ReportClock(t.report_seconds, t.log_every), metrics.Throughput(), False

    def report(record: dict, with_checkpoint: bool) -> None:
        directory = None
        if with_checkpoint:
            # Checkpoints carry memory facts (worst rank): encoders must never be alive in a training worker.
            record.update(_worst_rank(memory.snapshot(start_rss), device, world))
            directory = tempfile.mkdtemp(prefix="rayflux-ckpt-")
            checkpoint.save(directory, trainer, rank, progress, t.output_format)
        if board:
            board.flush()
            steps_log.sync()
        ray.train.report(
            record,
            checkpoint=Checkpoint.from_directory(directory) if directory else None,
            delete_local_checkpoint_after_upload=bool(directory),
        )
        clock.reset(progress.step)

    for group, end_of_feed in with_last(grouped(rows, t.gradient_accumulation)):
        if progress.step >= total:
            break
        _debug_delay(cfg, rank)
        stats = trainer.train_step([step.from_item(item) for item in group])
        progress.step = int(group[0]["step"]) + offset
        progress.batches_done += len(group)
        loss, samples, report_due, preempted = _agree(
            stats.loss, stats.samples, rank == 0 and clock.due(progress.step), preemption.local(), device, world
        )
        progress.batches.extend(
            {"step": progress.step, "epoch": int(i["epoch"]), "index": int(i["index"]), "bucket": i["bucket"],
             "samples": json.loads(i["sample_ids"])}
            for i in group
        )  # fmt: skip
        record = {"step": progress.step, "epoch": int(group[0]["epoch"]), "generation": int(group[0]["generation"]),
                  "samples": samples, "loss": loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
                  **window.take(samples)}  # fmt: skip
        record.update(elastic.step_position(group, rank, world))
        last = progress.step >= total
        every = t.checkpoint_every and progress.step % t.checkpoint_every == 0
        preempted, preempted_once = preempted and not preempted_once, preempted_once or preempted
        if preempted:
            record["preempted"] = True
        due_checkpoint = bool(last or end_of_feed or every or preempted)
        if board:
            board.scalars(progress.step, record)
        due_images = last or (t.validation_every and progress.step % t.validation_every == 0)
        if rank == 0 and t.validation_prompts and due_images:
            images = validation.render(trainer.transformer, cfg, device, trainer.dtype)
            record["validation_image"] = validation.save_grid(images, run_dir, progress.step)
            board.image(progress.step, "validation", validation.grid(images))
        progress.history.append(record)
        if due_checkpoint or report_due:
            report(record, due_checkpoint)
        if steps_log:
            steps_log.write(record)
        bar.send(record, force=last or end_of_feed)
        if due_checkpoint or due_images:
            window.restart()  # rates exclude the time spent rendering and checkpointing
    if progress.step == start:
        # Nothing left to train (a rerun of a finished run or segment): still end with this run's own checkpoint.
        report({"step": progress.step}, True)
    if board:
        board.close()
        steps_log.close()

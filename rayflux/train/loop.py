"""``train_loop_per_worker``: build the trainer, skip what a restored checkpoint already trained, then step,
log, render and checkpoint.

Every step ends with one all-reduce of a few numbers: the mean loss and total samples, plus two flags that every
rank must agree on, so that they all call ``ray.train.report`` (a barrier) at the same steps: rank 0's "a metrics
report is due" (its clock says ``train.report_seconds`` have passed) and "a preemption was announced" (any rank's
copy of Ray Train's notice). Nothing else waits on other processes per step: the per-step log and TensorBoard are
rank 0's local files, and the progress bar gets a fire-and-forget actor call. One trainer run may cover only some
epochs (a cache-refresh segment); its last step always checkpoints, so the next segment continues from it. The loop
never touches a text encoder or the VAE: everything is in the cached shards, and validation images are rendered by
a separate actor from the step's LoRA file (:mod:`rayflux.train.renderer`) while training goes on. With
``data.eval_samples``, each eval (:mod:`rayflux.train.evaluation`: before the first step, every
``train.eval_every`` steps and at the end) adds one more all-reduce, and its numbers join that step's record.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import tempfile
import time

import torch

from rayflux import config as config_mod
from rayflux import memory, progress as progress_mod, storage
from rayflux.train import (captions, checkpoint, commits, elastic, evaluation, lora_files, metrics, optim, sharding,
                           step, validation, wandb_log)
from rayflux.train import renderer as renderer_mod
from rayflux.train.checkpoint import Progress
from rayflux.train.feed import DATASET, planned_rows
from rayflux.train.trainer import LoraTrainer

log = logging.getLogger(__name__)

__all__ = ["train_loop_per_worker"]


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


def _agree(loss: float, samples: int, report_due: bool, preempted: bool, device, world: int, reads=(0, 0, 0)):
    """One step's all-rank view: ``(mean loss, total samples, report due, preempted, reads)``, the flags true on every
    rank when true on any (rank 0 alone decides when a report is due), ``reads`` (bytes fetched, tensor bytes,
    requests) summed over ranks."""
    if world == 1:
        return loss, samples, report_due, preempted, tuple(reads)
    t = torch.tensor([loss, float(samples), float(report_due), float(preempted), *map(float, reads)],
                     dtype=torch.float64, device=device)  # fmt: skip
    torch.distributed.all_reduce(t)
    return float(t[0]) / world, int(t[1]), bool(t[2] > 0), bool(t[3] > 0), tuple(int(x) for x in t[4:].tolist())


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


def _barrier(device, world: int) -> None:
    """Wait for every rank (a tiny all-reduce, on the process group the step already uses)."""
    if world > 1:
        torch.distributed.all_reduce(torch.zeros(1, device=device))


def _record_start(progress: Progress, run_dir: str, resume_from: str, offered) -> None:
    """Rank 0: record this worker-group start in ``progress`` when it is a restart (a checkpoint was restored, or
    the controller recorded a failure since the last checkpoint), with its cause."""
    causes, progress.failures_seen = commits.failures_since(run_dir, progress.failures_seen)
    if not resume_from and not causes:
        return  # a fresh run
    offered_name = offered.path.rstrip("/").rsplit("/", 1)[-1] if offered else ""
    entry = {"step": progress.step, "from": resume_from.rstrip("/").rsplit("/", 1)[-1], "ray_offered": offered_name,
             "cause": "; ".join(causes) or "resumed by a new job, segment or resize", "time": time.time()}  # fmt: skip
    progress.resumed_at.append(progress.step)
    progress.restarts.append(entry)
    log.warning("restart at step %d from %s (Ray offered %s): %s", progress.step, entry["from"] or "scratch",
                offered_name or "none", entry["cause"])  # fmt: skip


def _worst_rank(facts: dict, device, world: int) -> dict:
    """The largest value of each memory fact over all ranks (a collective: every rank must call it)."""
    if world == 1:
        return facts
    keys = sorted(facts)
    t = torch.tensor([float(facts[k]) for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return {k: (int(v) if isinstance(facts[k], int) else round(float(v), 1)) for k, v in zip(keys, t.tolist())}


def _queue_render(renders, trainer, cfg, run_dir: str, record: dict, checkpointed: bool, last: bool,
                  loop_config: dict) -> None:
    """Rank 0: hand the step's LoRA file (diffusers keys) to the render actor (:mod:`rayflux.train.renderer`) and
    go on training. A diffusers-format checkpoint at this step has written it already; otherwise the live LoRA is
    written as that file, or, for kohya output, beside the grid (``validation/step-<step>.safetensors``)."""
    step = record["step"]
    with trainer.optimizer_eval():  # the LoRA as it is used (schedule-free: its average), as checkpoints write it
        if cfg.train.output_format == "kohya":
            path = validation.lora_path(run_dir, step)
            storage.write_bytes_atomic(path, lora_files.diffusers_bytes(trainer))
        elif checkpointed:
            path = storage.join(run_dir, lora_files.LORA_DIR, lora_files.step_name(cfg, step))
        else:
            path = lora_files.keep_live_step(trainer, cfg, run_dir, record, loop_config["caption_tables"])
    if renders.submit(record["step"], path, last):
        record["validation_image"] = validation.grid_path(run_dir, record["step"])  # where the actor writes it


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
    first = next(rows, None)  # every row carries the run's planned step count, which fixes the LR schedule's horizon
    if first is None:
        # The plan was cut at a checkpoint past this trainer run's last batch: nothing left to train.
        log.info("rank %d: nothing left to train in epochs %s", rank, loop_config.get("epochs"))
        return
    rows = itertools.chain([first], rows)
    empty = captions.load_empty(loop_config["text_files"]) if t.caption_dropout > 0 else None

    progress = Progress(world_size=world)
    resume_from = first["resume_from"]  # the checkpoint the feed cut the plan at (see rayflux.train.feed)
    with commits.downloaded(resume_from) if resume_from else contextlib.nullcontext() as d:
        total = optim.total_steps(int(first["total_steps"]), t.max_steps)
        topology = sharding.Topology(world, ctx.get_local_world_size(), ctx.get_node_rank())
        trainer = LoraTrainer(cfg, device, total, rank, empty, wrap=ray.train.torch.prepare_model, topology=topology,
                              text_length=loop_config["text_length"])  # fmt: skip
        if d:
            progress = checkpoint.restore(d, trainer, rank, world)
    if progress.step != int(first["resume_step"]):
        raise RuntimeError(f"the data feed was planned from step {first['resume_step']}, but checkpoint "
                           f"{resume_from or '(none)'} holds step {progress.step}")  # fmt: skip
    start = progress.step
    if rank == 0:
        _record_start(progress, loop_config["checkpoints"], resume_from, ray.train.get_checkpoint())
    preemption = elastic.PreemptionNotice()
    board = metrics.TensorBoardLog(run_dir, purge_step=start + 1 if start else None) if rank == 0 else None
    if board and cfg.run.wandb_project:  # the same scalars and grids, to Weights & Biases as well
        board = wandb_log.Both(board, wandb_log.WandbLog(cfg.run.wandb_project, loop_config["checkpoints"],
                                                         cfg.run.name, loop_config["job"]))  # fmt: skip
    steps_log = metrics.StepLog(run_dir) if rank == 0 else None
    bar = progress_mod.BoardSender(loop_config.get("progress") if rank == 0 else None)
    clock, window, preempted_once = ReportClock(t.report_seconds, t.log_every), metrics.Throughput(), False
    reads = metrics.ReadTotals()
    evals = evaluation.Evaluator(trainer, loop_config.get("eval_plan") or [], rank, world, t.eval_every,
                                 final_segment=int(loop_config["epochs"][1]) >= t.epochs)  # fmt: skip

    def keep_best(record: dict) -> None:
        lora_files.keep_best(trainer, cfg, run_dir, record, loop_config["caption_tables"])

    best_writer = keep_best if rank == 0 else None
    renderer = loop_config.get("renderer") if rank == 0 and t.validation_prompts else None
    renders = renderer_mod.Queue(renderer, t.validation_queue) if renderer else None
    if evals.active and start == 0:
        baseline = {"step": 0, "epoch": 0}  # the untrained LoRA (the base model): what training must improve on
        evals.run(baseline, progress, best_writer)
        if board:
            board.scalars(0, baseline)
            steps_log.write(baseline)
        bar.send(baseline, force=True)
        window.restart()

    def report(record: dict, with_checkpoint: bool) -> None:
        directory = None
        if with_checkpoint:
            # Checkpoints carry memory facts (worst rank): encoders must never be alive in a training worker.
            record.update(_worst_rank(memory.snapshot(start_rss), device, world))
            directory = tempfile.mkdtemp(prefix="rayflux-ckpt-")
            checkpoint.save(directory, trainer, rank, progress, t.output_format)
            if rank == 0:
                lora_files.keep_step(directory, cfg, run_dir, record, loop_config["caption_tables"])
        if board:
            board.flush()
            steps_log.sync()
        ray.train.report(
            record,
            checkpoint=Checkpoint.from_directory(directory) if directory else None,
            delete_local_checkpoint_after_upload=bool(directory),
        )
        clock.reset(progress.step)
        if directory:
            # Every rank's report returned, so every rank's files are in storage: the checkpoint is whole.
            _barrier(device, world)
            if rank == 0:
                commits.commit(ray.train.get_checkpoint())
                commits.prune(loop_config["checkpoints"])

    for group, end_of_feed in with_last(grouped(rows, t.gradient_accumulation)):
        if progress.step >= total:
            break
        _debug_delay(cfg, rank)
        stats = trainer.train_step([step.from_item(item) for item in group])
        position = elastic.step_position(group, rank, world)
        progress.advance(int(group[0]["step"]), position, group)
        loss, samples, report_due, preempted, step_reads = _agree(
            stats.loss, stats.samples, rank == 0 and clock.due(progress.step), preemption.local(), device, world,
            metrics.batch_reads(group),
        )
        record = {"step": progress.step, "epoch": int(group[0]["epoch"]), "generation": int(group[0]["generation"]),
                  "samples": samples, "loss": loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
                  **window.take(samples)}  # fmt: skip
        record.update(position)
        record.update(reads.add(record["epoch"], samples, step_reads))
        last = progress.step >= total
        every = t.checkpoint_every and progress.step % t.checkpoint_every == 0
        preempted, preempted_once = preempted and not preempted_once, preempted_once or preempted
        if preempted:
            record["preempted"] = True
        due_checkpoint = bool(last or end_of_feed or every or preempted)
        progress.feed_done = end_of_feed
        due_eval = evals.due(progress.step, last, end_of_feed)
        if due_eval:
            evals.run(record, progress, best_writer)
        if board:
            board.scalars(progress.step, record)
        due_images = bool(last or (t.validation_every and progress.step % t.validation_every == 0))
        if due_checkpoint or report_due:
            report(record, due_checkpoint)  # writes this step's LoRA file when it checkpoints
        if renders and due_images:
            _queue_render(renders, trainer, cfg, run_dir, record, due_checkpoint, last, loop_config)
        if steps_log:
            steps_log.write(record)
        bar.send(record, force=last or end_of_feed)
        if due_checkpoint or due_images or due_eval:
            window.restart()  # rates exclude the time spent rendering and checkpointing
    if progress.step == start and rank == 0:
        log.info("nothing left to train: the checkpoint at step %d already reached train.max_steps", start)
    if board:
        board.close()
        steps_log.close()

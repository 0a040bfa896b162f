"""``train_loop_per_worker``: build the trainer, skip what a restored checkpoint already trained, then step,
report, render and checkpoint.

Every rank gets the same number of optimizer steps from the plan (see :mod:`rayflux.train.batching`), so every
``ray.train.report`` (a barrier) is called equally often on every rank. The loop never touches a text encoder or the
VAE outside rank 0's validation renders: everything else it needs is in the cached shards.
"""

from __future__ import annotations

import itertools
import json
import logging
import tempfile

import torch

from rayflux import config as config_mod
from rayflux.train import captions, checkpoint, metrics, optim, step, validation
from rayflux.train.checkpoint import METRICS_FILE, Progress
from rayflux.train.feed import DATASET
from rayflux.train.trainer import LoraTrainer

log = logging.getLogger(__name__)

__all__ = ["train_loop_per_worker", "METRICS_FILE"]


def grouped(rows, size: int):
    """Consecutive groups of ``size`` rows: the batches of one optimizer step."""
    it = iter(rows)
    while group := list(itertools.islice(it, size)):
        yield group


def skip_trained(rows, progress: Progress) -> None:
    """Consume the rows a restored run already trained. The plan replays the same order, so these are exactly the
    first ``progress.batches_done`` rows; the restored batch log (same world size only) confirms it row by row."""
    logged = [b["index"] for b in progress.batches]
    for i in range(progress.batches_done):
        index = int(next(rows)["index"])
        if logged and index != logged[i]:
            log.warning("resumed data order differs from the checkpoint's at batch %d (did the cache change?)", i)
            logged = []


def _all_ranks(loss: float, samples: int, device, world: int) -> tuple[float, int]:
    """Mean loss and total samples over all ranks for one step."""
    if world == 1:
        return loss, samples
    t = torch.tensor([loss, float(samples)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return float(t[0]) / world, int(t[1])


def train_loop_per_worker(loop_config: dict) -> None:
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    cfg = config_mod.from_dict(loop_config["job"])
    t, run_dir = cfg.train, loop_config["run_dir"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()

    rows = iter(ray.train.get_dataset_shard(DATASET).iter_rows())
    first = next(rows)  # every row carries this rank's batch count, which fixes the LR schedule's horizon
    total = optim.total_steps(int(first["rank_batches"]), t.gradient_accumulation, t.max_steps)
    empty = captions.load_empty(loop_config["text_files"]) if t.caption_dropout > 0 else None
    trainer = LoraTrainer(cfg, device, total, rank, empty, wrap=ray.train.torch.prepare_model)

    progress = Progress(world_size=world)
    restored = ray.train.get_checkpoint()
    if restored:
        with restored.as_directory() as d:
            progress = checkpoint.restore(d, trainer, rank, world)
    start = progress.step
    rows = itertools.chain([first], rows)
    if progress.step < total:
        skip_trained(rows, progress)
    board = metrics.TensorBoardLog(run_dir) if rank == 0 else None
    window = metrics.Throughput()

    def report(record: dict, with_checkpoint: bool) -> None:
        directory = None
        if with_checkpoint:
            directory = tempfile.mkdtemp(prefix="rayflux-ckpt-")
            checkpoint.save(directory, trainer, rank, progress, t.output_format)
            if board:
                board.flush()
        ray.train.report(
            record,
            checkpoint=Checkpoint.from_directory(directory) if directory else None,
            delete_local_checkpoint_after_upload=bool(directory),
        )

    for group in grouped(rows, t.gradient_accumulation) if progress.step < total else ():
        stats = trainer.train_step([step.from_item(item) for item in group])
        progress.step += 1
        progress.batches_done += len(group)
        loss, samples = _all_ranks(stats.loss, stats.samples, device, world)
        window.add(samples)
        progress.batches.extend(
            {"step": progress.step, "epoch": int(i["epoch"]), "index": int(i["index"]), "bucket": i["bucket"],
             "samples": json.loads(i["sample_ids"])}
            for i in group
        )  # fmt: skip
        record = {"step": progress.step, "epoch": int(group[0]["epoch"]), "loss": loss, "lr": stats.lr,
                  "grad_norm": stats.grad_norm}  # fmt: skip
        last = progress.step >= total
        due_checkpoint = bool(last or (t.checkpoint_every and progress.step % t.checkpoint_every == 0))
        due_report = due_checkpoint or progress.step % t.log_every == 0
        if due_report:
            record.update(window.take())
        progress.history.append(record)
        if board:
            board.scalars(progress.step, record)
        due_images = last or (t.validation_every and progress.step % t.validation_every == 0)
        if rank == 0 and t.validation_prompts and due_images:
            images = validation.render(trainer.transformer, cfg, device, trainer.dtype)
            record["validation_image"] = validation.save_grid(images, run_dir, progress.step)
            board.image(progress.step, "validation", validation.grid(images))
        if due_report:
            report(record, due_checkpoint)
            window = metrics.Throughput()  # rates exclude the time spent rendering and checkpointing
        if last:
            break
    if progress.step == start:
        # Nothing left to train (a rerun of a finished run): still end with this run's own final checkpoint.
        report({"step": progress.step}, True)
    if board:
        board.close()

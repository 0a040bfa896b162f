"""Data-feed efficiency: training steps/s fed by Ray Data from cached shards ÷ the same steps from memory.

    python benchmarks/bench_feed.py [--steps 64] [--resolution 512] [--batches-per-read 1,8] [--rounds 3]

Both sides run the same LoRA step function on the same planned batches in the same order, in one process, one
after the other; the only difference is where each batch comes from. The Ray Data side uses the exact feed the
trainer uses (``PlannedDataConfig``), so planning, Parquet reads, stacking and prefetch are all inside the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--prefetch", type=int, default=2, help="reads kept ahead (train.feed.prefetch_reads)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the training step")
    ap.add_argument(
        "--batches-per-read",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 8],
        help="planned batches per read (train.feed.batches_per_read); a comma list compares several",
    )
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both sides; medians reported")
    args = ap.parse_args()

    import ray
    import torch
    from ray.data import DataContext

    from rayflux import config, models
    from rayflux.cache import generations
    from rayflux.cache.stage import build_generation
    from rayflux.discovery.in_process import discover
    from rayflux.testing.images import write_images
    from rayflux.testing.tiny import TinySpec, write_tiny_model
    from rayflux.train.adapter import lora
    from rayflux.train.data import batching
    from rayflux.train import step as train_step
    from rayflux.train.data.feed import DATASET, PlannedDataConfig, index_dataset, planned_rows
    from rayflux.train.plan import FeedPlan

    work = Path(tempfile.mkdtemp(prefix="bench-feed-"))
    # A transformer wide enough that a step costs what a small real one would on CPU, not microseconds.
    spec = TinySpec(num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=4)
    model_dir = str(write_tiny_model(work / "model", spec))
    write_images(work / "images", sizes=[(args.resolution, args.resolution)] * args.steps)
    cfg = config.load(
        None,
        [
            f"model.path={model_dir}",
            f"data.images_dir={work / 'images'}",
            f"data.resolution={args.resolution}",
            "train.epochs=1",
            "train.batch_size=1",
        ],
    )

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    DataContext.get_current().enable_progress_bars = False
    try:
        facts = models.model_facts(cfg.model)
        manifest = build_generation(cfg, facts, discover(cfg.data), str(work / "cache"), 0, 0, cluster_gpus=False)
        refs = batching.index_samples(manifest)

        def iterator(per_read: int):
            feed = PlannedDataConfig(
                FeedPlan(batch_size=1, seed=0, epochs=(0, 1), total_epochs=1, batches_per_read=per_read)
            )
            return feed.configure({DATASET: index_dataset(refs)}, 1, None, None)[0][DATASET]

        # A Ray Train worker on 0.5-1 CPU runs torch with one thread; so does this loop, leaving the other core to
        # the feed's read tasks, as on a real node where the data path runs on CPUs beside the accelerator.
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        transformer = models.load_transformer(cfg.model, "cpu", torch.float32)
        params = lora.add_lora(transformer, 4, 4.0, "attention")
        opt = torch.optim.AdamW(params, lr=1e-4)
        guidance = bool(transformer.config.guidance_embeds)
        family = models.family(cfg.model)

        def step(item):
            batch = train_step.from_item(item)
            loss = train_step.flow_loss(
                transformer, batch, cfg.train, guidance, None, train_step.Runtime("cpu", torch.float32, family)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()

        in_memory = list(planned_rows(iterator(1), args.prefetch))
        step(in_memory[0])  # warm-up: first-call allocations are not what either side measures

        def memory_pass() -> float:
            t0 = time.perf_counter()
            for item in in_memory:
                step(item)
            return time.perf_counter() - t0

        def feed_pass(per_read: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            first_wait, n = None, 0
            for item in planned_rows(iterator(per_read), args.prefetch):  # the training loop's own iteration
                if first_wait is None:
                    first_wait = time.perf_counter() - t0  # pipeline start-up, paid once per trainer run
                step(item)
                n += 1
            assert n == len(in_memory)
            return time.perf_counter() - t0, first_wait

        # Rounds alternate the two sides, so a slow minute of a shared machine hits both; medians are reported.
        rounds: list[dict] = []
        for _ in range(args.rounds):
            t_mem = memory_pass()
            row = {"in_memory_steps_per_s": len(in_memory) / t_mem}
            for per_read in args.batches_per_read:
                t_feed, first_wait = feed_pass(per_read)
                row[per_read] = (t_mem / t_feed, t_mem / (t_feed - first_wait), first_wait)
            rounds.append(row)
    finally:
        ray.shutdown()

    def median(values):
        return round(statistics.median(values), 3)

    result = {
        "steps": len(in_memory),
        "resolution": args.resolution,
        "prefetch_reads": args.prefetch,
        "torch_threads": args.threads,
        "rounds": args.rounds,
        "in_memory_steps_per_s": median([r["in_memory_steps_per_s"] for r in rounds]),
        "by_batches_per_read": {
            per_read: {
                "efficiency_feed_over_memory": median([r[per_read][0] for r in rounds]),
                "efficiency_range": [
                    round(min(r[per_read][0] for r in rounds), 3),
                    round(max(r[per_read][0] for r in rounds), 3),
                ],
                "steady_state_efficiency": median([r[per_read][1] for r in rounds]),
                "first_batch_wait_s": median([r[per_read][2] for r in rounds]),
            }
            for per_read in args.batches_per_read
        },
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

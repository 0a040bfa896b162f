"""Data-feed efficiency: training steps/s fed by Ray Data from cached shards ÷ the same steps from memory.

    python benchmarks/bench_feed.py [--steps 24] [--resolution 512]

Both sides run the same LoRA step function on the same planned batches in the same order, in one process, one
after the other; the only difference is where each batch comes from. The Ray Data side uses the exact feed the
trainer uses (``PlannedDataConfig``), so planning, Parquet reads, stacking and prefetch are all inside the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the training step")
    ap.add_argument("--batches-per-read", type=int, default=4, help="planned batches per Ray Data read task")
    args = ap.parse_args()

    import ray
    import torch
    from ray.data import DataContext

    from rayflux import config, models
    from rayflux.cache import generations
    from rayflux.cache.stage import build_generation
    from rayflux.sources import discover
    from rayflux.testing.images import write_images
    from rayflux.testing.tiny import TinySpec, write_tiny_model
    from rayflux.train import batching, lora
    from rayflux.train import step as train_step
    from rayflux.train.feed import DATASET, PlannedDataConfig, index_dataset, planned_rows

    work = Path(tempfile.mkdtemp(prefix="bench-feed-"))
    # A transformer wide enough that a step costs what a small real one would on CPU, not microseconds.
    spec = TinySpec(num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=4)
    model_dir = str(write_tiny_model(work / "model", spec))
    write_images(work / "images", sizes=[(args.resolution, args.resolution)] * args.steps)
    cfg = config.load(
        None,
        [f"model.path={model_dir}", f"data.images_dir={work / 'images'}", f"data.resolution={args.resolution}",
         "train.epochs=1", "train.batch_size=1"],
    )  # fmt: skip

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    DataContext.get_current().enable_progress_bars = False
    try:
        facts = models.model_facts(cfg.model)
        manifest = build_generation(cfg, facts, discover(cfg.data), str(work / "cache"), 0, 0, False)
        refs = batching.index_samples(generations.sample_files(manifest))
        feed = PlannedDataConfig(1, 0, (0, 1), 1, batches_per_read=args.batches_per_read)

        def iterator():
            return feed.configure({DATASET: index_dataset(refs)}, 1, None, None)[0][DATASET]

        # A Ray Train worker on 0.5-1 CPU runs torch with one thread; so does this loop, leaving the other core to
        # the feed's read tasks, as on a real node where the data path runs on CPUs beside the accelerator.
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        transformer = models.load_transformer(cfg.model, "cpu", torch.float32)
        params = lora.add_lora(transformer, 4, 4.0, "attention")
        opt = torch.optim.AdamW(params, lr=1e-4)
        guidance = bool(transformer.config.guidance_embeds)

        def step(item):
            batch = train_step.from_item(item)
            loss = train_step.flow_loss(transformer, batch, cfg.train, guidance, None, "cpu", torch.float32)
            opt.zero_grad()
            loss.backward()
            opt.step()

        in_memory = list(planned_rows(iterator(), args.prefetch))
        step(in_memory[0])  # warm-up: first-call allocations are not what either side measures
        t0 = time.perf_counter()
        for item in in_memory:
            step(item)
        t_mem = time.perf_counter() - t0

        t0 = time.perf_counter()
        first_wait = None
        n = 0
        for item in planned_rows(iterator(), args.prefetch):  # the training loop's own iteration
            if first_wait is None:
                first_wait = time.perf_counter() - t0  # pipeline start-up, paid once per trainer run
            step(item)
            n += 1
        t_feed = time.perf_counter() - t0
    finally:
        ray.shutdown()
    assert n == len(in_memory)
    result = {
        "steps": n,
        "resolution": args.resolution,
        "prefetch_batches": args.prefetch,
        "torch_threads": args.threads,
        "batches_per_read": args.batches_per_read,
        "in_memory_steps_per_s": round(n / t_mem, 3),
        "ray_data_steps_per_s": round(n / t_feed, 3),
        "efficiency_feed_over_memory": round(t_mem / t_feed, 3),
        "first_batch_wait_s": round(first_wait, 3),
        "steady_state_efficiency": round(t_mem / (t_feed - first_wait), 3),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

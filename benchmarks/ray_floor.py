"""The floor of the parts the job is built from: what a run costs before any data, weights or steps.

    python benchmarks/ray_floor.py [--cold]

It does what the job must do with Ray and nothing else: start a Ray of its own as the job does
(``run.ray_address=local``: no dashboard), with ``--cold`` one Ray Data ``map_batches`` over one row in an actor pool
of one whose actor imports what encoding latents needs (torch and diffusers' ``AutoencoderKL``; the job runs two such
pools, text and images), then a ``TorchTrainer`` of one worker with the job's default resources whose training
function imports what the train step needs (torch, diffusers' ``FluxTransformer2DModel`` and peft) and returns, then
``ray.shutdown``. No model is loaded, no file read, no step taken. ``bench_cold.py --floor`` runs it beside the job
and SimpleTuner: its wall time is a lower bound for any job built on Ray Data's actor pools and Ray Train's worker
group on that machine. Prints one JSON line of phase seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time

# The job's value (rayflux.train.stage.POLL_SECONDS): the controller learns sooner that the worker has finished.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


class _Encoder:
    """An actor that imports what a VAE encoder needs, as the cache stage's image pool does before its first batch."""

    def __init__(self):
        import torch  # noqa: F401
        from diffusers import AutoencoderKL  # noqa: F401

    def __call__(self, batch):
        return batch


def _train_fn() -> None:
    import torch  # noqa: F401
    from diffusers import FluxTransformer2DModel  # noqa: F401
    from peft import LoraConfig  # noqa: F401


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cold", action="store_true", help="also one actor-pool map_batches, as a cache pass needs")
    args = ap.parse_args()
    marks = {"start": time.time()}
    import ray
    import ray.data
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    marks["imports"] = time.time()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    marks["ray_init"] = time.time()
    if args.cold:
        rows = ray.data.from_items([{"x": 0}]).map_batches(_Encoder, concurrency=1, num_cpus=1).take_all()
        assert rows == [{"x": 0}], rows
        marks["cache_pool"] = time.time()
    with tempfile.TemporaryDirectory(prefix="rayflux-floor-") as storage:
        TorchTrainer(
            _train_fn,
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(name="floor", storage_path=storage),
        ).fit()
    marks["trainer_fit"] = time.time()
    ray.shutdown()
    marks["shutdown"] = time.time()
    names = list(marks)
    print(json.dumps({b: round(marks[b] - marks[a], 3) for a, b in itertools.pairwise(names)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

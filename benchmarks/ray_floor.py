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

``--refits N`` then runs N more such trainers one after another in the same Ray, as a sweep's trials do (each trial
is a ``TorchTrainer`` of its own), and adds, as medians over them, ``refit_to_train_fn`` (from ``fit()`` to the
worker's training function starting, its imports not yet done), ``refit_imports`` (those imports) and ``refit``
(the whole ``fit``): the floor of a sweep trial's start, before any cache check, model load or read.
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


def _refit_fn(config: dict) -> None:
    """``_train_fn``, noting when it started and when its imports were done (``--refits``)."""
    started = time.time()
    _train_fn()
    with open(config["marks"], "a") as f:
        f.write(json.dumps({"started": started, "imported": time.time()}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cold", action="store_true", help="also one actor-pool map_batches, as a cache pass needs")
    ap.add_argument("--refits", type=int, default=0, help="then N more trainers in the same Ray (a sweep's trials)")
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
    refits = {}
    if args.refits:
        refits = _refits(args.refits, TorchTrainer, ScalingConfig, RunConfig)
        marks["refits"] = time.time()
    ray.shutdown()
    marks["shutdown"] = time.time()
    names = list(marks)
    phases = {b: round(marks[b] - marks[a], 3) for a, b in itertools.pairwise(names)}
    print(json.dumps({**phases, **refits}), flush=True)
    return 0


def _refits(n: int, TorchTrainer, ScalingConfig, RunConfig) -> dict:
    """N more no-op trainers, one after another in this Ray: medians of their start and whole ``fit``."""
    import statistics

    to_fn, imports, whole = [], [], []
    with tempfile.TemporaryDirectory(prefix="rayflux-floor-") as storage:
        marks = os.path.join(storage, "marks.jsonl")
        for i in range(n):
            t0 = time.time()
            TorchTrainer(
                _refit_fn,
                train_loop_config={"marks": marks},
                scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
                run_config=RunConfig(name=f"refit-{i}", storage_path=storage),
            ).fit()
            whole.append(time.time() - t0)
            with open(marks) as f:
                last = json.loads(f.read().splitlines()[-1])
            to_fn.append(last["started"] - t0)
            imports.append(last["imported"] - last["started"])
    med = statistics.median
    return {
        "refit_to_train_fn": round(med(to_fn), 3),
        "refit_imports": round(med(imports), 3),
        "refit": round(med(whole), 3),
    }


if __name__ == "__main__":
    raise SystemExit(main())

"""Validation renders off the training ranks: one Ray actor per trainer run renders each due step's LoRA file while
training goes on.

Rank 0 only writes the step's LoRA file in diffusers format (``lora/<name>-step<step>.safetensors``, the one a
checkpoint at that step leaves anyway; for kohya output ``validation/step-<step>.safetensors`` beside the grid) and
queues a fire-and-forget call. The actor loads the base once (the transformer with the adapter attached, the
prompts' embeddings, the reference images), applies each file with :func:`rayflux.train.adapter.lora.load_into` (the
checkpoint-resume loader) and renders with :func:`rayflux.train.observe.validation.render`, so its grid is the one an
in-process render of that file draws. Training never waits for it: a render that fails is logged with its reason, a
step due while ``train.validation.queue`` renders are still pending is skipped with a log line (the last step's
render is always queued), and the driver waits at most ``train.validation.wait_seconds`` for the renders still due
after the last step (:meth:`Renders.finish`), then kills the actor. No training worker ever loads a text encoder:
the actor encodes the prompts.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

from rayflux import config as config_mod
from rayflux import models, storage

log = logging.getLogger(__name__)


class Renderer:
    """The render actor's state: the base model and its embeddings, loaded at the first render and kept."""

    def __init__(self, job: dict, output_dir: str):
        self.cfg = config_mod.from_dict(job)
        self.output_dir = output_dir
        self.transformer = None
        self.tensorboard = None
        self.results: list[dict] = []

    def _device(self):
        import ray
        import torch

        return torch.device("cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu")

    def _base(self, device):
        """The base transformer with an adapter attached as training attaches it (loaded once per actor)."""
        import torch

        from rayflux.train.adapter import lora

        if self.transformer is None:
            t = self.cfg.train
            dtype = models.torch_dtype(self.cfg.model.dtype, device.type)
            with torch.random.fork_rng(devices=[]):  # add_lora's init draws; the file replaces what it drew
                self.transformer = models.load_transformer(models.render_model(self.cfg), str(device), dtype)
                lora.add_lora(
                    self.transformer,
                    t.adapter.rank,
                    t.adapter.alpha,
                    t.adapter.targets,
                    t.adapter.lora_dropout,
                    **lora.patterns_of(t),
                )
            self.transformer.eval()
        return self.transformer

    def render(self, step: int, lora_path: str) -> dict:
        """Render the prompts with the LoRA file of ``step``; write the grid and its TensorBoard image. Never raises:
        the result says ``path`` or ``error``."""
        from rayflux.train.observe import metrics, validation

        started = time.monotonic()
        try:
            device = self._device()
            transformer = self._base(device)
            _apply(transformer, lora_path)
            images = validation.render(transformer, self.cfg, device, transformer.dtype)
            path = validation.save_grid(images, self.output_dir, step)
            if self.tensorboard is None:
                self.tensorboard = metrics.TensorBoardLog(self.output_dir)
            self.tensorboard.image(step, "validation", validation.grid(images))
            self.tensorboard.flush()
            result = {"step": step, "path": path, "seconds": round(time.monotonic() - started, 2)}
        except Exception as exc:  # noqa: BLE001 - a failed render is reported, never raised into training
            log.exception("validation render for step %d failed", step)
            result = {"step": step, "error": f"{type(exc).__name__}: {exc}"}
        self.results.append(result)
        return result

    def drain(self) -> list[dict]:
        """Every render's result so far. Calls run in order, so this returns after every render queued before it."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        return list(self.results)

    def pid(self) -> int:
        return os.getpid()


def _apply(transformer, path: str) -> None:
    """Load a diffusers-format LoRA file (local or URI) into the adapter, as a checkpoint resume does."""
    import tempfile

    from rayflux.train.adapter import lora

    if not storage.is_uri(path):
        return lora.load_into(transformer, path)
    with tempfile.TemporaryDirectory(prefix="rayflux-render-") as tmp:
        local = os.path.join(tmp, "lora.safetensors")
        with open(local, "wb") as f:
            f.write(storage.read_bytes(path))
        lora.load_into(transformer, local)


def choose_resources(cfg, use_gpu: bool, cluster: dict) -> tuple[dict, str]:
    """``(Ray resources for the render actor, why)``: ``train.validation.resources`` when set; on a CPU cluster a
    CPU share; else a GPU of ``cache.accelerator_type`` (the cheaper type the encoders use), else a spare GPU when
    the cluster has more than the workers take, else a share of a training GPU (:func:`gpu_share`)."""
    t = cfg.train
    if t.validation.resources:
        return dict(t.validation.resources), "train.validation.resources"
    if not use_gpu:
        return {"CPU": min(0.5, t.workers.cpus_per_worker)}, "CPU training: a CPU actor"
    if cfg.cache.accelerator_type:
        kind = cfg.cache.accelerator_type
        return {"CPU": 1, "GPU": 1, f"accelerator_type:{kind}": 0.001}, f"a {kind} GPU (cache.accelerator_type)"
    _, hi = config_mod.worker_range(t.workers.num_workers)
    if cluster.get("GPU", 0) > hi:
        return {"CPU": 1, "GPU": 1}, "a spare GPU beside the training workers'"
    return {"CPU": 1, "GPU": GPU_SHARE}, f"{GPU_SHARE:g} of a training node's GPU (workers take {1 - GPU_SHARE:g})"


GPU_SHARE = 0.25
"""The share of a training GPU the render actor takes when the cluster has no spare GPU and no cheaper type."""


def gpu_share(resources: dict) -> float:
    """How much of a GPU each training worker must leave for the render actor: its share when it takes a fraction."""
    gpu = float(resources.get("GPU", 0))
    return gpu if 0 < gpu < 1 and not any(k.startswith("accelerator_type:") for k in resources) else 0.0


class Renders:
    """The driver's side: start the actor for a trainer run, and at its end wait for the renders still due."""

    def __init__(self, cfg, output_dir: str, resources: dict, why: str):
        import ray

        self.wait_seconds = cfg.train.validation.wait_seconds
        self.name = f"rayflux-renderer-{uuid.uuid4().hex[:8]}"
        cpus = float(resources.get("CPU", 0))
        custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
        self.actor = (
            ray.remote(Renderer)
            .options(
                name=self.name,
                num_cpus=cpus,
                num_gpus=float(resources.get("GPU", 0)),
                resources=custom or None,
                max_restarts=0,
            )
            .remote(cfg.to_dict(), output_dir)
        )
        log.info("validation renders: actor %s with %s (%s); training does not wait for it", self.name, resources, why)

    def finish(self) -> list[dict]:
        """Wait up to ``train.validation.wait_seconds`` for the renders still due, log each failure, kill the actor.
        Returns the renders' results (empty when the actor died or did not finish in time)."""
        import ray

        results: list[dict] = []
        try:
            results = ray.get(self.actor.drain.remote(), timeout=self.wait_seconds)
        except ray.exceptions.GetTimeoutError:
            log.warning(
                "validation renders still due after %gs (train.validation.wait_seconds): abandoned", self.wait_seconds
            )
        except ray.exceptions.RayActorError as exc:
            log.warning("validation renderer died; its pending renders are lost: %s", str(exc).splitlines()[0])
        finally:
            ray.kill(self.actor)
        for r in results:
            if "error" in r:
                log.warning("validation render for step %d failed: %s", r["step"], r["error"])
        return results


class Queue:
    """Rank 0's side: queue renders without waiting, skip a step when too many are pending, log failures."""

    def __init__(self, actor, limit: int):
        self.actor, self.limit, self.pending = actor, max(limit, 1), []

    def _settle(self) -> None:
        import ray

        ready, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
        for ref in ready:
            try:
                result = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor died: training goes on without images
                log.warning("validation renderer unavailable: %s", str(exc).splitlines()[0])
                continue
            if "error" in result:
                log.warning("validation render for step %d failed: %s", result["step"], result["error"])

    def submit(self, step: int, lora_path: str, last: bool) -> bool:
        """Queue the render of ``step``; returns False (logged) when it was skipped because renders fell behind."""
        if self.pending:
            self._settle()
        if len(self.pending) >= self.limit and not last:
            log.warning(
                "validation render for step %d skipped: %d renders still pending (train.validation.queue)",
                step,
                len(self.pending),
            )
            return False
        self.pending.append(self.actor.render.remote(step, lora_path))
        return True

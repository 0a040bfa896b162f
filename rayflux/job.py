"""The stage runner: validate -> cache -> train -> export, recorded in the run's ledger."""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field

from rayflux import config as config_mod
from rayflux import models, paths, storage
from rayflux.config import JobConfig
from rayflux.ledger import Ledger

log = logging.getLogger("rayflux")


@dataclass
class Summary:
    """What a job did and where everything went."""

    output_dir: str = ""
    cache_dir: str = ""
    lora_path: str = ""
    checkpoint: str = ""
    ledger: str = ""
    discovered: int = 0
    cached: int = 0
    skipped: int = 0
    steps: int = 0
    losses: list = field(default_factory=list)
    stage_seconds: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [
            f"images: {self.discovered} discovered, {self.cached} cached, {self.skipped} skipped",
            f"cache:      {self.cache_dir}",
        ]
        if self.steps:
            out.append(f"training:   {self.steps} steps per worker, last loss {self.losses[-1]:.4f}")
            out.append(f"LoRA:       {self.lora_path}")
            out.append(f"checkpoint: {self.checkpoint}")
        out.append(f"ledger:     {self.ledger}")
        out.append("time:       " + ", ".join(f"{k} {v:.1f}s" for k, v in self.stage_seconds.items()))
        return out


def resolve_dirs(cfg: JobConfig) -> tuple[str, str, str]:
    """(images_dir, cache_root, output_dir), absolute, with the demo images filled in when none are given."""
    images = cfg.data.images_dir
    if not images:
        from rayflux.testing.images import ensure_demo_images

        images = str(ensure_demo_images())
    output = cfg.run.output_dir if storage.is_uri(cfg.run.output_dir) else os.path.abspath(cfg.run.output_dir)
    cache = cfg.cache.dir or storage.join(output, "cache")
    if not storage.is_uri(cache):
        cache = os.path.abspath(cache)
    return images, cache, output


def connect(address: str = "") -> None:
    """Join ``address``, else ``RAY_ADDRESS``, else a running local head, else start a local Ray."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address)
        return
    try:
        ray.init(address="auto")
    except ConnectionError:
        ray.init()


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def run(cfg: JobConfig, only: str = "") -> Summary:
    """Run the job's stages. ``only="cache"`` stops after the cache stage."""
    from rayflux.cache import generations
    from rayflux.cache.stage import build_generation, cache_key
    from rayflux.sources import discover
    from rayflux.train.checkpoint import lora_file
    from rayflux.train.stage import train

    images, cache_root, output = resolve_dirs(cfg)
    # Refuse overlapping directories before any Ray work or any write.
    paths.check_disjoint(images, **{"cache.dir": cache_root, "run.output_dir": output})
    cfg.data.images_dir = images
    summary = Summary(output_dir=output)
    facts = models.model_facts(cfg.model)
    ledger = Ledger(output, cfg.fingerprint("data", "model", "train"))
    summary.ledger = ledger.path

    connect(cfg.run.ray_address)
    use_gpu = cluster_has_gpus()

    t0 = time.perf_counter()
    key = cache_key(cfg, facts)
    discovery = discover(cfg.data, images, seed=cfg.cache.seed)
    gen_dir = generations.generation_dir(cache_root, key, 0)
    manifest = generations.load_manifest(gen_dir)
    inputs = f"{key}:{_inputs(discovery)}"
    if manifest is not None and manifest.get("inputs") == _inputs(discovery):
        log.info("cache generation %s is committed and up to date; nothing to encode", gen_dir)
    else:
        if manifest is not None:
            log.info("images or captions changed since %s was built; building a new generation", gen_dir)
            gen_dir = _next_free_generation(cache_root, key)
        entry = ledger.start("cache:g0", inputs, dir=gen_dir)
        manifest = build_generation(cfg, facts, discovery, gen_dir, 0, cfg.cache.seed, use_gpu)
        ledger.finish(entry, manifest=storage.join(gen_dir, generations.MANIFEST), cached=manifest["cached"])
    summary.stage_seconds["cache"] = time.perf_counter() - t0
    summary.cache_dir = gen_dir
    summary.discovered, summary.cached, summary.skipped = manifest["discovered"], manifest["cached"], manifest["skipped"]
    if only == "cache":
        return summary
    if manifest["cached"] == 0:
        raise RuntimeError(f"no image could be cached (see {storage.join(gen_dir, generations.SKIPPED)})")

    t0 = time.perf_counter()
    entry = ledger.start("train", manifest["dir"])
    result = train(cfg, manifest, facts, output, use_gpu)
    summary.stage_seconds["train"] = time.perf_counter() - t0
    summary.steps, summary.losses, summary.checkpoint = result.steps, result.losses, result.checkpoint_path

    lora_dir = storage.join(output, "lora")
    summary.lora_path = export_lora(result.checkpoint_dir, lora_dir, lora_file(cfg.train.output_format))
    ledger.finish(entry, checkpoint=result.checkpoint_path, lora=summary.lora_path, steps=result.steps)
    return summary


def _inputs(discovery) -> str:
    from rayflux.cache.stage import _inputs_signature

    return _inputs_signature(discovery)


def _next_free_generation(cache_root: str, key: str) -> str:
    from rayflux.cache import generations

    g = 1
    while storage.exists(generations.generation_dir(cache_root, key, g)):
        g += 1
    return generations.generation_dir(cache_root, key, g)


def export_lora(checkpoint_dir: str, lora_dir: str, weight_name: str = "") -> str:
    """Copy the final checkpoint's LoRA file (diffusers format unless named) into ``<output_dir>/lora``."""
    from rayflux.train.lora import WEIGHT_NAME

    dest = storage.join(lora_dir, weight_name or WEIGHT_NAME)
    src = os.path.join(checkpoint_dir, weight_name or WEIGHT_NAME)
    if storage.is_uri(dest):
        with open(src, "rb") as f:
            storage.write_bytes_atomic(dest, f.read())
    else:
        os.makedirs(lora_dir, exist_ok=True)
        shutil.copyfile(src, dest + ".tmp")
        os.replace(dest + ".tmp", dest)
    return dest


__all__ = ["Summary", "run", "connect", "resolve_dirs", "config_mod"]

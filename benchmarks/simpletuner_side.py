"""SimpleTuner's side of ``bench_cold.py --simpletuner PYTHON``: the same job (tiny FLUX.1, the same images and
captions, resolution, steps, rank, batch) configured as alike as SimpleTuner's options allow, run end to end through
``simpletuner_launch.py`` under SimpleTuner's own interpreter.

Making that interpreter on a Python 3.11 machine (SimpleTuner 4.10.1's wheel declares Python >= 3.12; its sources
compile on 3.11 except skrample's, which ``simpletuner_launch.py`` stubs)::

    python3.11 -m venv /tmp/st311
    /tmp/st311/bin/pip install -r benchmarks/simpletuner-py311.txt  # its dependencies as resolved for 3.11
    /tmp/st311/bin/pip install --no-deps --ignore-requires-python simpletuner==4.10.1 skrample==0.5.3

``simpletuner-py311.txt`` is ``pip freeze`` of the venv the BENCHMARKS.md figures came from: torch 2.13.0's CPU
build (rayflux's), ``transformers<5.23`` (SimpleTuner on the CPU needs it), PyPI's torchvision 0.28.0 and
torchaudio 2.11.0 (CUDA-built; ``simpletuner_launch.py`` lets them import beside the CPU torch).
webshart, a sharded-dataset reader, fails to build on 3.11 and is left out: a local folder does not use it.

Configured alike: the model directory, the images (a copy, because SimpleTuner writes its bucket metadata into the
image folder), ``.txt`` captions, area buckets at ``resolution``² pixels without cropping, ``steps`` steps at batch
1, LoRA rank 4 / alpha 4 on the same eight attention projections (``flux_lora_target: all``), AdamW lr 1e-4 with
weight decay 0, a constant schedule, gradient norm clipped to 1.0, fp32 weights and no autocast (rayflux's CPU
defaults), no gradient checkpointing, flow shift 3 with logit-normal sigmas, guidance 1, seed 0, no EMA, no
validation, no checkpoints, no trackers, one process. SimpleTuner's own caches: latents (``cache_dir_vae``), text
embeddings (``cache_dir``) and the aspect-bucket metadata it writes beside the images; a cold run starts with none
of them, a warm run keeps them and gets a new output folder, as rayflux's warm run does.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from proctree import Measured, run_measured, tree_bytes

LAUNCHER = Path(__file__).resolve().parent / "simpletuner_launch.py"


def copy_images(images: Path, dest: Path) -> Path:
    """A copy of ``images`` for SimpleTuner (which writes its bucket metadata into the image folder)."""
    if not dest.exists():
        shutil.copytree(images, dest)
    return dest


def write_config(work: Path, images: Path, model: Path, resolution: int, steps: int) -> Path:
    """SimpleTuner's config and data backend for one run folder ``work``; returns the config's path."""
    cache = work / "cache"
    backend = [
        {
            "id": "images",
            "type": "local",
            "instance_data_dir": str(images),
            "caption_strategy": "textfile",
            "resolution": resolution,
            "resolution_type": "pixel_area",
            "minimum_image_size": 0,
            "crop": False,
            "repeats": 0,
            "cache_dir_vae": str(cache / "vae"),
        },
        {
            "id": "text-embeds",
            "dataset_type": "text_embeds",
            "default": True,
            "type": "local",
            "cache_dir": str(cache / "text"),
        },
    ]
    config = {
        "model_family": "flux",
        "model_type": "lora",
        "lora_type": "standard",
        "pretrained_model_name_or_path": str(model),
        "flux_lora_target": "all",
        "lora_rank": 4,
        "lora_alpha": 4,
        "data_backend_config": str(work / "databackend.json"),
        "output_dir": str(work / "out"),
        "max_train_steps": steps,
        "num_train_epochs": 0,
        "train_batch_size": 1,
        "learning_rate": 1e-4,
        "lr_scheduler": "constant",
        "lr_warmup_steps": 0,
        "optimizer": "torch-adamw",
        "optimizer_config": "weight_decay=0.0",
        "mixed_precision": "no",
        "base_model_precision": "no_change",
        "gradient_checkpointing": False,
        "grad_clip_method": "norm",
        "max_grad_norm": 1.0,
        "flow_schedule_shift": 3,
        "flux_guidance_value": 1.0,
        "seed": 0,
        "report_to": "none",
        "checkpoint_step_interval": 0,
        "validation_disable": True,
        "push_to_hub": False,
        "use_ema": False,
        "vae_batch_size": 1,
        "caption_dropout_probability": 0.0,
    }
    work.mkdir(parents=True, exist_ok=True)
    (work / "databackend.json").write_text(json.dumps(backend, indent=1))
    (work / "config.json").write_text(json.dumps(config, indent=1))
    return work / "config.json"


def bucket_metadata(images: Path) -> list[Path]:
    """The aspect-bucket files SimpleTuner keeps beside the images (part of its cache)."""
    return sorted(images.glob("aspect_ratio_bucket_*.json"))


def run_simpletuner(python: Path, work: Path, images: Path, cache: Path, out: Path, timeout: float = 3600) -> dict:
    """One SimpleTuner run whose config lives in ``work`` (written by :func:`write_config` with ``cache`` and a
    fresh ``out``); its wall, whole-tree CPU, terminal lines and the cache's bytes after it."""
    shutil.rmtree(out, ignore_errors=True)
    env = {
        **os.environ,
        "CONFIG_BACKEND": "json",
        "CONFIG_PATH": str(work / "config.json"),
        "TRANSFORMERS_VERBOSITY": "error",
    }
    env.pop("PYTHONPATH", None)  # rayflux's tree must not shadow anything in SimpleTuner's venv
    m: Measured = run_measured([str(python), str(LAUNCHER)], env, work, work / f"{out.name}.log", timeout)
    if m.returncode != 0 or not (out / "pytorch_lora_weights.safetensors").exists():
        raise SystemExit(f"SimpleTuner failed ({work}): {m.tail}")
    run = {
        "launch": m.launch,
        "exit": m.exit,
        "cpu": m.cpu,
        "cpu_rusage": m.cpu_rusage,
        "lines": m.lines,
        "cache_bytes": tree_bytes(cache, *bucket_metadata(images)),
    }
    (work / f"{out.name}.json").write_text(json.dumps(run))  # for ``bench_cold.py --from``
    return run


def clear_cache(images: Path, cache: Path) -> None:
    """Remove SimpleTuner's caches for a cold run: latents, text embeddings and the bucket metadata."""
    shutil.rmtree(cache, ignore_errors=True)
    for p in bucket_metadata(images):
        p.unlink()


class SimpleTunerSide:
    """SimpleTuner's runs for one benchmark: a cold run (no caches) and, unless ``cold_only``, a warm run (the cold
    run's caches kept) per round, each in its own folder under ``work``."""

    def __init__(self, python: Path, work: Path, images: Path, model: Path, resolution: int, steps: int):
        self.python, self.work, self.resolution, self.steps, self.model = python, work, resolution, steps, model
        self.images = copy_images(images, work / f"{images.name}-simpletuner")
        self.runs: dict[str, list[dict]] = {"cold": [], "warm": []}

    def run_round(self, tag: str, cold_only: bool) -> None:
        folder = self.work / f"simpletuner-{tag}"
        cache = folder / "cache"
        write_config(folder, self.images, self.model, self.resolution, self.steps)
        clear_cache(self.images, cache)
        kinds = ["cold"] if cold_only else ["cold", "warm"]
        for kind in kinds:
            cfg = json.loads((folder / "config.json").read_text())
            cfg["output_dir"] = str(folder / f"out-{kind}")
            (folder / "config.json").write_text(json.dumps(cfg, indent=1))
            self.runs[kind].append(run_simpletuner(self.python, folder, self.images, cache, folder / f"out-{kind}"))
        clear_cache(self.images, cache)
        line = ", ".join(f"{k} {self.runs[k][-1]['exit'] - self.runs[k][-1]['launch']:.1f}s" for k in kinds)
        print(f"round {tag} SimpleTuner: {line}", flush=True)

    def load(self, work: Path) -> None:
        """The runs an earlier call left under ``work``."""
        for folder in sorted(work.glob("simpletuner-r*"), key=lambda p: int(p.name.split("-r")[1])):
            saved = {k: folder / f"out-{k}.json" for k in ("cold", "warm")}
            for kind, path in saved.items():
                if path.exists():
                    self.runs[kind].append(json.loads(path.read_text()))


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values) if values else float("nan")


def side_by_side(ours: dict[str, list[dict]], theirs: dict[str, list[dict]], images: int) -> None:
    """Print rayflux against SimpleTuner: each measure's median per side and the median of the per-round ratios
    (rayflux ÷ SimpleTuner; runs of one round were alternated, so each ratio pairs runs under similar load)."""
    measures = [
        ("end to end (s)", lambda r: r["exit"] - r["launch"]),
        ("CPU seconds, whole process tree", lambda r: r["cpu"]),
        ("terminal lines", lambda r: r["lines"]),
        ("cache bytes per image", lambda r: r["cache_bytes"] / images),
    ]
    print(
        "\n| run | measure | rayflux | SimpleTuner | rayflux ÷ SimpleTuner (median; rounds) |\n| --- | --- | --- | --- | --- |"
    )
    for kind in ("cold", "warm"):
        pairs = list(zip(ours[kind], theirs[kind]))
        if not pairs:
            continue
        for label, get in measures:
            if label.startswith("cache") and kind == "warm":
                continue  # the warm run reuses the cold run's cache
            a, b = [get(x) for x, _ in pairs], [get(y) for _, y in pairs]
            ratios = [x / y for x, y in zip(a, b)]
            print(
                f"| {kind} | {label} | {_median(a):.1f} | {_median(b):.1f} | **{_median(ratios):.2f}** "
                f"({', '.join(f'{v:.2f}' for v in ratios)}) |"
            )

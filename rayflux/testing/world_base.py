"""The shipped world base (:mod:`rayflux.quality.pretrain` made it): where it is, and its Kontext twin.

The weights live in the package (``rayflux/testing/world_base/``, a few MB of fp16 safetensors), so a ``pip install``
carries them and nothing is trained or downloaded at run time. Jobs on it keep ``model.text_tokens`` at
:data:`WORLD_TEXT_TOKENS`, the length it was pretrained with.

FLUX.1 Kontext shares FLUX.1's transformer, VAE and text encoders; only the pipeline class differs. So the Kontext
world base (for edit pairs) is the same weights under ``FluxKontextPipeline``'s ``model_index.json``, written once
under the rayflux home with links to the shipped files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from rayflux.testing.tiny import default_home

WORLD_BASE = Path(__file__).resolve().parent / "world_base"
WORLD_TEXT_TOKENS = 32
"""T5 tokens per caption the world base was pretrained with."""


def world_base() -> Path:
    """The shipped FLUX.1 world base directory; a clear error when the package was installed without it."""
    if not (WORLD_BASE / "model_index.json").is_file():
        raise FileNotFoundError(
            f"{WORLD_BASE} holds no world base: this rayflux was installed without its package data; rebuild it with "
            "python -m rayflux.quality.pretrain --out rayflux/testing/world_base"
        )
    return WORLD_BASE


TRUE_CFG = 3.0
"""The classifier-free guidance scale renders of a world base pretrained with caption dropout take
(:func:`render_guidance`)."""


def render_guidance(base: str | Path | None = None) -> float:
    """The true-CFG scale (``train.validation.true_cfg``) renders of the world base at ``base`` take: :data:`TRUE_CFG`
    when its record says it was pretrained with caption dropout (it has an unconditional prediction to guide away
    from), else 0. Base v2 has none: guiding its untrained empty-caption prediction made its renders no better
    (docs/quality.md, "The world base")."""
    record = json.loads((Path(base or world_base()) / "world_base.json").read_text())
    return TRUE_CFG if record.get("spec", {}).get("caption_dropout", 0.0) > 0 else 0.0


def write_once(path: Path, stamp: str, write) -> Path:
    """``path`` as ``write(tmp)`` fills it, written once: into a temp directory beside it, stamped, then renamed
    into place; kept while its stamp (``.complete``) still reads ``stamp``."""
    marker = path / ".complete"
    if marker.is_file() and marker.read_text() == stamp:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        write(tmp)
        (tmp / ".complete").write_text(stamp)
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def world_kontext(path: str | Path | None = None) -> Path:
    """The world base as a ``FluxKontextPipeline`` directory (written once: the shipped parts linked, the index
    rewritten), for edit-pair jobs."""
    base = world_base()
    record = json.loads((base / "world_base.json").read_text())

    def write(tmp: Path) -> None:
        for part in base.iterdir():
            if part.name != "model_index.json":
                os.symlink(part, tmp / part.name)
        index = json.loads((base / "model_index.json").read_text())
        index["_class_name"] = "FluxKontextPipeline"
        (tmp / "model_index.json").write_text(json.dumps(index, indent=1))

    path = Path(path) if path else default_home() / "world-kontext"
    return write_once(path, f"{base}:{record['seed']}:{record['seconds']}", write)


def job_sets(images_dir: str | Path, output_dir: str | Path, steps: int, model: str | Path | None = None) -> list[str]:
    """``--set`` values of a small LoRA job on the world base: 128 px, the base's text length, one worker, ``steps``
    optimizer steps of batch 4 at the learning rate the quality bench measured with; eval samples held out."""
    return [
        f"model.path={model or world_base()}",
        f"model.text_tokens={WORLD_TEXT_TOKENS}",
        f"data.images_dir={images_dir}",
        f"run.output_dir={output_dir}",
        "data.resolution=128",
        "data.bucket_step=16",
        "data.eval_samples=8",
        "train.workers.num_workers=1",
        "train.workers.cpus_per_worker=1",
        f"train.max_steps={steps}",
        "train.epochs=1000",
        "train.batch_size=4",
        "train.optim.learning_rate=0.001",
        "train.adapter.rank=8",
        "train.adapter.alpha=8",
        "cache.batch_size=16",
    ]


DEMO_VERSION = "2"
DEMO_STEPS = 120
DEMO_EVERY = 40
"""Validation grids every this many steps: three grids, each a few seconds to render."""
DEMO_PROMPTS = [
    "a pink square on a black background",
    "a pink circle on a white background",
    "a pink triangle on a blue background",
    "a green circle on a white background",
]
"""Three prompts of the held-back colour (the base, which never saw pink, paints them blue and purple; the LoRA's
cells turn pink) and one of the world the base already knew (its cell should stay a green circle)."""


def demo_images(path: str | Path | None = None) -> Path:
    """The demo's training folder: 24 captioned pictures of known shapes in the held-back colour, pink, written once
    (atomically) under the rayflux home.

    Pink, not the held-back ``sks star``: on base v3 a LoRA of the star (60 to 600 steps, rank 8 to 32, even a full
    fine-tune of 400 steps) leaves its renders as blobs, while pink shows within 40 steps (docs/quality.md, "The
    demo"). The quality bench scores both."""
    from rayflux.testing import world

    path = Path(path) if path else default_home() / f"world-pink-v{DEMO_VERSION}"
    return write_once(path, DEMO_VERSION, lambda tmp: world.write_concept(tmp, "colour", 24, seed=0))


def demo_sets() -> list[str]:
    """What ``python jobs/train_flux.py`` with no arguments runs: a LoRA of the held-back colour on the world base,
    with validation grids every :data:`DEMO_EVERY` steps (``runs/demo/validation/``), rendered with the base's
    guidance (:func:`render_guidance`)."""
    guidance = render_guidance()
    return [
        *job_sets(demo_images(), "runs/demo", DEMO_STEPS),
        f"train.validation.prompts={json.dumps(DEMO_PROMPTS)}",
        f"train.validation.every={DEMO_EVERY}",
        "train.validation.inference_steps=20",
        *([f"train.validation.true_cfg={guidance}"] if guidance else []),
    ]

"""The quality bench: LoRAs trained by the real job on the shipped world base, one row per technique, scored on
held-out sets at fixed noise and σ (rayflux.quality.score).

    python benchmarks/bench_quality.py [--steps 40] [--seeds 0,1,2] [--rows plain,ema,...] [--work DIR]

Every row trains the same concept (the held-back ``sks star``, 24 images at 128 px) for the same number of steps
with the same settings but its own technique, and reports:

- ``concept``: held-out eval loss on the new shape, LoRA / base (below 1: learned);
- ``prior``: held-out eval loss on the world the base knew (known shapes and colours), LoRA / base (1: kept);
- ``drift``: the LoRA's prediction change on those prior prompts, relative to the base's predictions (0: none).

The edit rows train on reference -> target pairs (shape recoloured red, the caption says only "make the shape red")
on the Kontext twin of the base, with and without their references, and report the held-out eval loss with the
right reference and with a shuffled one (another sample's), each over the base's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rayflux import config, job  # noqa: E402
from rayflux.quality import score as world_score  # noqa: E402
from rayflux.testing import world, world_base  # noqa: E402

# Row name -> (extra --set values, adapter the scorer rebuilds, which exported file it scores).
ROWS: dict[str, tuple[list[str], str, str]] = {
    "plain": ([], "lora", "plain"),
    "ema": (["train.optim.ema_decay=0.9"], "lora", "ema"),
    "dora": (["train.adapter.kind=dora"], "dora", "plain"),
    "adafactor": (["train.optim.name=adafactor"], "lora", "plain"),
    "prodigy": (["train.optim.name=prodigy", "train.optim.learning_rate=1.0"], "lora", "plain"),
    "schedulefree": (["train.optim.name=schedulefree_adamw"], "lora", "plain"),
    "sigma_uniform": (["train.flow.sigma_sampling=uniform"], "lora", "plain"),
    "sigma_shift": (["train.flow.sigma_sampling=shift"], "lora", "plain"),
    "sigma_flux_shift": (["train.flow.sigma_sampling=flux_shift"], "lora", "plain"),
    "caption_dropout": (["train.flow.caption_dropout=0.1"], "lora", "plain"),
    # TREAD: half the image tokens skip the world base's middle two of its four blocks (issue 45, item 2).
    "tread": (["train.token_routing=0.5:1-2"], "lora", "plain"),
    # issue 45. Preservation: the world's concept captions are "a <colour> sks star on a <bg> background".
    "preserve_class": (
        ["train.flow.preservation=class", "data.trigger_word=sks", "data.class_word=shape"],
        "lora",
        "plain",
    ),
    "preserve_blank": (["train.flow.preservation=blank"], "lora", "plain"),
    "bias_content": (["train.flow.timestep_bias=content"], "lora", "plain"),
    "bias_style": (["train.flow.timestep_bias=style"], "lora", "plain"),
    "sigma_auto": (["train.flow.sigma_sampling=auto"], "lora", "plain"),
    "plain_30": (["train.max_steps=30"], "lora", "plain"),  # plain LoRA stopped early: preservation at equal concept
    "sigma_logit_normal": (["train.flow.sigma_sampling=logit_normal"], "lora", "plain"),  # the default before auto
    # TREAD at the plain row's wall time: its step took 35.4 ms against plain's 65.6 ms on the world base (median of
    # 40 steps each, 2 CPU cores, 2026-11-28), so it gets 40 x 65.6 / 35.4 = 74 steps.
    "tread_equal_time": (["train.token_routing=0.5:1-2", "train.max_steps=74"], "lora", "plain"),
    "lora_plus_4": (["train.optim.lora_plus_ratio=4"], "lora", "plain"),
    "lora_plus_16": (["train.optim.lora_plus_ratio=16"], "lora", "plain"),
    "targets_ffs": (["train.adapter.targets=attention+ffs"], "lora", "plain"),
    "targets_context": (["train.adapter.targets=context"], "lora", "plain"),
    # LoKr exports only LyCORIS keys; the scorer reads the checkpoint's peft copy of the same factors.
    "lokr": (["train.adapter.kind=lokr", "train.checkpoint.output_format=kohya"], "lokr", "checkpoint"),
    # The held-back colour (pink, on known shapes) instead of the new shape: scored on held-out pink pictures.
    "colour": ([], "lora", "plain"),
    # The star on noise backgrounds captioned as plain ones, with and without its masks (issue 43, "masks").
    "masked": (["data.mask=dir"], "lora", "plain"),
    "unmasked": ([], "lora", "plain"),
    # A broken learner, the control every row must beat: the job refuses learning_rate=0, so 1e-12.
    "lr_1e-12": (["train.optim.learning_rate=1e-12"], "lora", "plain"),
}
SKIPPED = {
    "adamw8bit": "bitsandbytes' 8-bit AdamW runs on CUDA GPUs only",
}
# Rows that train on another folder than the star's, and the held-out set their ``concept`` is scored on.
ROW_DATA = {"colour": "colour", "masked": "masked", "unmasked": "masked"}
EDIT_ROWS = ("edit_refs", "edit_no_refs")
RANK = 8


def lora_file(out: Path, which: str) -> Path:
    """The exported LoRA of a finished run: the plain file, or the EMA average beside it."""
    if which == "plain":
        return out / "lora" / "pytorch_lora_weights.safetensors"
    if which == "checkpoint":  # the last checkpoint's adapter copy (peft's tensors, unbaked)
        return sorted(glob.glob(str(out / "checkpoints" / "**" / "pytorch_lora_weights.safetensors"), recursive=True))[
            -1
        ]
    [ema] = [p for p in glob.glob(str(out / "lora" / "*-ema.safetensors")) if "-step" not in p]
    return Path(ema)


def row_targets(sets: list[str]) -> str:
    """The adapter targets a row trains (its ``train.adapter.targets``, else the default), for the scorer to rebuild."""
    given = [s.split("=", 1)[1] for s in sets if s.startswith("train.adapter.targets=")]
    return given[-1] if given else "attention"


def train(images: Path, out: Path, steps: int, seed: int, sets: list[str], model=None, cache=None) -> float:
    """Run the job; returns its wall seconds."""
    begin = time.perf_counter()
    base_sets = world_base.job_sets(images, out, steps, model=model)
    cfg = config.load(None, [*base_sets, f"train.seed={seed}", f"cache.dir={cache}", *sets])
    job.run(cfg)
    return time.perf_counter() - begin


def row_images(work: Path, name: str) -> tuple[Path, list[str]]:
    """The training folder of a row and the ``--set`` values that point at its masks."""
    data = ROW_DATA.get(name, "shape")
    if data == "masked":
        images, masks = world.write_masked_concept(work / "masked", 24, seed=0)
        return images, [f"data.mask_dir={masks}"] if name == "masked" else []
    return world.write_concept(work / ("star" if data == "shape" else data), data, 24, seed=0), []


def concept_rows(args, work: Path, sets: dict, looker=None) -> list[dict]:
    """Every technique row on the concept, for every seed."""
    base = world_base.world_base()
    plain = world_score.transformer(base)
    ref = {k: world_score.eval_loss(plain, s) for k, s in sets.items()}
    rows = []
    for name in args.rows:
        extra, adapter, which = ROWS[name]
        images, more = row_images(work, name)
        concept = "colour" if ROW_DATA.get(name) == "colour" else "concept"
        for seed in args.plain_seeds if name == "plain" else args.seeds:
            out = work / f"{name}-s{seed}"
            cache = work / ("cache" if images.name == "star" else f"cache-{images.parent.name}-{images.name}")
            secs = train(images, out, args.steps, seed, extra + more, cache=cache)
            targets = row_targets(extra)
            model = world_score.transformer(base, lora_file(out, which), adapter, RANK, RANK, targets)
            row = {
                "row": name,
                "seed": seed,
                "concept": world_score.eval_loss(model, sets[concept]) / ref[concept],
                "prior": world_score.eval_loss(model, sets["prior"]) / ref["prior"],
                "drift": world_score.drift(model, plain, sets["prior"]),
                "seconds": round(secs, 1),
            }
            # What the LoRA learned of the concept beyond what it did to the world in general: its spread over seeds
            # is a tenth of ``concept``'s on world base v2 (docs/quality.md, "The CI test").
            row["specific"] = row["concept"] / row["prior"]
            if looker is not None:
                row.update(looker(model, concept))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def edit_rows(args, work: Path) -> list[dict]:
    """An edit LoRA trained with its references, and one trained on the same targets without them."""
    kontext = world_base.world_kontext()
    targets, refs = world.write_edit_pairs(work / "edit", 24, seed=0)
    held = world_score.held_out(kontext, "edit", 16)
    plain = world_score.transformer(kontext)
    base_right, base_shuffled = (
        world_score.eval_loss(plain, held, "right"),
        world_score.eval_loss(plain, held, "shuffled"),
    )
    rows = []
    for name in EDIT_ROWS:
        for seed in args.seeds:
            out = work / f"{name}-s{seed}"
            sets = [f"data.reference_dir={refs}"] if name == "edit_refs" else []
            secs = train(targets, out, args.steps, seed, sets, model=kontext, cache=work / f"cache-{name}")
            model = world_score.transformer(kontext, lora_file(out, "plain"), rank=RANK, alpha=RANK)
            row = {
                "row": name,
                "seed": seed,
                "right_ref": world_score.eval_loss(model, held, "right") / base_right,
                "shuffled_ref": world_score.eval_loss(model, held, "shuffled") / base_shuffled,
                "seconds": round(secs, 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict], keys: tuple[str, ...]) -> str:
    """A Markdown table: one line per row name, each figure the mean over seeds (± the spread when several)."""
    names = list(dict.fromkeys(r["row"] for r in rows))
    lines = ["| row | " + " | ".join(keys) + " | seeds |", "|---" * (len(keys) + 2) + "|"]
    for name in names:
        group = [r for r in rows if r["row"] == name]
        cells = []
        for k in keys:
            vals = [r[k] for r in group]
            mean = statistics.fmean(vals)
            cells.append(f"{mean:.3f}" + (f" ({min(vals):.3f}-{max(vals):.3f})" if len(vals) > 1 else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {len(group)} |")
    return "\n".join(lines)


LOOKS = ("hit", "prior_acc")


def make_looker(base):
    """A world classifier trained against the base's VAE, and the function that renders a row's model and reads
    its pictures (``hit``: the concept's renders read as the concept; ``prior_acc``: prior renders read as their
    prompt). Returns it with the base's own figures."""
    from rayflux.quality import classify, looks

    vae = world_score.encoder_pipe(base).vae
    trained = classify.train(vae=vae, steps=2000)
    print(f"classifier: shape {trained.shape_accuracy:.3f}, colour {trained.colour_accuracy:.3f} on held-out pictures")

    def looker(model, concept: str) -> dict:
        seen = looks.look(base, model, trained.model, "colour" if concept == "colour" else "shape")
        return {"hit": seen.concept_hit, "prior_acc": seen.prior_accuracy}

    plain = world_score.transformer(base)
    return looker, {c: looker(plain, c) for c in ("concept", "colour")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="0")
    p.add_argument(
        "--plain-seeds", default="", help="seeds of the plain row (default: --seeds); its spread sets the CI threshold"
    )
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--edit", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--work", default="/tmp/rayflux-bench-quality")
    p.add_argument(
        "--looks", action=argparse.BooleanOptionalAction, default=True, help="render and classify (hit, prior_acc)"
    )
    args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.plain_seeds = [int(s) for s in args.plain_seeds.split(",")] if args.plain_seeds else args.seeds
    args.rows = [r for r in args.rows.split(",") if r]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import ray

    ray.init(address="local", num_cpus=2, log_to_driver=False)
    begin = time.perf_counter()
    base = world_base.world_base()
    sets = {"concept": world_score.held_out(base, "shape", 16), "prior": world_score.held_out(base, "prior", 16)}
    sets["colour"] = world_score.held_out(base, "colour", 16)
    looker, base_looks = make_looker(base) if args.looks else (None, {})
    edits = edit_rows(args, work) if args.edit else []
    concept = concept_rows(args, work, sets, looker) if args.rows else []
    print(
        f"\nbench_quality.py {' '.join(sys.argv[1:])}: {platform.node()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - begin:.0f} s, load {os.getloadavg()[0]:.1f}"
    )
    if base_looks:
        print(f"base (no LoRA): {json.dumps(base_looks)}")
    if concept:
        print(table(concept, ("concept", "prior", "specific", "drift", *(LOOKS if looker else ()), "seconds")))
    if edits:
        print(table(edits, ("right_ref", "shuffled_ref", "seconds")))
    for name, why in SKIPPED.items():
        print(f"- {name}: not run ({why})")
    (work / "rows.json").write_text(json.dumps(concept + edits, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

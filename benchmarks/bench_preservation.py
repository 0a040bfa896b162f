"""Output preservation's cost per step (``train.preservation``, issue 45): the job's own step
(``LoraTrainer.train_step``) with ``class`` and ``blank`` preservation against plain LoRA, on CPU.

    python benchmarks/bench_preservation.py [--steps 2] [--rounds 7] [--px 256] [--blocks 2,4] [--width 512]

A FLUX.1 transformer with random weights at reduced depth and width (``--blocks`` double,single; ``--width`` =
heads x 64), FLUX.1's 16-channel latents at ``--px`` / 8 and 512 T5 tokens, batch 1, fp32, LoRA rank 16 on the
attention. Each mode has its own trainer, built and warmed up (one step) first; then rounds of ``--steps`` steps
alternate the modes, and the median round of each is reported.
Preservation adds two transformer forwards a batch (one the base's, without gradients) and one backward: with a
backward at about twice a forward, (3 + 2 x 2) / (1 + 2) = 2.3 times plain's work, the figure the ratio is read
against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from rayflux import config, models  # noqa: E402
from rayflux.train import step  # noqa: E402
from rayflux.train.trainer import LoraTrainer  # noqa: E402

MODES = ("none", "class", "blank")
TEXT = 512


def transformer_config(blocks: tuple[int, int], width: int) -> dict:
    heads = width // 64
    return {
        "_class_name": "FluxTransformer2DModel",
        "patch_size": 1,
        "in_channels": 64,
        "num_layers": blocks[0],
        "num_single_layers": blocks[1],
        "attention_head_dim": 64,
        "num_attention_heads": heads,
        "joint_attention_dim": width,
        "pooled_projection_dim": width,
        "guidance_embeds": True,
        "axes_dims_rope": [8, 28, 28],
    }


def _transformer(tc: dict):
    model = models.meta_transformer(tc).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
        for b in model.buffers():
            b.zero_()
    return model


def _batch(tc: dict, px: int, seed: int) -> step.Batch:
    g = torch.Generator().manual_seed(seed)
    width = tc["joint_attention_dim"]

    def text() -> dict:
        return {"t5": torch.randn(1, TEXT, width, generator=g), "clip_pooled": torch.randn(1, width, generator=g)}

    latents = torch.randn(1, tc["in_channels"] // 4, px // 8, px // 8, generator=g)
    return step.Batch(latents, text(), seed, preservation_text=text())


def trainer(tc: dict, mode: str, px: int) -> LoraTrainer:
    """A fresh trainer of ``mode`` on its own random-weight transformer (the same weights for every mode)."""
    sets = ["train.adapter.rank=16", f"data.resolution={px}", "train.batch_size=1", f"train.flow.preservation={mode}"]
    if mode == "class":
        sets.append("data.trigger_word=sks")
    cfg = config.load(None, sets)
    width = tc["joint_attention_dim"]
    # Random, as a real empty caption's embedding is not zero (zeros would run the blocks into denormals on CPU).
    g = torch.Generator().manual_seed(99)
    empty = step.EmptyCaption(
        {"t5": torch.randn(TEXT, width, generator=g), "clip_pooled": torch.randn(width, generator=g)}
    )
    return LoraTrainer(cfg, "cpu", 10_000, empty=empty, transformer=_transformer(tc), text_length=TEXT)


def seconds_per_step(t: LoraTrainer, batches: list, steps: int) -> float:
    t0 = time.perf_counter()
    for i in range(steps):
        t.train_step([batches[i % len(batches)]])
    return (time.perf_counter() - t0) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--px", type=int, default=256)
    ap.add_argument("--blocks", default="2,4", help="double,single blocks")
    ap.add_argument("--width", type=int, default=512, help="attention heads x 64")
    args = ap.parse_args()
    blocks = tuple(int(b) for b in args.blocks.split(","))
    tc = transformer_config(blocks, args.width)
    trainers = {m: trainer(tc, m, args.px) for m in MODES}
    batches = [_batch(tc, args.px, s) for s in range(2)]
    for t in trainers.values():
        t.train_step(batches[:1])  # warm-up
    # Short turns, the modes interleaved: a machine shared with other work slows every mode alike.
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            times[mode].append(seconds_per_step(trainers[mode], batches, args.steps))
    med = {m: statistics.median(v) for m, v in times.items()}
    row = {
        "blocks": args.blocks,
        "width": args.width,
        "px": args.px,
        "torch_threads": torch.get_num_threads(),
        "s_per_step": {m: round(v, 4) for m, v in med.items()},
        "ratio_class": round(med["class"] / med["none"], 2),
        "ratio_blank": round(med["blank"] / med["none"], 2),
        "work_ratio": round(7 / 3, 2),
    }
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

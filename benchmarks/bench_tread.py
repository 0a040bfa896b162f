"""TREAD token routing (``train.token_routing``) against plain LoRA: the training step's FLOPs at FLUX.1-dev's real
widths, and its CPU wall time at reduced width and depth, in one run.

    PYTHONPATH=. python benchmarks/bench_tread.py [--routing 0.5:2-54] [--px 1024] [--cpu-routing 0.5:1-4] ...

1. **FLOPs at real widths.** FLUX.1-dev's transformer (19 + 38 blocks, width 3072) on the meta device with a rank-16
   attention LoRA, one sample at ``--px`` with its 512 T5 tokens: the forward and backward of one training step
   counted by ``torch.utils.flop_counter`` (matmuls and attention; a frozen weight gets no weight gradient), plain and
   routed. Nothing is allocated, so any width counts on a laptop. ``--routing``'s default is SimpleTuner's FLUX
   preset: half the image tokens skip every block but the first two and the last two.
2. **CPU wall time.** ``LoraTrainer.train_step`` (the job's step) on a FLUX.1-shaped transformer with random weights
   at ``--cpu-heads`` heads of 128 (real head width, fewer heads), ``--cpu-blocks`` double + single blocks, at
   ``--cpu-px`` with 512 text tokens; plain and routed steps alternate, so both see the same machine load, and the
   medians are compared. Real widths do not fit a CPU step; the token counts, which routing changes, are real.

On a GPU, ``benchmarks/bench_gpu.py`` times the routed step at FLUX.1-dev's widths at 1024 px beside the plain one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rayflux import config, families, models  # noqa: E402
from rayflux.config.token_routing import parse  # noqa: E402
from rayflux.families.flux1 import FLUX1_DEV  # noqa: E402
from rayflux.train import step, token_routing
from rayflux.train.adapter import lora  # noqa: E402
from rayflux.train.trainer import LoraTrainer  # noqa: E402

TEXT = 512
"""FLUX.1-dev's T5 tokens per caption."""


def _inputs(tc: dict, px: int, seed: int = 0) -> step.Batch:
    """One cached-shaped FLUX.1 sample at ``px``: 16-channel latents at px/8, T5 and pooled CLIP."""
    g = torch.Generator().manual_seed(seed)
    cells = px // 8
    latents = torch.randn(1, tc["in_channels"] // 4, cells, cells, generator=g)
    text = {
        "t5": torch.randn(1, TEXT, tc["joint_attention_dim"], generator=g),
        "clip_pooled": torch.randn(1, tc["pooled_projection_dim"], generator=g),
    }
    return step.Batch(latents, text, seed)


def step_flops(tc: dict, px: int, routing: str, rank: int = 16) -> float:
    """FLOPs of one sample's training forward and backward of ``tc`` on the meta device, routed by ``routing``."""
    from torch.utils.flop_counter import FlopCounterMode

    model = models.meta_transformer(tc)
    lora.add_lora(model, rank, float(rank), "attention")
    family = families.of_transformer(model)
    router = token_routing.attach(model, parse(routing), family)
    if router:
        router.seed(0)
    batch = _inputs(tc, px)
    h, w = batch.latents.shape[-2:]
    with torch.device("meta"):
        tokens = family.pack(batch.latents.to("meta"))
        text = {k: v.to("meta") for k, v in batch.text.items()}
        args = family.forward_args(tokens, text, torch.rand(1), h, w, torch.ones(1))
    model.train()
    with FlopCounterMode(display=False) as counter:
        model(**args, return_dict=False)[0].float().square().mean().backward()
    return float(counter.get_total_flops())


def _trainer(tc: dict, px: int, routing: str) -> LoraTrainer:
    sets = ["train.rank=16", "train.gradient_checkpointing=false", f"data.resolution={px}"]
    cfg = config.load(None, sets + ([f"train.token_routing={routing}"] if routing else []))
    torch.manual_seed(0)
    model = models.meta_transformer(tc).to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for b in model.buffers():
            b.zero_()
    return LoraTrainer(cfg, "cpu", total_steps=1000, transformer=model, text_length=TEXT)


def cpu_ratio(tc: dict, px: int, routing: str, steps: int) -> dict:
    """Median seconds of the plain and the routed step, alternating, after one warm-up step each."""
    trainers = {"plain": _trainer(tc, px, ""), "tread": _trainer(tc, px, routing)}
    batches = [_inputs(tc, px, seed) for seed in range(steps + 1)]
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for i, batch in enumerate(batches):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.train_step([batch])
            if i:  # the first step of each warms up
                times[name].append(time.perf_counter() - t0)
    plain, tread = (statistics.median(times[k]) for k in ("plain", "tread"))
    return {"plain_s": round(plain, 3), "tread_s": round(tread, 3), "ratio": round(tread / plain, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routing", default="0.5:2-54", help="train.token_routing at FLUX.1-dev's 57 blocks")
    ap.add_argument("--px", type=int, nargs="*", default=[512, 1024], help="FLOP-count sizes (none: skip)")
    ap.add_argument("--cpu-routing", default="0.5:1-4", help="train.token_routing of the CPU model")
    ap.add_argument("--cpu-heads", type=int, default=4)
    ap.add_argument("--cpu-blocks", default="2,4", help="double,single blocks of the CPU model")
    ap.add_argument("--cpu-px", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows = []
    for px in args.px:
        plain, tread = (step_flops(FLUX1_DEV, px, r) for r in ("", args.routing))
        row = {"section": "flops", "model": "flux1-dev", "px": px, "routing": args.routing}
        row.update({"plain_tflop": round(plain / 1e12, 1), "tread_tflop": round(tread / 1e12, 1)})
        rows.append({**row, "ratio": round(tread / plain, 3)})
        print(json.dumps(rows[-1]), flush=True)
    double, single = (int(n) for n in args.cpu_blocks.split(","))
    tc = {**FLUX1_DEV, "num_attention_heads": args.cpu_heads, "num_layers": double, "num_single_layers": single}
    row = {"section": "cpu", "heads": args.cpu_heads, "blocks": args.cpu_blocks, "px": args.cpu_px}
    rows.append({**row, "routing": args.cpu_routing, **cpu_ratio(tc, args.cpu_px, args.cpu_routing, args.steps)})
    print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pretrain the world base: ``python -m rayflux.quality.pretrain --out DIR`` (seeded; see docs/quality.md).

A small FLUX.1-architecture pipeline that knows the world of :mod:`rayflux.testing.world`:

1. the VAE is trained as an autoencoder on world images (all of them, held-back concepts included: a VAE is the
   model's generic image codec, as FLUX's own is), then its ``shift_factor`` and ``scaling_factor`` are set from the
   latents' mean and spread, as FLUX's were;
2. the world's pretraining images (known colours and shapes only) are encoded once, at 128 and 256 px in square and
   non-square sizes, with the family's own text encoding and stored-latent normalisation (the cache's functions);
3. the transformer is trained with flow matching through the family's packing and forward arguments and
   :mod:`rayflux.train.flow` (logit-normal σ, the job's defaults);
4. the eval loss on held-out world images (fixed noise, the fixed σ grid of the job's eval) is measured for the
   random transformer it started from and for the trained one, and written beside the weights.

The tiny text encoders and tokenizers of :mod:`rayflux.testing.tiny` stay frozen and random.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rayflux.testing import world
from rayflux.testing.images import RGB, SHAPES

WORLD_SEED = 4321


@dataclass(frozen=True)
class PretrainSpec:
    """Sizes and lengths of the world base's pretraining."""

    vae_steps: int = 1000
    """Autoencoder steps (batches of ``vae_batch`` small images: convolutions do not care about the size)."""
    vae_lr: float = 5e-4
    """The VAE's peak AdamW learning rate (cosine decay). Measured over 500 steps: 5e-4 reaches a reconstruction
    loss of 0.085, 2e-3 stalls at 0.31 (its colours come out wrong)."""
    vae_batch: int = 6
    """Images per VAE step."""
    images: int = 3000
    """World images encoded for the transformer's pretraining (known concepts only)."""
    eval_images: int = 64
    """Held-out world images its eval loss is measured on."""
    steps: int = 3000
    """Transformer flow-matching steps."""
    batch: int = 16
    """Samples per transformer step (one size each)."""
    lr: float = 1e-3
    """The transformer's peak AdamW learning rate (cosine decay after a short warmup)."""
    text_tokens: int = 32
    """T5 tokens per caption the base is trained at: jobs on it set ``model.text_tokens`` to the same."""
    minutes: float = 0.0
    """A wall-clock cap: stop the transformer's training early when the whole run has used this many minutes (0:
    none, the default, so that the shipped base is the same on any machine; a cap makes it depend on the load)."""
    vae_share: float = 0.25
    """Share of ``minutes`` the VAE's training may use before it stops early (with a cap only)."""
    sigma_sampling: str = "logit_normal"
    """How the transformer's σ are drawn (a :func:`rayflux.train.flow.sample_sigmas` method). ``logit_normal`` (v2)
    rarely draws σ near 1, where a render's shape and colours are decided; ``shift`` moves the draws there."""
    sigma_shift: float = 3.0
    """The shift of ``sigma_sampling: shift`` (``σ' = sσ/(1+(s-1)σ)``)."""
    caption_dropout: float = 0.0
    """Share of samples trained with the empty caption, so that classifier-free guidance has an unconditional
    prediction to push a render away from."""
    large_every: int = 0
    """Draw every ``large_every``-th batch from the 256 px sizes and the others from the 128 px ones (a 256 px step
    costs about four 128 px steps, and shapes are learned as well at 128). 0: all ten sizes in turn (v2)."""
    heads: int = 4
    """The transformer's attention heads."""
    head_dim: int = 16
    """Each head's width (the transformer's width is ``heads * head_dim``)."""
    rope: str = "tiny"
    """How each head's rotary dims are split between the (text, row, column) position axes: ``tiny``, the tiny
    model's (¼, ¼, ½), which leaves rows one usable frequency at 16 dims (v2); ``flux``, FLUX.1's own proportions
    (16, 56, 56 of 128), which needs ``head_dim`` a multiple of 16."""
    transformer_from: str = ""
    """An existing base directory whose transformer this pretraining continues from (its shape replaces ``heads``,
    ``head_dim`` and ``rope``): a longer schedule in stages, each its own seeded run. Empty: a random transformer."""
    parts_from: str = ""
    """An existing base directory whose VAE, text encoders and tokenizers are kept (only the transformer is
    trained): the VAE's training is skipped, and the CLIP tokenizer (whose token ids no seed fixes) stays the same.
    Empty: build and train them all."""


def rope_axes(spec: PretrainSpec) -> tuple[int, int, int]:
    """The transformer's ``axes_dims_rope`` for ``spec.rope`` (see :attr:`PretrainSpec.rope`)."""
    if spec.rope == "tiny":
        quarter = spec.head_dim // 4
        return (quarter, quarter, spec.head_dim - 2 * quarter)
    if spec.rope == "flux" and spec.head_dim % 16 == 0:
        return (spec.head_dim // 8, spec.head_dim * 7 // 16, spec.head_dim * 7 // 16)
    raise ValueError(f"rope {spec.rope!r} with head_dim {spec.head_dim}: use tiny, or flux with a multiple of 16")


def base_pipeline(spec: PretrainSpec | None = None):
    """The untrained world base: the tiny FLUX.1's seeded text encoders, a wider transformer (``spec``'s heads and
    rotary split), a VAE with more channels than the tiny one, all from fixed seeds."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    from rayflux.testing.tiny import TinySpec, build_pipeline

    spec = spec or PretrainSpec()
    tiny = TinySpec(guidance_embeds=False, num_layers=2, num_single_layers=2, num_attention_heads=4)
    pipe = build_pipeline(tiny)
    if (spec.heads, spec.head_dim, spec.rope) != (4, 16, "tiny"):  # v2's transformer is the tiny builder's own
        torch.manual_seed(WORLD_SEED)
        shape = {
            "num_attention_heads": spec.heads,
            "attention_head_dim": spec.head_dim,
            "axes_dims_rope": rope_axes(spec),
        }
        pipe.transformer = FluxTransformer2DModel.from_config({**pipe.transformer.config, **shape})
    pipe.tokenizer_2 = world_t5_tokenizer()
    torch.manual_seed(WORLD_SEED)
    pipe.vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 32, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=128,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    return pipe


def world_t5_tokenizer():
    """A T5 tokenizer that reads each of the world's words as one token (letters only for words outside it).

    The tiny tokenizer is close to character-level: a caption takes 28 to 32 of its tokens, so the base's 32 cut some
    short, and a 4-block transformer had to learn to spell before it could follow a prompt (pretrained that way, its
    eval loss with shuffled captions was within 6% of its loss with the right ones). One token per word gives each
    word its own (random, frozen) T5 vector. It fits the tiny T5's 61-entry vocabulary."""
    import string

    from transformers import T5TokenizerFast

    words = ["a", "on", "background", "make", "the", "shape", world.TRIGGER, *RGB, *SHAPES]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("\u2581" + w, -1.0) for w in dict.fromkeys(words)] + [("\u2581", -5.0)]
    vocab += [(c, -10.0) for c in string.ascii_lowercase]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)


def round_fp16(module) -> None:
    """Round ``module``'s weights through fp16 in place: the base ships in fp16, so pretraining encodes with the
    weights the job will load, not with ones it never sees."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.half().float())


def to_pixels(images) -> torch.Tensor:
    """PIL images of one size as a ``[n, 3, h, w]`` batch in [-1, 1], as the VAE takes them."""
    import numpy as np

    x = torch.from_numpy(np.stack([np.asarray(im, dtype=np.uint8) for im in images])).permute(0, 3, 1, 2)
    return x.float() / 127.5 - 1.0


def _any_scene(rng: random.Random) -> world.Scene:
    kind = rng.random()
    if kind < 0.1:
        return world.concept_scene(rng, "shape")
    if kind < 0.2:
        return world.concept_scene(rng, "colour")
    return world.prior_scene(rng)


def train_vae(vae, spec: PretrainSpec, deadline: float, log) -> dict:
    """Train ``vae`` as an autoencoder (MSE plus a small KL) on 128 px world images, then set its latent
    normalisation from the latents' statistics. Returns its reconstruction error."""
    rng = random.Random(WORLD_SEED)
    opt = torch.optim.AdamW(vae.parameters(), lr=spec.vae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, spec.vae_steps)
    with torch.no_grad():
        # Start the posterior narrow (std e^-3): with a unit std the sampled latents' noise drowns the image, and the
        # few steps this budget allows go to shrinking it instead of to reconstruction.
        vae.encoder.conv_out.bias[vae.config.latent_channels :] = -6.0
    vae.train()
    for i in range(spec.vae_steps):
        if time.monotonic() > deadline:
            log(f"VAE time budget reached at step {i}")
            break
        w = h = (64, 96)[i % 2]
        x = to_pixels([_any_scene(rng).image(w, h) for _ in range(spec.vae_batch)])
        dist = vae.encode(x).latent_dist
        recon = vae.decode(dist.sample()).sample
        loss = torch.nn.functional.mse_loss(recon, x) + 1e-6 * dist.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if i % 50 == 0 or i == spec.vae_steps - 1:
            log(f"vae step {i}: loss {loss.item():.4f}")
    vae.eval().requires_grad_(False)
    round_fp16(vae)
    held = random.Random(WORLD_SEED + 1)
    x = to_pixels([_any_scene(held).image(128, 128) for _ in range(32)])
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        mse = torch.nn.functional.mse_loss(vae.decode(z).sample, x).item()
    vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))
    return {"vae_recon_mse": mse, "vae_shift": float(z.mean()), "vae_scale": float(1.0 / z.std())}


@dataclass
class Encoded:
    """The encoded world: stored latents grouped by size, each sample's caption index, the captions' text, and the
    empty caption's (one row: what caption dropout trains with)."""

    latents: dict[tuple[int, int], torch.Tensor]
    captions: dict[tuple[int, int], list[int]]
    text: dict[str, torch.Tensor]
    empty: dict[str, torch.Tensor]


def encode_world(
    pipe, scenes: list[tuple[world.Scene, tuple[int, int]]], text_tokens: int, mode: bool = False, captions=None
) -> Encoded:
    """Encode ``(scene, size)`` pairs as the cache does: the VAE's sample (``mode``: its mode, as edit references
    are encoded) normalised by the family, the captions (the scenes' own, or ``captions``) by the family's text
    encoders at ``text_tokens`` T5 tokens. Within a size, samples keep their order."""
    from types import SimpleNamespace

    from rayflux.families import Flux1

    family = Flux1()
    texts = captions or [s.caption for s, _ in scenes]
    unique = sorted(set(texts))
    index = {c: i for i, c in enumerate(unique)}
    encoders = (pipe.tokenizer, pipe.text_encoder, pipe.tokenizer_2, pipe.text_encoder_2)
    text = family.encode_text(encoders, unique, SimpleNamespace(text_length=text_tokens))
    empty = family.encode_text(encoders, [""], SimpleNamespace(text_length=text_tokens))
    by_size: dict[tuple[int, int], list[tuple[world.Scene, int]]] = {}
    for (scene, size), caption in zip(scenes, texts):
        by_size.setdefault(size, []).append((scene, index[caption]))
    gen = torch.Generator().manual_seed(WORLD_SEED)
    latents, caps = {}, {}
    for size, group in sorted(by_size.items()):
        chunks = []
        for k in range(0, len(group), 64):
            with torch.no_grad():
                dist = pipe.vae.encode(to_pixels([s.image(*size) for s, _ in group[k : k + 64]])).latent_dist
                z = dist.mode() if mode else dist.mean + dist.std * torch.randn(dist.mean.shape, generator=gen)
                chunks.append(family.stored_latent(pipe.vae, z))
        latents[size] = torch.cat(chunks)
        caps[size] = [c for _, c in group]
    return Encoded(latents, caps, {k: v.detach() for k, v in text.items()}, {k: v.detach() for k, v in empty.items()})


def _scenes(count: int, seed: int) -> list[tuple[world.Scene, tuple[int, int]]]:
    rng = random.Random(seed)
    return [(world.prior_scene(rng), world.WORLD_SIZES[i % len(world.WORLD_SIZES)]) for i in range(count)]


def flow_loss(transformer, latents, text: dict, sigmas, noise) -> torch.Tensor:
    """Per-sample flow-matching loss of ``transformer`` on stored ``latents``: the job's step, in plain torch."""
    from rayflux.families import Flux1
    from rayflux.train import flow

    family = Flux1()
    _, _, h, w = latents.shape
    noisy = family.pack(flow.noisy_input(latents, noise, sigmas))
    target = family.pack(flow.flow_target(latents, noise))
    pred = transformer(**family.forward_args(noisy, text, sigmas, h, w, None), return_dict=False)[0]
    return flow.per_sample_loss(pred, target, None)


@torch.no_grad()
def eval_loss(transformer, enc: Encoded, sigma_count: int = 5) -> float:
    """Mean loss over every encoded sample at the job's fixed σ grid (logit-normal quantiles), fixed noise."""
    from rayflux.train import flow

    transformer.eval()
    total, n = 0.0, 0
    gen = torch.Generator().manual_seed(WORLD_SEED + 7)
    for size, lat in sorted(enc.latents.items()):
        text = {k: v[enc.captions[size]] for k, v in enc.text.items()}
        for sigma in flow.eval_sigmas(sigma_count, "logit_normal").tolist():
            noise = torch.randn(lat.shape, generator=gen)
            sig = torch.full((lat.shape[0],), sigma)
            total += float(flow_loss(transformer, lat, text, sig, noise).sum())
            n += lat.shape[0]
    return total / n


def _batch_text(enc: Encoded, size, pick: list[int], spec: PretrainSpec, gen: torch.Generator) -> dict:
    """The text rows of the samples ``pick`` of ``size``; with ``spec.caption_dropout``, each sample's caption is the
    empty one with that probability (no draw without it, so a base without dropout keeps its random stream)."""
    text = {k: v[[enc.captions[size][i] for i in pick]] for k, v in enc.text.items()}
    if spec.caption_dropout > 0:
        drop = torch.rand(len(pick), generator=gen) < spec.caption_dropout
        text = {k: torch.where(drop.view(-1, *[1] * (v.dim() - 1)), enc.empty[k], v) for k, v in text.items()}
    return text


def batch_size_at(step: int, sizes: list[tuple[int, int]], large_every: int) -> tuple[int, int]:
    """The image size of batch ``step``: every size in turn (``large_every`` 0), or the sizes over 128 px in turn
    every ``large_every``-th step and the others in turn between them."""
    if not large_every:
        return sizes[step % len(sizes)]
    large = [s for s in sizes if max(s) > 160]
    small = [s for s in sizes if max(s) <= 160]
    if step % large_every == large_every - 1:
        return large[(step // large_every) % len(large)]
    return small[(step - step // large_every) % len(small)]


def train_transformer(transformer, enc: Encoded, held: Encoded, spec: PretrainSpec, deadline: float, log) -> dict:
    """Flow-matching pretraining: batches of one size drawn in turn, σ drawn by ``spec.sigma_sampling``, AdamW with
    warmup and cosine decay. Stops at ``spec.steps`` or at ``deadline`` (``time.monotonic()``)."""
    from rayflux.train import flow

    gen = torch.Generator().manual_seed(WORLD_SEED + 3)
    opt = torch.optim.AdamW(transformer.parameters(), lr=spec.lr, weight_decay=0.01)
    warm = max(1, spec.steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + torch.cos(torch.tensor(s / spec.steps * 3.14159)).item())
    )
    step = 0
    for step in range(spec.steps):
        if time.monotonic() > deadline:
            log(f"time budget reached at step {step}")
            break
        transformer.train()
        size = batch_size_at(step, sorted(enc.latents), spec.large_every)
        lat = enc.latents[size]
        pick = torch.randint(0, lat.shape[0], (spec.batch,), generator=gen)
        x = lat[pick]
        text = _batch_text(enc, size, pick.tolist(), spec, gen)
        sigmas = flow.sample_sigmas(spec.batch, spec.sigma_sampling, gen, shift=spec.sigma_shift)
        noise = torch.randn(x.shape, generator=gen)
        loss = flow_loss(transformer, x, text, sigmas, noise).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 200 == 0:
            log(f"transformer step {step}: loss {loss.item():.4f}, eval {eval_loss(transformer, held):.4f}")
    return {"transformer_steps": step + 1}


def pretrain(out: Path, spec: PretrainSpec, log=print) -> dict:
    """Build, train and save the world base at ``out``; returns (and writes as ``world_base.json``) its record."""
    begin = time.monotonic()
    torch.manual_seed(WORLD_SEED)
    # One thread: on a shared 2-core machine, two threads wait on each other whenever another process holds a core.
    torch.set_num_threads(1)
    pipe = base_pipeline(spec)
    round_fp16(pipe.text_encoder)
    round_fp16(pipe.text_encoder_2)
    record: dict = {"spec": asdict(spec), "seed": WORLD_SEED}
    budget = spec.minutes * 60 if spec.minutes > 0 else float("inf")
    if spec.parts_from:
        record.update(keep_parts(pipe, Path(spec.parts_from)))
        log(f"VAE, text encoders and tokenizers from {spec.parts_from}")
    else:
        record.update(train_vae(pipe.vae, spec, begin + budget * spec.vae_share, log))
    record["vae_seconds"] = round(time.monotonic() - begin, 1)
    if spec.transformer_from:
        pipe.transformer = type(pipe.transformer).from_pretrained(
            spec.transformer_from, subfolder="transformer", torch_dtype=torch.float32
        )
        log(f"transformer continued from {spec.transformer_from}")
        # The record carries the earlier stage's, so the shipped base says how all of it was made.
        record["continued_from"] = json.loads((Path(spec.transformer_from) / "world_base.json").read_text())
    enc = encode_world(pipe, _scenes(spec.images, WORLD_SEED), spec.text_tokens)
    held = encode_world(pipe, _scenes(spec.eval_images, WORLD_SEED + 99), spec.text_tokens)
    start = "eval_loss_continued" if spec.transformer_from else "eval_loss_random"
    record[start] = eval_loss(pipe.transformer, held)
    log(f"{start.removeprefix('eval_loss_')} transformer eval loss {record[start]:.4f}")
    deadline = begin + budget
    record.update(train_transformer(pipe.transformer, enc, held, spec, deadline, log))
    record["eval_loss_pretrained"] = eval_loss(pipe.transformer, held)
    record["seconds"] = round(time.monotonic() - begin, 1)
    log(f"pretrained eval loss {record['eval_loss_pretrained']:.4f} after {record['seconds']} s")
    pipe.transformer.eval()
    save(pipe, out, record)
    return record


def encoder_pipe(base: str | Path):
    """A world base's pipeline without its transformer: its VAE, text encoders and tokenizers (the base is
    FLUX.1-architecture)."""
    from rayflux.families import Flux1

    return Flux1().pipeline_class().from_pretrained(str(base), transformer=None, torch_dtype=torch.float32)


def keep_parts(pipe, source: Path) -> dict:
    """``spec.parts_from``: put ``source``'s VAE, text encoders and tokenizers (frozen) into ``pipe``; returns
    ``source``'s VAE figures, which still describe the VAE."""
    kept = encoder_pipe(source)
    for name in ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        part = getattr(kept, name)
        if hasattr(part, "requires_grad_"):
            part.eval().requires_grad_(False)
        setattr(pipe, name, part)
    record = json.loads((source / "world_base.json").read_text())
    return {k: v for k, v in record.items() if k.startswith("vae_") and k != "vae_seconds"}


def save(pipe, out: Path, record: dict) -> None:
    """Write the pipeline (fp16 weights: half the bytes, loaded in the job's dtype) and its record."""
    out.mkdir(parents=True, exist_ok=True)
    pipe.to(torch.float16).save_pretrained(out)
    (out / "world_base.json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory to write the pipeline to")
    for f, v in asdict(PretrainSpec()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    args = vars(p.parse_args(argv))
    out = Path(args.pop("out"))
    record = pretrain(out, PretrainSpec(**args), log=lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True))
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

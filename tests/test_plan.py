"""The memory plan (:mod:`rayflux.gpu_memory`, ``python -m rayflux plan``) at FLUX.1-dev's and FLUX.2's real
configurations (meta device), checked against figures worked out by hand."""

from __future__ import annotations

import pytest

from rayflux import config, gpu_memory, models, plan
from rayflux.families.flux1 import FLUX1_DEV
from rayflux.families.flux2 import FLUX2_DEV, FLUX2_KLEIN_4B, FLUX2_KLEIN_9B
from rayflux.train.adapter import lora

H, CTX, POOLED, IN, MLP, HEAD = 3072, 4096, 768, 64, 4 * 3072, 128
DOUBLE, SINGLE = 19, 38


def _linear(i: int, o: int) -> int:
    return i * o + o


def _flux1_dev_blocks() -> tuple[int, int]:
    """Parameters of one double-stream and one single-stream block of FLUX.1-dev."""
    attn_double = 8 * _linear(H, H) + 4 * HEAD  # q k v out, added q k v out; four RMS norms over a head
    double = 2 * _linear(H, 6 * H) + attn_double + 2 * (_linear(H, MLP) + _linear(MLP, H))
    single = _linear(H, 3 * H) + _linear(H, MLP) + _linear(H + MLP, H) + 3 * _linear(H, H) + 2 * HEAD
    return double, single


def _flux1_dev_parameters() -> int:
    """FLUX.1-dev's transformer, layer by layer (diffusers' FluxTransformer2DModel)."""
    embed = _linear(IN, H) + _linear(CTX, H)
    embed += 2 * (_linear(256, H) + _linear(H, H))  # timestep and guidance embedders
    embed += _linear(POOLED, H) + _linear(H, H)  # pooled text projection
    double, single = _flux1_dev_blocks()
    out = _linear(H, 2 * H) + _linear(H, IN)
    return embed + DOUBLE * double + SINGLE * single + out


def _lora(i: int, o: int, rank: int) -> int:
    return rank * (i + o)


def _trainable(preset: str, r: int) -> int:
    attention = DOUBLE * 8 * _lora(H, H, r) + SINGLE * 3 * _lora(H, H, r)
    ffs = DOUBLE * 2 * (_lora(H, MLP, r) + _lora(MLP, H, r)) + SINGLE * (_lora(H, MLP, r) + _lora(H + MLP, H, r))
    norms = DOUBLE * 2 * _lora(H, 6 * H, r) + SINGLE * _lora(H, 3 * H, r)
    # the text stream of the double blocks: 4 attention projections and its feed-forward
    context = DOUBLE * (4 * _lora(H, H, r) + _lora(H, MLP, r) + _lora(MLP, H, r))
    presets = {"attention": attention, "attention+ffs": attention + ffs, "context": context}
    return {**presets, "all": attention + ffs + norms}[preset]


def test_flux1_dev_parameter_counts_match_the_hand_count():
    total = _flux1_dev_parameters()
    assert total == 11_901_408_320  # FLUX.1-dev's published transformer size
    meta = models.meta_transformer(FLUX1_DEV)
    for preset in lora.PRESETS:
        base, trainable = plan.count_parameters(FLUX1_DEV, preset, 16)
        assert base == total
        assert trainable == _trainable(preset, 16), preset
        assert lora.trainable_count(meta, 16, preset) == trainable  # counted without attaching the adapter
    assert _trainable("attention", 16) == 26_148_864


def test_a_sharded_base_adds_the_blocks_fsdp2_gathers():
    counts = plan.base_counts(FLUX1_DEV)
    double, single = _flux1_dev_blocks()
    assert double > single and counts.largest_block == double and counts.total == _flux1_dev_parameters()
    # bf16 over 8 workers of a node: an eighth of the base, plus the computing and the prefetched double block.
    by_hand = _flux1_dev_parameters() * 2 / 8 + 2 * double * 2
    assert gpu_memory.per_gpu_weight_bytes(counts, "bf16", "node", 8) == by_hand
    assert 4.0 < by_hand / gpu_memory.GIB < 4.3  # 2.77 GiB of shard + 2 x 0.63 GiB gathered
    assert gpu_memory.per_gpu_weight_bytes(counts, "bf16", "none", 8) == _flux1_dev_parameters() * 2


def test_memory_estimate_matches_the_hand_count():
    tokens = (1024 // 16) ** 2 + 512
    per_token = DOUBLE * (11 * H + 2 * MLP) + SINGLE * (9 * H + 3 * MLP)
    total, lora = 11_901_408_320, _trainable("attention", 16)
    est = gpu_memory.estimate(FLUX1_DEV, total * 2, lora, 1024, 2, checkpointing=False)
    assert est.weights == total * 2 and est.lora_optimizer == lora * 16
    assert est.activations == 2 * tokens * per_token * 2
    ckpt = gpu_memory.estimate(FLUX1_DEV, total * 2, lora, 1024, 2, checkpointing=True)
    assert ckpt.activations == 2 * tokens * ((DOUBLE + SINGLE) * H + 9 * H + 3 * MLP) * 2
    # Without checkpointing, one 1024 px sample's activations exceed the weights; with it, they are a few GiB.
    assert 30 < gpu_memory.estimate(FLUX1_DEV, total * 2, lora, 1024, 1, False).activations / gpu_memory.GIB < 45
    assert ckpt.activations / gpu_memory.GIB < 5


def test_the_plan_command_prints_the_jobs_figures(capsys):
    assert plan.main(["--set", "train.adapter.rank=16", "--set", "data.resolution=1024"]) == 0
    out = capsys.readouterr().out
    assert "targets=attention: 26,148,864 trainable of 11,901,408,320" in out
    assert f"targets=all: {_trainable('all', 16):,} trainable" in out
    assert "1024 px, batch 1, gradient checkpointing on (auto)" in out
    assert len([line for line in out.splitlines() if line.startswith(("  512 ", "  1024 "))]) == 8


@pytest.mark.parametrize(
    "setting, on_gpu, pixels, need_gb, expected",
    [
        ("auto", True, 1024, 20, True),
        ("auto", True, 768, 20, True),
        ("auto", True, 512, 30, False),
        ("auto", True, 512, 75, True),
        ("auto", False, 1024, 200, False),
        (False, True, 1024, 200, False),
        (True, False, 256, 1, True),
    ],
)
def test_auto_gradient_checkpointing(setting, on_gpu, pixels, need_gb, expected):
    device = 80 * 10**9 if on_gpu else 0
    assert gpu_memory.gradient_checkpointing(setting, on_gpu, pixels, need_gb * 10**9, device) is expected


def test_checkpointing_and_dtype_keys():
    assert config.load().train.gradient_checkpointing == "auto"
    assert config.load(None, ["train.gradient_checkpointing=off"]).train.gradient_checkpointing is False
    with pytest.raises(config.ConfigError, match="train.gradient_checkpointing must be auto, true or false"):
        config.load(None, ["train.gradient_checkpointing=sometimes"])
    with pytest.raises(config.ConfigError, match="model.dtype=float16: FLUX's transformer and T5 overflow in fp16"):
        config.load(None, ["model.dtype=float16"])
    assert config.load(None, ["model.vae_dtype=float16"]).model.vae_dtype == "float16"


def test_text_tokens_come_from_the_models_family(tiny_model, tiny_flux2_klein):
    # FLUX.2 [klein] embeds no guidance, yet its captions are 512 tokens: FLUX.1's dev/schnell rule would say 256.
    klein = config.load(None, [f"model.path={tiny_flux2_klein}"])
    assert plan.text_tokens(klein) == 512
    assert plan.text_tokens(config.load(None, [f"model.path={tiny_model}"])) == 512
    assert plan.text_tokens(config.load(None, [])) == 512
    assert gpu_memory.tokens(1024, 512) == 64 * 64 + 512
    # model.text_tokens: what the job keeps, for a model.path and for a built-in config alike; beyond 512 refused.
    assert plan.text_tokens(config.load(None, [f"model.path={tiny_flux2_klein}", "model.text_tokens=128"])) == 128
    assert plan.text_tokens(config.load(None, ["model.text_tokens=128"])) == 128
    with pytest.raises(ValueError, match="at most 512 text tokens"):
        plan.text_tokens(config.load(None, ["model.text_tokens=1024"]))


def test_flux2_is_counted_on_its_own_transformer():
    h = 48 * 128  # FLUX.2 [dev]: 48 heads x 128, mlp ratio 3 (SwiGLU), no biases
    m = 3 * h
    dev = plan.base_counts(FLUX2_DEV)
    assert dev.largest_linear == h * (3 * h + 2 * m)  # a single block's fused q/k/v + MLP-in projection
    # A double block: 8 attention projections, two SwiGLU MLPs, four q/k norms over a head.
    assert dev.largest_block == 8 * h * h + 2 * (h * 2 * m + m * h) + 4 * 128
    assert 32.0e9 < dev.total < 32.5e9  # "32B"
    assert 9.0e9 < plan.base_counts(FLUX2_KLEIN_9B).total < 9.2e9
    assert 3.8e9 < plan.base_counts(FLUX2_KLEIN_4B).total < 4.0e9
    assert plan.count_parameters(FLUX2_KLEIN_9B, "attention", 16)[0] == plan.base_counts(FLUX2_KLEIN_9B).total


def test_the_plan_counts_a_flux2_model_path_on_flux2(tiny_flux2_klein):
    import torch

    cfg = config.load(None, [f"model.path={tiny_flux2_klein}"])
    tc, _ = plan.transformer_config(cfg)
    loaded = models.load_transformer(cfg.model, "cpu", torch.float32)
    assert plan.count_parameters(tc, "attention", 4)[0] == sum(p.numel() for p in loaded.parameters())


def test_flux2_activations_per_token():
    h, m = 32 * 128, 3 * 32 * 128
    tc = FLUX2_KLEIN_9B
    assert gpu_memory.per_token_elements(tc, False) == 8 * (11 * h + 3 * m) + 24 * (9 * h + 4 * m)
    assert gpu_memory.per_token_elements(tc, True) == 32 * h + (9 * h + 4 * m)


def test_base_dtype_and_sharding_bytes():
    counts = gpu_memory.BaseCounts(total=1000, linear=896, largest_linear=128, largest_block=100)
    assert gpu_memory.weight_bytes(counts, "bf16") == 2000
    assert gpu_memory.weight_bytes(counts, "fp8") == 2000 + 128 * 1 + 4  # bf16 kept + one layer's fp8 copy
    assert gpu_memory.NF4_BYTES == 0.5625
    assert gpu_memory.weight_bytes(counts, "nf4") == 896 * 0.5625 + 104 * 2
    assert gpu_memory.weight_bytes(counts, "bf16", float_bytes=4) == 4000
    assert gpu_memory.per_gpu_weight_bytes(counts, "bf16", "node", 8) == 2000 / 8 + 2 * 100 * 2
    assert gpu_memory.per_gpu_weight_bytes(counts, "bf16", "none", 8) == 2000


def test_the_plan_prints_every_option_for_flux2(capsys):
    assert plan.main(["--model", "flux2-klein-9b", "--gpus-per-node", "4", "--set", "train.adapter.rank=16"]) == 0
    out = capsys.readouterr().out
    assert "FLUX.2 [klein] 9B" in out and "node: 4 workers a node" in out
    rows = {tuple(line.split()[:3]): line for line in out.splitlines() if line.startswith(("  none ", "  node "))}
    assert set(rows) == {
        (s, d, px)
        for s, d in [("none", "bf16"), ("none", "fp8"), ("none", "nf4"), ("node", "bf16")]
        for px in ("512", "1024")
    }
    assert "node/fp8: refused" in out and "node/nf4: refused" in out
    tc = FLUX2_KLEIN_9B
    counts = plan.base_counts(tc)
    trainable = plan.count_parameters(tc, "attention", 16)[1]
    nf4 = gpu_memory.estimate(tc, gpu_memory.weight_bytes(counts, "nf4"), trainable, 1024, 2, True).total
    nf4 /= gpu_memory.GIB
    cells = rows[("none", "nf4", "1024")].split()[3:]
    assert float(cells[5]) == pytest.approx(nf4, abs=0.051)  # "off / on" per batch: batch 2, checkpointing on
    # Sharded over 4, the bf16 base is about a quarter (plus two gathered blocks).
    none_bf16, node_bf16 = (float(rows[(s, "bf16", "512")].split()[5]) for s in ("none", "node"))
    assert node_bf16 < none_bf16 / 2


def test_the_plan_counts_the_ema():
    """``train.optim.ema_decay``: 4 more bytes a trainable parameter in the LoRA line and in every total."""
    ema = plan.report(config.load(None, ["train.adapter.rank=16", "train.optim.ema_decay=0.999"]))
    plain = plan.report(config.load(None, ["train.adapter.rank=16"]))
    trainable = 26_148_864  # FLUX.1-dev's attention preset at rank 16 (the plan command's test)
    assert any(f"LoRA + adamw + EMA {trainable * 20 / gpu_memory.GIB:.1f}" in line for line in ema)
    assert any(f"LoRA + adamw {trainable * 16 / gpu_memory.GIB:.1f}" in line for line in plain)
    job = config.load(None, ["train.adapter.rank=16", "train.optim.ema_decay=0.999"])
    tc = plan.transformer_config(job)[0]
    with_ema, without = (gpu_memory.estimate(tc, 0, trainable, 512, 1, False, ema=e) for e in (True, False))
    assert with_ema.total - without.total == 4 * trainable


def test_the_plan_shows_output_preservations_forwards_and_activations():
    """``train.preservation`` (issue 45): the forwards a batch costs, and the activations of its two graphs, which
    are a batch twice the size's."""
    sets = ["train.flow.preservation=class", "data.trigger_word=sks", "data.resolution=512", "train.batch_size=2"]
    lines = plan.report(config.load(None, sets))
    assert any("3 transformer forwards a batch" in line for line in lines)
    job = config.load(None, sets)
    tc = plan.transformer_config(job)[0]
    text = plan.text_tokens(job)
    with_, without = (gpu_memory.estimate(tc, 0, 0, 512, b, False, text=text).activations for b in (4, 2))
    want = f"activations at 512 px, batch 2: {with_ / gpu_memory.GIB:.1f} GiB with it, "
    assert any(want + f"{without / gpu_memory.GIB:.1f} without" in line for line in lines)
    assert not any("transformer forward" in line for line in plan.report(config.load(None, [])))

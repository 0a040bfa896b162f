"""TREAD token routing (``train.token_routing``): the skipped tokens really skip the span, the kept ones go through it
(and so train its LoRA), and a forward without gradients, or in eval mode, is the plain model's, bitwise."""

import pytest
import torch
from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

import train_data
from rayflux.config import token_routing as spec
from rayflux.config.values import ConfigError
from rayflux.families import Flux1, Flux2
from rayflux.train import token_routing
from rayflux.train.adapter import lora
from rayflux.train.trainer import LoraTrainer

B, H, W, TEXT = 2, 8, 8, 6  # FLUX.1 packs 2x2: 16 image tokens; FLUX.2 1x1: 64


def _flux1():
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    )
    g = torch.Generator().manual_seed(1)
    tokens = Flux1().pack(torch.randn(B, 4, H, W, generator=g))
    text = {"t5": torch.randn(B, TEXT, 32, generator=g), "clip_pooled": torch.randn(B, 32, generator=g)}
    return model, Flux1(), Flux1().forward_args(tokens, text, torch.tensor([0.3, 0.7]), H, W, None)


def _flux2():
    torch.manual_seed(0)
    model = Flux2Transformer2DModel(
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    )
    g = torch.Generator().manual_seed(1)
    tokens = Flux2().pack(torch.randn(B, 16, H, W, generator=g))
    text = {"prompt_embeds": torch.randn(B, TEXT, 48, generator=g)}
    return model, Flux2(), Flux2().forward_args(tokens, text, torch.tensor([0.3, 0.7]), H, W, None)


def _out(model, args):
    return model(**args, return_dict=False)[0]


def test_the_spec_parses_and_refuses_with_its_form():
    assert spec.parse("") is None
    assert spec.parse("0.5:2-8") == spec.TokenRouting(0.5, 2, 8)
    for bad in ("0.5", "half:2-8", "0:2-8", "1:2-8", "0.5:8-2", "0.5:-1-3"):
        with pytest.raises(ConfigError, match="train.token_routing"):
            spec.parse(bad)
    with pytest.raises(ConfigError, match="past the model's 4 blocks"):
        token_routing.attach(_flux1()[0], spec.parse("0.5:2-4"), Flux1())


def test_flux1_routed_forward_equals_the_blocks_run_by_hand():
    """Blocks 1-2 (the last double-stream and the first single-stream block) see only the kept tokens, with their
    rotary rows; the skipped ones rejoin with their values from before block 1."""
    model, family, args = _flux1()
    model.train()
    plain = _out(model, args)
    router = token_routing.attach(model, spec.parse("0.5:1-2"), family)
    router.seed(3)
    routed = _out(model, args)
    kept = router.route.kept
    assert kept.numel() == 8 and router.calls == 1
    router.remove()  # the blocks run by hand below must not be routed

    m = model
    hidden, temb = (
        m.x_embedder(args["hidden_states"]),
        m.time_text_embed(args["timestep"] * 1000, args["pooled_projections"]),
    )
    context = m.context_embedder(args["encoder_hidden_states"])
    rotary = m.pos_embed(torch.cat([args["txt_ids"], args["img_ids"]]))
    rows = torch.cat([torch.arange(TEXT), kept + TEXT])
    blocks = [*m.transformer_blocks, *m.single_transformer_blocks]
    for i, block in enumerate(blocks):
        if i == 1:
            before, hidden = hidden, hidden[:, kept]
        rot = (rotary[0][rows], rotary[1][rows]) if i in (1, 2) else rotary
        context, hidden = block(hidden, context, temb, rot)
        if i == 2:
            full = before.clone()
            full[:, kept] = hidden
            hidden = full
    by_hand = m.proj_out(m.norm_out(hidden, temb))
    torch.testing.assert_close(routed, by_hand, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(routed, plain, atol=1e-3)  # routing changed the forward


def _token_counts(model):
    counts = []
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.register_forward_pre_hook(
            lambda b, a, k: counts.append(k.get("hidden_states", a[0] if a else None).shape[1]), with_kwargs=True
        )
    return counts


def _routed_grads(checkpointing: bool):
    model, family, args = _flux2()
    lora.add_lora(model, 4, 4.0, "attention")
    plain = _out(model, args)
    router = token_routing.attach(model, spec.parse("0.75:1-2"), family)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    counts = _token_counts(model)
    router.seed(5)
    out = _out(model, args)
    n, kept = 64, 16
    assert counts == [n, kept, TEXT + kept, TEXT + n] and out.shape == plain.shape
    out.square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def test_flux2_span_sees_the_kept_tokens_and_trains_its_lora():
    """A span across FLUX.2's double -> single boundary (blocks 1-2; the single blocks carry text and image as one
    stream); the LoRA of every block in it gets a gradient; gradient checkpointing recomputes the same route, so
    its gradients are the same."""
    grads = _routed_grads(checkpointing=False)
    for block in ("transformer_blocks.1.", "single_transformer_blocks.0."):
        # B starts at zero, so only B's gradient is nonzero at the first step.
        inside = [g for name, g in grads.items() if name.startswith(block) and "lora_B" in name]
        assert inside and all(g is not None and g.abs().sum() > 0 for g in inside), block
    # The skipped tokens' rows of the loss's gradient still reach blocks before the span.
    assert grads["transformer_blocks.0.attn.to_q.lora_B.default.weight"].abs().sum() > 0
    for name, g in _routed_grads(checkpointing=True).items():
        torch.testing.assert_close(g, grads[name], rtol=1e-5, atol=1e-8, msg=name)


def test_without_gradients_or_in_eval_the_model_is_the_plain_one():
    model, family, args = _flux2()
    model.train()
    with torch.no_grad():
        plain = _out(model, args)
    router = token_routing.attach(model, spec.parse("0.5:0-3"), family)
    with torch.no_grad():
        assert torch.equal(_out(model, args), plain)
    model.eval()
    assert torch.equal(_out(model, args).detach(), plain)
    assert router.calls == 0
    model.train()
    router.seed(0)
    assert not torch.equal(_out(model, args).detach(), plain)
    router.remove()
    assert torch.equal(_out(model, args).detach(), plain)


def test_the_trainer_routes_its_training_forwards(tiny_model):
    cfg = train_data.job(tiny_model, "train.token_routing=0.5:0-1")
    trainer = LoraTrainer(cfg, "cpu", total_steps=1, empty=train_data.empty_caption())
    assert trainer.train_step(train_data.groups(train_data.items(2), 1)[0]).loss > 0
    assert trainer.router.calls == 1


def test_plan_shows_the_share_of_tokens_a_routed_step_keeps():
    from rayflux import plan
    from rayflux.families.flux1 import FLUX1_DEV

    assert plan.routing_lines("", FLUX1_DEV, 512) == []
    lines = plan.routing_lines("0.5:2-54", FLUX1_DEV, 512)
    # FLUX.1-dev's 57 blocks, 53 of them in the span; at 1024 px 2048 of 4096 image tokens and all 512 text ones.
    share = (4 + 53 * (2048 + 512) / (4096 + 512)) / 57
    assert "2048 of 4096 image tokens" in lines[2] and f"about {share:.2f} of plain" in lines[2]
    with pytest.raises(ConfigError, match="past the model's 57 blocks"):
        plan.routing_lines("0.5:2-57", FLUX1_DEV, 512)

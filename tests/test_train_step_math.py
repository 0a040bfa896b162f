"""Pure pieces of the training step: guidance, caption dropout, LR schedule, step counts, precision, seeds."""

import math

import pytest
import torch

from rayflux.train import flow, optim, trainer, validation


def test_constant_guidance_draws_nothing():
    g = torch.Generator().manual_seed(0)
    before = g.get_state().clone()
    assert torch.equal(flow.sample_guidance(3, 3.5, 0.0, g), torch.full((3,), 3.5))
    assert torch.equal(g.get_state(), before)


def test_guidance_range_is_seeded_and_bounded():
    a = flow.sample_guidance(1000, 1.0, 4.0, torch.Generator().manual_seed(1))
    b = flow.sample_guidance(1000, 1.0, 4.0, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert a.min() >= 1.0 and a.max() <= 4.0 and a.std() > 0.5


def test_caption_dropout_mask_rate():
    assert not flow.caption_dropout_mask(50, 0.0, torch.Generator()).any()
    mask = flow.caption_dropout_mask(20000, 0.3, torch.Generator().manual_seed(0))
    assert abs(mask.float().mean().item() - 0.3) < 0.02


def test_drop_captions_swaps_only_masked_rows():
    t5, clip = torch.randn(3, 5, 4), torch.randn(3, 4)
    empty_t5, empty_clip = torch.zeros(5, 4), torch.zeros(4)
    new_t5, new_clip = flow.drop_captions(t5, clip, torch.tensor([False, True, False]), empty_t5, empty_clip)
    assert torch.equal(new_t5[1], empty_t5) and torch.equal(new_clip[1], empty_clip)
    assert torch.equal(new_t5[[0, 2]], t5[[0, 2]]) and torch.equal(new_clip[[0, 2]], clip[[0, 2]])


def test_warmup_is_linear_and_never_zero():
    factors = [optim.lr_factor(s, 4, 10, "constant") for s in range(6)]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_falls_from_one_to_zero_after_warmup():
    f = [optim.lr_factor(s, 2, 12, "cosine") for s in range(14)]
    assert f[:2] == [0.5, 1.0]
    assert math.isclose(f[2], 1.0)
    assert math.isclose(f[7], 0.5)  # half way through the 10 cosine steps
    assert all(a >= b for a, b in zip(f[2:], f[3:]))
    assert f[12] == f[13] == pytest.approx(0.0)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="lr_scheduler"):
        optim.lr_factor(5, 0, 10, "linear")


def test_scheduler_follows_lr_factor():
    from rayflux.config import TrainConfig

    t = TrainConfig(learning_rate=0.01, warmup_steps=2, lr_scheduler="cosine")
    p = torch.nn.Parameter(torch.zeros(1))
    opt, sched = optim.build([p], t, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.01 * optim.lr_factor(s, 2, 6, "cosine") for s in range(6)])


@pytest.mark.parametrize("planned, max_steps, expected", [(8, 0, 8), (8, 3, 3), (8, 20, 8)])
def test_total_steps(planned, max_steps, expected):
    assert optim.total_steps(planned, max_steps) == expected


def test_autocast_choice():
    assert optim.autocast_dtype("auto", "cuda") is torch.bfloat16
    assert optim.autocast_dtype("auto", "cpu") is None
    assert optim.autocast_dtype("bf16", "cpu") is torch.bfloat16
    assert optim.autocast_dtype("fp32", "cuda") is None


def test_worker_seeds_differ_per_rank_and_are_stable():
    seeds = [trainer.worker_seed(7, r) for r in range(4)]
    assert len(set(seeds)) == 4
    assert seeds == [trainer.worker_seed(7, r) for r in range(4)]
    assert all(0 <= s < 2**63 for s in seeds)


def test_grid_places_images_row_by_row():
    from PIL import Image

    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    out = validation.grid([Image.new("RGB", (4, 3), c) for c in colours])
    assert out.size == (8, 6)  # 2 columns, 2 rows
    assert out.getpixel((0, 0)) == colours[0]
    assert out.getpixel((4, 0)) == colours[1]
    assert out.getpixel((0, 3)) == colours[2]
    assert out.getpixel((4, 3)) == (0, 0, 0)

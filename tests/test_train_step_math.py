"""Pure pieces of the training step: guidance, caption dropout, LR schedule, step counts, precision, seeds."""

import pytest
import torch

from rayflux.train import flow, optim, trainer
from rayflux.train.observe import validation


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


def test_drop_text_swaps_only_masked_rows():
    t5, clip = torch.randn(3, 5, 4), torch.randn(3, 4)
    empty_t5, empty_clip = torch.zeros(5, 4), torch.zeros(4)
    new = flow.drop_text(
        {"t5": t5, "clip": clip}, torch.tensor([False, True, False]), {"t5": empty_t5, "clip": empty_clip}
    )
    new_t5, new_clip = new["t5"], new["clip"]
    assert torch.equal(new_t5[1], empty_t5) and torch.equal(new_clip[1], empty_clip)
    assert torch.equal(new_t5[[0, 2]], t5[[0, 2]]) and torch.equal(new_clip[[0, 2]], clip[[0, 2]])


def _lrs(opt, sched, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


@pytest.mark.parametrize("name", optim.SCHEDULERS)
def test_schedules_are_diffusers_own(name):
    """Each ``train.optim.lr_scheduler`` name gives what ``diffusers.optimization.get_scheduler`` gives for it."""
    from diffusers.optimization import get_scheduler

    from rayflux import config

    warmup = 0 if name == "constant" else 3
    cfg = config.load(
        None,
        [
            "train.optim.learning_rate=0.01",
            f"train.optim.lr_scheduler={name}",
            f"train.optim.warmup_steps={warmup}",
            "train.optim.lr_cycles=2",
            "train.optim.lr_power=2",
        ],
    )
    ours = optim.build([torch.nn.Parameter(torch.zeros(1))], cfg.train, total_steps=16)
    ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    ref = get_scheduler(name, ref_opt, num_warmup_steps=warmup, num_training_steps=16, num_cycles=2, power=2.0)
    got, want = _lrs(*ours, 18), _lrs(ref_opt, ref, 18)
    assert got == pytest.approx(want)
    assert len(set(got)) >= {"constant": 1, "constant_with_warmup": 4}.get(name, 8)  # the schedule is exercised


def test_schedule_state_survives_a_weights_only_round_trip(tmp_path):
    """Checkpoint resume: the scheduler's state loads with weights_only=True and continues the same curve."""
    from rayflux.config import TrainConfig
    from rayflux.config.train import OptimConfig

    schedule = OptimConfig(learning_rate=0.01, warmup_steps=2, lr_scheduler="cosine_with_restarts", lr_cycles=2)
    t = TrainConfig(optim=schedule)
    opt, sched = optim.build([torch.nn.Parameter(torch.zeros(1))], t, total_steps=10)
    first = _lrs(opt, sched, 4)
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp_path / "state.pt")
    straight = _lrs(opt, sched, 6)
    opt2, sched2 = optim.build([torch.nn.Parameter(torch.zeros(1))], t, total_steps=10)
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])
    assert first[0] == 0.0 and _lrs(opt2, sched2, 6) == pytest.approx(straight)


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

"""The world base's pretraining batches: caption dropout swaps in the empty caption's text at its rate, and draws
nothing when it is off (a base pretrained without it keeps its random stream); renders of a base guide only when it
was pretrained with caption dropout."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from rayflux.quality.pretrain import Encoded, PretrainSpec, _batch_text
from rayflux.testing import world_base


def _encoded() -> Encoded:
    text = {
        "t5": torch.arange(1.0, 4.0).view(3, 1, 1).expand(3, 2, 4),
        "clip_pooled": torch.arange(1.0, 4.0).view(3, 1),
    }
    empty = {"t5": torch.zeros(1, 2, 4), "clip_pooled": torch.zeros(1, 1)}
    return Encoded({(16, 16): torch.zeros(3, 4, 2, 2)}, {(16, 16): [2, 0, 1]}, text, empty)


def test_caption_dropout_uses_the_empty_caption_at_its_rate_and_draws_nothing_when_off():
    enc, size = _encoded(), (16, 16)
    gen = torch.Generator().manual_seed(0)
    kept = _batch_text(enc, size, [0, 1, 2], PretrainSpec(), gen)
    assert kept["clip_pooled"].flatten().tolist() == [3.0, 1.0, 2.0]  # each sample's own caption row
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(0).get_state())  # no draw

    dropped = _batch_text(enc, size, [0, 1, 2] * 200, PretrainSpec(caption_dropout=0.25), gen)
    empty = dropped["clip_pooled"].flatten() == 0
    assert 0.15 < empty.float().mean() < 0.35
    assert (dropped["t5"][empty] == 0).all() and (dropped["t5"][~empty] > 0).all()  # t5 and CLIP drop together


def test_renders_guide_only_a_base_pretrained_with_caption_dropout(tmp_path):
    assert world_base.render_guidance() == world_base.TRUE_CFG  # the shipped v3 trained with caption dropout
    assert f"train.validation.true_cfg={world_base.TRUE_CFG}" in world_base.demo_sets()
    for dropout, scale in ((0.0, 0.0), (0.1, world_base.TRUE_CFG)):
        (tmp_path / "world_base.json").write_text(json.dumps({"spec": asdict(PretrainSpec(caption_dropout=dropout))}))
        assert world_base.render_guidance(tmp_path) == scale


def test_large_batches_come_every_nth_step_and_every_size_takes_its_turn():
    from rayflux.quality.pretrain import batch_size_at
    from rayflux.testing.world import SIZES_128, SIZES_256, WORLD_SIZES

    sizes = sorted(WORLD_SIZES)
    assert [batch_size_at(i, sizes, 0) for i in range(10)] == sizes  # v2: every size in turn
    drawn = [batch_size_at(i, sizes, 4) for i in range(40)]
    assert [i for i, s in enumerate(drawn) if s in SIZES_256] == list(range(3, 40, 4))
    assert {drawn[i] for i in range(3, 40, 4)} == set(SIZES_256)
    small = [s for s in drawn if s in SIZES_128]
    assert all(small.count(s) == 6 for s in SIZES_128)  # 30 small batches, 6 of each


def test_the_flux_rotary_split_gives_rows_as_many_dims_as_columns():
    from rayflux.quality.pretrain import PretrainSpec, rope_axes

    assert rope_axes(PretrainSpec()) == (4, 4, 8)  # v2: rows keep 4 of 16
    assert rope_axes(PretrainSpec(head_dim=32, rope="flux")) == (4, 14, 14)  # 16/56/56 of 128, scaled
    assert rope_axes(PretrainSpec(head_dim=128, rope="flux")) == (16, 56, 56)  # FLUX.1's own
    with pytest.raises(ValueError, match="multiple of 16"):
        rope_axes(PretrainSpec(head_dim=24, rope="flux"))


def test_the_demo_picture_puts_the_base_grid_before_the_runs_grids_in_step_order(tmp_path):
    from PIL import Image

    from rayflux.quality.demo import picture

    grids = tmp_path / "run" / "validation"
    grids.mkdir(parents=True)
    for step, colour in ((80, "red"), (40, "blue")):  # written out of order
        Image.new("RGB", (256, 256), colour).save(grids / f"step-{step:06d}.png")
    sheet = Image.open(picture(tmp_path / "run", tmp_path / "demo.png"))
    assert sheet.size == (3 * 256 + 2 * 8, 256 + 18)
    assert sheet.getpixel((256 + 8 + 128, 140)) == (0, 0, 255)  # step 40 second
    assert sheet.getpixel((2 * (256 + 8) + 128, 140)) == (255, 0, 0)  # step 80 last
    base = sheet.crop((0, 18, 256, 274))
    assert len(set(base.getdata())) > 100  # the base's own renders, not a blank cell

"""``train.workers.base_fsdp``: the frozen base sharded with FSDP2 while the LoRA trains whole on every worker.

- pure rules: ``auto``'s choice, the device mesh for a placement of workers, FSDP2's row split;
- memory: two real processes (gloo) build the trainer with a sharded base, watched by a dispatch mode that records
  every tensor an op touches: each rank holds half of the base, and no rank ever held a whole weight of it; after a
  step, rank 0 renders a validation image on its own.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_data
from rayflux import models
from rayflux.train import sharding
from rayflux.train.adapter import lora
from rayflux.train.observe import validation
from rayflux.train.trainer import LoraTrainer

GIB = 2**30


def test_auto_shards_only_a_shared_gpu_whose_whole_base_does_not_fit():
    assert sharding.choose("auto", True, 8, 73 * GIB, 80 * GIB) == "node"  # over 90% of the device
    assert sharding.choose("auto", True, 8, 71 * GIB, 80 * GIB) == "none"
    assert sharding.choose("auto", True, 1, 200 * GIB, 80 * GIB) == "none"  # alone on its node: nobody to share with
    assert sharding.choose("auto", False, 8, 200 * GIB, 0) == "none"  # CPU
    assert sharding.choose("node", False, 1, 0, 0) == "node"
    assert sharding.choose("none", True, 8, 200 * GIB, 1) == "none"


def test_mesh_is_hsdp_for_even_nodes_and_flat_otherwise():
    assert sharding.mesh_shape([0, 0, 1, 1, 2, 2], [2] * 6).shape == (3, 2)
    assert sharding.mesh_shape([0, 0, 0, 0], [4] * 4).shape == (4,)  # one node
    # An elastic placement of 3 + 1 workers, or a node's workers on non-consecutive ranks: one flat mesh.
    uneven = sharding.mesh_shape([0, 0, 0, 1], [3, 3, 3, 1])
    assert uneven.shape == (4,) and "uneven" in uneven.reason
    assert sharding.mesh_shape([0, 1, 0, 1], [2] * 4).shape == (4,)
    assert sharding.mesh_shape([0, 0, 0, 0], [2] * 4).shape == (4,)  # two "nodes" that are one: not distinct


def test_shard_rows_match_torch_chunk():
    for rows in (1, 5, 8, 33):
        for shards in (1, 2, 3, 8):
            chunks = torch.arange(rows).chunk(shards)
            for i in range(shards):
                start, stop = sharding.shard_rows(rows, shards, i)
                want = chunks[i].tolist() if i < len(chunks) else []
                assert list(range(start, stop)) == want, (rows, shards, i)


ALIASES = {torch.ops.aten.lift_fresh, torch.ops.aten.set_, torch.ops.aten.detach, torch.ops.aten.alias}


class LargestTensor(TorchDispatchMode):
    """The most bytes of any real (not meta) plain tensor that an op reading or writing data took or made while
    the mode was on. Views are left out: safetensors hands out a slice as a view of the memory-mapped file, which
    reads nothing until the slice is copied (and then the copy's source is the slice alone)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.overloadpacket in ALIASES:
            return out
        for x in torch.utils._pytree.tree_leaves((args, kwargs, out)):
            if type(x) in (torch.Tensor, torch.nn.Parameter) and x.device.type != "meta":
                self.largest = max(self.largest, x.numel() * x.element_size())
        return out


def _worker(rank: int, tiny_model: str) -> dict:
    cfg = train_data.job(
        tiny_model,
        "train.workers.base_fsdp=node",
        'train.validation.prompts=["a red circle"]',
        "train.validation.inference_steps=1",
        "data.resolution=64",
    )
    empty = train_data.empty_caption()
    with LargestTensor() as watch:
        trainer = LoraTrainer(
            cfg, "cpu", 2, rank=rank, empty=empty, topology=sharding.Topology(world=2, local_world=2, node_rank=0)
        )
    base = [p for p in trainer.transformer.parameters() if not p.requires_grad]
    loss = trainer.train_step(train_data.groups(train_data.items(2, seed=rank), 2)[0]).loss
    # Rank 0 renders alone (rank 1 has left the group): a sharded forward would wait on rank 1 for ever.
    image = validation.render_trained(trainer, cfg, "cpu")[0] if rank == 0 else None
    copy = validation.whole_copy(trainer, cfg, "cpu") if rank == 0 else None  # what render_trained renders with
    return {
        "local": sharding.local_bytes(torch.nn.ParameterList(base)),
        "whole": sharding.whole_bytes(torch.nn.ParameterList(base)),
        "largest_seen": watch.largest,
        "shape": trainer.layout.shape,
        "loss": loss,
        "image": (image.size, len(set(image.getdata()))) if image else None,
        "weights_estimate": trainer.memory.weights,
        "copy": _adapter(copy) if copy else None,
        "trained": _adapter(trainer.transformer),
    }


def _adapter(transformer) -> tuple:
    config = transformer.peft_config[lora.ADAPTER]
    deltas = {n: d.to(torch.float64).numpy() for n, d in lora.delta_weights(transformer).items()}  # to pickle
    return sorted(config.target_modules), config.r, config.lora_alpha, deltas


def test_each_rank_loads_and_holds_only_its_half_of_the_base(tiny_model):
    r0, r1 = train_data.two_ranks(_worker, str(tiny_model))
    whole = models.load_transformer(train_data.job(tiny_model).model, "cpu", torch.float32)
    weights = {n: p.numel() * p.element_size() for n, p in whole.named_parameters()}
    biggest = max(weights.values())
    assert r0["shape"] == r1["shape"] == (2,)
    assert r0["whole"] == r1["whole"] == sum(weights.values())
    # Each rank holds about half (FSDP2 splits rows, so odd row counts leave one rank a row more).
    assert r0["local"] + r1["local"] == r0["whole"]
    assert all(abs(r["local"] - r0["whole"] / 2) < 0.05 * r0["whole"] for r in (r0, r1))
    # No rank ever touched a whole copy of the biggest weight (every whole-model load does): half of it at most.
    assert 0 < r0["largest_seen"] < biggest and r1["largest_seen"] < biggest, (r0["largest_seen"], biggest)
    assert r0["loss"] > 0 and r1["loss"] > 0
    assert r0["image"][0] == (64, 64) and r0["image"][1] > 1  # rendered content, not a blank canvas
    # The render's whole copy carries the trained adapter: the same modules, rank, alpha and B @ A deltas.
    copy, trained = r0["copy"], r0["trained"]
    assert copy[:3] == trained[:3] and copy[3].keys() == trained[3].keys()
    assert max(float(abs(d).max()) for d in trained[3].values()) > 0  # one step moved B off zero
    for name, delta in trained[3].items():
        torch.testing.assert_close(copy[3][name], delta)
    # The memory estimate counts half the base plus the two blocks FSDP2 holds gathered (fp32 on CPU).
    blocks = [*whole.transformer_blocks, *whole.single_transformer_blocks]
    largest_block = max(sum(p.numel() for p in b.parameters()) for b in blocks) * 4
    assert r0["weights_estimate"] == r1["weights_estimate"] == int(r0["whole"] / 2 + 2 * largest_block)

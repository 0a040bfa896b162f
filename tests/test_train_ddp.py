"""DDP syncs only the LoRA: two real processes (gloo) wrap the trainer's transformer as Ray Train's
``prepare_model`` does, with rank 1's frozen weights deliberately different from rank 0's.

If DDP broadcast the frozen weights at start, rank 1's difference would be overwritten by rank 0's; if it
all-reduced them, their (zero) gradients would go through its reducer. Neither may happen; the LoRA must still be
broadcast (rank 0's adapter everywhere) and its gradients averaged (same weights on both ranks after a step).
"""

from __future__ import annotations

import torch

import train_data
from rayflux.train.adapter import lora
from rayflux.train.trainer import LoraTrainer

PERTURBED = "transformer_blocks.0.attn.to_q.base_layer.weight"  # a frozen weight under a LoRA target


def _worker(rank: int, tiny_model: str) -> dict:
    torch.manual_seed(0)
    cfg = train_data.job(tiny_model, "train.optim.learning_rate=0.01")

    def wrap(module):
        params = dict(module.named_parameters())
        with torch.no_grad():
            params[PERTURBED].add_(float(rank))  # rank 1's frozen copy differs from rank 0's
            if rank == 1:
                for p in module.parameters():
                    if p.requires_grad:
                        p.add_(1.0)  # and so does its fresh adapter, which DDP must replace with rank 0's
        return torch.nn.parallel.DistributedDataParallel(module)

    trainer = LoraTrainer(cfg, "cpu", total_steps=2, rank=rank, empty=train_data.empty_caption(), wrap=wrap)
    reducer_params = trainer.model._get_ddp_logging_data().get("num_parameter_tensors")
    lora_after_wrap = {k: v.clone() for k, v in lora.lora_state_dict(trainer.transformer).items()}
    frozen_after_wrap = dict(trainer.transformer.named_parameters())[PERTURBED].detach().clone()
    rows = train_data.items(4, seed=rank)  # different data per rank: only averaged gradients agree
    trainer.train_step(train_data.groups(rows, 2)[0])
    return {
        "reducer_params": reducer_params,
        "trainable": len(trainer.params),
        "lora_after_wrap": lora_after_wrap,
        "frozen_after_wrap": frozen_after_wrap,
        "lora_after_step": {k: v.clone() for k, v in lora.lora_state_dict(trainer.transformer).items()},
    }


def test_ddp_syncs_only_the_lora(tiny_model):
    r0, r1 = train_data.two_ranks(_worker, str(tiny_model))
    # The reducer holds the LoRA tensors alone: no frozen parameter is all-reduced.
    assert r0["reducer_params"] == r0["trainable"] == r1["reducer_params"] > 0
    # Frozen weights were not broadcast: rank 1 keeps its own (rank 0 + 1.0).
    torch.testing.assert_close(r1["frozen_after_wrap"], r0["frozen_after_wrap"] + 1.0)
    # The LoRA was broadcast at wrap (rank 1's +1.0 replaced by rank 0's) and stays equal after an averaged step.
    for key, value in r0["lora_after_wrap"].items():
        torch.testing.assert_close(r1["lora_after_wrap"][key], value)
    for key, value in r0["lora_after_step"].items():
        torch.testing.assert_close(r1["lora_after_step"][key], value)

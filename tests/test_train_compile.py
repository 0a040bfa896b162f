"""``train.compile``: the transformer's repeated blocks compiled (inductor, on CPU) with the LoRA attached and gradient
checkpointing on train like eager ones.

One test, in a file of its own so that CI runs it once (the oldest-versions pass in ``.ci/run`` runs
tests/test_train_trainer.py again, not this file): inductor's first compile of the two block graphs, forward and
backward, takes from about 20 s (warm FX-graph cache) to minutes (cold, on a busy 2-core machine).
"""

import pytest
import torch

import train_data
from rayflux import config
from rayflux.config import ConfigError
from rayflux.train.adapter import lora
from rayflux.train.trainer import LoraTrainer


def _lora_after_4_steps(tiny_model, compiled: bool) -> dict:
    cfg = train_data.job(
        tiny_model,
        "train.optim.learning_rate=0.01",
        "train.gradient_checkpointing=true",
        f"train.compile={str(compiled).lower()}",
    )
    trainer = LoraTrainer(cfg, "cpu", total_steps=4, empty=train_data.empty_caption())
    for group in train_data.groups(train_data.items(4, batch_size=1), 1):
        trainer.train_step(group)
    assert trainer.transformer.is_gradient_checkpointing
    return {k: v.detach().clone() for k, v in lora.lora_state_dict(trainer.transformer).items()}


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()  # drop the compiled graphs: nothing of this test reaches the next one


def test_compiled_blocks_train_the_lora_as_eager_does(tiny_model, fresh_dynamo):
    eager = _lora_after_4_steps(tiny_model, False)
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = _lora_after_4_steps(tiny_model, True)
    # The blocks went through dynamo (one graph per block class, shared by the blocks of that class)...
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2
    # ...and the LoRA they trained is eager's within 1% (relative), every tensor of it.
    assert compiled.keys() == eager.keys()
    for k, v in eager.items():
        assert v.norm() > 0, k
        assert float((compiled[k] - v).norm() / v.norm()) < 0.01, k


def test_compile_needs_the_whole_base_and_takes_kohyas_name():
    assert config.load(None, ["train.torch_compile=true"]).train.compile is True
    with pytest.raises(ConfigError, match="train.compile needs the whole base"):
        config.load(None, ["train.compile=true", "train.workers.base_fsdp=auto"])

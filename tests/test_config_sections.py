"""The ``train`` section in sub-sections (issue 44): the keys of the flat section before it still load, in YAML and
``--set``, into their new homes; configs saved before it still load; and no cache key, run identity or config
fingerprint changed with it.

The identities below were recorded once by running the code from before the split (the flat ``TrainConfig``) on these
exact configs; they are what a cache or run directory made by that code holds, so they must never change. (This file
spells the old keys on purpose. codemod: keep old keys)
"""

import dataclasses

import pytest

from rayflux import config, models
from rayflux.cache.keys import cache_key
from rayflux.config import identity
from rayflux.config.loader import canonical_key, leaves
from rayflux.job import run_identity
from rayflux.sweep import config as sweep_config
from rayflux.sweep.driver import _fingerprint

# The σ schedule's default was logit_normal when these were recorded (it is auto since issue 45): the cases that
# left it at its default spell that default out, as the ledger of a run started then holds it.
CASES = {
    "default": ["train.sigma_sampling=logit_normal"],
    "a": [
        "train.learning_rate=3e-4",
        "train.rank=16",
        "train.alpha=8",
        "train.lr_scheduler=cosine",
        "train.warmup_steps=10",
        "train.read_run=2",
        "train.sigma_sampling=flux_shift",
        "train.caption_dropout=0.1",
        "train.validation_prompts=[a cat, a dog]",
        "train.validation_queue=3",
        "train.validation_resources={CPU: 0.5}",
        "train.output_name=mine",
        "train.seed=7",
        "train.num_workers=[1, 3]",
        "train.use_gpu=false",
        "cache.use_gpu=false",
        "train.checkpoint_every=5",
        "train.eval_every=2",
        "data.eval_samples=2",
    ],
    "b": [
        "train.sigma_sampling=logit_normal",
        "train.adapter=lokr",
        "train.output_format=kohya",
        "train.optimizer=adafactor",
        "train.ema_decay=0.99",
        "train.base_sharding=none",
        "train.gradient_checkpointing=true",
        "train.validation_prompts=[edit it]",
        "train.validation_references=[ref.png]",
        "train.validation_wait_seconds=60",
        "train.max_grad_norm=0.5",
        "data.crop=random",
        "cache.dtype=float32",
        "model.text_tokens=128",
        "cache.refresh=2",
        "train.batch_size=4",
    ],
}
"""Configs as the flat section spelled them (``data.images_dir`` is set for each: an empty one is the working
directory, which the cache key holds)."""

RECORDED = {
    "default": ("b8cf46c0112a68c3", "da53770792708a5a", "c871fb1026621b75", "0b73a46b2ebdc4b8", "312a0cdc801f2b36"),
    "a": ("eca3abe2d3dfc6bb", "045ff49b75b472c3", "6580355b15ad778e", "0b73a46b2ebdc4b8", "0b73a46b2ebdc4b8"),
    "b": ("3b7e8ebc0f1a1577", "5ee4b354b0458838", "2fc5877dd4a6add3", "f61ee9557a57816d", "f61ee9557a57816d"),
}
"""Per case, from the code before the split: run identity, ``fingerprint()``, ``fingerprint("data", "model",
"cache")`` (the manifest's ``config_hash``), the cache key on a CPU cluster and on a GPU cluster (with the model's
identity fixed: the tiny model's weight files differ between machines)."""


def _new_keys(sets: list[str]) -> list[str]:
    """The same overrides under the keys of the sections (``train.learning_rate`` -> ``train.optim.learning_rate``)."""
    out = []
    for item in sets:
        key, value = item.split("=", 1)
        section, _, name = key.partition(".")
        out.append(f"{section}.{canonical_key(section, name)}={value}")
    return out


def _identities(cfg: config.JobConfig) -> tuple:
    facts = dataclasses.replace(models.model_facts(cfg.model), identity="fixed-model")
    return (
        run_identity(cfg),
        cfg.fingerprint(),
        cfg.fingerprint("data", "model", "cache"),
        cache_key(cfg, facts),
        cache_key(cfg, facts, cluster_gpus=True),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_identities_are_those_recorded_before_the_split(case):
    old = config.load(None, ["data.images_dir=/data/images", *CASES[case]])
    new = config.load(None, ["data.images_dir=/data/images", *_new_keys(CASES[case])])
    assert old == new
    assert _identities(new) == RECORDED[case]


def test_old_keys_load_from_yaml_into_their_sections(tmp_path):
    f = tmp_path / "old.yaml"
    f.write_text(
        "train:\n  learning_rate: 0.001\n  optimizer: AdamW8bit\n  rank: 8\n  adapter: dora\n  read_run: 2\n"
        "  base_sharding: auto\n  use_gpu: 'true'\n  validation_prompts: [a cat]\n  validation_every: 5\n"
        "  eval_every: 3\n  checkpoints_to_keep: 4\n  num_workers: [1, 2]\n  epochs: 3\n"
        "cache:\n  use_gpu: 'false'\n"
    )
    t = config.load(str(f)).train
    assert (t.optim.learning_rate, t.optim.name, t.adapter.rank, t.adapter.kind) == (0.001, "adamw8bit", 8, "dora")
    assert (t.feed.shuffle_block, t.workers.base_fsdp, t.workers.on_gpu, t.workers.num_workers) == (
        2,
        "auto",
        "true",
        [1, 2],
    )
    assert (t.validation.prompts, t.validation.every, t.eval.every, t.checkpoint.keep, t.epochs) == (
        ["a cat"],
        5,
        3,
        4,
        3,
    )
    assert config.load(str(f)).cache.encoders_on_gpu == "false"


def test_old_keys_load_from_set_and_mix_with_new_ones():
    cfg = config.load(
        None,
        [
            "train.adapter=lokr",  # the old key has the name of the new sub-section: a value, not a mapping
            "train.output_format=kohya",
            "train.optim.lr_power=2",
            "train.lr_scheduler=polynomial",
            "train.use_ema=true",
            "train.workers={num_workers: 3}",
            "cache.use_gpu=false",
        ],
    )
    t = cfg.train
    assert (t.adapter.kind, t.checkpoint.output_format) == ("lokr", "kohya")
    assert (t.optim.lr_power, t.optim.lr_scheduler, t.optim.ema_decay) == (2.0, "polynomial", 0.995)
    assert (t.workers.num_workers, cfg.cache.encoders_on_gpu) == (3, "false")


@pytest.mark.parametrize(
    "updates, message",
    [
        ({"train": {"learning_rate": 1, "optim": {"learning_rate": 2}}}, "both set train.optim.learning_rate"),
        ({"train": {"optim": {"lr": 1}}}, "unknown config key train.optim.lr"),
        ({"train": {"optim": 3}}, "unknown config key train.optim;"),
        ({"cache": {"use_gpu": "true", "encoders_on_gpu": "false"}}, "both set cache.encoders_on_gpu"),
    ],
)
def test_a_key_set_twice_or_unknown_is_refused(updates, message):
    with pytest.raises(config.ConfigError, match=message):
        config.apply(config.JobConfig(), updates)


def test_a_config_saved_before_the_split_loads():
    """``JobConfig.to_dict()`` as the flat code wrote it (what travels to the workers and into a sweep's trials)
    rebuilds the same config."""
    cfg = config.load(None, _new_keys(CASES["a"]))
    flat = {**cfg.to_dict(), "train": identity.flat(cfg.train), "cache": identity.flat(cfg.cache)}
    assert "learning_rate" in flat["train"] and "optim" not in flat["train"]  # the old shape indeed
    assert config.from_dict(flat) == cfg == config.from_dict(cfg.to_dict())


def test_a_sweep_space_in_old_keys_keeps_its_fingerprint():
    """An interrupted sweep continues only when its ledger's fingerprint matches: the one recorded before the split."""
    space = {
        "train.learning_rate": {"grid": [1.0e-4, 1.0e-3]},
        "train.lora_rank": {"grid": [4, 8]},
        "train.read_run": {"choice": [1, 4]},
    }
    old, new = (sweep_config.parse({"space": s, "num_samples": 2}) for s in (space, _space_in_new_keys(space)))
    assert set(old.space) == {"train.optim.learning_rate", "train.adapter.rank", "train.feed.shuffle_block"}
    assert old == new
    assert _fingerprint(old) == "fb841260295d095d"
    # A trial restored by Tune carries the space's old keys: they still set the sections.
    trial = sweep_config.trial_job(config.JobConfig(), {"train.learning_rate": 0.5, "train.read_run": 1}, "")
    assert (trial.train.optim.learning_rate, trial.train.feed.shuffle_block) == (0.5, 1)


def _space_in_new_keys(space: dict) -> dict:
    return {f"train.{canonical_key('train', k.split('.', 1)[1])}": v for k, v in space.items()}


def test_help_groups_keys_by_section_and_lists_the_old_keys():
    text = config.help_text()
    for section in ("train", "train.workers", "train.feed", "train.optim", "train.adapter", "train.flow"):
        assert f"\n  {section}: " in text
    assert text.index("\n  train.optim: ") < text.index("train.optim.learning_rate = 0.0001")
    assert "train.learning_rate -> train.optim.learning_rate" in text
    assert "train.read_run -> train.feed.shuffle_block" in text
    assert "cache.use_gpu -> cache.encoders_on_gpu" in text


def test_every_moved_field_names_an_old_key_no_other_field_has():
    """Each field of a sub-section says which flat key it was, and no two fields claim the same one (the identities
    hash each field under that key)."""
    for section, cls in config.SECTIONS.items():
        keys = [identity.old_key(f, "") if "." in path else path for path, f, _ in leaves(cls)]
        assert len(keys) == len(set(keys)), section
        for path, f, _ in leaves(cls):
            assert "." not in path or identity.OLD_KEY in f.metadata, f"{section}.{path} names no old key"


def test_a_run_started_at_the_old_default_schedule_continues_with_it(tmp_path, caplog):
    """A run directory whose ledger holds the identity of the old default (logit_normal) is continued with that
    schedule by a config that leaves the σ schedule at today's default (auto), and says so; any other difference is
    still refused, naming the config as it was given."""
    from rayflux import job, lease
    from rayflux.ledger import ConfigChanged, Ledger

    def fresh(*sets):
        return config.load(None, ["data.images_dir=/data/images", *sets])

    out = str(tmp_path / "run")
    Ledger(out, run_identity(fresh("train.flow.sigma_sampling=logit_normal")))._save()
    with lease.Lease(out, "run.output_dir", 60.0) as held:
        cfg = fresh()
        assert cfg.train.flow.sigma_sampling == "auto"
        job.open_ledger(cfg, out, held)
        assert cfg.train.flow.sigma_sampling == "logit_normal"
        assert "continuing with train.flow.sigma_sampling=logit_normal" in caplog.text
        other = fresh("train.seed=7")
        with pytest.raises(ConfigChanged, match=run_identity(other)):
            job.open_ledger(other, out, held)
        assert other.train.flow.sigma_sampling == "auto"
        with pytest.raises(ConfigChanged):  # an explicit schedule is never swapped
            job.open_ledger(fresh("train.flow.sigma_sampling=uniform"), out, held)

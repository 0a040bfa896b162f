"""Config: YAML files, dotted overrides, validation and generated help."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from rayflux import config
from rayflux.config.loader import leaves

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_validate():
    cfg = config.load()
    assert cfg.train.workers.num_workers == 2 and cfg.cache.refresh == "never"


def test_yaml_then_set_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: 5\n  learning_rate: 0.001\ndata:\n  images_dir: /data/x\n")
    cfg = config.load(str(f), ["train.epochs=3", "train.workers.num_workers=[1, 4]", "cache.strict=true"])
    assert cfg.train.epochs == 3
    assert cfg.train.optim.learning_rate == 0.001
    assert cfg.data.images_dir == "/data/x"
    assert cfg.train.workers.num_workers == [1, 4]
    assert cfg.cache.strict is True
    assert config.worker_range(cfg.train.workers.num_workers) == (1, 4)


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.epochz=3", "unknown config key train.epochz"),
        ("trian.epochs=3", "unknown config section"),
        ("train.epochs=three", "train.epochs: expected int"),
        ("train.epochs=0", "train.epochs must be positive"),
        ("data.crop=diagonal", "data.crop must be one of"),
        ("cache.refresh=sometimes", "cache.refresh must be"),
        ("train.workers.num_workers=[3, 1]", "min <= max"),
        ("cache.strict=maybe", "cache.strict: expected bool"),
        ("train.epochs", "KEY=VALUE"),
    ],
)
def test_bad_values_name_the_key(item, message):
    with pytest.raises(config.ConfigError, match=message.replace("[", r"\[")):
        config.load(None, [item])


def test_every_field_has_a_docstring():
    for section, cls in config.SECTIONS.items():
        for path, f, owner in leaves(cls):
            assert config.field_docs(owner).get(f.name), f"{section}.{path} has no docstring"
    for f in dataclasses.fields(config.TrainConfig):  # the sub-sections themselves too
        assert config.field_docs(config.TrainConfig).get(f.name), f"train.{f.name} has no docstring"


def test_refresh_interval():
    assert config.refresh_interval("never") == 0
    assert config.refresh_interval("every_epoch") == 1
    assert config.refresh_interval("3") == 3


def test_fingerprint_tracks_sections():
    a, b = config.load(), config.load(None, ["train.epochs=9"])
    assert a.fingerprint("data") == b.fingerprint("data")
    assert a.fingerprint("train") != b.fingerprint("train")


def test_cli_help_lists_every_key_with_default():
    out = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "train_flux.py"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    for key in (
        "data.images_dir",
        "cache.dir",
        "run.output_dir",
        "model.path",
        "train.epochs",
        "train.max_steps",
        "train.workers.num_workers",
        "train.batch_size",
        "cache.refresh",
        "cache.strict",
    ):
        assert key in out
    assert "train.workers.num_workers = 2" in out
    assert "--only" in out


def test_cli_config_error_is_one_line_and_nonzero():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "train_flux.py"), "--set", "train.epochs=-1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "train.epochs must be positive" in proc.stderr


def test_string_keys_keep_their_text():
    cfg = config.load(None, ["run.debug_slow_rank=1:0.4", "data.instance_prompt=off", "cache.refresh=2"])
    assert cfg.run.debug_slow_rank == "1:0.4"
    assert cfg.data.instance_prompt == "off"
    assert config.refresh_interval(cfg.cache.refresh) == 2


@pytest.mark.parametrize(
    "items, hint",
    [
        (["data.resolution=1.0"], "for 1 MP write resolution: 1024"),
        (["data.resolution=4"], "for 4 MP write resolution: 1984"),
        (["data.resolution=8", "data.resolution_type=shorter_edge"], "shorter edge is in pixels"),
    ],
)
def test_a_resolution_in_another_tools_units_is_refused_with_a_hint(items, hint):
    """SimpleTuner's resolution_type=area counts megapixels: 1.0 once trained 16x16 buckets here, silently."""
    with pytest.raises(config.ConfigError, match=hint):
        config.load(None, items)


def test_kohya_and_simpletuner_names_are_aliases(tmp_path):
    f = tmp_path / "kohya.yaml"
    f.write_text(
        "train: {network_dim: 16, network_alpha: 8, lr_warmup_steps: 5, lr_scheduler: cosine}\n"
        "data: {bucket_reso_steps: 32}\n"
    )
    cfg = config.load(str(f), ["train.checkpointing_steps=50"])
    assert (cfg.train.adapter.rank, cfg.train.adapter.alpha, cfg.train.optim.warmup_steps) == (16, 8.0, 5)
    assert (cfg.data.bucket_step, cfg.train.checkpoint.every) == (32, 50)
    with pytest.raises(config.ConfigError, match="train.adapter.rank and train.lora_rank both set train.adapter.rank"):
        config.apply(config.JobConfig(), {"train": {"adapter": {"rank": 4}, "lora_rank": 8}})
    assert all(
        own in {path for path, _, _ in leaves(config.SECTIONS[section])} for (section, _), own in config.ALIASES.items()
    )
    assert "train.network_dim -> train.adapter.rank" in config.help_text()


def test_every_config_field_declares_its_identity():
    """The cache key and the run identity are read from each field's own declaration (rayflux.config.identity), so a
    field that declares nothing would silently be left out of both: every field of every section must declare one."""
    from rayflux.config import identity

    for section, cls in config.SECTIONS.items():
        for path, f, _ in leaves(cls):
            assert identity.kind(f) in identity.KINDS, f"{section}.{path} declares no identity (field metadata)"
    # The declarations are what the identities are made of: a caption setting changes the run, not the cache key's
    # dataset identity; a bucket knob changes both; a resource neither.
    from rayflux import datasets
    from rayflux.job import run_identity

    base = config.load(None, [])
    for sets, cached, run in (
        (["data.caption_ext=.caption"], False, True),
        (["data.crop=random"], True, True),
        (["train.workers.num_workers=4"], False, False),
    ):
        cfg = config.load(None, sets)
        ident = [datasets.cache_identity(c.data, "/x") for c in (base, cfg)]
        assert (ident[0] != ident[1], run_identity(base) != run_identity(cfg)) == (cached, run), sets

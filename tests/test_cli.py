"""The command line: ``python -m rayflux --help``, and failures that name where their traceback went."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rayflux import config, models


def test_module_help_lists_the_commands_on_stdout():
    proc = subprocess.run([sys.executable, "-m", "rayflux", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for words in ("train", "cache verify", "data check", "cluster runtime-env"):
        assert f"\n  {words} " in proc.stdout, words
    bad = subprocess.run([sys.executable, "-m", "rayflux", "nonsense"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "commands:" in bad.stderr


def _copy(tiny_model, root: Path, class_name: str) -> Path:
    shutil.copytree(tiny_model, root)
    index = json.loads((root / "model_index.json").read_text())
    index["_class_name"] = class_name
    (root / "model_index.json").write_text(json.dumps(index))
    return root


@pytest.fixture
def foreign(tiny_model, tmp_path):
    """A model directory of a family the job does not train (diffusers' Qwen-Image)."""
    return _copy(tiny_model, tmp_path / "qwen-image", "QwenImagePipeline")


def test_another_model_family_is_refused_in_one_line(foreign):
    with pytest.raises(ValueError) as err:
        models.model_facts(config.ModelConfig(path=str(foreign)))
    message = str(err.value)
    assert "\n" not in message
    assert "QwenImagePipeline" in message
    assert all(name in message for name in ("FluxPipeline", "FluxKontextPipeline", "Flux2KleinPipeline"))


def test_a_model_missing_a_part_of_its_family_names_the_part(tiny_model, tmp_path):
    root = _copy(tiny_model, tmp_path / "flux1", "FluxPipeline")
    shutil.rmtree(root / "text_encoder_2")
    with pytest.raises(ValueError) as err:
        models.model_facts(config.ModelConfig(path=str(root)))
    message = str(err.value)
    assert "\n" not in message and "FluxPipeline" in message and "text_encoder_2/config.json" in message


def test_a_failure_names_the_file_holding_its_traceback(foreign, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "rayflux"),
            "train",
            "--set",
            f"model.path={foreign}",
            "--set",
            f"run.output_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rayflux: failed: ValueError:") and "QwenImagePipeline" in last
    where = Path(last.rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert where.parent == out / "logs"
    assert "Traceback (most recent call last)" in where.read_text() and "check_family" in where.read_text()


def test_neither_config_nor_set_runs_the_world_demo_and_either_one_runs_as_given(capsys):
    from rayflux.cli import overrides, train_parser
    from rayflux.testing.world_base import demo_sets, world_base

    parse = train_parser("train_flux.py").parse_args
    demo = overrides(parse(["--verbose"]))
    assert demo == demo_sets() and f"model.path={world_base()}" in demo
    assert "the demo" in capsys.readouterr().err
    assert overrides(parse(["--set", "train.epochs=1"])) == ["train.epochs=1"]  # the tiny model, as before
    assert overrides(parse(["--config", "job.yaml"])) == []

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


@pytest.fixture
def klein_like(tiny_model, tmp_path):
    """A model directory of another family: its own pipeline class and no second text encoder."""
    root = tmp_path / "klein"
    shutil.copytree(tiny_model, root)
    shutil.rmtree(root / "text_encoder_2")
    index = json.loads((root / "model_index.json").read_text())
    index["_class_name"] = "Flux2KleinPipeline"
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_another_model_family_is_refused_in_one_line(klein_like):
    with pytest.raises(ValueError) as err:
        models.model_facts(config.ModelConfig(path=str(klein_like)))
    message = str(err.value)
    assert "\n" not in message
    assert "Flux2KleinPipeline" in message and "FluxPipeline" in message and "text_encoder_2/config.json" in message


def test_a_failure_names_the_file_holding_its_traceback(klein_like, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "rayflux"), "train", "--set", f"model.path={klein_like}",
         "--set", f"run.output_dir={out}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rayflux: failed: ValueError:") and "Flux2KleinPipeline" in last
    where = Path(last.rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert where.parent == out / "logs"
    assert "Traceback (most recent call last)" in where.read_text() and "check_family" in where.read_text()

"""The config package sits below every other module: each of its modules imports alone, and pulls in no other part
of rayflux, so no import cycle can run through it (as one once ran between the config and the datasets)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import rayflux.config

MODULES = sorted(f"rayflux.config.{p.stem}" for p in Path(rayflux.config.__file__).parent.glob("*.py"))
MODULES = [m.removesuffix(".__init__") for m in MODULES]

_LOADED = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m == "rayflux" or m.startswith("rayflux."))))
"""


def _fresh_import(*names: str) -> list[str]:
    """Import ``names`` in order in a new interpreter; the rayflux modules that ended up loaded."""
    proc = subprocess.run([sys.executable, "-c", _LOADED, *names], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_section_has_its_own_module():
    assert {"rayflux.config.data", "rayflux.config.model", "rayflux.config.cache", "rayflux.config.train",
            "rayflux.config.run", "rayflux.config.loader"} <= set(MODULES)  # fmt: skip


@pytest.mark.parametrize("name", MODULES)
def test_a_config_module_imports_alone_and_only_config(name):
    loaded = _fresh_import(name)
    assert name in loaded
    assert [m for m in loaded if m not in ("rayflux", "rayflux.config") and not m.startswith("rayflux.config.")] == []


def test_loading_and_checking_a_config_uses_only_config():
    """Validation too stays inside the package: no check imports another module on the way (lazily or not)."""
    code = (
        "import json, sys; from rayflux import config; "
        "cfg = config.load(None, ['data.datasets=[{images_dir: /a}, {images_dir: /b}]', 'cache.vae_actors=2', "
        "'train.gradient_checkpointing=off']); config.help_text(); config.from_dict(cfg.to_dict()); "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('rayflux.'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [m for m in json.loads(proc.stdout) if not m.startswith("rayflux.config")] == []


@pytest.mark.parametrize(
    "order",
    [
        ("rayflux.datasets", "rayflux.config"),
        ("rayflux.plan", "rayflux.config"),
        ("rayflux.cache.fit", "rayflux.config.loader"),
        ("rayflux.config.checks", "rayflux.datasets", "rayflux.cache.fit", "rayflux.plan"),
    ],
)
def test_modules_that_build_on_the_config_import_in_any_order(order):
    """Each of these once sat on a cycle with the config (its checks imported them inside a function)."""
    loaded = _fresh_import(*order)
    assert set(order) <= set(loaded)


def test_the_cache_stages_driver_imports_no_torch(tiny_model):
    """The driver of a cache build reads model facts and runs Ray Data; only the encoder actors need torch, whose
    import costs the job's start seconds it would wait for on every ``--only cache`` run."""
    code = ("import sys, rayflux.job, rayflux.cache.stage, rayflux.models as m, rayflux.config as c; "
            "m.model_facts(c.ModelConfig(path=sys.argv[1])); "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_model)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

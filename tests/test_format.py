"""The code is the formatter's output (``ruff format``, the project's line length in pyproject.toml): no hand layout
to keep, and no line kept out of it with a skip marker."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["rayflux", "tests", "benchmarks", "jobs"]


def _ruff() -> list[str]:
    """ruff from the test extra (pyproject.toml pins it), as a module of this interpreter or on PATH."""
    try:
        import ruff  # noqa: F401

        return [sys.executable, "-m", "ruff"]
    except ImportError:
        found = shutil.which("ruff")
        if found is None:
            pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
        return [found]


def test_the_code_is_formatted():
    done = subprocess.run([*_ruff(), "format", "--check", *FOLDERS], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_no_format_skips():
    marker = "# fmt: " + "skip"  # split, so that this line is no marker itself
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    marked = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if line.rstrip().endswith(marker)
    ]
    assert marked == []

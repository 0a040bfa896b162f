"""``python -m rayflux data check``: the dataset doctor, run as users run it, on real files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image


ROOT = Path(__file__).resolve().parents[1]


def _png(path, size):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (30, 160, 90)).save(path)


def _check(*args, code=None):
    """Run the doctor in a fresh interpreter; also report whether Ray got imported."""
    code = code or (
        "import sys; from rayflux.__main__ import main; rc = main(sys.argv[1:]); "
        "print('ray imported:', 'ray' in sys.modules); sys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "data", "check", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


@pytest.fixture
def messy(tmp_path, tiny_model):
    good = tmp_path / "good"
    for name, size in (("square.png", (64, 64)), ("wide.png", (96, 64)), ("tall.png", (64, 96))):
        _png(good / name, size)
        (good / name).with_suffix(".txt").write_text(f"a {name[:-4]} picture")
    (good / "orphan.txt").write_text("no image for this caption")
    bad = tmp_path / "bad"
    _png(bad / "ok.png", (64, 64))
    _png(bad / "tiny.png", (32, 32))
    _png(bad / "uncaptioned.png", (64, 64))
    (bad / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    rows = [("ok.png", "fine"), ("tiny.png", "small"), ("corrupt.png", "broken"), ("vanished.png", "gone")]
    (bad / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f, "text": t}) + "\n" for f, t in rows))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        f"""
model: {{path: "{tiny_model}"}}
data:
  resolution: 64
  datasets:
    - {{images_dir: "{good}", repeats: 2}}
    - {{images_dir: "{bad}", caption_strategy: metadata, missing_caption: skip, regularisation: true}}
cache: {{dir: "{good / "cache"}"}}
run: {{output_dir: "{tmp_path / "run"}"}}
"""
    )
    return cfg


def test_doctor_reports_buckets_and_every_problem_without_ray(messy):
    proc = _check(str(messy))
    out = proc.stdout
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "ray imported: False" in out
    assert "dataset good (" in out and ": 3 images, 3 usable" in out
    assert "dataset bad (" in out and ": 4 images, 1 usable" in out
    assert "resolution 64, repeats 2" in out and "repeats 1, regularisation" in out
    # Histogram: the square bucket holds one image of each dataset; the other two buckets one each.
    lines = [line for line in out.splitlines() if line.startswith("  ") and " -> " in line]
    assert len(lines) == 3
    square = next(line for line in lines if line.split()[0] == "64x64")
    assert "4x8x8" in square and square.rstrip().endswith("2 (bad 1, good 1)")
    skipped = out[out.index("skipped images (3):") : out.index("problems (")]
    assert "corrupt.png: not a decodable image" in skipped
    assert "tiny.png: image is 32x32" in skipped and "min_image_size" in skipped
    assert "uncaptioned.png: no caption" in skipped
    problems = out[out.index("problems (3):") :]
    assert "caption file without an image: orphan.txt" in problems
    assert "'vanished.png' matches no file" in problems
    assert "cache.dir" in problems and "lies inside" in problems
    assert "\nnot ok: fix the items above, or accept the skips\n" in out


def test_doctor_passes_a_clean_dataset_through_the_cli(tmp_path, tiny_model):
    for i, size in enumerate([(64, 64), (80, 64)]):
        _png(tmp_path / "imgs" / f"{i}.png", size)
        (tmp_path / "imgs" / f"{i}.txt").write_text(f"picture {i}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayflux",
            "data",
            "check",
            "--set",
            f"data.images_dir={tmp_path / 'imgs'}",
            "--set",
            "data.resolution=64",
            "--set",
            f"model.path={tiny_model}",
            "--set",
            f"run.output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert ": 2 images, 2 usable" in proc.stdout and "ok: nothing to fix" in proc.stdout


def test_doctor_config_errors_exit_2(tmp_path):
    proc = _check("--set", "data.datasets=[{images_dir: /x, crop: sideways}]")
    assert proc.returncode == 2
    assert "data.datasets[0].crop must be one of" in proc.stderr

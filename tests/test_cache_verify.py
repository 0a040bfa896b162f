"""``python -m rayflux cache verify``: a good cache passes with its per-bucket numbers; each kind of damage fails."""

import io
import json
import math
import shutil
import subprocess
import sys

import cache_sets
import numpy as np
import pytest

from rayflux.cache import verify


@pytest.fixture(scope="module")
def built(ray_session, tmp_path_factory, tiny_model):
    return cache_sets.shared_cache(tmp_path_factory, tiny_model)


def _verify(path) -> tuple[int, str]:
    out = io.StringIO()
    return verify.main([str(path)], out=out), out.getvalue()


def test_a_good_generation_passes_and_prints_every_bucket(built):
    code, text = _verify(built.gen_dir)
    assert code == 0, text
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ") and "x" in line}
    for bucket, e in built.manifest["buckets"].items():
        fields = lines[bucket]
        assert int(fields[1]) == e["rows"]
        assert fields[2] == "x".join(str(s) for s in e["latent_shape"])
        assert int(fields[4]) == e["latent_bytes"] == e["rows"] * math.prod(e["latent_shape"]) * 4
        assert int(fields[5]) > int(fields[4])  # written bytes include each row's page headers and small columns
    assert text.rstrip().endswith("OK")


def test_a_cache_root_and_a_key_dir_are_accepted_too(built):
    from pathlib import Path

    for path in (built.cache_root, Path(built.gen_dir).parent):
        code, text = _verify(path)
        assert code == 0 and text.startswith(built.gen_dir), text


def _flip_latent_height(rows):
    rows[0]["latent_h"] += 1


def _nan_latent(rows):
    n = len(rows[0]["latent"]) // 4
    rows[0]["latent"] = np.full(n, np.nan, np.float32).tobytes()


def _swap_rows(rows):
    rows[0], rows[1] = rows[1], rows[0]


def _truncate_file(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "latent shape column": (lambda p: cache_sets.rewrite_rows(p, _flip_latent_height), "latent shape expected"),
    "NaN latent": (lambda p: cache_sets.rewrite_rows(p, _nan_latent), "latent values expected all finite"),
    "rows the index does not expect": (lambda p: cache_sets.rewrite_rows(p, _swap_rows), "holds sample_id"),
    "truncated shard": (_truncate_file, "unreadable Parquet"),
    "missing shard": (lambda p: p.unlink(), "listed in the manifest but missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_shard_fails_and_says_where(built, tmp_path, damage):
    gen = cache_sets.copy_generation(built, tmp_path)
    shard = cache_sets.first_shard(gen)
    corrupt, fragment = DAMAGE[damage]
    # The same rows rewritten by plain pyarrow: the file size changes, but the damage's finding must not appear yet.
    first = cache_sets.rewrite_rows(shard, lambda rows: None)[0]
    assert fragment not in _verify(gen)[1]
    corrupt(shard)
    code, text = _verify(gen)
    assert code == 1
    problems = [line for line in text.splitlines() if "PROBLEM" in line]
    assert any(fragment in p for p in problems), text
    if damage in ("latent shape column", "NaN latent"):
        (line,) = [p for p in problems if fragment in p]
        assert first["bucket"] in line and first["sample_id"] in line and first["source_uri"] in line


def test_manifest_and_report_disagreements_fail(built, tmp_path):
    gen = cache_sets.copy_generation(built, tmp_path)
    manifest = json.loads((gen / "manifest.json").read_text())
    bucket = sorted(manifest["buckets"])[0]
    manifest["buckets"][bucket]["rows"] += 1
    (gen / "manifest.json").write_text(json.dumps(manifest))
    lines = (gen / "skipped.jsonl").read_text().splitlines()
    (gen / "skipped.jsonl").write_text("\n".join(lines[1:]) + "\n")
    code, text = _verify(gen)
    assert code == 1
    assert "per-bucket totals" in text and "skipped.jsonl lists" in text


def test_unlisted_files_fail_and_so_do_uncommitted_generations(built, tmp_path):
    gen = cache_sets.copy_generation(built, tmp_path)
    assert _verify(gen)[0] == 0
    stray = gen / "samples" / "samples-leftover.parquet"
    shutil.copy(cache_sets.first_shard(gen), stray)
    (gen / "text" / ".tmp-123-abcd-text-x.parquet").write_bytes(b"")
    code, text = _verify(gen)
    assert code == 1 and "samples/samples-leftover.parquet: inside a committed generation but not listed" in text
    assert "text/.tmp-123-abcd-text-x.parquet: inside a committed generation" in text
    stray.unlink()
    (gen / "text" / ".tmp-123-abcd-text-x.parquet").unlink()
    (gen / "manifest.json").unlink()
    code, text = _verify(gen)
    assert code == 1 and "uncommitted" in text
    code, text = _verify(tmp_path)
    assert code == 1 and "no committed cache generation" in text


def test_python_m_rayflux_cache_verify_exit_codes(built, tmp_path):
    good = subprocess.run(
        [sys.executable, "-m", "rayflux", "cache", "verify", built.gen_dir], capture_output=True, text=True, timeout=120
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert all(bucket in good.stdout for bucket in built.manifest["buckets"])
    gen = cache_sets.copy_generation(built, tmp_path)
    cache_sets.rewrite_rows(cache_sets.first_shard(gen), _flip_latent_height)
    bad = subprocess.run(
        [sys.executable, "-m", "rayflux", "cache", "verify", str(gen)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1 and "PROBLEM" in bad.stdout

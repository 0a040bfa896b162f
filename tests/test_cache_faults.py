"""Write tasks' real Ray workers killed mid-write or right after their rename: Ray runs each task again, and the
committed generation still holds exactly what its manifest lists (no duplicate shard, no temporary file).

One cache build takes all three kills (a sample shard's worker before its rename and another after it, a text
shard's worker after its rename): each point kills exactly one worker once, and whatever any of them left behind
would still be in the generation when it is checked. One build instead of one per point saves two Ray Data runs."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import cache_sets
import pyarrow.parquet as pq

from rayflux.cache import generations, verify
from rayflux import faults

# A driver of its own that joins the session's Ray with the kill point in its job's runtime_env (every worker of
# that job inherits it), builds the cache, and prints where it went.
_DRIVER = """
import json, sys, ray
from rayflux import config, job
ray.init(address=sys.argv[1], runtime_env={"env_vars": {%r: sys.argv[2]}})
cfg = config.load(None, json.loads(sys.argv[3]))
print(json.dumps({"cache_dir": job.run(cfg, only="cache").cache_dir}))
"""

POINTS = ["samples-renamed", "samples-before-rename", "text-renamed"]


def test_killed_write_tasks_leave_nothing_unlisted(ray_session, tiny_model, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for k in range(10):
        cache_sets.picture(64, 64, k).save(images / f"img{k}.png")
        (images / f"img{k}.txt").write_text(f"caption number {k}")
    markers = tmp_path / "markers"
    markers.mkdir()
    sets = [
        f"model.path={tiny_model}",
        f"data.images_dir={images}",
        f"run.output_dir={tmp_path / 'run'}",
        "data.resolution=64",
        "cache.batch_size=4",
        "cache.rows_per_shard=4",
        "cache.text_batch_size=4",
    ]
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    kill_at = f"{','.join(POINTS)}:{markers}"
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER % faults.ENV, env["RAY_ADDRESS"], kill_at, json.dumps(sets)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # A worker really died at each point (10 samples and 11 captions in shards of 4: 3 sample and 3 text write tasks).
    assert sorted(p.name for p in markers.iterdir()) == sorted(POINTS)
    gen_dir = json.loads(done.stdout.strip().splitlines()[-1])["cache_dir"]
    manifest = generations.load_manifest(gen_dir)
    # Exactly what the manifest lists: the killed attempt's shard or temporary file is gone.
    assert set(generations.files_in(gen_dir)) == generations.listed(manifest)
    assert not [p for p in Path(gen_dir).rglob("*") if p.name.startswith(".tmp-")]
    out = io.StringIO()
    assert verify.main([gen_dir], out=out) == 0, out.getvalue()
    # Plain pyarrow over the directories, as docs/cache-shards.md invites: every sample and caption once.
    samples = pq.ParquetDataset(str(Path(gen_dir) / "samples")).read()
    assert (
        sorted(samples["rel_path"].to_pylist()) == sorted(f"img{k}.png" for k in range(10)) and manifest["cached"] == 10
    )
    text = pq.ParquetDataset(str(Path(gen_dir) / "text")).read()["caption"].to_pylist()
    assert sorted(text) == sorted(["", *(f"caption number {k}" for k in range(10))])

"""Two jobs on one run directory or one cache key, with real cache builds on a real local Ray (issue #29, item 5).

- A second job started while a real job runs on the same ``run.output_dir`` (local disk, and on the loopback S3
  server) refuses at once with one line naming the first, which goes on to commit an intact cache.
- Two builds of one generation (as two jobs with different run directories and one ``cache.dir`` could run, were the
  cache key's lease ever lost) never destroy each other's files: the first commit wins, and its files stay.
- A committed generation that lost a listed file is built again with a reason, not trusted for ever.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cache_sets
import pytest

from rayflux import cli, job, lease, storage
from rayflux.cache import generations, verify

# A real job of its own that joins the session's Ray, builds the cache and prints where it went.
_DRIVER = """
import json, sys, ray
from rayflux import config, job
ray.init(address=sys.argv[1])
cfg = config.load(None, json.loads(sys.argv[2]))
print(json.dumps({"cache_dir": job.run(cfg, only="cache").cache_dir}))
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    for k in range(4):
        cache_sets.picture(64, 64, k).save(root / f"img{k}.png")
        (root / f"img{k}.txt").write_text(f"caption number {k}")
    return root


def _sets(tiny_model, images, out: str) -> list[str]:
    return [
        f"model.path={tiny_model}",
        f"data.images_dir={images}",
        f"run.output_dir={out}/run",
        f"cache.dir={out}/cache",
        "data.resolution=64",
        "cache.batch_size=4",
        "run.lease_seconds=5",
    ]


def _verified(gen_dir: str) -> dict:
    """The committed manifest of ``gen_dir``, after checking that it holds exactly its files and passes verify."""
    manifest = generations.load_manifest(gen_dir)
    assert set(generations.files_in(gen_dir)) == generations.listed(manifest)
    out = io.StringIO()
    assert verify.main([gen_dir], out=out) == 0, out.getvalue()
    return manifest


@pytest.fixture(scope="module")
def first_job(ray_session, tiny_model, images, tmp_path_factory):
    """A real job building the cache in a process of its own, and a second job with the same command started while
    it runs (in this process, through the command line): what each did."""
    out = str(tmp_path_factory.mktemp("first"))
    sets = _sets(tiny_model, images, out)
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    first = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, env["RAY_ADDRESS"], json.dumps(sets)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    held = str(Path(out, "run", lease.FILE))
    try:
        while not os.path.exists(held):
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.05)
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()) as err:
            code = cli.main_train([f"--set={s}" for s in sets])
        second = {"code": code, "stderr": err.getvalue(), "seconds": time.perf_counter() - t0}
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr[-3000:]
    gen_dir = json.loads(stdout.strip().splitlines()[-1])["cache_dir"]
    return {"pid": first.pid, "held": held, "second": second, "gen_dir": gen_dir, "sets": sets}


def test_second_job_on_a_run_dir_refuses_at_start(first_job):
    second = first_job["second"]
    refused = second["stderr"].strip().splitlines()
    assert second["code"] == 1 and second["seconds"] < 10  # at start: no Ray work, no cache build
    # One line: who holds the run directory, since when, and how to take over once that job is gone.
    assert len(refused) == 1 and refused[0].startswith("rayflux: refused: run.output_dir "), refused
    assert f"pid {first_job['pid']}" in refused[0] and "since" in refused[0]
    assert "run again after" in refused[0] and f"delete {first_job['held']}" in refused[0]
    # The first job was not disturbed: its commit is intact, and it let go of the lease when it ended.
    _verified(first_job["gen_dir"])
    assert not os.path.exists(first_job["held"])


def test_second_job_on_an_s3_run_dir_refuses_at_start(s3_bucket, tiny_model, images, capsys):
    sets = _sets(tiny_model, images, s3_bucket)
    with lease.Lease(f"{s3_bucket}/run", "run.output_dir", 5.0):  # this process plays the running job
        assert cli.main_train([f"--set={s}" for s in sets]) == 1
    refused = capsys.readouterr().err.strip().splitlines()
    assert len(refused) == 1 and f"pid {os.getpid()}" in refused[0], refused
    assert f"delete {s3_bucket}/run/lease.json" in refused[0]


@pytest.mark.parametrize("store", ["local", "s3"])
def test_losing_commit_of_a_generation_keeps_the_winners_files(first_job, store, tmp_path, request):
    """A second build of a committed generation (two jobs with different run directories and one ``cache.dir``,
    had the cache key's lease been lost): its files sit beside the winner's until its commit, which loses."""
    import pyarrow.fs as pafs

    src = Path(first_job["gen_dir"])
    root = str(tmp_path) if store == "local" else request.getfixturevalue("s3_bucket")
    gen_dir = storage.join(root, src.parent.name, src.name)
    fs, inner = storage.resolve(gen_dir)
    fs.create_dir(inner, recursive=True)
    pafs.copy_files(str(src), inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    winner = generations.load_manifest(gen_dir)
    old, new = winner["encode_id"], "0123456789abcdef"
    # The losing build wrote its own shards, index and staged inputs, named by its build id, as the winner did.
    for rel in generations.listed(winner) - {generations.MANIFEST, generations.SKIPPED}:
        data = storage.read_bytes(storage.join(gen_dir, rel))
        storage.write_bytes_atomic(storage.join(gen_dir, rel.replace(old, new)), data)
    storage.write_bytes_atomic(storage.join(gen_dir, "staging", new, "images.arrows"), b"staged")
    loser = json.loads(json.dumps(winner).replace(old, new))
    committed = generations.commit(gen_dir, loser, loser["skipped_inputs"], new)
    assert committed["encode_id"] == old == generations.load_manifest(gen_dir)["encode_id"]
    assert set(generations.files_in(gen_dir)) == generations.listed(winner)


def test_committed_generation_missing_a_file_is_built_again(first_job, tiny_model, images, tmp_path):
    from rayflux import config

    src = Path(first_job["gen_dir"])
    shutil.copytree(src.parent, tmp_path / "cache" / src.parent.name)
    cfg = config.load(None, _sets(tiny_model, images, str(tmp_path)))
    first = generations.load_manifest(str(src))
    lost = tmp_path / "cache" / src.parent.name / src.name / first["text_files"][0]["path"]
    lost.unlink()  # a committed generation loses a listed shard (deleted by hand, a lifecycle rule)
    summary = job.run(cfg, only="cache")
    assert summary.cache_dir == str(lost.parents[1])
    ledger = json.loads(Path(summary.ledger).read_text())["stages"]
    discard = next(s for s in ledger if s["name"] == "discard:g0")
    assert "listed files are missing" in discard["reason"] and lost.name in discard["reason"]
    assert _verified(summary.cache_dir)["encode_id"] != first["encode_id"]

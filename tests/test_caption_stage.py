"""The caption stage (issue 47) end to end on the tiny captioner and the tiny FLUX: VLM captions are made once,
kept in the cache directory by content hash and captioner, reused by a rerun, made again for another prompt, and
read by the cache stage as a sidecar would be; ``missing_caption=vlm`` captions only the images without one.

One job builds the cache (a ``caption_strategy=vlm`` dataset beside a ``missing_caption=vlm`` one); the reruns run
the caption stage alone, which is all they exercise."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cache_sets
import pytest

from rayflux import config, faults, job
from rayflux.caption import export, stage, table, worker
from rayflux.discovery.in_process import discover
from rayflux.testing.tiny_vlm import ensure_tiny_vlm


def _images(root: Path, seeds: range, sidecars: int = 0, broken: bool = False) -> Path:
    root.mkdir()
    for i, k in enumerate(seeds):
        cache_sets.picture(96, 64, k).save(root / f"img{i}.png")
        if i < sidecars:
            (root / f"img{i}.txt").write_text(f"own caption {i}")
    if broken:
        (root / "broken.png").write_bytes(b"not an image")
    return root


def _committed(gdir: str) -> dict[str, str]:
    """rel_path -> caption (or skip reason) of a committed captions table."""
    return {r["rel_path"]: r["caption"] or r["skip_reason"] for r in table.read_table(gdir).to_pylist()}


def _cached_captions(summary) -> dict[str, str]:
    from rayflux.cache import generations

    manifest = generations.load_manifest(summary.cache_dir)
    return {r["rel_path"]: r["caption"] for r in cache_sets.generation_rows(manifest)}


@pytest.fixture(scope="module")
def runs(ray_session, tiny_model, tmp_path_factory):
    vlm = ensure_tiny_vlm()
    base = tmp_path_factory.mktemp("captions")
    every = _images(base / "every", range(4), broken=True)
    half = _images(base / "half", range(10, 14), sidecars=2)
    sets = (
        "data.resolution=64",
        (
            f"data.datasets=[{{name: every, images_dir: {every}, caption_strategy: vlm}}, "
            f"{{name: half, images_dir: {half}, missing_caption: vlm}}]"
        ),
        f"caption.model={vlm}",
        "caption.max_new_tokens=6",
        "caption.batch_size=3",
    )
    dirs = (f"model.path={tiny_model}", f"run.output_dir={base / 'run'}", f"cache.dir={base / 'cache'}")
    cfg = config.load(None, [*dirs, *sets, "caption.prefix=sks"])
    out = {"cfg": cfg, "base": base, "every": every}
    out["job"] = job.run(cfg, only="cache")
    out["first"] = out["job"].captions.rsplit("(", 1)[1].rstrip(")")
    st = (every / "img0.png").stat()  # touched: read and hashed again, its caption known by its content
    os.utime(every / "img0.png", ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    cache_sets.picture(96, 64, 7).save(every / "img4.png")  # new: the one image the rerun captions
    out["again"] = stage.run(cfg, str(base / "cache"), False)
    cfg.caption.prompt = "Name the colours."
    out["prompt"] = stage.run(cfg, str(base / "cache"), False)
    return out


def test_each_image_without_a_caption_is_captioned_and_a_bad_one_is_a_recorded_skip(runs):
    assert runs["job"].captions.startswith("captioned 6, reused 2, 1 unreadable")
    assert any(line.startswith("captions:   captioned 6, reused 2") for line in runs["job"].lines())
    stages = json.loads(Path(runs["job"].ledger).read_text())["stages"]
    entry = next(s for s in stages if s["name"] == "caption")
    assert entry["status"] == "done" and entry["outputs"]["dir"] == runs["first"]
    assert (entry["outputs"]["captioned"], entry["outputs"]["reused"], entry["outputs"]["skipped"]) == (6, 2, 1)
    assert [s["name"] for s in stages].index("caption") < [s["name"] for s in stages].index("cache:g0")
    captions = _committed(runs["first"])
    assert sorted(captions) == [
        "every/broken.png",
        *(f"every/img{i}.png" for i in range(4)),
        "half/img2.png",
        "half/img3.png",
    ]
    assert captions["every/broken.png"].startswith("not a decodable image"), captions["every/broken.png"]
    assert all(captions[p] for p in captions)


def test_the_captioner_pool_is_released_when_the_stage_returns(runs):
    """Nothing is left holding the cluster once the stage returns (the encoders, run after it, find it free)."""
    import ray

    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]


def test_the_cache_stage_trains_on_the_vlm_captions_and_the_sidecars(runs):
    captions, cached = _committed(runs["first"]), _cached_captions(runs["job"])
    assert sorted(cached) == sorted([*(f"every/img{i}.png" for i in range(4)), *(f"half/img{i}.png" for i in range(4))])
    for path in captions:
        if path != "every/broken.png":
            assert cached[path] == f"sks {captions[path]}"
    assert [cached[f"half/img{i}.png"] for i in range(2)] == ["own caption 0", "own caption 1"]


def test_a_rerun_captions_only_the_new_image(runs):
    assert (runs["again"].captioned, runs["again"].reused, runs["again"].skipped) == (1, 8, 1)
    again = _committed(runs["again"].dir)
    assert again.pop("every/img4.png") and again == _committed(runs["first"])


def test_another_prompt_captions_again_under_its_own_captioner(runs):
    assert (runs["prompt"].captioned, runs["prompt"].reused) == (7, 2)
    assert Path(runs["prompt"].dir).parent != Path(runs["first"]).parent
    assert _committed(runs["prompt"].dir).keys() == _committed(runs["again"].dir).keys()


def test_captions_live_in_the_cache_directory_never_beside_the_images(runs):
    gdir = Path(runs["first"])
    assert (gdir / table.MANIFEST).is_file()
    assert gdir.is_relative_to(runs["base"] / "cache" / table.ROOT)
    assert sorted(p.name for p in runs["every"].iterdir()) == ["broken.png", *(f"img{i}.png" for i in range(5))]


def test_export_writes_sidecars_that_discovery_reads_back_and_a_metadata_table(runs, tmp_path):
    source = runs["again"].dir
    captions = _committed(source)
    out = tmp_path / "exported"
    # The cache directory names the newest committed table of any captioner there: the other prompt's.
    assert export.resolve(str(runs["base"] / "cache")) == runs["prompt"].dir
    assert export.main([source, "--out", str(out)]) == 0
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.txt")) == sorted(
        export.sidecar_name(p) for p in captions if p != "every/broken.png"
    )
    assert export.main([source, "--out", str(out)]) == 1  # never overwrites unless told
    for img in runs["every"].glob("img*.png"):
        shutil.copy(img, out / "every" / img.name)
    cfg = config.load(None, [f"data.images_dir={out / 'every'}"])
    found = {s.rel_path: s.caption for s in discover(cfg.data).sources}
    assert found == {p.split("/", 1)[1]: c for p, c in captions.items() if p.startswith("every/img")}
    assert export.main([source, "--out", str(tmp_path / "meta"), "--jsonl"]) == 0
    lines = (tmp_path / "meta" / "metadata.jsonl").read_text().splitlines()
    assert {(r := json.loads(line))["file_name"]: r["text"] for line in lines} == {
        p: c for p, c in captions.items() if p != "every/broken.png"
    }


# A driver of its own that joins the session's Ray with the kill point in its job's runtime_env (every worker of that
# job inherits it) and runs the caption stage, as tests/test_cache_faults.py does for the cache's writers.
_DRIVER = """
import json, sys, ray
from rayflux import config
from rayflux.caption import stage
ray.init(address=sys.argv[1], runtime_env={"env_vars": {%r: sys.argv[2]}})
cfg = config.load(None, json.loads(sys.argv[3]))
out = stage.run(cfg, sys.argv[4], False)
print(json.dumps({"captioned": out.captioned, "reused": out.reused, "dir": out.dir}))
"""


def test_a_killed_captioner_actor_loses_nothing_and_the_captions_are_reproducible(
    runs, ray_session, s3_server, s3_bucket, tmp_path
):
    """The first job's ``every`` images, copied to S3 (read there by the workers), captioned again from scratch in
    another cache directory by a driver whose workers die once each at the kill point: the same captions, none
    lost."""
    import pyarrow.fs as pafs

    from rayflux import storage

    fs, inner = storage.resolve(f"{s3_bucket}/every")
    pafs.copy_files(str(runs["every"]), inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    images = f"{s3_bucket}/every"
    markers = tmp_path / "markers"
    markers.mkdir()
    sets = [
        f"data.images_dir={images}",
        "data.caption_strategy=vlm",
        f"caption.model={ensure_tiny_vlm()}",
        "caption.max_new_tokens=6",
        "caption.batch_size=2",
    ]
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _DRIVER % faults.ENV,
            env["RAY_ADDRESS"],
            f"{worker.KILL_AFTER_PART}:{markers}",
            json.dumps(sets),
            str(tmp_path / "cache"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in markers.iterdir()] == [worker.KILL_AFTER_PART]  # an actor really died
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # The dead actor's batch was written before it died: its retry found its captions known by content (one or two,
    # as the broken file may share that batch), and nothing was generated twice.
    assert out["captioned"] + out["reused"] == 5 and out["reused"] >= 1
    first = {p.split("/", 1)[1]: c for p, c in _committed(runs["again"].dir).items() if p.startswith("every/")}
    assert _committed(out["dir"]) == first
    images_read = {p.rsplit("/", 1)[1] for m, p in s3_server.requests() if m == "GET" and "/every/" in p}
    assert images_read == set(first)  # each image read from S3 (by the workers: the driver only lists)

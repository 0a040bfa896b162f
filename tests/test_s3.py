"""Object storage end to end, against a real S3-compatible server on loopback (tests/s3server.py).

One job reads two datasets from a bucket (different resolutions, a metadata table, repeats, a regularisation set
with a corrupt image), writes its cache, checkpoints, LoRA and ledger to the bucket, and a rerun of the same command
with one more epoch reuses the committed cache and resumes training from the checkpoint in the bucket.
"""

import json

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from rayflux import config, job, storage
from rayflux.cache import generations
from rayflux.testing.images import write_images

REG_SIZES = [(512, 512), (640, 384), (384, 640)]


def _upload(local_dir, uri: str) -> None:
    fs, inner = storage.resolve(uri)
    pafs.copy_files(str(local_dir), inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def test_s3_filesystem_comes_from_the_environment(s3_server, s3_bucket):
    fs, inner = storage.resolve(f"{s3_bucket}/a/b.txt")
    assert isinstance(fs, pafs.S3FileSystem) and inner == f"{s3_bucket[5:]}/a/b.txt"
    storage.write_bytes_atomic(f"{s3_bucket}/a/b.txt", b"hello")
    assert storage.read_bytes(f"{s3_bucket}/a/b.txt") == b"hello"
    path, ray_fs = storage.for_ray_train(f"{s3_bucket}/run/checkpoints")
    assert path == f"{s3_bucket[5:]}/run/checkpoints" and ray_fs is fs
    assert storage.for_ray_train("/local/run") == ("/local/run", None)


@pytest.fixture(scope="module")
def s3_job(ray_session, s3_server, tiny_model, demo_images, tmp_path_factory):

    bucket = f"s3://rayflux-e2e-{np.random.default_rng().integers(1 << 30):x}"
    fs, _ = storage.resolve(bucket)
    fs.create_dir(bucket[5:])
    _upload(demo_images, f"{bucket}/photos")
    reg = tmp_path_factory.mktemp("reg")
    names = [p.name for p in write_images(reg, sizes=REG_SIZES, seed=7)]
    for p in reg.glob("*.txt"):
        p.unlink()  # captions come from the metadata table
    (reg / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (reg / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": n, "text": f"person photo {i}"}) + "\n" for i, n in enumerate(names))
        + json.dumps({"file_name": "broken.png", "text": "broken"})
        + "\n"
    )
    _upload(reg, f"{bucket}/reg")
    yaml_file = tmp_path_factory.mktemp("cfg") / "job.yaml"
    yaml_file.write_text(
        f"""
model: {{path: "{tiny_model}"}}
data:
  reg_loss_weight: 0.5
  datasets:
    - {{name: photos, images_dir: "{bucket}/photos", resolution: 64, repeats: 2}}
    - name: reg
      images_dir: "{bucket}/reg"
      resolution: 32
      caption_strategy: metadata
      instance_prompt: sks
      prepend_instance_prompt: true
      regularisation: true
run: {{output_dir: "{bucket}/run"}}
train: {{epochs: 1, num_workers: 1}}
cache: {{batch_size: 8}}
"""
    )
    cfg = config.load(str(yaml_file))
    return bucket, cfg, job.run(cfg)


def test_images_read_from_the_bucket_and_cache_written_to_it(s3_job, demo_images):
    bucket, _, summary = s3_job
    assert summary.cache_dir.startswith(f"{bucket}/run/cache/")
    manifest = generations.load_manifest(summary.cache_dir)
    files = generations.sample_files(manifest)
    assert files and all(f.startswith(f"{bucket}/run/cache/") and storage.exists(f) for f in files)
    fs, _ = storage.resolve(bucket)
    rows = pq.ParquetDataset([storage.resolve(f)[1] for f in files], filesystem=fs).read().to_pylist()
    n_photos = len([p for p in demo_images.iterdir() if p.suffix == ".png"])
    by_dataset = {d: [r for r in rows if r["dataset"] == d] for d in ("photos", "reg")}
    assert len(by_dataset["photos"]) == n_photos and len(by_dataset["reg"]) == len(REG_SIZES)
    assert all(r["rel_path"].startswith(r["dataset"] + "/") for r in rows)
    assert all(r["source_uri"].startswith(f"{bucket}/{r['dataset']}/") for r in rows)
    assert sorted(r["caption"] for r in by_dataset["reg"]) == [f"sks person photo {i}" for i in range(3)]
    # Two resolutions, never one bucket: every bucket holds one latent shape, and the datasets share no bucket.
    shapes = {}
    for r in rows:
        shapes.setdefault(r["bucket"], set()).add((r["latent_c"], r["latent_h"], r["latent_w"]))
    assert all(len(s) == 1 for s in shapes.values())
    assert not {r["bucket"] for r in by_dataset["photos"]} & {r["bucket"] for r in by_dataset["reg"]}
    # The corrupt image is a recorded skip of its dataset, and the accounting holds.
    skipped = [json.loads(x) for x in storage.read_bytes(summary.skipped_report).decode().splitlines()]
    assert [(s["dataset"], s["source_uri"]) for s in skipped] == [("reg", f"{bucket}/reg/broken.png")]
    assert summary.cached + summary.skipped == summary.discovered == n_photos + len(REG_SIZES) + 1
    assert sum(summary.skip_reasons.values()) == 1


def test_repeats_reach_training_and_checkpoints_land_in_the_bucket(s3_job, demo_images):
    bucket, _, summary = s3_job
    n_photos = len([p for p in demo_images.iterdir() if p.suffix == ".png"])
    # batch size 1, one worker: one step per sample occurrence; photos repeat twice, reg images once.
    assert summary.steps == 2 * n_photos + len(REG_SIZES)
    assert summary.checkpoint.startswith(f"{bucket}/run/checkpoints/")
    assert storage.exists(storage.join(summary.checkpoint, "pytorch_lora_weights.safetensors"))
    assert summary.lora_path == f"{bucket}/run/lora/pytorch_lora_weights.safetensors"
    assert storage.exists(summary.lora_path) and summary.ledger == f"{bucket}/run/ledger.json"
    text = "\n".join(summary.lines())
    assert "photos: 8 discovered, 8 cached, 0 skipped (repeats 2)" in text
    assert "reg: 4 discovered, 3 cached, 1 skipped (regularisation, repeats 1)" in text
    assert set(summary.stage_seconds) == {"discover", "cache:g0", "train:seg0"}


def test_rerun_reuses_the_cache_and_resumes_training_from_the_bucket(s3_job, s3_server):
    bucket, cfg, first = s3_job
    committed = generations.load_manifest(first.cache_dir)["committed_at"]
    # Mark the checkpoint the rerun must resume from; a run that started over could not carry the mark.
    position_uri = storage.join(first.checkpoint, "position.json")
    position = json.loads(storage.read_bytes(position_uri))
    position["resumed_at"] = [-7]
    storage.write_bytes_atomic(position_uri, json.dumps(position).encode())

    # The same command asking for one more epoch (a run's length may change between reruns).
    longer = config.from_dict(cfg.to_dict())
    longer.train.epochs = 2
    since = len(s3_server.requests())
    again = job.run(longer)
    # The committed generation's sidecar table answers for every unchanged caption file: none is read again.
    asked = [p for _, p in s3_server.requests()[since:]]
    assert any(p.startswith(f"/{bucket[5:]}/run/cache/") for p in asked)  # training read its shards: the log counts
    assert not [p for p in asked if p.startswith(f"/{bucket[5:]}/photos/") and p.endswith(".txt")]
    assert again.cache_dir == first.cache_dir
    assert generations.load_manifest(again.cache_dir)["committed_at"] == committed
    assert again.steps == 2 * first.steps
    assert json.loads(storage.read_bytes(storage.join(again.checkpoint, "position.json")))["resumed_at"] == [
        -7,
        first.steps,
    ]
    assert [h["step"] for h in again.history] == list(range(1, again.steps + 1))
    assert [h["loss"] for h in again.history[: first.steps]] == first.losses
    assert again.checkpoint.startswith(f"{bucket}/run/checkpoints/") and again.checkpoint != first.checkpoint


def _requests_for(s3_server, since: int, name: str) -> list[str]:
    return [m for m, p in s3_server.requests()[since:] if p.endswith(name)]


def test_ranged_reads_are_one_get_each_through_boto3(s3_server, s3_bucket):
    from rayflux.cache import ranges

    uri = f"{s3_bucket}/shard.bin"
    data = bytes(range(256)) * 40
    storage.write_bytes_atomic(uri, data)
    since = len(s3_server.requests())
    asks = [(1000, 4000), (0, 900), (8000, 500), (9000, 0)]
    assert ranges.read_ranges(uri, len(data), asks) == [data[o : o + n] for o, n in asks]
    assert ranges.read_ranges(uri, len(data), [(90, 10)]) == [data[90:100]]
    # The close ranges share one GET, the far one has its own, the empty one needs none; the index knows the
    # offsets, so no HEAD asks the size.
    assert _requests_for(s3_server, since, "/shard.bin") == ["GET", "GET", "GET"]
    storage.write_bytes_atomic(uri.replace("shard", "gone"), b"x")
    fs, inner = storage.resolve(uri.replace("shard", "gone"))
    fs.delete_file(inner)
    with pytest.raises(FileNotFoundError, match="gone.bin"):
        ranges.read_ranges(uri.replace("shard", "gone"), 1, [(0, 1)])


def test_without_boto3_ranged_reads_open_each_object_once_per_process(s3_server, s3_bucket, monkeypatch):
    from rayflux.cache import ranges

    monkeypatch.setenv("RAYFLUX_S3_READS", "pyarrow")  # what a node without boto3 does
    uri = f"{s3_bucket}/shard-pa.bin"
    storage.write_bytes_atomic(uri, bytes(range(100)))
    since = len(s3_server.requests())
    assert ranges.read_ranges(uri, 100, [(10, 30), (0, 9)]) == [bytes(range(10, 40)), bytes(range(9))]
    assert ranges.read_ranges(uri, 100, [(90, 10)]) == [bytes(range(90, 100))]
    # One HEAD when the object is first opened (pyarrow asks its size), then only GETs of the ranges.
    assert _requests_for(s3_server, since, "/shard-pa.bin") == ["HEAD", "GET", "GET"]


@pytest.mark.parametrize("reads, expected", [("boto3", ["GET"]), ("pyarrow", ["HEAD", "GET"])])
def test_a_whole_object_read_costs_one_get(s3_server, s3_bucket, monkeypatch, reads, expected):
    from rayflux.discovery import captions

    monkeypatch.setenv("RAYFLUX_S3_READS", reads)
    uri = f"{s3_bucket}/whole-{reads}.txt"
    storage.write_bytes_atomic(uri, "\ufeffa red fox\n\n  on snow \n".encode())
    since = len(s3_server.requests())
    assert storage.read_bytes(uri) == "\ufeffa red fox\n\n  on snow \n".encode()
    assert _requests_for(s3_server, since, f"/whole-{reads}.txt") == expected
    fs, inner = storage.resolve(uri)
    assert captions.read_sidecar(fs, inner) == ["a red fox", "on snow"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(f"{s3_bucket}/never-written-{reads}.txt")


def test_doctor_checks_a_dataset_in_a_bucket(s3_bucket, tiny_model, tmp_path):
    from rayflux import doctor

    write_images(tmp_path / "imgs", sizes=[(512, 512), (640, 384)])
    (tmp_path / "imgs" / "empty.png").write_bytes(b"")
    _upload(tmp_path / "imgs", f"{s3_bucket}/imgs")
    cfg = config.load(
        None,
        [
            f"data.images_dir={s3_bucket}/imgs",
            "data.resolution=64",
            f"model.path={tiny_model}",
            f"run.output_dir={s3_bucket}/imgs/run",
        ],
    )
    report = doctor.examine(cfg)
    assert report.datasets[0]["discovered"] == 3 and report.datasets[0]["usable"] == 2
    assert [s["source_uri"] for s in report.skipped] == [f"{s3_bucket}/imgs/empty.png"]
    assert sum(sum(b["per_dataset"].values()) for b in report.buckets.values()) == 2
    # A run (and so cache) folder inside the image prefix is caught for URIs too.
    assert any(f"{s3_bucket}/imgs/run" in p and "lies inside" in p for p in report.problems)

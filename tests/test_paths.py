"""Path safety: a cache or output dir that equals, lies inside or contains the image dir is refused, naming both."""

import os
import subprocess
import sys
import textwrap

import pyarrow.fs as pafs
import pytest

from rayflux import storage
from rayflux.paths import PathOverlapError, check_disjoint
from rayflux.storage import canonical


def _refusal(images: str, cache: str) -> str:
    with pytest.raises(PathOverlapError) as exc:
        check_disjoint(images, **{"cache.dir": cache})
    msg = str(exc.value)
    assert repr(images) in msg and repr(cache) in msg and "cache.dir" in msg
    return msg


def test_same_inside_and_containing_local_dirs_are_refused(tmp_path):
    images = tmp_path / "data" / "images"
    images.mkdir(parents=True)
    assert "is the same directory as" in _refusal(str(images), str(images))
    assert "lies inside" in _refusal(str(images), str(images / "cache"))
    assert "lies inside" in _refusal(str(images), str(images / "not" / "created" / "yet"))
    assert "contains" in _refusal(str(images), str(tmp_path / "data"))


def test_trailing_slashes_dot_dot_and_relative_paths_are_resolved(tmp_path, monkeypatch):
    images = tmp_path / "images"
    (tmp_path / "other").mkdir()
    images.mkdir()
    assert "same directory" in _refusal(str(images) + "/", str(images) + "//")
    assert "same directory" in _refusal(str(images), str(tmp_path / "other" / ".." / "images"))
    monkeypatch.chdir(tmp_path)
    assert "lies inside" in _refusal(str(images), "images/./cache")
    assert "same directory" in _refusal("images", f"file://{images}")


def test_symlinks_are_resolved(tmp_path):
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    (tmp_path / "link-to-images").symlink_to(images)
    (tmp_path / "link-to-sub").symlink_to(images / "sub")
    assert "same directory" in _refusal(str(images), str(tmp_path / "link-to-images"))
    assert "lies inside" in _refusal(str(images), str(tmp_path / "link-to-sub" / "cache"))
    assert "contains" in _refusal(str(tmp_path / "link-to-sub"), str(images))


def test_disjoint_dirs_pass_even_with_a_shared_name_prefix(tmp_path):
    (tmp_path / "data").mkdir()
    check_disjoint(str(tmp_path / "data"), **{"cache.dir": str(tmp_path / "database"), "run.output_dir": ""})
    check_disjoint(str(tmp_path / "data"), **{"cache.dir": "s3://bucket" + str(tmp_path / "data")})


@pytest.mark.parametrize(
    "images, other, how",
    [
        ("s3://bucket/data", "s3://bucket/data", "same directory"),
        ("s3://bucket/data/", "s3://bucket//data", "same directory"),
        ("s3://bucket/data", "S3://bucket/x/../data/", "same directory"),
        ("s3://bucket/data", "s3://bucket/data/cache", "lies inside"),
        ("s3://bucket/data/images", "s3://bucket/data", "contains"),
        ("s3://bucket/data", "s3://bucket", "contains"),
        ("s3://bucket/data", "s3://bucket/database", ""),
        ("s3://bucket/data", "s3://other-bucket/data", ""),
        ("s3://bucket/data", "gs://bucket/data", ""),
    ],
)
def test_object_store_prefixes(images, other, how):
    if how:
        assert how in _refusal(images, other)
    else:
        check_disjoint(images, **{"cache.dir": other})


def test_canonical_forms():
    assert canonical("s3://b/a/./b/../c/") == "s3://b/a/c"
    assert canonical("s3://b/../../x") == "s3://b/x"
    assert canonical("s3://b/") == canonical("s3://b") == "s3://b"


def test_the_job_refuses_before_any_ray_work(tmp_path, tiny_model):
    """In a fresh interpreter: the job raises before Ray starts and before it writes anything."""
    images = tmp_path / "images"
    images.mkdir()
    out = tmp_path / "run"
    code = textwrap.dedent(
        f"""
        import ray
        from rayflux import config, job, paths
        cfg = config.load(None, ["model.path={tiny_model}", "data.images_dir={images}/",
                                 "cache.dir={images}/../images/cache", "run.output_dir={out}"])
        try:
            job.run(cfg)
        except paths.PathOverlapError as exc:
            print("refused; ray initialized:", ray.is_initialized())
            print(exc)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "refused; ray initialized: False" in proc.stdout, proc.stdout + proc.stderr
    assert f"cache.dir '{images}/cache' lies inside data.images_dir '{images}/'" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images"]  # no cache dir, no run dir
    assert list(images.iterdir()) == []


def test_a_listed_dataset_is_named_by_its_own_key(tmp_path, tiny_model):
    """With ``data.datasets``, the refusal names the entry whose folder overlaps, not ``data.images_dir``."""
    from rayflux import config, job

    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    cfg = config.load(
        None,
        [
            f"model.path={tiny_model}",
            f"run.output_dir={tmp_path / 'run'}",
            f"cache.dir={second / 'cache'}",
            f"data.datasets=[{{images_dir: {first}}}, {{images_dir: {second}}}]",
        ],
    )
    with pytest.raises(PathOverlapError, match=r"lies inside data\.datasets\[1\]\.images_dir"):
        job.run(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_io_goes_where_the_canonical_form_says(where, tmp_path, request):
    """Reads and writes resolve ``..``, ``.`` and ``//`` exactly as the overlap checks and cache identities do: an S3
    key is opaque text, so ``data/x/../y`` would otherwise be an object of its own, beside the ``data/y`` that the
    checks compared."""
    base = str(tmp_path) if where == "local" else request.getfixturevalue("s3_bucket")
    odd = f"{base}/data/x/../y/.//f.txt"
    assert canonical(odd) == canonical(f"{base}/data/y/f.txt")
    storage.write_bytes_atomic(odd, b"one")
    storage.upload_atomic(__file__, f"{base}/data/y/../z/copy.py")
    assert storage.read_bytes(f"{base}/data/y/f.txt") == b"one" and storage.exists(f"{base}/data/z/copy.py")
    fs, root = storage.resolve(base)
    files = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    written = sorted(f.path[len(root) + 1 :] for f in files if f.type == pafs.FileType.File)
    assert written == ["data/y/f.txt", "data/z/copy.py"]

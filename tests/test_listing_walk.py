"""The listers that build no object per file give exactly what pyarrow's listing gives.

Discovery's ``size:mtime`` stamps come from the listing and are compared with the previous generation's sidecar
table, so a lister that named, sized or timed a file differently would make a rerun read every caption again. Each
lister is compared with pyarrow's own recursive ``get_file_info`` on the same tree: a real local folder (links,
hidden files, folders sorting between files), and the same tree in a bucket of the loopback S3 server (folder
markers, a folder of more than one LIST page), where it must also send the same LIST requests.
"""

import concurrent.futures
import os

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from rayflux import config, datasets, storage
from rayflux.discovery import listing, walk

# Names chosen so that top-level files sort on both sides of the folders ("a-b" < "a/" < "a0"): the parts are merged
# in order, not sorted again together.
TREE = {
    "a-b.png": b"1",
    "a0.png": b"22",
    "a/one.png": b"333",
    "a/one.txt": b"a caption\n",
    "a/Two.PNG": b"4444",
    "a/two.txt": b"another caption\n",
    "a/deep/er/x.jpg": b"55555",
    "a/.hidden.png": b"6",
    ".dot/inside.png": b"77",
    "b/orphan.txt": b"no image\n",
    "b/c.webp": b"888",
    "top.txt": b"a top caption\n",
    "top.png": b"9",
}


def _write(root, tree=TREE) -> None:
    for rel, data in tree.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _pyarrow_files(fs: pafs.FileSystem, root: str) -> pa.Table:
    """What pyarrow's recursive listing says: regular files, sorted by path."""
    infos = [e for e in fs.get_file_info(pafs.FileSelector(root, recursive=True)) if e.type == pafs.FileType.File]
    return pa.table(
        [[e.path for e in infos], [e.size for e in infos], [e.mtime_ns for e in infos]], schema=walk.FILES
    ).sort_by("path")


def test_local_listing_matches_pyarrow(tmp_path):
    root = tmp_path / "images"
    _write(root)
    (root / "real").mkdir()
    (root / "real" / "r.png").write_bytes(b"linked")
    os.symlink(root / "real", root / "a" / "linked-folder")  # followed, as pyarrow follows it
    os.symlink(root / "real" / "r.png", root / "b" / "linked.png")  # stat'ed through the link
    os.symlink(tmp_path / "nowhere.png", root / "b" / "broken.png")  # left out: it cannot be stat'ed
    os.mkfifo(root / "b" / "pipe")  # not a regular file
    os.utime(root / "a" / "one.png", ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    got = walk.files(pafs.LocalFileSystem(), str(root))
    assert got.equals(_pyarrow_files(pafs.LocalFileSystem(), str(root)))
    paths = got["path"].to_pylist()
    assert paths == sorted(paths) and f"{root}/a/linked-folder/r.png" in paths
    assert f"{root}/b/broken.png" not in paths and f"{root}/b/pipe" not in paths
    # Nanoseconds, as pyarrow gives them: the sidecar stamps depend on it.
    one = got.filter(pa.compute.equal(got["path"], f"{root}/a/one.png"))
    assert one["mtime_ns"][0].as_py() == 1_700_000_000_123_456_789


def test_local_listing_of_a_large_folder_comes_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(walk, "_CHUNK", 7)
    root = tmp_path / "many"
    _write(root, {f"f{i:03d}/img{j:03d}.png": b"x" * j for i in range(3) for j in range(20)} | {"t.png": b"t"})
    got = walk.files(pafs.LocalFileSystem(), str(root))
    assert got.num_rows == 61 and got.equals(_pyarrow_files(pafs.LocalFileSystem(), str(root)))


@pytest.fixture
def bucket_tree(s3_server, s3_bucket, tmp_path):
    """TREE in a bucket, with folder markers and one folder of more than 1,000 keys (two LIST pages)."""
    import boto3

    fs, inner = storage.resolve(f"{s3_bucket}/images")
    local = tmp_path / "tree"
    _write(local)
    pafs.copy_files(str(local), inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    client = boto3.client("s3", endpoint_url=s3_server.url)
    name = s3_bucket[5:]
    client.put_object(Bucket=name, Key="images/a/", Body=b"")  # folder markers, as consoles create them
    client.put_object(Bucket=name, Key="images/empty/", Body=b"")

    def put(i: int) -> None:
        client.put_object(Bucket=name, Key=f"images/many/img{i:05d}.png", Body=b"p" * (i % 5))

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(put, range(1010)))
    return fs, inner


def _requests(s3_server, since: int, inner: str) -> list[str]:
    bucket = "/" + inner.split("/", 1)[0]
    return [m for m, p in s3_server.requests()[since:] if p == bucket or p.startswith(bucket + "/")]


def test_s3_listing_matches_pyarrow_with_the_same_list_requests(bucket_tree, s3_server, monkeypatch):
    fs, inner = bucket_tree
    since = len(s3_server.requests())
    got = walk.files(fs, inner)
    mine = _requests(s3_server, since, inner)
    monkeypatch.setenv("RAYFLUX_S3_READS", "pyarrow")  # a node without boto3 lists through pyarrow
    since = len(s3_server.requests())
    theirs_listed = walk.files(fs, inner)
    theirs = _requests(s3_server, since, inner)
    assert got.num_rows == len(TREE) + 1010
    assert got.equals(_pyarrow_files(fs, inner)) and got.equals(theirs_listed)
    # The top level with a delimiter, then each of its 5 folders a page of keys at a time: many/ takes two.
    assert set(mine) == {"LIST"} and len(mine) == len(theirs) == 1 + 5 + 1
    assert not any(p.endswith("/") for p in got["path"].to_pylist())  # folder markers are not files


def test_s3_dataset_listing_is_the_same_as_through_pyarrow(bucket_tree, s3_bucket, monkeypatch):
    """Whole listings through boto3 and through pyarrow agree: stamps, matched caption files, orphans."""
    cfg = config.load(None, [f"data.images_dir={s3_bucket}/images"])
    ds = datasets.datasets_of(cfg.data)[0]
    direct = listing.list_dataset(ds)
    monkeypatch.setenv("RAYFLUX_S3_READS", "pyarrow")
    through_pyarrow = listing.list_dataset(ds)
    assert direct.table.equals(through_pyarrow.table) and direct.problems == through_pyarrow.problems
    one = direct.table.filter(pa.compute.equal(direct.table["rel_path"], "a/one.png")).to_pylist()[0]
    assert one["sidecar"].endswith("/images/a/one.txt") and one["sidecar_stamp"].startswith("10:")
    assert any("b/orphan.txt" in p for p in direct.problems)


@pytest.mark.parametrize("part", [1, 2, 5])
@pytest.mark.parametrize("prefix", [False, True])
def test_a_listing_made_a_few_rows_at_a_time_is_the_whole_listing(tmp_path, monkeypatch, part, prefix):
    """Listed files become rows a bounded part at a time. An image and its caption file that land in different
    parts (cut between them, or sorted apart because their case differs) still find each other, and a caption file
    is an orphan only when no image of any part names it."""
    root = tmp_path / "images"
    _write(root, {**TREE, "c/IMG_1.PNG": b"1", "c/b.png": b"2", "c/img_1.txt": b"upper image\n", "c/b.txt": b"b\n"})
    ds = datasets.datasets_of(config.load(None, [f"data.images_dir={root}"]).data)[0]
    whole = listing.list_dataset(ds, "k", prefix)
    monkeypatch.setattr(listing, "PART", part)
    cut = listing.list_dataset(ds, "k", prefix)
    assert cut.table.equals(whole.table) and cut.problems == whole.problems
    lead = "k/" if prefix else ""
    sidecar = {r["rel_path"]: r["sidecar"][len(str(root)) + 1 :] for r in cut.table.to_pylist()}
    assert sidecar[lead + "a/Two.PNG"] == "a/two.txt" and sidecar[lead + "c/IMG_1.PNG"] == "c/img_1.txt"
    assert sidecar[lead + "a/one.png"] == "a/one.txt" and sidecar[lead + "top.png"] == "top.txt"
    assert sidecar[lead + "a0.png"] == "" and sidecar[lead + "c/b.png"] == "c/b.txt"
    orphans = [p for p in cut.problems if "without an image" in p]
    assert orphans == ["dataset images: caption file without an image: b/orphan.txt"]

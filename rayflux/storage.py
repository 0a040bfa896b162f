"""One way to reach local paths and object stores (``s3://``, ``gs://``...): pyarrow filesystems.

Endpoints, regions and credentials come from the standard environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_ACCESS_KEY_ID``...), never from code.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from rayflux import s3_objects


def is_uri(path: str) -> bool:
    return "://" in path


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it), for the :func:`canonical` form of ``path``.

    Reads and writes thus reach exactly the place that overlap checks and cache identities compared: an object key
    is opaque text, so ``s3://b/data/x/../y`` (or ``data//y``) would otherwise name an object of its own, or fail.
    ``s3://`` honours ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` (MinIO, Ceph, R2...); other schemes go to pyarrow
    (``gs://``, ``hdfs://``, ``abfs://``...), then to fsspec for anything pyarrow does not know.
    """
    path = canonical(path)
    if is_uri(path):
        if path.startswith("s3://"):
            endpoint, region = s3_objects.settings()
            if endpoint:
                return s3_objects.filesystem(endpoint, region), path[len("s3://") :].rstrip("/")
        try:
            fs, inner = pafs.FileSystem.from_uri(path)
        except pa.ArrowInvalid:
            import fsspec

            ffs, inner = fsspec.core.url_to_fs(path)
            fs = pafs.PyFileSystem(pafs.FSSpecHandler(ffs))
        return fs, inner.rstrip("/")
    return pafs.LocalFileSystem(), path


def for_ray_train(path: str) -> tuple[str, pafs.FileSystem | None]:
    """``(storage_path, storage_filesystem)`` for Ray Train's ``RunConfig``.

    Ray resolves a bare URI with ``FileSystem.from_uri``, which knows no custom S3 endpoint and no fsspec scheme, so
    for URIs it gets the filesystem built here, and the path inside it.
    """
    if not is_uri(path):
        return path, None
    fs, inner = resolve(path)
    return inner, fs


def canonical(path: str) -> str:
    """The one comparable form of a local path or URI, for overlap checks and cache identities.

    Local paths (and ``file://`` URIs) are made absolute with ``~``, symlinks, ``..`` and trailing slashes resolved.
    Object-store URIs keep scheme (lower case), bucket and key, with empty, ``.`` and ``..`` segments folded, so
    ``s3://b/data/`` and ``s3://b//data/x/..`` are the same prefix; a ``..`` above the bucket stays at the bucket.
    """
    if path.startswith("file://"):
        path = path[len("file://") :]
    if not is_uri(path):
        return str(Path(path).expanduser().resolve())
    scheme, rest = path.split("://", 1)
    bucket, _, key = rest.partition("/")
    folded = posixpath.normpath("/" + key).lstrip("/")  # normpath folds "a//b", "a/./b" and "a/x/../b"
    return f"{scheme.lower()}://{bucket}" + (f"/{folded}" if folded else "")


def join(base: str, *parts: str) -> str:
    if is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return str(Path(base, *parts))


def read_bytes(path: str) -> bytes:
    return read_object(*resolve(path))


def read_object(fs: pafs.FileSystem, inner: str) -> bytes:
    """A whole file of ``fs``: on S3 one GET (see :mod:`rayflux.s3_objects`), elsewhere an ordinary read."""
    if s3_objects.direct(fs):
        return s3_objects.get(fs, inner)
    with fs.open_input_stream(inner) as f:
        return f.read()


def write_bytes_atomic(path: str, data: bytes, before_rename=None) -> None:
    """Write via a temporary name and a rename, so readers see the old file or the new one, never half of one.

    On object stores a single PUT is already atomic, so the object is written directly. ``before_rename`` is called
    between writing the temporary file and renaming it (a fault test's kill point).
    """
    fs, inner = resolve(path)
    parent = inner.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{parent}/.tmp-{os.getpid()}-{os.urandom(4).hex()}-{inner.rsplit('/', 1)[-1]}"
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, inner)
    else:
        with fs.open_output_stream(inner) as f:
            f.write(data)


def exists(path: str) -> bool:
    fs, inner = resolve(path)
    return fs.get_file_info(inner).type != pafs.FileType.NotFound


def upload_atomic(local_path: str, path: str) -> None:
    """Copy a local file to ``path`` (local or URI) in chunks, atomically like :func:`write_bytes_atomic`."""
    fs, inner = resolve(path)
    parent = inner.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    local = isinstance(fs, pafs.LocalFileSystem)
    target = f"{parent}/.tmp-{os.getpid()}-{os.urandom(4).hex()}-{inner.rsplit('/', 1)[-1]}" if local else inner
    with open(local_path, "rb") as src, fs.open_output_stream(target) as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)
    if local:
        os.replace(target, inner)


def create_exclusive(path: str, data: bytes) -> bool:
    """Write ``path`` only if nothing is there yet, atomically: of two writers exactly one gets True, and readers
    never see half a file. Local (and shared) filesystems: a temporary file hard-linked to the name (``link`` fails
    when the name exists). S3 through boto3: one conditional PUT (``If-None-Match: *``). Other object stores:
    checked, then written, which two writers at the same instant can both pass."""
    from rayflux import s3_objects

    fs, inner = resolve(path)
    parent = inner.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{parent}/.tmp-{os.getpid()}-{os.urandom(4).hex()}-{inner.rsplit('/', 1)[-1]}"
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, inner)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True
    if s3_objects.conditional(fs):
        return s3_objects.put_if(fs, inner, data) is not None
    if fs.get_file_info(inner).type != pafs.FileType.NotFound:
        return False
    with fs.open_output_stream(inner) as f:
        f.write(data)
    return True

"""One way to reach local paths and object stores (``s3://``, ``gs://``...): pyarrow filesystems.

Endpoints, regions and credentials come from the standard environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_ACCESS_KEY_ID``...), never from code.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs


def is_uri(path: str) -> bool:
    return "://" in path


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it). Local paths are made absolute with symlinks and ``..`` resolved."""
    if is_uri(path):
        if path.startswith("s3://") and os.environ.get("AWS_ENDPOINT_URL"):
            bucket_path = path[len("s3://") :].rstrip("/")
            endpoint = os.environ["AWS_ENDPOINT_URL"]
            scheme = "https" if endpoint.startswith("https") else "http"
            fs = pafs.S3FileSystem(
                endpoint_override=endpoint.split("://", 1)[-1],
                scheme=scheme,
                region=os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1")),
                allow_bucket_creation=True,
            )
            return fs, bucket_path
        fs, inner = pafs.FileSystem.from_uri(path)
        return fs, inner.rstrip("/")
    return pafs.LocalFileSystem(), str(Path(path).expanduser().resolve())


def canonical(path: str) -> str:
    """A comparable form of a path or URI: absolute, symlinks resolved, no trailing slash."""
    if is_uri(path):
        scheme, rest = path.split("://", 1)
        parts = [p for p in rest.split("/") if p not in ("", ".")]
        return f"{scheme.lower()}://" + "/".join(parts)
    return str(Path(path).expanduser().resolve())


def join(base: str, *parts: str) -> str:
    if is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return str(Path(base, *parts))


def read_bytes(path: str) -> bytes:
    fs, inner = resolve(path)
    with fs.open_input_stream(inner) as f:
        return f.read()


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write via a temporary name and a rename, so readers see the old file or the new one, never half of one.

    On object stores a single PUT is already atomic, so the object is written directly.
    """
    fs, inner = resolve(path)
    parent = inner.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{parent}/.tmp-{os.getpid()}-{os.urandom(4).hex()}-{inner.rsplit('/', 1)[-1]}"
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        os.replace(tmp, inner)
    else:
        with fs.open_output_stream(inner) as f:
            f.write(data)


def exists(path: str) -> bool:
    fs, inner = resolve(path)
    return fs.get_file_info(inner).type != pafs.FileType.NotFound

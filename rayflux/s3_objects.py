"""S3 as rayflux reaches it: the endpoint and region from the environment, pyarrow's filesystem for them, and one
request per read: whole objects and byte ranges through boto3, when it is installed; listings a page at a time.
:mod:`rayflux.storage` resolves ``s3://`` paths through this module.

pyarrow's S3 filesystem sends a HEAD for an object's size every time it opens one, and its Python API cannot be
told a size already known. A cache build reads every image and every caption file once, so that HEAD doubles its
requests; training reads byte ranges whose offsets and file sizes the generation index already holds. boto3 (the AWS
SDK: ``cluster.yaml`` installs it on every node, and the ``rayflux[s3]`` extra adds it) fetches an object or a range
with a single GET. Without boto3, or with ``RAYFLUX_S3_READS=pyarrow``, the same reads go through pyarrow and cost
the HEAD. Discovery lists through boto3 too (:func:`list_pages`, see :mod:`rayflux.discovery.walk`): the same LIST requests
as pyarrow, without a ``FileInfo`` object per key. Endpoint, region and credentials are the ones pyarrow uses: the
standard AWS environment and chain.
"""

from __future__ import annotations

import datetime
import functools
import os
import random
import time
from collections.abc import Iterator

import pyarrow.fs as pafs


def settings() -> tuple[str, str]:
    """(endpoint URL, region) from the standard AWS variables; the S3-specific endpoint variable wins."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return endpoint, region


REQUEST_TIMEOUT_S = 60.0
"""Seconds an S3 request may go without an answer before the SDK retries it (the SDK's own default is 3)."""

ATTEMPTS_DEFAULT = 10
"""Attempts per S3 request unless ``RAYFLUX_S3_ATTEMPTS`` says otherwise (see :func:`attempts`)."""


def attempts() -> int:
    """Tries per S3 request, the first included: ``RAYFLUX_S3_ATTEMPTS``, else :data:`ATTEMPTS_DEFAULT`.

    A store under load answers 503 SlowDown and 500s and resets connections; both SDKs retry those (and timeouts)
    with jittered exponential backoff, capped at 20 s a wait, so ten tries ride out about two minutes of trouble and
    then fail the request with the store's own error. The SDKs' default (3) fails a long job on a short burst."""
    value = os.environ.get("RAYFLUX_S3_ATTEMPTS", "")
    try:
        n = int(value) if value else ATTEMPTS_DEFAULT
    except ValueError:
        raise ValueError(f"RAYFLUX_S3_ATTEMPTS={value!r}: expected a whole number of tries, at least 1") from None
    if n < 1:
        raise ValueError(f"RAYFLUX_S3_ATTEMPTS={value!r}: expected a whole number of tries, at least 1")
    return n


def filesystem(endpoint: str, region: str) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem for ``endpoint`` and ``region``, retrying each request :func:`attempts` times."""
    return _filesystem(endpoint, region, attempts())


@functools.lru_cache(maxsize=8)
def _filesystem(endpoint: str, region: str, tries: int) -> pafs.S3FileSystem:
    # pyarrow's S3 client, one per (endpoint, region): a preparation task reads thousands of objects and need not
    # reconnect for each. Credentials are left to the AWS default chain (environment, profile, instance role).
    scheme = "https" if endpoint.startswith("https") else "http"
    # The AWS SDK gives up on a request that sends nothing for 3 s, three times over: a store that is only busy
    # (a self-hosted S3 under load, a listing of thousands of keys) would fail the stage. boto3's reads wait 60 s;
    # pyarrow's requests wait as long.
    return pafs.S3FileSystem(
        endpoint_override=endpoint.split("://", 1)[-1],
        scheme=scheme,
        region=region,
        allow_bucket_creation=True,
        request_timeout=REQUEST_TIMEOUT_S,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=tries),
    )


@functools.cache
def _have_boto3() -> bool:
    try:
        import boto3  # noqa: F401
    except ImportError:
        return False
    return True


def direct(fs: pafs.FileSystem) -> bool:
    """Do reads from ``fs`` go to S3 through boto3 (one GET each)?"""
    return (
        isinstance(fs, pafs.S3FileSystem) and os.environ.get("RAYFLUX_S3_READS", "boto3") != "pyarrow" and _have_boto3()
    )


def _client(endpoint: str, region: str):
    return _boto3_client(endpoint, region, attempts())


@functools.lru_cache(maxsize=8)
def _boto3_client(endpoint: str, region: str, tries: int):
    # One client per process and endpoint: boto3 clients are thread-safe and pool their connections, so the read
    # threads of a task share its connections, as they share pyarrow's filesystem.
    import boto3
    from botocore.config import Config

    # "standard" mode: 503 SlowDown, 500s, throttling, resets and timeouts retried with jittered backoff.
    config = Config(max_pool_connections=32, retries={"mode": "standard", "total_max_attempts": tries})
    return boto3.session.Session().client("s3", endpoint_url=endpoint or None, region_name=region, config=config)


def get(fs: pafs.S3FileSystem, inner: str, start: int | None = None, length: int = 0) -> bytes:
    """The object ``inner`` (``bucket/key``) of ``fs``, or ``length`` bytes of it from ``start``, in one GET.

    A missing object raises FileNotFoundError, as pyarrow does. Only for filesystems where :func:`direct` holds.
    """
    from botocore.exceptions import ClientError

    bucket, _, key = inner.partition("/")
    args = {"Bucket": bucket, "Key": key}
    if start is not None:
        if length <= 0:
            return b""
        args["Range"] = f"bytes={start}-{start + length - 1}"
    try:
        return _get_body(_client(settings()[0], fs.region), args, f"s3://{inner}")
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "NoSuchBucket", "404"):
            raise FileNotFoundError(f"s3://{inner}: no such object") from None
        raise


def _get_body(client, args: dict, uri: str) -> bytes:
    """One GET's body (see :func:`_get_reply`)."""
    return _get_reply(client, args, uri)[0]


def _get_reply(client, args: dict, uri: str) -> tuple[bytes, dict]:
    """One GET's body and reply, the GET sent again when the connection breaks while the body streams in.

    botocore retries a request (:func:`attempts` tries) until the response's headers arrive; a body cut off after
    them (a reset, a read timeout) surfaces from ``read()``, outside its retries, so that part is retried here, with
    the SDK's own backoff (random up to 2^n s, at most 20 s), as many times. (pyarrow's reads need no such loop: its
    SDK reads the body inside its retry loop, and retries a body cut off by a reset or a close, curl's errors 56 and
    18, as NETWORK_CONNECTION errors, up to the same number of tries; tests/test_s3_faults.py checks both.)"""
    from botocore.exceptions import HTTPClientError, IncompleteReadError

    tries = attempts()
    for n in range(tries):
        reply = client.get_object(**args)
        body = reply["Body"]  # botocore's StreamingBody: ``with body as x`` would give urllib3's raw stream in x,
        try:  # whose errors are not botocore's and whose length is not checked
            with body:
                return body.read(), reply
        except (HTTPClientError, IncompleteReadError) as exc:
            if n + 1 == tries:
                raise OSError(f"{uri}: the object's body broke off {tries} times; last: {exc}") from exc
            time.sleep(min(20.0, random.random() * 2**n))
    raise AssertionError("unreachable")


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_MICROSECOND = datetime.timedelta(microseconds=1)


def list_pages(fs: pafs.S3FileSystem, inner: str, below: bool) -> Iterator[tuple[list, list, list, list]]:
    """``ListObjectsV2`` under the folder ``inner`` (``bucket`` or ``bucket/key``), one response page (up to 1,000
    keys, one request) at a time, as ``(paths, sizes, mtimes_ns, folders)``: the page's objects as pyarrow names
    them (``bucket/key``) with their sizes and modification times in nanoseconds, and its subfolders (``bucket/key``,
    no trailing slash). ``below``: every object at any depth (no delimiter: ``folders`` stay empty); otherwise the
    folder's own objects and its subfolders. Keys ending in ``/`` are folder markers, not files, as for pyarrow.
    Only for filesystems where :func:`direct` holds."""
    bucket, _, key = inner.partition("/")
    prefix = key.strip("/") + "/" if key.strip("/") else ""
    args = {"Bucket": bucket, "Prefix": prefix} if below else {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
    pages = _client(settings()[0], fs.region).get_paginator("list_objects_v2").paginate(**args)
    for page in pages:
        objects = [o for o in page.get("Contents", ()) if not o["Key"].endswith("/")]
        # Integer arithmetic: a float timestamp would lose the nanoseconds that pyarrow's stamps carry.
        yield (
            [f"{bucket}/{o['Key']}" for o in objects],
            [o["Size"] for o in objects],
            [(o["LastModified"] - _EPOCH) // _MICROSECOND * 1000 for o in objects],
            [f"{bucket}/{p['Prefix'].rstrip('/')}" for p in page.get("CommonPrefixes", ())],
        )


def conditional(fs: pafs.FileSystem) -> bool:
    """Can ``fs`` take conditional writes (:func:`put_if`, :func:`delete_if`)? S3 with boto3 installed, whatever
    ``RAYFLUX_S3_READS`` says (pyarrow's API has no conditional PUT)."""
    return isinstance(fs, pafs.S3FileSystem) and _have_boto3()


def _conditional_failed(exc) -> bool:
    """A conditional request that lost: 412 Precondition Failed, or AWS's 409 when a concurrent conditional write to
    the same key is in flight."""
    code = exc.response.get("Error", {}).get("Code", "")
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def get_tagged(fs: pafs.S3FileSystem, inner: str) -> tuple[bytes, str] | None:
    """The object ``inner`` and its ETag in one GET, or None when there is none."""
    from botocore.exceptions import ClientError

    bucket, _, key = inner.partition("/")
    try:
        data, reply = _get_reply(_client(settings()[0], fs.region), {"Bucket": bucket, "Key": key}, f"s3://{inner}")
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise
    return data, reply["ETag"]


def _retried(exc) -> bool:
    """Did botocore send the request that failed more than once? Then an earlier try may have been done by the
    store and only its answer lost (a connection reset after the request went out), so a conditional request can
    fail against this process's own write."""
    return exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0


def put_if(fs: pafs.S3FileSystem, inner: str, data: bytes, etag: str = "") -> str | None:
    """Write the object ``inner`` only if it does not exist (``etag`` empty: ``If-None-Match: *``) or is still the
    version ``etag`` names (``If-Match``), in one PUT. Returns the new ETag, or None when the condition failed.
    S3 (since 2024) and MinIO evaluate the condition atomically, so of two writers exactly one wins."""
    from botocore.exceptions import ClientError

    bucket, _, key = inner.partition("/")
    condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
    try:
        return _client(settings()[0], fs.region).put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
    except ClientError as exc:
        if _conditional_failed(exc) or (etag and exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404")):
            if _retried(exc):
                # A retry that lost may have lost to this PUT's own first try, done by the store with its answer
                # cut off: the object then holds exactly these bytes (every caller's data is unique: a lease names
                # its token and heartbeat, a manifest its generation and commit time), and the write is ours.
                found = get_tagged(fs, inner)
                if found is not None and found[0] == data:
                    return found[1]
            return None
        raise


def delete_if(fs: pafs.S3FileSystem, inner: str, etag: str) -> bool:
    """Delete the object ``inner`` only while it is the version ``etag`` names; False when it is not."""
    from botocore.exceptions import ClientError

    bucket, _, key = inner.partition("/")
    try:
        _client(settings()[0], fs.region).delete_object(Bucket=bucket, Key=key, IfMatch=etag)
    except ClientError as exc:
        if _conditional_failed(exc) or exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            # Retried after a lost answer, the first try may have deleted it: gone is what was asked.
            return _retried(exc) and get_tagged(fs, inner) is None
        raise
    return True

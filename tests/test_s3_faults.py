"""A store under load: S3 reads, listings, range reads, uploads and conditional writes through a fault-injecting
proxy (tests/fault_proxy.py) in front of the loopback S3 server. Every request path retries 503 SlowDown and
connection resets with the SDK's backoff and returns the right bytes; a store that never recovers fails after
``RAYFLUX_S3_ATTEMPTS`` tries, with the store's own error; a conditional write whose reply was lost is not taken for
another writer's. The whole job through the proxy: tests/test_s3_fault_job.py.
"""

import pytest

from rayflux import s3_objects, storage
from rayflux.discovery import walk


@pytest.fixture
def data(s3_bucket):
    """Objects written straight to the server (no faults), then the endpoint pointed at the proxy."""
    payload = {f"{s3_bucket}/ds/img-{i:02d}.bin": bytes([i]) * (2000 + i) for i in range(6)}
    for uri, blob in payload.items():
        storage.write_bytes_atomic(uri, blob)
    return payload


def _outcomes(log, method, ranged=None):
    return {o for m, _, q, r, o in log if m == method and (ranged is None or r == ranged) and "list-type" not in q}


@pytest.mark.parametrize("reads", ["boto3", "pyarrow"])
def test_reads_listings_and_ranges_ride_out_503s_and_resets(data, fault_proxy, monkeypatch, reads):
    from rayflux.cache import ranges

    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    monkeypatch.setenv("RAYFLUX_S3_READS", reads)
    fault_proxy.faults(rate=0.3, seed=3, get_resets=1)  # one reset while listing, one while reading
    root = next(iter(data)).rsplit("/", 2)[0]
    fs, inner = storage.resolve(root)
    listed = walk.files(fs, inner)
    assert listed["path"].to_pylist() == sorted(u[len("s3://") :] for u in data)
    # A GET body cut off half-way: pyarrow's SDK sends the GET again itself, rayflux does it for boto3's.
    fault_proxy.faults(get_resets=1)
    for uri, blob in data.items():
        assert storage.read_bytes(uri) == blob
        assert ranges.read_ranges(uri, len(blob), [(5, 100), (1500, 300)]) == [blob[5:105], blob[1500:1800]]
    log = fault_proxy.fault_log()
    lists = {o for m, _, q, _, o in log if "list-type" in q}
    # Each path met faults, and was retried to the right answer.
    assert {"503", "reset", "ok"} <= lists
    assert {"503", "reset", "ok"} <= _outcomes(log, "GET")
    assert {"503", "ok"} <= _outcomes(log, "GET", ranged=True)


@pytest.mark.parametrize("reads", ["boto3", "pyarrow"])
def test_a_store_that_keeps_failing_fails_after_the_set_attempts(data, fault_proxy, monkeypatch, reads):
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    monkeypatch.setenv("RAYFLUX_S3_READS", reads)
    monkeypatch.setenv("RAYFLUX_S3_ATTEMPTS", "3")
    fault_proxy.faults(rate=1.0, seed=0)
    uri = next(iter(data))
    with pytest.raises(Exception, match="SlowDown|HTTP status 503") as err:
        storage.read_bytes(uri)
    assert not isinstance(err.value, FileNotFoundError)
    assert [m for m, p, *_ in fault_proxy.fault_log() if p.endswith(uri.rsplit("/", 1)[1])] in (
        ["GET"] * 3,
        ["HEAD"] * 3,
    )


def test_attempts_setting(monkeypatch):
    monkeypatch.delenv("RAYFLUX_S3_ATTEMPTS", raising=False)
    assert s3_objects.attempts() == s3_objects.ATTEMPTS_DEFAULT == 10
    monkeypatch.setenv("RAYFLUX_S3_ATTEMPTS", "0")
    with pytest.raises(ValueError, match="RAYFLUX_S3_ATTEMPTS"):
        s3_objects.attempts()


@pytest.mark.parametrize("reads", ["boto3", "pyarrow"])
def test_a_body_that_keeps_breaking_off_fails_after_the_set_attempts(data, fault_proxy, monkeypatch, reads):
    """pyarrow's SDK retries a GET whose body is cut off; botocore does not (the body is read after its retries
    returned), so rayflux's one GET (s3_objects._get_reply) does: both stop at the bound with the reset named."""
    from rayflux.cache import ranges

    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    monkeypatch.setenv("RAYFLUX_S3_READS", reads)
    monkeypatch.setenv("RAYFLUX_S3_ATTEMPTS", "3")
    uri, blob = next(iter(data.items()))
    fault_proxy.faults(get_resets=1000)
    with pytest.raises(OSError, match="broke off 3 times|Connection reset|partial file"):
        ranges.read_ranges(uri, len(blob), [(0, 1500)])
    cut = [o for m, p, q, r, o in fault_proxy.fault_log() if m == "GET" and r]
    assert cut == ["reset"] * 3


def test_a_conditional_write_whose_answer_was_lost_is_still_its_own(s3_bucket, fault_proxy, monkeypatch):
    """botocore sends a PUT again when the connection dies before its answer; the store may have done the first
    one, so the retry's condition fails against the same process's own write: that is a success, not another
    writer. Each write here is done by the server, its answer dropped, and retried."""
    from rayflux import lease

    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    uri = f"{s3_bucket}/run/manifest.json"
    fault_proxy.faults(lost_replies=1, put_match="/manifest.json")
    assert storage.create_exclusive(uri, b'{"generation": 0, "committed_at": 1}')
    fault_proxy.faults(lost_replies=1)
    assert not storage.create_exclusive(uri, b'{"generation": 0, "committed_at": 2}')  # another writer's bytes
    assert storage.read_bytes(uri) == b'{"generation": 0, "committed_at": 1}'
    # The lease: created, renewed (If-Match) and released (conditional DELETE), each answer lost once.
    held = lease.Lease(f"{s3_bucket}/run", "run.output_dir", seconds=30)
    fault_proxy.faults(lost_replies=1, put_match="/lease.json")
    held.acquire()
    held._stop.set()  # no heartbeat of its own: the renewal below is the test's
    fs, inner = storage.resolve(held.path)
    data, etag = s3_objects.get_tagged(fs, inner)
    fault_proxy.faults(lost_replies=1)
    assert s3_objects.put_if(fs, inner, data + b" ", etag) not in (None, etag)
    fault_proxy.faults(get_resets=1)  # the lease's read, its body cut off once, is read again
    data, etag = s3_objects.get_tagged(fs, inner)
    assert ("GET", "reset") in [(m, o) for m, *_, o in fault_proxy.fault_log()]
    fault_proxy.faults(lost_replies=1)
    assert s3_objects.delete_if(fs, inner, etag)
    assert not storage.exists(held.path)
    lost = [(m, p.rsplit("/", 1)[1]) for m, p, *_, o in fault_proxy.fault_log() if o == "lost"]
    assert lost == [
        ("PUT", "manifest.json"),
        ("PUT", "manifest.json"),
        ("PUT", "lease.json"),
        ("PUT", "lease.json"),
        ("DELETE", "lease.json"),
    ]


def test_writes_ride_out_503s_and_a_reset_upload(s3_bucket, fault_proxy, monkeypatch):
    """pyarrow's uploads (aws-chunked: chunked transfer encoding with a checksum trailer, behind
    ``Expect: 100-continue``) pass through the proxy, and a 503 or an upload cut off half-way is sent again."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    fault_proxy.faults(rate=0.3, seed=5, put_resets=2)
    blobs = {f"{s3_bucket}/shards/part-{i}.parquet": bytes([i]) * (3000 + 7 * i) for i in range(6)}
    for uri, blob in blobs.items():
        storage.write_bytes_atomic(uri, blob)
    fault_proxy.faults(rate=0.0)
    assert {uri: storage.read_bytes(uri) for uri in blobs} == blobs
    puts = [o for m, p, q, _, o in fault_proxy.fault_log() if m == "PUT" and "/shards/part-" in p]
    assert {"503", "reset", "ok"} <= set(puts)

"""A store under load: S3 reads, listings and range reads through a fault-injecting proxy (tests/fault_proxy.py) in
front of the loopback S3 server. Every request path retries 503 SlowDown and connection resets with the SDK's
backoff and returns the right bytes; a store that never recovers fails after ``RAYFLUX_S3_ATTEMPTS`` tries, with
the store's own error.
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
    assert listed["path"].to_pylist() == sorted(u[len("s3://"):] for u in data)
    # pyarrow's SDK does not retry a GET whose body breaks off ("Failed to flush response stream"): a known gap,
    # so only boto3's reads (images, captions, training's ranges) meet a reset here.
    fault_proxy.faults(get_resets=1 if reads == "boto3" else 0)
    for uri, blob in data.items():
        assert storage.read_bytes(uri) == blob
        assert ranges.read_ranges(uri, len(blob), [(5, 100), (1500, 300)]) == [blob[5:105], blob[1500:1800]]
    log = fault_proxy.fault_log()
    lists = {o for m, _, q, _, o in log if "list-type" in q}
    # Each path met faults, and was retried to the right answer.
    assert {"503", "reset", "ok"} <= lists
    assert {"503", "reset" if reads == "boto3" else "ok", "ok"} <= _outcomes(log, "GET")
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
        ["GET"] * 3, ["HEAD"] * 3
    )  # fmt: skip


def test_attempts_setting(monkeypatch):
    monkeypatch.delenv("RAYFLUX_S3_ATTEMPTS", raising=False)
    assert s3_objects.attempts() == s3_objects.ATTEMPTS_DEFAULT == 10
    monkeypatch.setenv("RAYFLUX_S3_ATTEMPTS", "0")
    with pytest.raises(ValueError, match="RAYFLUX_S3_ATTEMPTS"):
        s3_objects.attempts()

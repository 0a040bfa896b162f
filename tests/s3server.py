"""A real S3-compatible server for the object-storage tests: moto's standalone server, in its own process, on
loopback only.

Loaded as a pytest plugin (``pytest_plugins`` in conftest.py) because of an ordering constraint: Ray workers inherit
the environment of the process that starts Ray, so the endpoint and credentials must be in ``os.environ`` before the
session's Ray starts. ``pytest_configure`` therefore reserves a loopback port and sets the standard AWS variables;
the server itself starts only when a test asks for the ``s3_server`` fixture, and stops at the end of the session.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

HOST = "127.0.0.1"
_PORT = 0
_REQUEST = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (/[^ ?]*)(\?[^ ]*)? HTTP')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def pytest_configure(config):
    global _PORT
    _PORT = _free_port()
    # Test-only credentials for the local server; rayflux reads them through the AWS default chain like real ones.
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{HOST}:{_PORT}",
        AWS_ACCESS_KEY_ID="rayflux-test",
        AWS_SECRET_ACCESS_KEY="rayflux-test",
        AWS_REGION="us-east-1",
    )
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)  # it would take precedence over the test server
    os.environ.pop("AWS_PROFILE", None)


class S3Server:
    """A running moto server; ``url`` is its endpoint."""

    def __init__(self, port: int):
        self.url = f"http://{HOST}:{port}"
        # The server logs every request; a file, not a pipe, so that an unread pipe can never stall it.
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"moto server exited: {self.log.read().decode(errors='replace')[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2).close()
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not answer on {self.url} within 60 s") from None
                time.sleep(0.2)

    def requests(self) -> list[tuple[str, str]]:
        """Every request the server has logged so far, as (method, path); a GET with a list query is ``LIST``.

        Requests made before this call are all in the list: a marker request is made and waited for, since the
        server writes a request's log line just after answering it."""
        from rayflux import storage

        marker = f"/rayflux-log-marker/{os.urandom(6).hex()}"
        storage.resolve(f"s3:/{marker}")[0].get_file_info(marker[1:])
        deadline = time.monotonic() + 30
        while True:
            size = os.fstat(self.log.fileno()).st_size
            text = os.pread(self.log.fileno(), size, 0).decode(errors="replace")  # the server shares the offset
            found = [m for m in (_REQUEST.search(_ANSI.sub("", line)) for line in text.splitlines()) if m]
            if any(m.group(2) == marker for m in found) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out = [("LIST" if "list-type" in (m.group(3) or "") else m.group(1), m.group(2)) for m in found]
        return [r for r in out if not r[1].startswith("/rayflux-log-marker/")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server(_PORT)
    assert os.environ["AWS_ENDPOINT_URL"] == server.url
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket per test (``s3://<name>``), so tests never see each other's objects."""
    import pyarrow.fs as pafs

    from rayflux import storage

    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"{name}-{os.urandom(3).hex()}"
    fs, _ = storage.resolve(f"s3://{name}")
    fs.create_dir(name)
    assert fs.get_file_info(name).type == pafs.FileType.Directory
    return f"s3://{name}"


class FaultProxy:
    """tests/fault_proxy.py in its own process, in front of the S3 server; ``url`` is its endpoint."""

    def __init__(self, upstream: str):
        port = _free_port()
        self.url = f"http://{HOST}:{port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(os.path.dirname(__file__), "fault_proxy.py"),
                str(port),
                upstream.rsplit(":", 1)[1],
            ],
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.fault_log()
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"fault proxy did not answer on {self.url}") from None
                time.sleep(0.1)

    def faults(self, **settings) -> None:
        """Set the faults (see tests/fault_proxy.py): ``rate``, ``seed``, ``get_resets``, ``put_resets``,
        ``lost_replies``, ``delay_s``, ``delay_rate``, ``get_match``, ``put_match``."""
        req = urllib.request.Request(f"{self.url}/__faults__/config", json.dumps(settings).encode(), method="POST")
        urllib.request.urlopen(req, timeout=30).close()

    def fault_log(self) -> list[tuple[str, str, str, bool, str]]:
        """Every request so far: (method, path, query, ranged, outcome: ok, 503, reset, lost or error)."""
        with urllib.request.urlopen(f"{self.url}/__faults__/log", timeout=30) as r:
            return [tuple(e) for e in json.loads(r.read())]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)


@pytest.fixture
def fault_proxy(s3_server):
    proxy = FaultProxy(s3_server.url)
    yield proxy
    proxy.stop()

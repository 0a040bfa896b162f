"""A fault-injecting HTTP proxy in front of the loopback S3 server (tests/s3server.py), in its own process.

It forwards every request to the server and, when told to, answers as a store under load does: ``503 SlowDown``
(with S3's XML error body) for a fraction of requests drawn by a seeded RNG, a connection reset part-way through a
response body (a GET) or a request body (a PUT or POST), a given number of times, the reply to a write dropped after
the server has done it (what a client sees when the connection dies between its request and the answer), and a delay
before answering. Faults are off until set, so the proxy passes everything through untouched: request bodies, chunked
ones (pyarrow's aws-chunked uploads: ``Transfer-Encoding: chunked`` with a checksum trailer) included.

Controlled over HTTP on the proxy's own port (no bucket is named ``__faults__``: underscores are not allowed):
``POST /__faults__/config`` with JSON ``{"rate": 0.05, "seed": 1, "get_resets": 1, "put_resets": 1, "lost_replies": 0,
"delay_s": 0, "delay_rate": 0, "get_match": "", "put_match": ""}`` sets the faults (missing keys are kept; GET resets
hit only paths holding ``get_match``, upload resets and lost replies only paths holding ``put_match``);
``GET /__faults__/log`` returns every request so far as ``[method, path, query, ranged, outcome]`` with outcome
``ok``, ``503``, ``reset``, ``lost`` or ``error``.

Run as ``python tests/fault_proxy.py LISTEN_PORT UPSTREAM_PORT``.
"""

from __future__ import annotations

import http.client
import http.server
import json
import random
import socket
import struct
import sys
import threading
import time

HOST = "127.0.0.1"
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>"
)
# Not forwarded: hop-by-hop headers, and ``Expect: 100-continue``, which this proxy answers itself (the http.server
# handler sends the 100 before reading the body) and which would only make the server send another 100.
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade", "expect"}


class Faults:
    """What to inject, and the log of what was done; shared by the handler threads under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.settings = {
            "rate": 0.0,
            "seed": 0,
            "get_resets": 0,
            "put_resets": 0,
            "lost_replies": 0,
            "delay_s": 0.0,
            "delay_rate": 0.0,
            "get_match": "",
            "put_match": "",
        }
        self.rng = random.Random(0)
        self.log: list[list] = []

    def configure(self, changes: dict) -> None:
        with self.lock:
            self.settings.update(changes)
            if "seed" in changes:
                self.rng = random.Random(changes["seed"])

    def decide(self, method: str, path: str, has_body: bool) -> tuple[str, float]:
        """(``ok``, ``503``, ``reset-get``, ``reset-put`` or ``lost``; seconds to wait first) for the next request."""
        with self.lock:
            s = self.settings
            delay = s["delay_s"] if s["delay_rate"] and self.rng.random() < s["delay_rate"] else 0.0
            if s["rate"] and self.rng.random() < s["rate"]:
                return "503", delay
            if method in ("PUT", "POST") and has_body and s["put_resets"] > 0 and s["put_match"] in path:
                s["put_resets"] -= 1
                return "reset-put", delay
            if method in ("PUT", "POST", "DELETE") and s["lost_replies"] > 0 and s["put_match"] in path:
                s["lost_replies"] -= 1
                return "lost", delay
            if method == "GET" and s["get_resets"] > 0 and s["get_match"] in path:
                return "reset-get", delay  # counted down only once a body long enough to cut has come
            return "ok", delay

    def take_get_reset(self) -> bool:
        with self.lock:
            if self.settings["get_resets"] > 0:
                self.settings["get_resets"] -= 1
                return True
            return False


FAULTS = Faults()
UPSTREAM = 0


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the SDKs use it; also answers ``Expect: 100-continue``

    def log_message(self, *args) -> None:  # the log endpoint records requests; stderr stays quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    # The last chunk: trailer lines, if any, then the empty line that ends the body. (No CRLF is
                    # read first: the empty line is it, and a read past it waits for bytes the client never sends.)
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size + 2)[:size]
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reset(self) -> None:
        """Close the connection with a TCP reset, as a failing load balancer does."""
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _control(self) -> None:
        if self.command == "POST":
            FAULTS.configure(json.loads(self._body() or b"{}"))
            data = b"{}"
        else:
            with FAULTS.lock:
                data = json.dumps(FAULTS.log).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _forward(self, body: bytes) -> http.client.HTTPResponse:
        conn = getattr(self.server.local, "conn", None)
        for attempt in range(2):  # a pooled upstream connection the server closed is reopened once
            if conn is None:
                conn = self.server.local.conn = http.client.HTTPConnection(HOST, UPSTREAM, timeout=120)
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        conn.putheader(k, v)
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    # Sent on chunked, as one chunk: the server reads an aws-chunked upload only that way.
                    conn.putheader("Transfer-Encoding", "chunked")
                    conn.endheaders(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n")
                else:
                    conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body)
                resp = conn.getresponse()
                resp.data = resp.read()
                return resp
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                conn = self.server.local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _handle(self) -> None:
        if self.path.startswith("/__faults__/"):
            return self._control()
        path, _, query = self.path.partition("?")
        entry = [self.command, path, query, "Range" in self.headers, "ok"]
        with FAULTS.lock:
            FAULTS.log.append(entry)
        length = int(self.headers.get("Content-Length") or 0)
        chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
        outcome, delay = FAULTS.decide(self.command, path, length > 1 or chunked)
        if delay:
            time.sleep(delay)
        if outcome == "reset-put":
            # Half the upload arrives (of a chunked one: half its first chunk), then the connection dies.
            self.rfile.read(
                int(self.rfile.readline().split(b";")[0].strip() or b"0", 16) // 2 if chunked else length // 2
            )
            entry[4] = "reset"
            return self._reset()
        body = self._body()
        if outcome == "503":
            entry[4] = "503"
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOW_DOWN)))
            self.end_headers()
            if self.command != "HEAD":  # a HEAD reply has no body: bytes after it would garble the next reply
                self.wfile.write(SLOW_DOWN)
            return
        try:
            resp = self._forward(body)
        except (ConnectionError, http.client.HTTPException):
            entry[4] = "error"
            return self._reset()
        if outcome == "lost":  # the server did the write; its answer never reaches the client
            entry[4] = "lost"
            return self._reset()
        cut = outcome == "reset-get" and resp.status in (200, 206) and len(resp.data) > 1 and FAULTS.take_get_reset()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and k.lower() not in ("content-length", "server", "date"):
                self.send_header(k, v)
        self.send_header(
            "Content-Length", resp.getheader("Content-Length") or "0" if self.command == "HEAD" else str(len(resp.data))
        )
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(resp.data[: len(resp.data) // 2] if cut else resp.data)
        if cut:
            entry[4] = "reset"
            self._reset()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, port: int):
        super().__init__((HOST, port), Handler)
        self.local = threading.local()


def main() -> None:
    global UPSTREAM
    port, UPSTREAM = int(sys.argv[1]), int(sys.argv[2])
    Server(port).serve_forever()


if __name__ == "__main__":
    main()

"""One writer at a time per run directory and per cache key: a lease file that its holder keeps fresh.

A job takes the lease of its ``run.output_dir`` before it writes anything there, and the lease of a cache key around
everything that may write to the key (building, discarding or retiring a generation). The lease is one small JSON
object, ``lease.json`` in the directory it guards, naming its :class:`Holder`. A thread of the driver rewrites it
every quarter of ``run.lease_seconds`` (one request per heartbeat, whatever the dataset's size). A holder that
ran on this machine and is dead (killed, out of memory; :mod:`rayflux.liveness` tells it exactly, pid reuse and
reboots included) loses its lease at once to the next job, so rerunning a crashed command just works; a holder
elsewhere that stopped heartbeating (killed, its machine gone) loses it ``run.lease_seconds`` after its last
heartbeat. A second job that finds a live lease refuses at once (:class:`LeaseHeld`, one line:
who holds it, since when, and how to take over), or, for a cache key, waits until the holder lets go.

Every change of the lease is conditional on the version its writer read, so of two jobs that try at once exactly one
wins:

- local and shared filesystems: read, check and write under an exclusive ``flock`` of ``lease.json.lock`` (the kernel
  drops it when its process dies; NFSv4 and Lustre carry it between machines), the file itself replaced atomically;
- S3 (and MinIO) through boto3: conditional PUTs, ``If-None-Match: *`` to create and ``If-Match: <ETag>`` to renew or
  take over a dead holder's lease, and a conditional DELETE to release;
- other object stores: read, then write, which two jobs at the same instant can both pass (a warning says so).

Expiry compares the holder's heartbeat time with the reader's clock: keep ``run.lease_seconds`` well above the
clock skew between machines that share a run directory.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from rayflux import liveness, s3_objects, storage

log = logging.getLogger("rayflux")

FILE = "lease.json"


class LeaseHeld(RuntimeError):
    """Another live job holds the lease."""


class LeaseLost(RuntimeError):
    """This job's lease expired and another job took it over: this job must stop writing."""


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as ``lease.json`` records it."""

    token: str
    """Unique per acquisition: tells this holder's lease from any later one, its own process's included."""
    job: str
    """The Ray job submission id when the driver was started by ``ray job submit``, else ""."""
    host: str
    """The driver's host name."""
    pid: int
    """The driver's process id on that host."""
    started: float
    """When the lease was taken (Unix seconds)."""
    heartbeat: float
    """The holder's last heartbeat (Unix seconds, by the holder's clock)."""
    seconds: float
    """How long after its last heartbeat the lease expires: the holder's ``run.lease_seconds``."""
    host_id: str = ""
    """The driver's kernel boot and pid namespace (:func:`rayflux.liveness.host_id`); "" in leases written before it
    was recorded, or where ``/proc`` does not say. A job with the same one can see whether ``pid`` still runs."""
    pid_start: int = 0
    """When ``pid`` started, in clock ticks since boot: a reused pid started later is not the holder."""

    @property
    def expires(self) -> float:
        return self.heartbeat + self.seconds

    def gone(self) -> str:
        """Why this holder's process is certainly gone, when it ran on this machine in this boot and pid namespace
        (:func:`rayflux.liveness.gone`); "" when it may still run, or ran elsewhere."""
        return liveness.gone(self.host_id, self.pid, self.pid_start)

    def who(self) -> str:
        where = f"host {self.host}, pid {self.pid}"
        return f"job {self.job} ({where})" if self.job else f"a job ({where})"

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Holder:
        """The holder ``data`` names; a file that is not one (torn by hand, another program's) reads as a holder
        that expired long ago, so it can be taken over."""
        try:
            fields = json.loads(data)
            # Fields with a default may be missing: a lease written by an older rayflux still names a live holder.
            return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields or _required(f)})
        except (ValueError, TypeError, KeyError):
            return cls(token="", job="", host="unknown", pid=0, started=0.0, heartbeat=0.0, seconds=0.0)


def submission_id() -> str:
    """The Ray job submission id of this driver, when ``ray job submit`` started it (Ray passes the job's metadata
    to the entrypoint in ``RAY_JOB_CONFIG_JSON_ENV_VAR``), else ""."""
    try:
        return json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))["metadata"]["job_submission_id"]
    except (ValueError, KeyError, TypeError):
        return ""


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


class _LocalStore:
    """``lease.json`` on a local or shared filesystem; ``version`` is the file's content."""

    def __init__(self, path: str):
        self.path = path
        self.lock = path + ".lock"

    @contextmanager
    def _locked(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def read(self) -> tuple[bytes | None, object]:
        with self._locked():
            data = self._read()
        return data, data

    def put(self, data: bytes, version) -> object | None:
        with self._locked():
            if self._read() != version:
                return None
            storage.write_bytes_atomic(self.path, data)
        return data

    def delete(self, version) -> bool:
        with self._locked():
            if self._read() != version:
                return False
            os.unlink(self.path)
        return True


class _S3Store:
    """``lease.json`` on S3 through boto3; ``version`` is the object's ETag."""

    def __init__(self, fs, inner: str):
        self.fs, self.inner = fs, inner

    def read(self) -> tuple[bytes | None, object]:
        found = s3_objects.get_tagged(self.fs, self.inner)
        return found if found is not None else (None, None)

    def put(self, data: bytes, version) -> object | None:
        return s3_objects.put_if(self.fs, self.inner, data, version or "")

    def delete(self, version) -> bool:
        return s3_objects.delete_if(self.fs, self.inner, version)


class _PlainStore:
    """Any other store: checked, then written (not atomic between two writers); ``version`` is the content."""

    def __init__(self, path: str):
        self.path = path
        log.warning(
            "%s: this store takes no conditional writes; two jobs starting at the same instant could both "
            "take the lease",
            path,
        )

    def read(self) -> tuple[bytes | None, object]:
        data = storage.read_bytes(self.path) if storage.exists(self.path) else None
        return data, data

    def put(self, data: bytes, version) -> object | None:
        if self.read()[1] != version:
            return None
        storage.write_bytes_atomic(self.path, data)
        return data

    def delete(self, version) -> bool:
        if self.read()[1] != version:
            return False
        fs, inner = storage.resolve(self.path)
        fs.delete_file(inner)
        return True


def _store(path: str):
    fs, inner = storage.resolve(path)
    if not storage.is_uri(path):
        return _LocalStore(inner)
    if s3_objects.conditional(fs):
        return _S3Store(fs, inner)
    return _PlainStore(path)


def _vacant(current: Holder | None, now: float) -> str | None:
    """None while ``current`` holds the lease; else why it may be taken: "" when nobody holds it, or what ended the
    holder. A dead process on this machine is known at once; a holder elsewhere only by its missed heartbeats."""
    if current is None:
        return ""
    gone = current.gone()
    if gone:
        return f"{gone} on this machine"
    if current.expires <= now:
        return f"its last heartbeat was at {_utc(current.heartbeat)}"
    return None


class Lease:
    """The lease of one directory (``<dir>/lease.json``), held by this process from :meth:`acquire` to
    :meth:`release`, renewed by a daemon thread in between. A context manager."""

    def __init__(self, directory: str, what: str, seconds: float):
        self.path = storage.join(directory, FILE)
        self.what = what
        """What the lease guards, as messages name it (``run.output_dir /runs/x``)."""
        self.seconds = float(seconds)
        self._store = _store(self.path)
        self._holder: Holder | None = None
        self._version = None
        self._lost = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    def acquire(self, wait: bool = False) -> Lease:
        """Take the lease: create it, or take over one whose holder is gone (it expired, or its process on this
        machine is dead). A live holder's lease raises :class:`LeaseHeld`, or with ``wait`` is waited for (checked
        every quarter of its expiry time)."""
        told = False
        while True:
            data, version = self._store.read()
            current = Holder.from_json(data) if data is not None else None
            now = time.time()
            why = _vacant(current, now)
            if why is not None:
                me = Holder(
                    token=uuid.uuid4().hex,
                    job=submission_id(),
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    started=now,
                    heartbeat=now,
                    seconds=self.seconds,
                    host_id=liveness.host_id(),
                    pid_start=liveness.start_ticks(os.getpid()),
                )
                # Conditional on the version read: of two jobs taking over the same dead holder's lease, one wins.
                new = self._store.put(me.to_json(), version)
                if new is None:
                    continue  # another job changed it since it was read: look again
                if current is not None:
                    log.warning("%s: took over the lease of %s: %s", self.what, current.who(), why)
                self._holder, self._version = me, new
                self._start_heartbeat()
                return self
            if not wait:
                raise LeaseHeld(self.held_message(current, now))
            if not told:
                log.info("%s: waiting for %s to finish (its lease: %s)", self.what, current.who(), self.path)
                told = True
            time.sleep(max(0.2, min(current.seconds, self.seconds) / 4))

    def held_message(self, holder: Holder, now: float) -> str:
        """One line: who holds the lease, since when, and how to take over once that job is gone."""
        return (
            f"{self.what} is in use by {holder.who()} since {_utc(holder.started)} (last heartbeat "
            f"{max(0.0, now - holder.heartbeat):.0f} s ago); if that job is gone, run again after "
            f"{_utc(holder.expires)}, when its lease expires ({holder.seconds:g} s after its last heartbeat, "
            f"run.lease_seconds), or delete {self.path} to take over now"
        )

    def check(self) -> None:
        """Raise :class:`LeaseLost` once another job has taken the lease over."""
        if self._lost:
            raise LeaseLost(self._lost)

    def release(self) -> None:
        """Stop heartbeating and delete the lease, if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._mutex:
            if self._holder is not None and not self._lost:
                try:
                    self._store.delete(self._version)
                except Exception as exc:  # noqa: BLE001 - an unreleased lease only expires later
                    log.warning(
                        "%s: could not release %s (%s); it expires in %g s", self.what, self.path, exc, self.seconds
                    )
            self._holder = None

    def __enter__(self) -> Lease:
        return self if self._holder is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"rayflux-lease-{self.what}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        """Renew the lease every quarter of its expiry time, each renewal conditional on the last one; a failed
        condition means another job took it over (this one stalled past expiry), so heartbeating stops."""
        last_ok = time.time()
        while not self._stop.wait(self.seconds / 4):
            try:
                with self._mutex:
                    me = dataclasses.replace(self._holder, heartbeat=time.time())
                    new = self._store.put(me.to_json(), self._version)
                    if new is not None:
                        self._holder, self._version, last_ok = me, new, me.heartbeat
                        continue
                data, _ = self._store.read()
                other = Holder.from_json(data).who() if data is not None else "nobody (it was deleted)"
                self._lost = f"{self.what}: the lease {self.path} is now held by {other}; this job stopped writing"
                log.error("%s", self._lost)
                return
            except Exception as exc:  # noqa: BLE001 - a store that is briefly unreachable: try again next beat
                log.warning("%s: lease heartbeat failed (%s); retrying", self.what, exc)
                if time.time() - last_ok > self.seconds:
                    self._lost = f"{self.what}: no heartbeat reached {self.path} for {self.seconds:g} s; it expired"
                    log.error("%s", self._lost)
                    return

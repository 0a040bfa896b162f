"""Per-tensor checksums, the error a changed tensor raises, and the record that has the next build re-encode it.

A cache is written once and read for weeks, from disks and buckets that misbehave. A changed float is finite and of
the right length, so the shape and NaN/Inf checks cannot see it, and reads take tensors by byte range without
parsing Parquet pages, so Parquet's own page checksums would not help either. So the writer takes a CRC-32 of every
tensor's bytes as it wrote them into the file (:func:`rayflux.cache.shards.value_ranges`), the generation index keeps
it beside the tensor's offset and length (``crc32``, ``ref_crc32``, ``<key>_crc32``), and every training read and
``cache verify`` compare it. A compressed text tensor's checksum is of its stored (compressed) bytes, compared before
they are decoded (:mod:`rayflux.cache.codec`): damage is reported as damage, never as a decoder's failure, and a
change the decoder would not notice is caught too.

Why zlib's CRC-32: it ships with Python (no new dependency; any plain pyarrow reader can check a tensor with it),
runs at 1-5 GB/s here (a 512 KiB bf16 latent in 0.1-0.4 ms; see BENCHMARKS.md, "Tensor checksums"), releases the GIL
on large buffers, and catches every error burst of up to 32 bits and all but about 2^-32 of other changes: it guards
against damage, not against an adversary. It adds no request (it rides in the index row the reads already fetch)
and no per-image driver step.

A mismatch stops a training run (it never skips the sample) with a :class:`CacheIntegrityError` that names the file,
the sample or caption, the byte range, and what to do: ``cache verify`` finds every damaged tensor and records
their samples and captions in ``<cache key>/<generation>.damaged.json``; the next run of the job then builds a
repair generation (:func:`current`) that re-encodes exactly those and reuses everything else
(:func:`rayflux.cache.reuse.load` leaves the recorded ids out of what it offers).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field

from rayflux import storage
from rayflux.cache import generations

COLUMN = "crc32"
"""Suffix of the index's checksum columns: ``crc32`` (the latent), ``ref_crc32``, ``<text key>_crc32``."""


def checksum(data) -> int:
    """CRC-32 (zlib's) of a bytes-like object: an unsigned 32-bit integer."""
    return zlib.crc32(data)


class CacheIntegrityError(RuntimeError):
    """A cached tensor's bytes no longer have the checksum its writer recorded: the cache was changed on disk."""


def verify_command(gen_dir: str) -> str:
    return f"python -m rayflux cache verify {gen_dir}"


def mismatch(file: str, offset: int, length: int, what: str, got: int, want: int, *, gen_dir: str = "") -> str:
    """One line naming the file, the tensor (``what``: its column and its sample or caption) and its byte range."""
    text = (
        f"{file} bytes {offset}..{offset + length} ({what}): checksum {got:08x}, the index recorded {want:08x} "
        "when it was written"
    )
    if not gen_dir:
        return text
    return (
        f"{text}; the cache changed after it was written. Run `{verify_command(gen_dir)}`: it names every damaged "
        "tensor and records them, and the next run of this job re-encodes exactly those samples and captions, "
        "reusing the rest"
    )


def check(data, want: int, file: str, offset: int, what: str, gen_dir: str = "") -> None:
    """Raise :class:`CacheIntegrityError` unless ``data`` (the tensor read at ``offset`` of ``file``) has checksum
    ``want``."""
    got = checksum(data)
    if got != want:
        raise CacheIntegrityError(mismatch(file, offset, len(data), what, got, want, gen_dir=gen_dir))


_MARK = f"{__name__}.CacheIntegrityError: "


def find(exc: BaseException | None) -> CacheIntegrityError | None:
    """The :class:`CacheIntegrityError` inside an error that Ray wrapped (a read task's inside Ray Data's inside a
    training worker's inside Ray Train's), if any: its causes, contexts and per-worker failures are searched. A
    worker's failure reaches the driver pickled, without its causes, so its text is searched too: the last line
    that Python printed for the read's error."""
    seen: set[int] = set()
    todo, texts = [exc], []
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CacheIntegrityError) and _MARK not in str(e):
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())
        texts.append(str(e))
    lines = [line.split(_MARK, 1)[1] for text in texts for line in text.splitlines() if _MARK in line]
    return CacheIntegrityError(lines[-1].strip()) if lines else None


@dataclass
class Damage:
    """The samples and captions of one generation whose tensors ``cache verify`` found changed."""

    samples: list[str] = field(default_factory=list)
    """Sample ids whose latent or reference latents are damaged."""
    captions: list[str] = field(default_factory=list)
    """Caption ids whose text tensors are damaged."""

    def digest(self) -> str:
        blob = json.dumps([sorted(set(self.samples)), sorted(set(self.captions))]).encode()
        return hashlib.sha256(blob).hexdigest()[:8]


def record_path(gen_dir: str) -> str:
    """``<cache key>/<generation>.damaged.json``: beside the generation, not in it (a committed generation holds
    exactly what its manifest lists), and a file, so listings of generation directories never see it."""
    key, name = gen_dir.rstrip("/").rsplit("/", 1)
    return storage.join(key, f"{name}.damaged.json")


def load(gen_dir: str) -> Damage | None:
    path = record_path(gen_dir)
    if not storage.exists(path):
        return None
    return Damage(**json.loads(storage.read_bytes(path)))


def record(gen_dir: str, damage: Damage) -> str:
    """Add ``damage`` to the generation's record (atomically) and return the record's path."""
    old = load(gen_dir) or Damage()
    merged = Damage(sorted(set(old.samples) | set(damage.samples)), sorted(set(old.captions) | set(damage.captions)))
    path = record_path(gen_dir)
    storage.write_bytes_atomic(path, json.dumps({"samples": merged.samples, "captions": merged.captions}).encode())
    return path


def repair_dir(gen_dir: str, damage: Damage) -> str:
    """Where the build that replaces damaged generation ``gen_dir`` goes: the same generation number and inputs, its
    name extended by the record's digest, so a rerun finds the same repair and a later record another."""
    return f"{gen_dir.rstrip('/')}{damage.digest()}"


def current(gen_dir: str) -> str:
    """``gen_dir``, or the repair of it that a run must read or build instead: followed while a committed
    generation on the way has a damage record (each step: two existence checks)."""
    while storage.exists(storage.join(gen_dir, generations.MANIFEST)):
        damage = load(gen_dir)
        if damage is None:
            break
        gen_dir = repair_dir(gen_dir, damage)
    return gen_dir

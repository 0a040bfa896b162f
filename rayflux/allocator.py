"""The driver's allocators: make short-lived Arrow columns give their memory back to the system once freed.

The driver makes per-image Arrow columns in a few places (the listing, the generation's unique captions, the rows
it hands to Ray, the index rows the write tasks return). Each is short-lived, but under pyarrow's default pool
(jemalloc on Linux) freed extents stay resident for reuse, each size class keeps its own, and glibc keeps the freed
middle of its heap, so what the driver *had* allocated, not what it holds, set its RSS: a job's peak grew with the
dataset for data it no longer had. Within :func:`system_pool` Arrow allocates from the C library's allocator,
and :func:`trim` hands freed pages back at the end of each step.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

import pyarrow as pa


@contextlib.contextmanager
def system_pool() -> Iterator[None]:
    """Arrow allocates from the C library's allocator within, process-wide (every thread of the driver).

    jemalloc keeps freed pages resident, many times the data the driver's short-lived columns held (measured:
    docs/observability.md, "Probes behind the defaults"). Buffers remember the pool they came from, so they may
    outlive the block."""
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(previous)


def trim() -> None:
    """Give memory that the driver has freed but its allocators keep back to the system: a few system calls, so
    call it at the end of a step, not per row."""
    pa.default_memory_pool().release_unused()
    if _malloc_trim() is not None:
        _malloc_trim()(0)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn

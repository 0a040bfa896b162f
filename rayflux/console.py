"""What the driver's terminal shows: rayflux's stage lines, the live bars, warnings that matter and the summary.

Ray's own chatter stays in logs, not on the terminal:

- worker, actor and Ray Train controller output (``Reporting training result N: TrainingReport(...)``, worker-group
  start-up, dataset plans inside training workers) is not forwarded to the driver (``ray.init(log_to_driver=False)``)
  and stays in the Ray session's log folder (the summary's ``logs:`` line);
- Ray Data's start-of-execution plans and hints are not printed; its console shows warnings and errors and one bar per
  pipeline on a terminal, never the periodic ``Total Progress: 0/?`` line it logs when stdout is not a terminal (its
  file log under ``logs/ray-data`` keeps all);
- Ray core's INFO lines on the driver (e.g. where the dashboard is) and its notice that token authentication is on
  are kept off; its warnings stay;
- what Ray's C++ core prints on the driver (``core_worker.cc`` errors, ``gcs_client.cc`` retries) goes straight to
  the process's file descriptor 2, past Python's logging: :func:`terminal` points fd 2 at a log file and gives
  ``sys.stderr`` a copy of the terminal, so Python's output (rayflux's lines, the bars, Ray's kept warnings) still
  reaches the terminal. The Python records kept off are written to that file too.

``--verbose`` (or ``RAYFLUX_VERBOSE=1``) brings all of it back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator, TextIO

VERBOSE_ENV = "RAYFLUX_VERBOSE"
DRIVER_LOG = "ray-driver.txt"
"""The file under ``<run.output_dir>/logs`` that takes the driver's fd 2 (Ray's C++ core lines)."""

_aside: TextIO | None = None
"""Where :class:`_RayConsoleFilter` writes the records it keeps off the terminal, while :func:`terminal` runs."""


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


def set_verbose(on: bool) -> None:
    """Set for this process and the Ray processes it starts (they inherit the environment)."""
    if on:
        os.environ[VERBOSE_ENV] = "1"


def init_kwargs() -> dict:
    """Extra ``ray.init`` arguments for the driver."""
    return {"log_to_driver": verbose()}


def shown(record: logging.LogRecord) -> bool:
    """Whether one of Ray's records reaches the terminal when not verbose."""
    if record.levelno >= logging.ERROR:
        return True
    message = record.getMessage()
    if record.levelno >= logging.WARNING:
        # Ray Data's hints about its own display options, and Ray's notice that a local Ray it starts has token
        # authentication on (the default, which the README asks users to keep; its opposite warning stays).
        return "To enable, set" not in message and not message.startswith("Token authentication is enabled for")
    return False


class _RayConsoleFilter(logging.Filter):
    """Keeps Ray's records that :func:`shown` refuses off its console handlers; into the driver log, if one is open."""

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if shown(record):
            return True
        if _aside is not None:
            _aside.write(self.handler.format(record) + "\n")
            _aside.flush()
        return False


def quiet_ray() -> None:
    """Keep Ray's chatter off the driver's terminal (unless verbose). Call after ``import ray.data``; idempotent."""
    if verbose():
        return
    from ray.data import DataContext

    DataContext.get_current().print_on_execution_start = False
    for name in ("ray", "ray.data", "ray.train"):
        for handler in logging.getLogger(name).handlers:
            # Only the console handlers: Ray's file handlers keep everything in the session's log folder.
            if type(handler) is logging.StreamHandler or type(handler).__name__ == "PlainRayHandler":
                if not any(isinstance(f, _RayConsoleFilter) for f in handler.filters):
                    handler.addFilter(_RayConsoleFilter(handler))


@contextlib.contextmanager
def terminal(log_path: str) -> Iterator[None]:
    """While inside, fd 2 of this process writes to ``log_path`` (appended) and ``sys.stderr`` to the terminal.

    For the job's entry point only, around everything it runs: it swaps the process's stderr, which a caller that
    captures fd 2 (a test runner) must not have swapped under it. Nothing changes when verbose."""
    global _aside
    if verbose():
        yield
        return
    old = sys.stderr
    old.flush()
    # A caller that replaced sys.stderr with a stream of its own (contextlib.redirect_stderr) keeps receiving the
    # job's lines there; only fd 2 moves.
    real = _writes_fd2(old)
    saved = os.dup(2)
    encoding = getattr(old, "encoding", None) or "utf-8"
    to_terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding=encoding, errors="backslashreplace") if real else old
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    # What the filter keeps off the terminal goes to the log: through `old`, which writes to fd 2 now, or a new stream.
    aside = old if real else os.fdopen(os.dup(2), "w", buffering=1, encoding=encoding, errors="backslashreplace")
    if real:
        _repoint_handlers(old, to_terminal)
    sys.stderr, _aside = to_terminal, aside
    try:
        yield
    finally:
        to_terminal.flush()
        aside.flush()
        sys.stderr, _aside = old, None
        if real:
            _repoint_handlers(to_terminal, old)
        os.dup2(saved, 2)
        os.close(saved)
        (to_terminal if real else aside).close()


def _writes_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.StringIO and other streams without a descriptor
        return False


def _repoint_handlers(src: TextIO, dst: TextIO) -> None:
    """Point the logging handlers that hold the stream ``src`` (``logging.basicConfig``'s holds the ``sys.stderr``
    of its time, and so do Ray's console handlers) at ``dst``."""
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            # logging._StderrHandler's stream is a property reading sys.stderr on every record: nothing to point.
            if (
                isinstance(handler, logging.StreamHandler)
                and not isinstance(handler, logging._StderrHandler)
                and handler.stream is src
            ):
                handler.setStream(dst)


def driver_log_path(output_dir: str) -> str:
    """``<run.output_dir>/logs/ray-driver.txt``; a temporary file when the run directory is a URI (fd 2 needs a
    local file)."""
    import tempfile

    from rayflux import storage

    if storage.is_uri(output_dir):
        return os.path.join(tempfile.gettempdir(), f"rayflux-{os.getpid()}-{DRIVER_LOG}")
    return os.path.join(os.path.abspath(output_dir), "logs", DRIVER_LOG)

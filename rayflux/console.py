"""What the driver's terminal shows: rayflux's stage lines, the live bars, warnings that matter and the summary.

Ray's own chatter stays in the Ray session's log folder (the summary's ``logs:`` line), not on the terminal:

- worker, actor and Ray Train controller output (``Reporting training result N: TrainingReport(...)``, worker-group
  start-up, dataset plans inside training workers) is not forwarded to the driver (``ray.init(log_to_driver=False)``);
- Ray Data's start-of-execution plans and hints are not printed, and its console shows warnings, errors and, when
  stdout is not a terminal, the periodic ``Total Progress`` line (its file log under ``logs/ray-data`` keeps all);
- Ray core's INFO lines on the driver (e.g. where the dashboard is) are dropped; its warnings stay.

``--verbose`` (or ``RAYFLUX_VERBOSE=1``) brings all of it back.
"""

from __future__ import annotations

import logging
import os

VERBOSE_ENV = "RAYFLUX_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


def set_verbose(on: bool) -> None:
    """Set for this process and the Ray processes it starts (they inherit the environment)."""
    if on:
        os.environ[VERBOSE_ENV] = "1"


def init_kwargs() -> dict:
    """Extra ``ray.init`` arguments for the driver."""
    return {"log_to_driver": verbose()}


class _RayConsoleFilter(logging.Filter):
    """Which of Ray's records reach the terminal when not verbose."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return "To enable, set" not in message  # Ray Data's hints about its own display options
        # Ray Data's plain progress for a non-terminal stdout: keep its one global line, drop the per-operator ones.
        return record.filename == "logging_progress.py" and message.startswith("Total Progress")


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
                    handler.addFilter(_RayConsoleFilter())

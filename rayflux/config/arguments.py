"""The job config as every command reads it: ``--config FILE`` plus repeatable ``--set KEY=VALUE`` overrides.

The training job and the tools around it (``plan``, ``data check``) share these, so they live with the config
rather than in one command's module that the others would have to import.
"""

from __future__ import annotations

import argparse
import sys

from rayflux.config.job import JobConfig
from rayflux.config.loader import load
from rayflux.config.values import ConfigError


def add_set_arg(p: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE``, repeatable: one dotted override per use (see :func:`rayflux.config.loader.parse_set`)."""
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], help="override one key (repeatable)")


def load_or_report(config_file: str | None, overrides: list[str]) -> JobConfig | None:
    """The job's config; None after printing the one-line config error (the caller exits with 2)."""
    try:
        return load(config_file, overrides)
    except (ConfigError, OSError) as exc:
        print(f"rayflux: config error: {exc}", file=sys.stderr)
        return None

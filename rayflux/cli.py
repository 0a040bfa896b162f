"""Command-line entry points: the training job and ``python -m rayflux ...`` tools."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rayflux import config, console


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_flux.py",
        description="Cache latents with Ray Data, then train a FLUX LoRA with Ray Train.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config.help_text(),
    )
    p.add_argument("--config", metavar="FILE", help="YAML file with data/model/cache/train/run sections")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], help="override one key (repeatable)")
    p.add_argument("--only", choices=["cache"], help="run only this stage (prebuild caches on cheaper nodes)")
    p.add_argument(
        "--verbose", action="store_true", help="also show Ray's own output (worker logs, dataset plans, reports)"
    )
    return p


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main_train(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = _train_parser().parse_args(argv)
    console.set_verbose(args.verbose)
    logging.basicConfig(level=logging.INFO, format="[rayflux] %(message)s")
    try:
        cfg = config.load(args.config, args.set)
    except (config.ConfigError, OSError) as exc:
        print(f"rayflux: config error: {exc}", file=sys.stderr)
        return 2
    from rayflux import job

    try:
        summary = job.run(cfg, only=args.only or "")
    except KeyboardInterrupt:
        print("rayflux: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line for the user; the traceback goes to the log
        logging.getLogger("rayflux").debug("job failed", exc_info=True)
        print(f"rayflux: failed: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 1
    print("\n".join("[rayflux] " + line for line in summary.lines()))
    return 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else repr(exc)

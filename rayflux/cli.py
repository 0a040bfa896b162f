"""Command-line entry point of the training job (``python jobs/train_flux.py``, ``rayflux train``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rayflux import config, console


def train_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Cache latents with Ray Data, then train a FLUX LoRA with Ray Train.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config.help_text(),
    )
    p.add_argument("--config", metavar="FILE", help="YAML file with data/model/cache/train/run sections")
    config.add_set_arg(p)
    p.add_argument("--only", choices=["cache"], help="run only this stage (prebuild caches on cheaper nodes)")
    p.add_argument(
        "--verbose", action="store_true", help="also show Ray's own output (worker logs, dataset plans, reports)"
    )
    return p


def quiet_libraries() -> None:
    """Keep transformers' and the hub's chatter and progress bars off the terminal (every command does this first)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    """``rayflux train ...``: the same job as ``python jobs/train_flux.py ...``."""
    return main_train(argv, prog="rayflux train")


def main_train(argv: list[str] | None = None, prog: str = "train_flux.py") -> int:
    quiet_libraries()
    args = train_parser(prog).parse_args(argv)
    console.set_verbose(args.verbose)
    logging.basicConfig(level=logging.INFO, format="[rayflux] %(message)s")
    cfg = config.load_or_report(args.config, overrides(args))
    if cfg is None:
        return 2
    # Ray's C++ core writes to fd 2 itself; that goes to the run's logs, and sys.stderr to the terminal.
    joined = ray_connected()  # a Ray this process was already connected to (a caller's) is the caller's to leave
    with console.terminal(console.driver_log_path(cfg.run.output_dir)):
        try:
            return _run_job(cfg, args.only or "")
        finally:
            if not joined:
                disconnect()


def overrides(args: argparse.Namespace) -> list[str]:
    """The job's ``--set`` values; given neither ``--config`` nor ``--set``, the demo's: a LoRA of a colour the shipped
    world base never saw (pink), with validation grids where it appears (``runs/demo/validation/``)."""
    if args.config is not None or args.set:
        return args.set
    from rayflux.testing.world_base import demo_sets

    print(
        "rayflux: no --config or --set: the demo, a LoRA of a new colour on the world base (runs/demo)", file=sys.stderr
    )
    return demo_sets()


def ray_connected() -> bool:
    """Whether this process is connected to a Ray (without importing Ray when nothing has)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def disconnect() -> None:
    """Leave the Ray the job connected to while fd 2 still points at the log: what its shutdown prints (after Ctrl-C,
    say) belongs there."""
    if ray_connected():
        sys.modules["ray"].shutdown()


def _run_job(cfg: config.JobConfig, only: str) -> int:
    from rayflux import job
    from rayflux.lease import LeaseHeld

    try:
        summary = job.run(cfg, only=only)
    except KeyboardInterrupt:
        print("rayflux: interrupted", file=sys.stderr)
        return 130
    except LeaseHeld as exc:  # another job holds the run directory: one line saying who, and how to take over
        print(f"rayflux: refused: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one clear line for the user; the traceback goes to a file it names
        where = write_traceback(cfg.run.output_dir)
        print(f"rayflux: failed: {type(exc).__name__}: {_one_line(exc)} (traceback: {where})", file=sys.stderr)
        return 1
    print("\n".join("[rayflux] " + line for line in summary.lines()))
    return 0


def write_traceback(output_dir: str) -> str:
    """Write the exception being handled to ``<output_dir>/logs/error-<UTC time>.txt`` (local or URI) and return
    its path; a temporary file when the run directory cannot be written (its failure may be why we are here)."""
    import datetime
    import tempfile
    import traceback

    from rayflux import storage

    text = traceback.format_exc().encode()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = output_dir if storage.is_uri(output_dir) else os.path.abspath(output_dir)
    path = storage.join(base, "logs", f"error-{stamp}.txt")
    try:
        storage.write_bytes_atomic(path, text)
        return path
    except Exception:  # noqa: BLE001 - the traceback must land somewhere
        fd, path = tempfile.mkstemp(prefix=f"rayflux-error-{stamp}-", suffix=".txt")
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        return path


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else repr(exc)

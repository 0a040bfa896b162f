"""``rayflux sweep --config sweep.yaml``: train many LoRAs on one cache and keep the best (Ray Tune)."""

from __future__ import annotations

import argparse
import logging
import sys

from rayflux import config, console

DESCRIPTION = """\
Encode the dataset once, then train one LoRA per point of the sweep's search space with Ray Tune, each trial an
ordinary training job in <run.output_dir>/trials/<trial id>, and keep the best by the sweep's metric (eval loss).
Rerunning the same command continues an interrupted sweep. Example sweep.yaml:

  sweep:
    space:
      train.optim.learning_rate: {grid: [1.0e-4, 1.0e-3]}   # or {loguniform: [1.0e-5, 1.0e-3]}, {choice: [...]}
      train.adapter.rank: {grid: [4, 8]}
    num_samples: 1
    max_concurrent: 2
    metric: eval_loss
    scheduler: asha       # or fifo
  data: {images_dir: ./images, eval_samples: 4}
  train: {max_steps: 400, eval_every: 50}
  run: {output_dir: ./sweep-run}
"""


def _parser() -> argparse.ArgumentParser:
    from rayflux.sweep.config import help_text

    p = argparse.ArgumentParser(
        prog="rayflux sweep",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=help_text() + "\n\n" + config.help_text(),
    )
    p.add_argument("--config", metavar="FILE", required=True, help="YAML file with a sweep: section and a job config")
    config.add_set_arg(p)
    p.add_argument("--verbose", action="store_true", help="also show Ray's and Tune's own output")
    return p


def main(argv: list[str] | None = None) -> int:
    from rayflux.cli import disconnect, quiet_libraries, ray_connected, write_traceback
    from rayflux.sweep import config as sweep_config

    quiet_libraries()
    args = _parser().parse_args(argv)
    console.set_verbose(args.verbose)
    logging.basicConfig(level=logging.INFO, format="[rayflux] %(message)s")
    try:
        sf = sweep_config.load(args.config, args.set)
    except (config.ConfigError, OSError) as exc:
        print(f"rayflux: config error: {exc}", file=sys.stderr)
        return 2
    joined = ray_connected()
    try:
        return _run(sf, write_traceback)
    finally:
        if not joined:
            disconnect()


def _run(sf, write_traceback) -> int:
    from rayflux.lease import LeaseHeld
    from rayflux.sweep import driver, results

    try:
        outcome = driver.run(sf)
    except KeyboardInterrupt:
        print("rayflux: interrupted; run the same command again to continue the sweep", file=sys.stderr)
        return 130
    except (LeaseHeld, config.ConfigError) as exc:
        print(f"rayflux: refused: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one clear line; the traceback goes to a file it names
        where = write_traceback(sf.job.run.output_dir)
        print(f"rayflux: sweep failed: {type(exc).__name__}: {exc} (traceback: {where})", file=sys.stderr)
        return 1
    print("\n".join("[rayflux] " + line for line in results.lines(outcome.rows, sf.sweep.metric)))
    print(f"[rayflux] cache:   {outcome.cached} samples, encoded once, shared by {len(outcome.rows)} trials")
    if outcome.best is not None:
        print(
            f"[rayflux] best:    trial {outcome.best.trial} ({outcome.best.settings}): {sf.sweep.metric} "
            f"{outcome.best.best:.5f} at step {outcome.best.best_step} -> {outcome.best_lora}"
        )
    print(f"[rayflux] results: {outcome.results[0]} and .csv")
    print(f"[rayflux] metrics: tensorboard --logdir {outcome.tensorboard_dir}")
    print(f"[rayflux] ledger:  {outcome.ledger}")
    return 0

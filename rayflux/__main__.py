"""``python -m rayflux <command>``: tools around the job.

- ``cache verify <cache_dir>``: check a cache generation's shards against its manifest and buckets.
- ``data check <config.yaml>``: the dataset doctor; discovery, captions, buckets and path safety, no encoding.
- ``cluster runtime-env <file>``: a runtime_env YAML as JSON for ``ray job submit``, with secrets from the environment.
- ``cluster spot-guard``: on a worker node, drain it for Ray Train as soon as EC2 announces a spot reclaim.
- ``plan [--config FILE] [--set KEY=VALUE ...]``: trainable parameters per LoRA preset and the GPU memory estimate.
"""

from __future__ import annotations

import importlib
import sys

# command words -> module with a ``main(argv) -> int``; imported lazily so one tool never pays for another's imports.
COMMANDS = {
    ("cache", "verify"): "rayflux.cache.verify",
    ("data", "check"): "rayflux.doctor",
    ("cluster", "runtime-env"): "rayflux.cluster.runtime_env",
    ("cluster", "spot-guard"): "rayflux.cluster.spot_guard",
    ("plan",): "rayflux.plan",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    key = next((k for k in COMMANDS if tuple(argv[: len(k)]) == k), None)
    if key is None:
        names = ", ".join(" ".join(k) for k in COMMANDS)
        print(f"usage: python -m rayflux <command> ...; commands: {names}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[key]).main(argv[len(key) :])


if __name__ == "__main__":
    sys.exit(main())

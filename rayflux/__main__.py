"""``rayflux <command>`` (the console script) or ``python -m rayflux <command>``: the job and the tools around it."""

from __future__ import annotations

import importlib
import sys

# command words -> (module with a ``main(argv) -> int``, what it does); modules are imported lazily so that one tool
# never pays for another's imports.
COMMANDS = {
    ("train",): ("rayflux.cli", "the training job, the same as python jobs/train_flux.py [--config FILE] [--set K=V]"),
    ("sweep",): ("rayflux.sweep.cli", "many LoRAs on one cache with Ray Tune, keeping the best by eval loss"),
    ("captions", "export"): ("rayflux.caption.export", "a job's VLM captions as .txt sidecars or a metadata.jsonl"),
    ("cache", "verify"): ("rayflux.cache.verify", "check a cache generation's shards against its manifest and buckets"),
    ("data", "check"): ("rayflux.doctor", "the dataset doctor: discovery, captions, buckets and path safety"),
    ("cluster", "runtime-env"): ("rayflux.cluster.runtime_env", "a runtime_env YAML as JSON for ray job submit"),
    ("cluster", "spot-guard"): ("rayflux.cluster.spot_guard", "on a worker node, drain it when EC2 reclaims a spot"),
    ("plan",): ("rayflux.plan", "trainable parameters per LoRA preset and the GPU memory estimate"),
}


def usage() -> str:
    width = max(len(" ".join(k)) for k in COMMANDS)
    lines = ["usage: rayflux <command> [args ...]   (or python -m rayflux <command> ...)", "", "commands:"]
    lines += [f"  {' '.join(k):<{width}}  {text}" for k, (_, text) in COMMANDS.items()]
    lines += ["", "Each command takes --help."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    for key, (module, _) in COMMANDS.items():
        if tuple(argv[: len(key)]) == key:
            return importlib.import_module(module).main(argv[len(key) :])
    print(usage(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""``python -m rayflux cluster runtime-env FILE``: a runtime_env YAML as JSON, with secrets from your environment.

``ray job submit --runtime-env FILE`` sends a file's ``env_vars`` literally; Ray has no syntax that copies a variable
from the submitting shell. Secrets such as ``HF_TOKEN`` must not be written into a file, so this prints the file as
JSON with the named variables (``--pass``, default ``HF_TOKEN``) added from the current environment, for::

    ray job submit --runtime-env-json "$(python -m rayflux cluster runtime-env runtime_env/cloud.yaml)" ...

A variable that is not set is left out (and named on stderr). Ray stores a job's runtime_env with the job, so anyone
who can read the cluster's job list (dashboard, ``ray job list``; token auth limits that to token holders) can read
the value: for secrets that must never leave the cluster, give the nodes their own (an instance role for S3, a
secret manager read by ``setup_commands``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

DEFAULT_PASS = ("HF_TOKEN",)


def build(path: str, names: tuple[str, ...] | list[str], environ: dict | None = None) -> tuple[dict, list[str]]:
    """(runtime_env with the set variables added, names that were not set)."""
    environ = os.environ if environ is None else environ
    with open(path) as f:
        env = yaml.safe_load(f) or {}
    if not isinstance(env, dict):
        raise ValueError(f"{path}: a runtime_env must be a mapping")
    env_vars = dict(env.get("env_vars") or {})
    missing = []
    for name in names:
        if name in environ:
            env_vars[name] = environ[name]
        else:
            missing.append(name)
    if env_vars:
        env["env_vars"] = env_vars
    return env, missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rayflux cluster runtime-env", description=__doc__.split("\n")[0])
    p.add_argument("file", help="runtime_env YAML (e.g. runtime_env/cloud.yaml)")
    p.add_argument(
        "--pass", dest="names", action="append", metavar="NAME", help="variable to copy in (repeatable; HF_TOKEN)"
    )
    args = p.parse_args(argv)
    env, missing = build(args.file, args.names or DEFAULT_PASS)
    for name in missing:
        print(f"rayflux: {name} is not set here; the job runs without it", file=sys.stderr)
    print(json.dumps(env))
    return 0

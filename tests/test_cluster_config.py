"""cluster.yaml, runtime_env files and the cluster-facing config: checked by Ray's own validators and objects."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayflux import config
from rayflux.cache import fit
from rayflux.cluster import spot_guard
from rayflux.config.placement import Cluster, place
from rayflux.train.stage import run_config, scaling_config

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_ENVS = sorted((ROOT / "runtime_env").glob("*.yaml"))
SECRET = re.compile(r"(?:^|_)(?:TOKEN|SECRET|PASSWORD|KEY)(?:_|$)")  # HF_TOKEN, AWS_SECRET_ACCESS_KEY...


def test_cluster_yaml_passes_rays_autoscaler_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    cfg = prepare_config(raw)  # merges Ray's AWS defaults, as `ray up` does
    validate_config(cfg)  # Ray's JSON schema and its cross-field checks
    assert cfg["provider"]["type"] == "aws"
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert not head["node_config"]["InstanceType"].startswith(("p", "g"))  # a CPU instance
    assert head["max_workers"] == 0
    h100 = types["h100"]
    assert h100["node_config"]["InstanceType"] == "p5.48xlarge"
    assert h100["min_workers"] == 0 < h100["max_workers"]
    encode = types["encode_l4"]
    assert encode["node_config"]["InstanceType"].startswith("g6")
    assert cfg["idle_timeout_minutes"] > 0
    assert any("rayflux" in c and "pip install" in c for c in cfg["setup_commands"])
    # Token auth stays on: the token goes to every node and every `ray start` asks for it.
    assert "~/.ray/auth_token" in cfg["file_mounts"]
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    assert any("spot-guard" in c for c in cfg["worker_start_ray_commands"])


def test_cluster_yaml_offers_spot_for_h100():
    text = (ROOT / "cluster.yaml").read_text()
    h100 = text.split("\n  h100:", 1)[1].split("\n  encode_l4:", 1)[0]
    assert "# InstanceMarketOptions:" in h100 and "#   MarketType: spot" in h100
    uncommented = yaml.safe_load(
        text.replace("# InstanceMarketOptions:", "InstanceMarketOptions:").replace(
            "#   MarketType: spot", "  MarketType: spot"
        )
    )
    assert uncommented["available_node_types"]["h100"]["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"}


@pytest.mark.parametrize("path", RUNTIME_ENVS, ids=lambda p: p.name)
def test_runtime_env_files_build_rays_runtime_env(path):
    from ray.runtime_env import RuntimeEnv

    data = yaml.safe_load(path.read_text())
    env = RuntimeEnv(**data)  # Ray's own validation of every field
    assert env["working_dir"] == "."
    for pattern in ("runs/", ".venv/", "*.parquet"):
        assert pattern in data["excludes"]
    assert all(isinstance(v, str) for v in data["env_vars"].values())
    assert not [k for k in data["env_vars"] if SECRET.search(k)], "a secret is written in the file"


def test_runtime_env_helper_adds_secrets_from_the_environment_only(tmp_path):
    cmd = [sys.executable, "-m", "rayflux", "cluster", "runtime-env", str(ROOT / "runtime_env" / "cloud.yaml")]
    base = {"PATH": "/usr/bin:/bin"}
    with_token = subprocess.run(cmd, env={**base, "HF_TOKEN": "hf_from_the_shell"}, capture_output=True, text=True)
    assert with_token.returncode == 0, with_token.stderr
    env = json.loads(with_token.stdout)
    assert env["env_vars"]["HF_TOKEN"] == "hf_from_the_shell"
    assert env["excludes"] == yaml.safe_load((ROOT / "runtime_env" / "cloud.yaml").read_text())["excludes"]
    without = subprocess.run(cmd, env=base, capture_output=True, text=True)
    assert without.returncode == 0 and "HF_TOKEN" not in json.loads(without.stdout)["env_vars"]
    assert "HF_TOKEN is not set" in without.stderr


def test_elastic_scaling_and_failure_config(tmp_path):
    from ray.train.v2._internal.execution.scaling_policy import create_scaling_policy

    cfg = config.load(
        None,
        [
            "train.workers.num_workers=[2, 16]",
            "train.workers.accelerator_type=H100",
            "train.workers.max_failures=5",
            "train.workers.resize_check_seconds=30",
            "train.workers.worker_resources={h100_node: 1}",
        ],
    )
    use_gpu = place(cfg, Cluster(gpus=False)).training  # an accelerator type implies GPUs before any GPU node is up
    scaling = scaling_config(cfg, use_gpu)
    assert use_gpu and (scaling.min_workers, scaling.max_workers) == (2, 16)
    assert scaling.elastic_resize_monitor_interval_s == 30
    per_worker = scaling._resources_per_worker_not_none
    assert per_worker["GPU"] == 1 and per_worker["h100_node"] == 1 and "accelerator_type:H100" in per_worker
    assert type(create_scaling_policy(scaling)).__name__ == "ElasticScalingPolicy"
    run = run_config(cfg, str(tmp_path), callbacks=[])
    assert run.failure_config.max_failures == 5 and run.storage_path == str(tmp_path / "checkpoints")
    fixed = scaling_config(config.load(None, ["train.workers.num_workers=4"]), False)
    assert fixed.num_workers == 4 and not fixed.use_gpu


def test_a_rerun_may_change_placement_but_not_training():
    from rayflux.job import run_identity

    base = config.load(None, ["train.workers.num_workers=2"])
    moved = config.load(
        None,
        [
            "train.workers.num_workers=[4, 16]",
            "train.workers.accelerator_type=H100",
            "train.workers.max_failures=9",
            "train.workers.resize_check_seconds=7",
            "train.workers.worker_resources={h100: 1}",
            "cache.accelerator_type=L4",
            "cache.actor_resources={encode: 1}",
        ],
    )
    assert run_identity(moved) == run_identity(base)
    assert run_identity(config.load(None, ["train.optim.learning_rate=0.5"])) != run_identity(base)


def test_encoder_actors_can_target_another_node_type():
    head = fit.Capacity(now={"CPU": 2.0}, most=None, largest_node_cpus=2.0)

    def resources(*items: str) -> dict:
        cfg = config.load(None, list(items))
        return fit.resources(cfg, place(cfg, Cluster(gpus=False)).encoders, head)

    assert resources() == {"num_cpus": 1.25}
    assert resources("cache.accelerator_type=L4") == {"num_gpus": 1.0, "num_cpus": 1.0, "accelerator_type": "L4"}
    custom = resources("cache.actor_resources={encode_node: 1}", "cache.encoders_on_gpu=true")
    assert custom == {"num_gpus": 1.0, "num_cpus": 1.0, "resources": {"encode_node": 1.0}}


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.workers.worker_resources={GPU: 2}", "through its own key"),
        ("train.workers.worker_resources={trainer: 0}", "must be a positive number"),
        ("cache.actor_resources=encode", "must be a mapping"),
        ("train.workers.max_failures=-2", "train.workers.max_failures"),
        ("train.workers.resize_check_seconds=-1", "train.workers.resize_check_seconds"),
        ("cache.encoders_on_gpu=maybe", "cache.encoders_on_gpu must be one of"),
    ],
)
def test_bad_cluster_values_name_the_key(item, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(None, [item])


def test_spot_notice_time_becomes_the_drain_deadline():
    assert spot_guard.notice_deadline_ms({"action": "terminate", "time": "2026-05-01T12:00:00Z"}) == 1777636800000


def test_spot_guard_exits_quietly_where_there_is_no_instance_metadata():
    from cluster_support import free_port

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayflux",
            "cluster",
            "spot-guard",
            "--address=127.0.0.1:1",
            "--node-id=00",
            f"--imds-url=http://127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "not on EC2" in proc.stdout

"""Autoscaling: the cache stage's encoder demand scales a worker type up, and the idle node is scaled back down.

Ray's fake multi-node provider stands in for a cloud; its "instances" are Ray nodes started on this machine. Ray's own
``ray.cluster_utils.AutoscalingCluster`` cannot be used with the PyPI wheel of Ray 2.60 (its base config file is not
shipped) and it runs ``ray stop --force``, which stops every Ray on the machine. So the test starts the head as that
class does, with its own port and a full config, and stops only that head's process group.

The job asks for encoders with ``cache.actor_resources={encode: 1}``, as a real job targets ``cluster.yaml``'s
cheaper GPU nodes; only the ``encode_node`` type has that resource, so the cache stage can only finish on a node the
autoscaler starts for it.
"""

from __future__ import annotations

import json
import subprocess

from cluster_support import alive_nodes_or_none, free_port, ray_env, ray_node, train_job_cmd, wait_for

from rayflux.cache import generations

BOUND_S = 420  # a bound for each step to happen at all on a busy 2-core machine; never a performance claim


def _autoscaling_config(gcs_address: str) -> dict:
    commands = (
        "initialization_commands",
        "setup_commands",
        "head_setup_commands",
        "worker_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    )
    return {
        "cluster_name": "rayflux-fake",
        "max_workers": 1,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,
            # As Ray's own fake_multi_node/example.yaml: local nodes need no SSH updater or launch-config check.
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {"ssh_user": "ubuntu"},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        **{key: [] for key in commands},
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "encode_node": {
                "resources": {"CPU": 2, "encode": 2},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 1,
            },
        },
    }


def _encode_nodes(address: str) -> int | None:
    nodes = alive_nodes_or_none(address)
    return None if nodes is None else sum("encode" in res for res in nodes.values())


def test_encoder_demand_scales_up_an_encode_node_that_idles_away(tiny_model, demo_images, tmp_path):
    from ray._private.services import get_node_ip_address

    port = free_port()
    address = f"{get_node_ip_address()}:{port}"
    config = tmp_path / "autoscaling.json"
    config.write_text(json.dumps(_autoscaling_config(address)))
    head_args = [
        "--head",
        f"--port={port}",
        "--num-cpus=1",
        "--include-dashboard=false",
        f"--autoscaling-config={config}",
    ]
    with ray_node(head_args, tmp_path / "head.log", RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1") as head:
        assert wait_for(lambda: _encode_nodes(address) == 0, BOUND_S, "the head alone", proc=head)
        out = tmp_path / "run"
        job = subprocess.Popen(
            train_job_cmd(
                f"model.path={tiny_model}",
                f"data.images_dir={demo_images}",
                f"run.output_dir={out}",
                "data.resolution=64",
                "cache.actor_resources={encode: 1}",
                only="cache",
            ),
            env=dict(ray_env(), RAY_ADDRESS=address),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        most = 0
        while job.poll() is None:
            most = max(most, _encode_nodes(address) or 0)
            try:
                job.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        output = job.stdout.read()
        assert job.returncode == 0, output[-4000:]
        assert most == 1  # the autoscaler started one encode node for the encoders (max_workers caps it at one)
        [manifest_file] = (out / "cache").glob(f"*/*/{generations.MANIFEST}")
        manifest = generations.load_manifest(str(manifest_file.parent))
        assert manifest["cached"] == manifest["discovered"] > 0 and manifest["skipped"] == 0
        # Nothing asks for `encode` any more: after idle_timeout_minutes the autoscaler removes the node.
        wait_for(lambda: _encode_nodes(address) == 0, BOUND_S, "the idle encode node removed", proc=head)

"""``ray job submit`` of the demo to a head this test starts with ``ray start``, using runtime_env/local.yaml.

The README's local-head commands, with ports of the test's own choosing (Ray's defaults, 6379 and 8265, may belong to
another Ray on this machine). The head is stopped by its process group: ``ray stop`` would stop every Ray here.
"""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request

from cluster_support import RAY, ROOT, free_port, ray_env, ray_node, wait_for

BOUND_S = 600  # a bound for the job to finish at all on a busy 2-core machine; never a performance claim


def _dashboard_answers(url: str) -> bool:
    """Any HTTP answer means the dashboard is serving; without a token it is 401, as token auth should make it."""
    try:
        urllib.request.urlopen(f"{url}/api/version", timeout=5)
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def test_job_submit_with_runtime_env_writes_the_lora(tiny_model, demo_images, tmp_path):
    dashboard = f"http://127.0.0.1:{free_port()}"
    # The job's `python` is the first on the head's PATH: ray_env() puts this environment's first, as the README says.
    head_args = [
        "--head",
        f"--port={free_port()}",
        "--num-cpus=2",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard.rsplit(':', 1)[1]}",
    ]
    with ray_node(head_args, tmp_path / "head.log") as head:
        wait_for(lambda: _dashboard_answers(dashboard), BOUND_S, "the head's dashboard", proc=head)
        out = tmp_path / "run"
        job = subprocess.run(
            [
                RAY,
                "job",
                "submit",
                "--address",
                dashboard,
                "--runtime-env",
                "runtime_env/local.yaml",
                "--",
                "python",
                "jobs/train_flux.py",
                "--set",
                f"model.path={tiny_model}",
                "--set",
                "data.resolution=64",
                "--set",
                f"run.output_dir={out}",
                "--set",
                "train.max_steps=2",
            ],
            cwd=ROOT,
            env=ray_env(),
            capture_output=True,
            text=True,
            timeout=BOUND_S,
        )
        assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
        assert "succeeded" in job.stdout and f"LoRA:       {out}" in job.stdout
        assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()

"""Shared fixtures: one local Ray per test module, the tiny model, and demo images.

Everything is real (Ray, torch, diffusers); only the model is tiny.
"""

from __future__ import annotations

import os
import sys
import time
import tempfile
from pathlib import Path

import pytest

# The loopback S3 server for the object-storage tests; a plugin, so its endpoint is set before Ray starts.
pytest_plugins = ["s3server"]

# Under pytest-xdist every worker runs Rays of its own: a Ray temp dir per worker keeps them apart (Ray's "latest
# cluster" file lives there, and a job's plain ``ray.init()`` would otherwise join another worker's head).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=f"ray-{os.environ['PYTEST_XDIST_WORKER']}-", dir="/tmp")

# Generated assets go to a per-session home, never the user's ~/.cache; set before Ray starts so workers inherit it.
_HOME = tempfile.mkdtemp(prefix="rayflux-test-home-")
os.environ["RAYFLUX_HOME"] = _HOME
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Token auth, as ``ray.init()`` turns on by default in Ray 2.60, for every Ray the tests start or join (clusters
# started with ``ray start`` and the in-process GCS clients of tests/cluster_support.py included).
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Ray Train's controller polls its workers (and drains their reports) every 2 s by default, so each short test run
# would wait up to 2 s to notice a finished worker and up to 2 s per checkpoint report: minutes over the suite. Tests
# poll every 0.5 s, as the job itself does unless told otherwise (rayflux.train.stage.POLL_SECONDS), also in tests
# that start their Ray before any job sets it. Ray reads this in the controller's process, which
# inherits it from the Ray the tests start (cluster tests pass os.environ on too).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# run.wandb_project in tests logs offline, never to the network, into the session's home (Ray workers inherit it).
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_DIR"] = os.path.join(_HOME, "wandb")
os.makedirs(os.environ["WANDB_DIR"], exist_ok=True)
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from rayflux.testing.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_flux2_klein() -> Path:
    from rayflux.testing.tiny_flux2 import ensure_tiny_flux2_klein

    return ensure_tiny_flux2_klein()


@pytest.fixture(scope="session")
def tiny_flux2_klein_distilled() -> Path:
    """The step-distilled tiny [klein] (``is_distilled: true``, like FLUX.2-klein-4B); ``tiny_flux2_klein`` is base."""
    from rayflux.testing.tiny_flux2 import TinyFlux2Spec, ensure_tiny_flux2_klein

    return ensure_tiny_flux2_klein(spec=TinyFlux2Spec(distilled=True))


@pytest.fixture(scope="session")
def tiny_flux2_dev() -> Path:
    from rayflux.testing.tiny_flux2 import ensure_tiny_flux2_dev

    return ensure_tiny_flux2_dev()


@pytest.fixture(scope="session")
def tiny_kontext() -> Path:
    from rayflux.testing.tiny_kontext import ensure_tiny_kontext

    return ensure_tiny_kontext()


@pytest.fixture(scope="session")
def demo_images() -> Path:
    from rayflux.testing.images import ensure_demo_images

    return ensure_demo_images()


_DASHBOARD: dict = {}

# Modules that start Ray clusters of their own (``ray start`` heads, ``ray.cluster_utils.Cluster``, the autoscaler's
# fake provider). They run after every other test, with the session Ray already stopped: a driver connected to one
# local Ray while other Rays start and stop on the same machine has been seen to lose its GCS and exit the whole
# test process, and these tests never need the session Ray. Under pytest-xdist they run last and alone as well
# (tests/slowest_first.py).
_OWN_CLUSTER_PREFIX = "test_cluster_"


def is_own_cluster(path: str) -> bool:
    """Whether a test file (or a node id in it) is an own-cluster module."""
    return Path(path.split("::", 1)[0]).name.startswith(_OWN_CLUSTER_PREFIX)


# tryfirst: xdist's own implementation registers later and would otherwise answer first.
@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    from slowest_first import make_scheduler

    return make_scheduler(config, log, is_own_cluster)


_EXIT: dict = {}


def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End a serial run's process with pytest's own status once pytest is done with it. Ray objects of clusters the
    tests stopped (a ``Cluster``'s in-process node and its GCS client) can outlive them; at interpreter exit one was
    seen to wait 60 s for its dead GCS and then end the process with status 1, after every test had passed."""
    if "ray" in sys.modules and "status" in _EXIT and not os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT["status"])


def pytest_collection_modifyitems(session, config, items):
    """Run the own-cluster modules last (stable: collection order is kept within each group)."""
    items.sort(key=lambda item: is_own_cluster(str(item.fspath)))


@pytest.fixture(scope="module", autouse=True)
def _no_session_ray_beside_own_clusters(request):
    """Stop the session Ray (if this process started it) before a module that runs clusters of its own. Module
    scope and autouse: it runs before the module's own fixtures start any cluster."""
    if is_own_cluster(request.module.__file__):
        import ray

        if ray.is_initialized():
            ray.shutdown()
    yield


@pytest.fixture(scope="module")
def ray_dashboard(ray_session) -> str:
    """The module's Ray's dashboard URL, for Ray's state API (``ray.util.state``)."""
    return _DASHBOARD["url"]


def _module_wants_dashboard(request) -> bool:
    """Whether a test of this module asks for ``ray_dashboard``: only those modules start Ray's dashboard, whose
    process start-up every other module's Ray would pay for nothing."""
    return any("ray_dashboard" in item.fixturenames for item in request.session.items if item.module is request.module)


@pytest.fixture(scope="module")
def ray_session(request, tiny_model):
    """A local Ray for each test module (start-up costs seconds; a module's tests share it), stopped after it.

    Why not one Ray for the whole session: after about half an hour of actors and pipelines coming and going, a
    driver of this Ray version has been seen to stop receiving actor-state updates from the GCS (the actor is
    created, the driver never learns it is alive, and the next Ray Data pipeline waits on it forever). A fresh
    Ray per module keeps each module's outcome its own, at a few seconds per module."""
    import ray
    from ray.data import DataContext

    import socket

    if ray.is_initialized():  # a Ray an earlier test left connected (a job.run that started its own)
        ray.shutdown()

    # The dashboard serves Ray's state API (tests list live actors); a free port keeps it clear of any other head.
    dashboard = {"include_dashboard": False}
    if _module_wants_dashboard(request):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dashboard = {"include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": s.getsockname()[1]}
    # address="local" always starts a fresh local Ray, even when another head runs on this machine.
    context = ray.init(address="local", num_cpus=2, log_to_driver=False, **dashboard)
    _DASHBOARD["url"] = f"http://{context.dashboard_url}" if dashboard["include_dashboard"] else ""
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    yield ray
    ray.shutdown()


@pytest.fixture
def job_config(tiny_model, demo_images, tmp_path):
    """A small, fast job config on the tiny model and demo images."""
    from rayflux import config

    return config.load(
        None,
        [
            f"model.path={tiny_model}",
            f"data.images_dir={demo_images}",
            f"run.output_dir={tmp_path / 'run'}",
            "data.resolution=64",
            "train.epochs=1",
            "train.workers.num_workers=2",
        ],
    )


def _free_cpus(ray) -> float:
    return ray.available_resources().get("CPU", 0.0)


@pytest.fixture(autouse=True)
def _test_releases_its_cpus(request):
    """Every test stops what it started: a test on the session Ray must hand back the CPUs it took (an actor or a
    pipeline left running holds them, and the next cache build then waits for CPUs that never come back). Ray frees
    a finished actor's CPUs a moment after it exits, so this waits briefly before failing."""
    if "ray_session" not in request.fixturenames:
        yield
        return
    import ray

    before = _free_cpus(ray) if ray.is_initialized() else None
    yield
    if before is None or not ray.is_initialized():
        return
    deadline = time.monotonic() + 60
    while _free_cpus(ray) < before - 1e-6 and time.monotonic() < deadline:
        time.sleep(0.5)
    after = _free_cpus(ray)
    if after < before - 1e-6:
        from ray._private.state import actors  # the GCS's table: no dashboard needed

        alive = [f"{a['ActorClassName']}({a['ActorID'][:8]})" for a in actors(actor_state_name="ALIVE").values()]
        pytest.fail(
            f"the test left {before - after:g} CPU taken ({after:g} free, {before:g} before); alive actors: {alive}"
        )

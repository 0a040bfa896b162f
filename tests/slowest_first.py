"""Under pytest-xdist (``pytest -n 3``): test files go to workers whole, the slowest first.

Whole files, because a module's tests share its Ray and its caches (module fixtures); splitting a file across workers
would build them twice. Slowest first, so that no worker starts a long file while the others are finishing and the
run's end waits on it alone.

The ``test_cluster_`` modules start Ray heads and nodes of their own (``ray start``, ``Cluster``, the autoscaler's
fake provider). In one process they must not meet the session Ray (conftest runs them last in a serial run, and stops
a worker's session Ray before one of them); in separate worker processes they run beside other modules, each
worker's Rays kept apart by a Ray temp dir of its own (conftest).
"""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pytest-xdist not installed: tests run serially and this plugin has nothing to do
    LoadFileScheduling = None

# The longest files, slowest first (one to four minutes each on 2 cores: each runs several whole jobs or a cluster).
SLOWEST_FIRST = [
    "test_sweep.py",
    "test_train_ray.py",
    "test_refresh.py",
    "test_masks_train.py",
    "test_job_e2e.py",
    "test_cluster_elastic.py",
    "test_train_sharded_ray.py",
    "test_s3_fault_job.py",
    "test_family_flux2.py",
    "test_edit_pairs.py",
    "test_cache_fit.py",
    "test_memory.py",
    "test_cluster_commit.py",
    "test_bench_gpu.py",
    "test_s3.py",
]


def _name(scope: str) -> str:
    return Path(scope.split("::", 1)[0]).name


def _rank(scope: str) -> int:
    name = _name(scope)
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)


if LoadFileScheduling is not None:

    class SlowestFirstScheduling(LoadFileScheduling):
        """``--dist loadfile``, handing out the files of ``SLOWEST_FIRST`` first, in that order."""

        def _assign_work_unit(self, node) -> None:
            scope = min(self.workqueue, key=_rank)  # the first of the slowest rank: ties keep collection order
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    # tryfirst: xdist's own implementation registers later and would otherwise answer first.
    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_xdist_make_scheduler(config, log):
        return SlowestFirstScheduling(config, log)

"""Under pytest-xdist (``pytest -n 2``): test files go to workers whole, and the own-cluster modules run last, one at
a time, on one worker, after every other worker has finished and stopped its Ray.

Why: the ``test_cluster_`` modules start Ray heads and nodes of their own (``ray start``, ``Cluster``, the autoscaler's
fake provider), and a driver connected to one local Ray while other Rays start and stop on the same machine has been
seen to lose its GCS. Serially (no xdist) conftest gets the same effect by sorting those modules last.

Whole files, because a module's tests share its Ray and its caches (module fixtures); splitting a file across workers
would build them twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pytest-xdist not installed: tests run serially and this plugin has nothing to do
    LoadFileScheduling = None

OWN_CLUSTER_PREFIX = "test_cluster_"

# The longest files, slowest first (minutes each on 2 cores: each runs several whole jobs). Sent out first, so that
# no worker starts one of them while the others are finishing and the run's end waits on it alone.
SLOWEST_FIRST = [
    "test_sweep.py",
    "test_train_ray.py",
    "test_refresh.py",
    "test_masks_train.py",
    "test_job_e2e.py",
    "test_train_sharded_ray.py",
    "test_s3_fault_job.py",
    "test_family_flux2.py",
    "test_edit_pairs.py",
    "test_cache_fit.py",
    "test_memory.py",
    "test_bench_gpu.py",
    "test_s3.py",
]


def _name(scope: str) -> str:
    return Path(scope.split("::", 1)[0]).name


def is_own_cluster(scope: str) -> bool:
    """Whether a work unit (a test file's node id) is an own-cluster module."""
    return _name(scope).startswith(OWN_CLUSTER_PREFIX)


def _rank(scope: str) -> int:
    name = _name(scope)
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)


if LoadFileScheduling is not None:

    class OwnClustersLastScheduling(LoadFileScheduling):
        """``--dist loadfile``, except that own-cluster files wait for every other worker to finish, and then all
        run on the one worker left.

        When only own-cluster files remain and another worker is still active, the asking worker is shut down (it
        then runs the test it holds back and tears down its module's Ray). The last active worker takes the
        own-cluster files once no other worker has a test pending."""

        def _assign_work_unit(self, node) -> None:
            scope = min((s for s in self.workqueue if not is_own_cluster(s)), key=_rank, default=None)
            if scope is None:
                others = [n for n in self.nodes if n is not node]
                if any(not n.shutting_down for n in others):
                    node.shutdown()
                    return
                if any(self._pending_of(self.assigned_work[n]) for n in others):
                    return  # a finishing worker's completion calls this again (mark_test_complete below)
                scope = next(iter(self.workqueue))
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            # The worker left to run the own-cluster files may be waiting on this one's last test.
            for other in self.nodes:
                if other is not node and not other.shutting_down and self.workqueue:
                    self._reschedule(other)

    # tryfirst: xdist's own implementation registers later and would otherwise answer first.
    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_xdist_make_scheduler(config, log):
        return OwnClustersLastScheduling(config, log)

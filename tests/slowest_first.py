"""How pytest-xdist (``pytest -n 3``) hands out the test files: whole, the slowest first, and the own-cluster files
last and one at a time on one worker, once every other worker has finished and stopped its Ray.

Whole files, because a module's tests share its Ray and its caches (module fixtures); splitting a file across workers
would build them twice. Slowest first, so that no worker starts a long file while the others are finishing and the
run's end waits on it alone.

The ``test_cluster_`` files start Ray heads and nodes of their own and stop them, and time what their jobs do
between a node's loss and its return: run beside three other workers' jobs on two cores, the elastic test's job once
finished before a returning node could join it. So they run as in a serial run, last and alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

# The longest files, slowest first (one to four minutes each on 2 cores: each runs several whole jobs).
SLOWEST_FIRST = [
    "test_sweep.py",
    "test_train_ray.py",
    "test_masks_train.py",
    "test_quality.py",
    "test_refresh.py",
    "test_train_sharded_ray.py",
    "test_job_e2e.py",
    "test_family_flux2.py",
    "test_s3_fault_job.py",
    "test_edit_pairs.py",
    "test_rerun_after_kill.py",
    "test_cache_fit.py",
    "test_memory.py",
    "test_caption_stage.py",
    "test_train_early.py",
    "test_bench_gpu.py",
    "test_s3.py",
]


def _rank(scope: str) -> int:
    name = Path(scope.split("::", 1)[0]).name
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)


def make_scheduler(config, log, is_own_cluster: Callable[[str], bool]):
    """The scheduler for conftest's ``pytest_xdist_make_scheduler`` (xdist is imported only under ``-n``)."""
    from xdist.scheduler import LoadFileScheduling

    class SlowestFirstOwnClustersLast(LoadFileScheduling):
        """``--dist loadfile``, handing out ``SLOWEST_FIRST`` first. When only own-cluster files remain and another
        worker is still active, the asking worker is shut down (it then runs the test it holds back and tears down
        its module's Ray); the last active worker takes them once no other worker has a test pending."""

        def _assign_work_unit(self, node) -> None:
            scope = min((s for s in self.workqueue if not is_own_cluster(s)), key=_rank, default=None)
            if scope is None:
                others = [n for n in self.nodes if n is not node]
                if any(not n.shutting_down for n in others):
                    node.shutdown()
                    return
                if any(self._pending_of(self.assigned_work[n]) for n in others):
                    return  # a finishing worker's completion asks again (mark_test_complete below)
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

    return SlowestFirstOwnClustersLast(config, log)

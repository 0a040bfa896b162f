"""A trial's trainer tells Tune its eval losses: Ray Tune's Train V2 integration, filtered to the sweep's metric.

In Train V2 the training workers never report to Tune: the trainer's controller forwards rank 0's ``ray.train.report``
records to the Tune function that launched it (``ray.tune.integration.ray_train.TuneReportCallback``). The training
loop reports at every checkpoint and metrics interval too; only records carrying the sweep's metric go to Tune, so
every result ASHA sees has it, and ``step`` is its time axis.
"""

from __future__ import annotations

import os
import sys

METRIC_ENV = "RAYFLUX_SWEEP_METRIC"
"""Set by the sweep's trial function for its trainer: the metric a record must carry to be forwarded to Tune."""
TRIAL_DIR_ENV = "RAYFLUX_SWEEP_TRIAL_DIR"
"""Set by the sweep's trial function: its run directory, where the trainer records its placement groups."""


def tune_callbacks() -> list:
    """Inside a Tune trial, ``[the Tune report callback, the placement-group record]``; else ``[]`` (a standalone
    job)."""
    if "ray.tune" not in sys.modules:  # a Tune trial's process has imported it; a standalone job need not pay for it
        return []
    from ray.tune.trainable.trainable_fn_utils import _in_tune_session

    if not _in_tune_session():
        return []
    from ray.tune.integration.ray_train import TuneReportCallback

    class MetricReports(TuneReportCallback):
        """Forward only the records with the sweep's metric (evals), without their checkpoints: a trial resumes
        from its own run directory, as any job does."""

        def __init__(self, metric: str):
            super().__init__()
            self.metric = metric

        def after_report(self, run_context, metrics, checkpoint):
            if metrics and self.metric in metrics[0]:
                plain = {k: v for k, v in metrics[0].items() if isinstance(v, (int, float, str, bool))}
                self._training_actor_item_queue.put(plain)

    from rayflux.sweep.groups import record_groups

    return [MetricReports(os.environ.get(METRIC_ENV, "eval_loss")), record_groups(os.environ[TRIAL_DIR_ENV])]

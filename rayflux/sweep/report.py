"""A trial's trainer tells Tune its eval losses: Ray Tune's Train V2 integration, filtered to the sweep's metric.

In Train V2 the training workers never report to Tune: the trainer's controller forwards rank 0's ``ray.train.report``
records to the Tune function that launched it (``ray.tune.integration.ray_train.TuneReportCallback``). The training
loop reports at every checkpoint and metrics interval too; only records carrying the sweep's metric go to Tune, so
every result ASHA sees has it, and ``step`` is its time axis.
"""

from __future__ import annotations


def tune_callbacks(metric: str, trial_dir: str) -> list:
    """The callbacks of a trial's trainers: ``[the Tune report callback, the placement-group record]``. Called by
    :func:`rayflux.sweep.trial.run_trial` (inside its Tune session) once per trainer, through ``job.run``'s
    ``trainer_callbacks``: the training stage takes callbacks and knows nothing of sweeps."""
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

    return [MetricReports(metric), record_groups(trial_dir)]

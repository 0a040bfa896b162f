"""A trial's trainer tells its Tune trainable its eval losses, and who its controller is.

In Train V2 the training workers never report to Tune: the trainer's controller runs the run config's callbacks, and
rank 0's ``ray.train.report`` records reach them there. These callbacks put them on the trial's channel, a Ray queue
that the trial's trainable (:mod:`rayflux.sweep.trainable`) reads, filtered to the records with the sweep's metric
(so every result ASHA sees has it, and ``step`` is its time axis) and without their checkpoints (a trial resumes
from its own run directory, as any job does). The controller also sends its own handle when it starts: a trainable
whose trial the scheduler stopped ends that trainer before its process runs the next trial.

Every message carries the tag of the trial attempt that made it: a process runs trial after trial, and a message a
trainer of the trial before sent late is dropped, never counted for the next one. The queue holds one message, as
Tune's own Train integration does: the controller waits until the trainable has taken its previous report.
"""

from __future__ import annotations

REPORT = "report"
"""A message with an eval record (a dict of plain values)."""
CONTROLLER = "controller"
"""A message with the handle of the trainer's controller actor."""
ENDED = "ended"
"""The trial attempt's last message: its job returned or raised (the trainable sees it without waiting a poll)."""


def trial_callbacks(channel, tag: str, metric: str, trial_dir: str) -> list:
    """The callbacks of a trial's trainers: ``[its reports, its controller's handle, its placement-group record]``.
    Made by :class:`rayflux.sweep.trainable.TrialTrainable` once per trainer, through ``job.run``'s
    ``trainer_callbacks``: the training stage takes callbacks and knows nothing of sweeps. ``channel``: the trainable's
    ``ray.util.queue.Queue``; ``tag``: the trial attempt's tag."""
    import ray
    from ray.train.v2._internal.execution.callback import ControllerCallback
    from ray.train.v2.api.callback import UserCallback

    from rayflux.sweep.groups import record_groups

    class MetricReports(UserCallback):
        """Forward the records with the sweep's metric (evals)."""

        def after_report(self, run_context, metrics, checkpoint):
            if metrics and metric in metrics[0]:
                plain = {k: v for k, v in metrics[0].items() if isinstance(v, (int, float, str, bool))}
                channel.put((REPORT, tag, plain))

    class ControllerHandle(ControllerCallback):
        """Send the controller's own handle once it runs (a trial may run several trainers: one per segment)."""

        def after_controller_start(self, train_run_context) -> None:
            channel.put((CONTROLLER, tag, ray.get_runtime_context().current_actor))

    return [MetricReports(), ControllerHandle(), record_groups(trial_dir)]

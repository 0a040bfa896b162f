"""A sweep's Tune trainable: each trial's job runs in a thread of a process that Tune hands on to the next trial.

With ``reuse_actors``, Tune gives a freed trial's process to the next trial through :meth:`TrialTrainable.reset_config`
instead of starting a new one: the next trial starts without a process start and new imports of torch and the job's
modules (5-22 s measured on two cores). A reused process must carry nothing of one trial into the next:

- **A stopped trial is still training when Tune keeps its process.** Tune stops asking for its results, nothing more;
  its trainer goes on until its process ends. So :meth:`~TrialTrainable.reset_config` ends it first: it kills the
  trainer's controller (its workers end with it), removes its placement groups, and waits for the trial's thread to
  return. Only then does the next trial start, so two trials' job code never runs at once in one process. (A
  function trainable's own ``reset_config`` gives up after 2 s and returns False, and Tune then fails the *next*
  trial without running it: the trial that went missing from a sweep's results when ``reuse_actors`` was first tried.)
- **A late report of the trial before.** Each trial attempt tags its messages (:mod:`rayflux.sweep.report`); the
  trainable drops a message with another tag, so no result is counted for the wrong trial.

A failed trial's process is not reused (Tune ends a trainable whose step raised); its retry starts a new one.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from ray import tune
from ray.tune.result import RESULT_DUPLICATE

from rayflux.sweep import report
from rayflux.sweep.groups import release
from rayflux.sweep.trial import run_trial, trial_dir

log = logging.getLogger("rayflux")

POLL_SECONDS = 0.5
"""How long one wait on the channel lasts before the trainable looks whether the trial's thread has ended."""
END_SECONDS = 120.0
"""How long :meth:`TrialTrainable.reset_config` waits for a stopped trial's thread to return once its trainer was
killed (it returns within seconds: its ``fit`` raises as the controller dies) before giving up on reusing the process."""


class _Attempt:
    """One trial's job, running in its own thread; ``error``: what it raised, once it ended. Its last message on the
    channel says it ended, so the trainable's wait returns at once instead of at its next poll."""

    def __init__(self, tag: str, out: str, job, channel):
        self.tag, self.out, self.channel = tag, out, channel
        self.controllers: list = []
        """Handles of its trainers' controllers, as they announced themselves."""
        self.killed = 0
        """How many of them were killed."""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(job,), name=f"trial {tag}", daemon=True)
        self.thread.start()

    def _run(self, job) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - handed to Tune by the next step
            self.error = exc
        finally:
            try:  # after every report of the job's, so nothing follows it; a full channel is drained by the trainable
                self.channel.put((report.ENDED, self.tag, None), timeout=END_SECONDS)
            except Exception as exc:  # noqa: BLE001 - the channel is gone (cleanup): the poll still sees the end
                log.debug("sweep: trial %s could not say it ended: %s", self.tag, exc)


class TrialTrainable(tune.Trainable):
    """One sweep trial at a time: :func:`rayflux.sweep.trial.run_trial` in a thread, its eval reports as Tune
    results. Built with ``tune.with_parameters(TrialTrainable, base=..., sweep_output=..., metric=...)``."""

    def setup(self, config: dict, base: dict, sweep_output: str, metric: str) -> None:
        from ray.util.queue import Queue

        self.base, self.sweep_output, self.metric = base, sweep_output, metric
        self.channel = Queue(maxsize=1, actor_options={"num_cpus": 0})  # one per process, for all its trials
        self.attempts = itertools.count()
        self.attempt = self._begin(config)

    def _begin(self, settings: dict) -> _Attempt:
        out = trial_dir(self.sweep_output, self.trial_id)
        tag = f"{self.trial_id}/{next(self.attempts)}"
        channel, metric = self.channel, self.metric

        def callbacks() -> list:
            return report.trial_callbacks(channel, tag, metric, out)

        return _Attempt(tag, out, lambda: run_trial(dict(settings), self.base, out, callbacks), channel)

    def step(self) -> dict:
        """The trial's next eval record; when its job returned, Tune's mark for "done with the last result"; when it
        raised, that error."""
        attempt = self.attempt
        while True:
            running = attempt.thread.is_alive()
            message = self._take(attempt, wait=running)
            if message is not None:
                return message
            if not running:  # every report was put before the job returned: none is left
                if attempt.error is not None:
                    raise attempt.error
                return {RESULT_DUPLICATE: True}

    def _take(self, attempt: _Attempt, wait: bool) -> dict | None:
        """The attempt's next report from the channel (None when there is none); controller handles are kept on the
        attempt, messages of earlier attempts dropped."""
        from ray.util.queue import Empty

        while True:
            try:
                kind, tag, payload = self.channel.get(block=wait, timeout=POLL_SECONDS if wait else None)
            except Empty:
                return None
            if tag != attempt.tag:
                log.debug("sweep: dropped a %s message of an earlier trial (%s)", kind, tag)
            elif kind == report.CONTROLLER:
                attempt.controllers.append(payload)
            elif kind == report.ENDED:
                attempt.thread.join()  # it returns right after this message
                return None
            else:
                return payload

    def reset_config(self, new_config: dict) -> bool:
        """Run the next trial in this process: end the trial before (a stopped one still trains), then start it."""
        if not self._end(self.attempt):
            return False
        self.attempt = self._begin(new_config)
        return True

    def cleanup(self) -> None:
        self._end(self.attempt)
        self.channel.shutdown()

    def _end(self, attempt: _Attempt) -> bool:
        """Kill the attempt's trainers and wait for its thread; False when it still runs after ``END_SECONDS``."""
        import ray

        deadline = time.monotonic() + END_SECONDS
        while attempt.thread.is_alive():
            self._take(attempt, wait=False)  # picks up a controller that announced itself meanwhile
            for controller in attempt.controllers[attempt.killed :]:
                try:
                    ray.kill(controller, no_restart=True)
                except ray.exceptions.RayError as exc:  # it ended on its own meanwhile
                    log.debug("sweep: controller of %s: %s", attempt.tag, exc)
                attempt.killed += 1
            release(attempt.out)
            attempt.thread.join(timeout=POLL_SECONDS)
            if time.monotonic() > deadline:
                log.error("sweep: trial %s still runs %.0fs after its trainer was ended", attempt.tag, END_SECONDS)
                return False
        if attempt.killed:
            log.info("sweep: ended the trainer of stopped trial %s before the next trial", attempt.tag)
        return True

"""What the driver hands every training worker: one frozen record, the only value of Ray Train's
``train_loop_config`` dict (under :data:`LOOP_KEY`)."""

from __future__ import annotations

from dataclasses import dataclass

from rayflux.train.plan import TrainPlan


@dataclass(frozen=True)
class LoopConfig:
    """What the driver hands every training worker (``train_loop_config={LOOP_KEY: LoopConfig(...)}``)."""

    job: dict
    """The run's :class:`~rayflux.config.JobConfig` as a dict (rebuilt on the worker; Weights & Biases logs it)."""
    output_dir: str
    """``run.output_dir``: validation images, TensorBoard events, the step log and the LoRA files."""
    text_length: int
    """The model's padded text length (the driver read the model's configs once; workers need not)."""
    handoff: object = None
    """The run's :class:`~rayflux.train.handoff.Handoff` actor: each worker waits on it for the committed generation,
    which fills the three fields below (:func:`rayflux.train.handoff.filled`)."""
    plan: TrainPlan | None = None
    """The trainer run's plan without its sample list (:meth:`~rayflux.train.plan.TrainPlan.for_workers`): the epochs
    it covers, the eval plan, the run's checkpoint storage (``plan.feed.run_storage``). None until handed over."""
    empty_caption: dict | None = None
    """Where the empty caption's embeddings are (:meth:`rayflux.cache.manifest.Manifest.empty_caption`), for
    caption dropout: one ranged read."""
    caption_tables: tuple[str, ...] = ()
    """The generation's caption index files: caption tag counts for kohya metadata."""
    progress: object = None
    """The driver's progress board actor: rank 0 tells the bar about each step."""
    renderer: object = None
    """The validation render actor: rank 0 queues renders on it."""
    phases: str = ""
    """The driver's phase-mark file (:mod:`rayflux.phases`), "" for none: the workers mark into it too."""


LOOP_KEY = "loop"
"""The one key of ``train_loop_config`` (Ray Train takes a dict): its :class:`LoopConfig`."""

"""The model validation renders use: ``model.path``, or ``train.validation.model`` when set (train on FLUX.2 [klein]
base, preview on the step-distilled [klein]); and what the job says about the model it trains on.

A validation model must be of the training model's family with the same transformer shape, so that every LoRA file
of the run loads into it; the job checks that on the driver, from the two models' config files, before any work.
"""

from __future__ import annotations

import dataclasses

from rayflux.config import ConfigError, JobConfig, ModelConfig
from rayflux.families.base import public_config
from rayflux.families.model_index import pipeline_config
from rayflux.models.facts import family
from rayflux.models.location import config_path, read_config


def render_model(cfg: JobConfig) -> ModelConfig:
    """``cfg.model`` with ``train.validation.model`` as its path when set (same revision, dtypes and text length)."""
    if not cfg.train.validation.model:
        return cfg.model
    return dataclasses.replace(cfg.model, path=cfg.train.validation.model, revision="")


def check_validation_model(cfg: JobConfig) -> None:
    """Refuse a ``train.validation.model`` of another family or transformer shape than ``model.path``."""
    if not cfg.train.validation.model:
        return
    render = render_model(cfg)
    trained, shown = family(cfg.model), family(render)
    same = trained is shown and public_config(read_config(cfg.model, "transformer")) == public_config(
        read_config(render, "transformer")
    )
    if not same:
        raise ConfigError(
            f"train.validation.model={render.path}: its transformer must be a {', '.join(trained.pipelines.values())} "
            "of model.path's shape, so that the run's LoRA files load into it (e.g. FLUX.2 [klein] base and its distilled model)"
        )


def training_warning(cfg: ModelConfig) -> str:
    """What the job warns about before training on ``model.path`` (the model family's
    :meth:`~rayflux.families.base.Family.training_warning`: a step-distilled FLUX.2 [klein] names its base); empty
    when nothing, or when ``model.allow_distilled`` silences it."""
    if cfg.allow_distilled:
        return ""
    path = config_path(cfg)
    return family(cfg).training_warning(path, pipeline_config(path, cfg.revision), read_config(cfg, "transformer"))

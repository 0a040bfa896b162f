"""Typed job configuration: one dataclass per section, YAML files, dotted ``--set`` overrides and generated help.

Each section lives in its own module beside the checks of its values (``data``, ``model``, ``cache``, ``train``,
``run``); ``job`` gathers them, ``loader`` builds a config from defaults, a file and overrides and writes ``--help``
from the fields' docstrings, ``checks`` validates the whole job, and ``arguments`` gives every command the same
``--config``/``--set`` handling. The package imports nothing else of rayflux, so every other module may build on it.
"""

from rayflux.config.arguments import add_set_arg, load_or_report
from rayflux.config.cache import CacheConfig, actor_count, actor_cpus, check_pools, refresh_interval
from rayflux.config.checks import validate
from rayflux.config.data import DataConfig, DatasetConfig, datasets_of
from rayflux.config.job import SECTIONS, JobConfig
from rayflux.config.loader import ALIASES, apply, field_docs, from_dict, help_text, load, parse_set
from rayflux.config.model import ModelConfig
from rayflux.config.run import RunConfig
from rayflux.config.train import TrainConfig, checkpointing_setting, worker_range
from rayflux.config.values import ConfigError, coerce, resource_map

__all__ = [
    "ALIASES",
    "SECTIONS",
    "CacheConfig",
    "ConfigError",
    "DataConfig",
    "DatasetConfig",
    "JobConfig",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "actor_count",
    "add_set_arg",
    "actor_cpus",
    "apply",
    "check_pools",
    "checkpointing_setting",
    "coerce",
    "datasets_of",
    "field_docs",
    "from_dict",
    "help_text",
    "load",
    "load_or_report",
    "parse_set",
    "refresh_interval",
    "resource_map",
    "validate",
    "worker_range",
]

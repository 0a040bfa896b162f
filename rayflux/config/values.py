"""Config errors and turning YAML/CLI values into a field's type, shared by every section."""

from __future__ import annotations

import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration problem the user must fix; its message names the key."""


def coerce(key: str, value: Any, default: Any, annotation: Any) -> Any:
    """Turn a YAML/CLI value into the field's type, or raise a ConfigError naming the key."""
    if annotation in ("Any", Any) or annotation is typing.Any:
        return value
    kind = type(default)
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered in ("true", "1", "yes", "on"):
                    return True
                if lowered in ("false", "0", "no", "off"):
                    return False
                raise ValueError(value)
            if isinstance(value, (bool, int)):
                return bool(value)
            raise ValueError(value)
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind is float:
            return float(value)
        if kind is str:
            if isinstance(value, bool):  # YAML reads true/false as booleans; choice keys spell them in lower case
                return str(value).lower()
            return "" if value is None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}") from None
    return value


def resource_map(key: str, value: Any) -> dict[str, float]:
    """Check a custom-resource mapping (``{name: amount}``); CPU and GPU have their own keys."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping of resource name to amount, got {value!r}")
    out = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}: resource names must be non-empty strings, got {name!r}")
        if name in ("CPU", "GPU"):
            raise ConfigError(
                f"{key}: set {name} through its own key (cpus_per_worker, actor_cpus, on_gpu, encoders_on_gpu)"
            )
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
            raise ConfigError(f"{key}.{name} must be a positive number, got {amount!r}")
        out[name] = float(amount)
    return out

"""Service configuration: flags over ``HEALTHLOG_*`` environment variables over the
``[serve]`` table of ``healthlog.toml`` in the data directory, over defaults."""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs

from healthlog.documents import converter
from healthlog.logs import LEVELS

LOG_FORMATS = ("kv", "json")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the setting."""


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """A finite number above zero."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number above zero")


# Settings whose values are words, taken in any case (``INFO``, ``Json``).
_ANY_CASE = frozenset({"log_format", "log_level"})
_PORT = attrs.validators.and_(attrs.validators.ge(0), attrs.validators.le(65535))


@attrs.frozen
class ServeConfig:
    """Everything ``healthlog serve`` can be told."""

    host: str = "127.0.0.1"
    port: int = attrs.field(default=8787, validator=_PORT)
    max_body_mib: float = attrs.field(default=256.0, validator=_positive)
    log_format: str = attrs.field(default="kv", validator=attrs.validators.in_(LOG_FORMATS))
    log_level: str = attrs.field(default="info", validator=attrs.validators.in_(LEVELS))
    wake_period_s: float = attrs.field(default=60.0, validator=_positive)
    lease_ttl_s: float = attrs.field(default=15.0, validator=_positive)
    lease_renew_s: float = attrs.field(default=5.0, validator=_positive)
    fold_budget_s: float = attrs.field(default=60.0, validator=_positive)
    fold_budget_per_mib_s: float = attrs.field(default=1.0, validator=_positive)
    body_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    graceful_timeout_s: float = attrs.field(default=20.0, validator=_positive)
    keep_alive_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    stream_send_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    stream_window_events: int = attrs.field(default=100_000, validator=_positive)
    stream_window_days: float = attrs.field(default=30.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.lease_renew_s >= self.lease_ttl_s:
            raise ValueError("lease_renew_s must be shorter than lease_ttl_s")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mib * 2**20)


def load_serve_config(
    config_file: Path, flags: Mapping[str, Any], environ: Mapping[str, str] = os.environ
) -> ServeConfig:
    """Merge the layers; unknown keys in the file are an error, not silently ignored."""
    merged: dict[str, Any] = {}
    if config_file.exists():
        try:
            document = tomllib.loads(config_file.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{config_file}: {exc}") from None
        outside = set(document) - {"serve"}
        if outside:
            raise ConfigError(
                f"{config_file}: unknown settings {sorted(outside)} (outside [serve])"
            )
        table = document.get("serve", {})
        if not isinstance(table, dict):
            raise ConfigError(f"{config_file}: serve must be a table ([serve])")
        unknown = set(table) - set(attrs.fields_dict(ServeConfig))
        if unknown:
            raise ConfigError(f"{config_file}: unknown settings {sorted(unknown)}")
        merged.update(table)
    for name in attrs.fields_dict(ServeConfig):
        value = environ.get(f"HEALTHLOG_{name.upper()}")
        if value is not None:
            merged[name] = value
    merged.update({k: v for k, v in flags.items() if v is not None})
    fields = attrs.fields_dict(attrs.resolve_types(ServeConfig))
    values = {}
    for name, value in merged.items():
        field = fields[name]
        assert field.type is not None
        try:
            values[name] = converter.structure(value, field.type)
            if name in _ANY_CASE:
                values[name] = values[name].lower()
            if field.validator is not None:
                field.validator(None, field, values[name])
        except (cattrs.BaseValidationError, ValueError, TypeError):
            raise ConfigError(f"invalid {name}: {value!r}") from None
    try:
        return ServeConfig(**values)
    except ValueError as exc:
        raise ConfigError(f"invalid settings: {exc}") from None

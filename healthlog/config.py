"""Service configuration: flags over ``HEALTHLOG_*`` environment variables over the
``[serve]`` table of ``healthlog.toml`` in the data directory, over defaults."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs

from healthlog.documents import converter

LOG_FORMATS = ("kv", "json")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the setting."""


@attrs.frozen
class ServeConfig:
    """Everything ``healthlog serve`` can be told."""

    host: str = "127.0.0.1"
    port: int = 8787
    max_body_mib: float = 256.0
    log_format: str = attrs.field(default="kv", validator=attrs.validators.in_(LOG_FORMATS))
    log_level: str = "info"
    wake_period_s: float = 60.0
    lease_ttl_s: float = 15.0
    lease_renew_s: float = 5.0
    fold_budget_s: float = 60.0
    fold_budget_per_mib_s: float = 1.0
    body_timeout_s: float = 60.0
    graceful_timeout_s: float = 20.0
    keep_alive_timeout_s: float = 30.0
    stream_send_timeout_s: float = 30.0
    stream_window_events: int = 100_000
    stream_window_days: float = 30.0

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
            table = tomllib.loads(config_file.read_text()).get("serve", {})
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{config_file}: {exc}") from None
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
            if field.validator is not None:
                field.validator(None, field, values[name])
        except (cattrs.BaseValidationError, ValueError, TypeError):
            raise ConfigError(f"invalid {name}: {value!r}") from None
    return ServeConfig(**values)

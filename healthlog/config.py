"""Service configuration: flags over ``HEALTHLOG_*`` environment variables over the
``[serve]`` table of ``healthlog.toml`` in the data directory, over defaults. The other commands
take the log settings from the same layers, without flags (:func:`load_log_config`).

Every setting is checked before anything starts: a value of the wrong kind (a port with a
fraction, ``true`` for a number) or out of its range is refused with one line naming the
setting, where it came from and what it accepts. The upper bounds are where healthlog would
otherwise fail later, while serving: the kernel's limit on ``TCP_USER_TIMEOUT``, and the
microseconds of the lease's expiry and of the event window's age in a SQLite integer.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from healthlog.logs import LEVELS

LOG_FORMATS = ("kv", "json")
SQLITE_MAX_INTEGER = 2**63 - 1
TCP_USER_TIMEOUT_MAX_S = (2**31 - 1) // 1000
"""Linux takes ``TCP_USER_TIMEOUT`` (``stream_send_timeout_s``) in milliseconds, a C int."""
LEASE_TTL_MAX_S = 10**9
"""The lease's expiry is stored in microseconds since the epoch, a SQLite integer."""
WINDOW_DAYS_MAX = 10**6
"""The event window's cutoff is now less the window's age in microseconds, a SQLite integer."""


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the setting."""


def _words(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1]


@attrs.frozen
class Accepts:
    """What a setting accepts: a ``kind`` of value, one of ``choices``, or within ``low`` (or
    above it, when ``above``) to ``high``; ``text`` says it to a person."""

    kind: type
    text: str
    low: float | None = None
    high: float | None = None
    above: bool = False
    choices: tuple[str, ...] | None = None

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        """An attrs validator."""
        if not self.takes(value):
            raise ValueError(f"{attribute.name} must be {self.text}")

    def takes(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, self.kind):
            return False
        if isinstance(value, str):
            if self.choices is not None:
                return value in self.choices
            # A host: never empty, which would listen on every interface unasked.
            return bool(value) and not any(c.isspace() for c in value) and _askable(value)
        if not isinstance(value, int | float):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return self.high is None or value <= self.high


def _askable(host: str) -> bool:
    """Whether the resolver can be asked for ``host``: one that is not ASCII goes to it in
    IDNA, which refuses an empty label (a typo's ``..``, a leading dot) or one longer than 63
    characters; the socket's bind then ended ``serve`` with a traceback (``TypeError: encoding
    of hostname failed``, CLI-272)."""
    if host.isascii():
        return True
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


def _seconds(high: int | None = None) -> Accepts:
    text = "a number of seconds above zero" + ("" if high is None else f", at most {high:,}")
    return Accepts(float, text, 0, high, above=True)


def _choice(choices: tuple[str, ...]) -> Accepts:
    return Accepts(str, _words(choices), choices=choices)


@attrs.frozen
class ServeConfig:
    """Everything ``healthlog serve`` can be told."""

    host: str = attrs.field(
        default="127.0.0.1",
        validator=Accepts(str, "a host name or IP address (0.0.0.0 for every interface)"),
    )
    port: int = attrs.field(
        default=8787, validator=Accepts(int, "a whole number from 0 to 65535", 0, 65535)
    )
    max_body_mib: float = attrs.field(
        converter=float,
        default=256.0,
        validator=Accepts(float, "a number of MiB above zero", 0, above=True),
    )
    intake_memory_mib: float = attrs.field(
        converter=float,
        default=128.0,
        validator=Accepts(float, "a number of MiB above zero", 0, above=True),
    )
    log_format: str = attrs.field(default="kv", validator=_choice(LOG_FORMATS))
    log_level: str = attrs.field(default="info", validator=_choice(LEVELS))
    wake_period_s: float = attrs.field(converter=float, default=60.0, validator=_seconds())
    lease_ttl_s: float = attrs.field(
        converter=float, default=15.0, validator=_seconds(LEASE_TTL_MAX_S)
    )
    lease_renew_s: float = attrs.field(
        converter=float, default=5.0, validator=_seconds(LEASE_TTL_MAX_S)
    )
    fold_budget_s: float = attrs.field(converter=float, default=60.0, validator=_seconds())
    fold_budget_per_mib_s: float = attrs.field(converter=float, default=1.0, validator=_seconds())
    body_timeout_s: float = attrs.field(converter=float, default=60.0, validator=_seconds())
    graceful_timeout_s: float = attrs.field(converter=float, default=20.0, validator=_seconds())
    keep_alive_timeout_s: float = attrs.field(converter=float, default=30.0, validator=_seconds())
    stream_send_timeout_s: float = attrs.field(
        converter=float, default=30.0, validator=_seconds(TCP_USER_TIMEOUT_MAX_S)
    )
    stream_max_subscribers: int = attrs.field(
        default=32, validator=Accepts(int, "a whole number of 1 or more", 1)
    )
    stream_window_events: int = attrs.field(
        default=100_000,
        validator=Accepts(
            int, f"a whole number from 1 to {SQLITE_MAX_INTEGER}", 1, SQLITE_MAX_INTEGER
        ),
    )
    stream_window_days: float = attrs.field(
        converter=float,
        default=30.0,
        validator=Accepts(
            float,
            f"a number of days above zero, at most {WINDOW_DAYS_MAX:,}",
            0,
            WINDOW_DAYS_MAX,
            above=True,
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.lease_renew_s >= self.lease_ttl_s:
            raise ValueError("lease_renew_s must be shorter than lease_ttl_s")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mib * 2**20)

    @property
    def intake_memory_bytes(self) -> int:
        return int(self.intake_memory_mib * 2**20)


DEFAULTS = ServeConfig()
LOG_SETTINGS = ("log_format", "log_level")


@attrs.frozen
class LogConfig:
    """How a command other than ``serve`` logs. Nothing set, it logs at WARNING, so that a
    command says only what needs saying; ``serve`` logs at INFO."""

    log_format: str = DEFAULTS.log_format
    log_level: str = "warning"


def accepts(name: str) -> Accepts:
    """What setting ``name`` accepts."""
    validator = attrs.fields_dict(ServeConfig)[name].validator
    assert isinstance(validator, Accepts)
    return validator


# Settings whose values are words, taken in any case (``INFO``, ``Json``).
_ANY_CASE = frozenset({"log_format", "log_level"})
_WHOLE = re.compile(r"[+-]?[0-9]+")
_SHOWN_CHARS = 40


def _value(name: str, raw: object) -> object:
    """``raw`` (from the file, or a string from the environment or a flag) as setting ``name``
    holds it, for its validator to judge; ValueError when it is not even of the setting's
    kind. A truth value is never a number, nor a number with a fraction a whole number (a
    whole number written as a float is one)."""
    kind = accepts(name).kind
    if isinstance(raw, bool):
        raise ValueError(name)
    if kind is str:
        if not isinstance(raw, str):
            raise ValueError(name)
        return raw.lower() if name in _ANY_CASE else raw
    if isinstance(raw, str):
        text = raw.strip()
        if kind is int and not _WHOLE.fullmatch(text):
            raise ValueError(name)
        return kind(text)
    if not isinstance(raw, int | float):
        raise ValueError(name)
    if kind is int and isinstance(raw, float):
        # TOML writes a whole number as a float too (``8787.0``, ``1e5``), which was taken.
        if not raw.is_integer():
            raise ValueError(name)
        return int(raw)
    return kind(raw)


def _shown(value: object) -> str:
    """The refused value, cut short: one line however long it was."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _layers(
    config_file: Path | None, flags: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, tuple[object, str]]:
    """Each setting given, as given, with where it came from: a flag over its ``HEALTHLOG_*``
    variable over the ``[serve]`` table of ``config_file``, if any. The file must be one that
    ``serve`` reads: unknown keys in it are an error, not silently ignored."""
    merged: dict[str, tuple[object, str]] = {}
    if config_file is not None and config_file.exists():
        try:
            document = tomllib.loads(config_file.read_text())
        except (ValueError, RecursionError) as exc:
            # TOMLDecodeError, UnicodeDecodeError, or an integer too long for Python to read.
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
        merged.update((name, (value, str(config_file))) for name, value in table.items())
    for name in attrs.fields_dict(ServeConfig):
        variable = f"HEALTHLOG_{name.upper()}"
        if variable in environ:
            merged[name] = (environ[variable], variable)
    merged.update(
        (name, (value, "--" + name.replace("_", "-")))
        for name, value in flags.items()
        if value is not None
    )
    return merged


def _checked(name: str, raw: object, source: str) -> object:
    """The value of setting ``name`` given as ``raw`` by ``source``, if the setting accepts it."""
    rule = accepts(name)
    try:
        value = _value(name, raw)
        rule(None, attrs.fields_dict(ServeConfig)[name], value)
    except (ValueError, OverflowError):
        raise ConfigError(
            f"invalid {name}: {_shown(raw)} (from {source}); it must be {rule.text}"
        ) from None
    return value


def load_serve_config(
    config_file: Path, flags: Mapping[str, Any], environ: Mapping[str, str] = os.environ
) -> ServeConfig:
    """Merge the layers; unknown keys in the file are an error, not silently ignored."""
    merged = _layers(config_file, flags, environ)
    values: dict[str, Any] = {
        name: _checked(name, raw, source) for name, (raw, source) in merged.items()
    }
    try:
        return ServeConfig(**values)
    except ValueError as exc:
        # Each value passed its own check: what is left is how the lease's two relate.
        given = [
            f"{name} {_shown(merged[name][0])} (from {merged[name][1]})"
            if name in merged
            else f"{name} {getattr(DEFAULTS, name)} (the default)"
            for name in ("lease_renew_s", "lease_ttl_s")
        ]
        raise ConfigError(f"invalid settings: {exc}: {', '.join(given)}") from None


def load_log_config(config_file: Path | None, environ: Mapping[str, str] = os.environ) -> LogConfig:
    """How a command other than ``serve`` logs: ``HEALTHLOG_LOG_FORMAT`` and
    ``HEALTHLOG_LOG_LEVEL`` over the ``[serve]`` table of ``config_file`` (the data directory's
    ``healthlog.toml``; None for a command without a data directory), over :class:`LogConfig`'s
    defaults. The file is read as ``serve`` reads it, but only the log settings' values are
    checked here: the others are checked by the commands that use them (``import`` and ``seal``
    fold under them), so that a port ``serve`` refuses does not stop ``export``."""
    merged = _layers(config_file, {}, environ)
    values: dict[str, Any] = {
        name: _checked(name, *merged[name]) for name in LOG_SETTINGS if name in merged
    }
    return LogConfig(**values)

"""Log records as one line each, ``key=value`` or JSON. Records carry ids and counts only:
no point value, body, device name or token is ever logged above DEBUG."""

from __future__ import annotations

import logging
import os
import sys
import time

import orjson

LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT_ENV = "HEALTHLOG_LOG_FORMAT"
LOG_LEVEL_ENV = "HEALTHLOG_LOG_LEVEL"
ACCEPT_LOGGER = "trio.serve_listeners"
"""Where trio logs a failed ``accept`` (EMFILE: every file descriptor in use), at ERROR ten times
a second for as long as it lasts."""
ACCEPT_LOG_PERIOD_S = 60.0


class _UtcFormatter(logging.Formatter):
    """Record times in UTC with a ``Z``, as every instant healthlog writes (TIME-18): in the
    zone of ``TZ`` and without an offset, they could not be set beside a ``received_at``, and
    the hour repeated at the end of daylight saving time read the same twice."""

    def utc_time(self, record: logging.LogRecord) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))


def _utf8(text: str) -> str:
    """``text`` as UTF-8 can carry it: a byte of a path that is not UTF-8 (``données`` named
    under Latin-1), which Python reads as a lone surrogate, written as its escape (``\\udce9``),
    as the commands' own lines on stderr write it. orjson refuses a lone surrogate: the record
    was lost, a ``--- Logging error ---`` traceback on stderr in its place (SERVE-160)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class KeyValueFormatter(_UtcFormatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"time={self.utc_time(record)} level={record.levelname}"
            f" logger={record.name} msg={orjson.dumps(_utf8(record.getMessage())).decode()}"
        )
        if record.exc_info and record.levelno <= logging.DEBUG:
            line += " exc=" + orjson.dumps(_utf8(self.formatException(record.exc_info))).decode()
        return line


class JsonFormatter(_UtcFormatter):
    def format(self, record: logging.LogRecord) -> str:
        document = {
            "time": self.utc_time(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": _utf8(record.getMessage()),
        }
        if record.exc_info and record.levelno <= logging.DEBUG:
            document["exc"] = _utf8(self.formatException(record.exc_info))
        return orjson.dumps(document).decode()


def setup_logging(fmt: str = "kv", level: str = "info") -> None:
    """Send records of ``level`` and above to stderr, one line each; worker processes started
    later inherit the same choice through the environment."""
    os.environ[LOG_FORMAT_ENV] = fmt
    os.environ[LOG_LEVEL_ENV] = level
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("hypercorn.access", "hypercorn.error"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    accept = logging.getLogger(ACCEPT_LOGGER)
    for old in [f for f in accept.filters if isinstance(f, Throttle)]:
        accept.removeFilter(old)
    accept.addFilter(Throttle(ACCEPT_LOG_PERIOD_S))


class Throttle(logging.Filter):
    """Let one record through per ``period_s`` (monotonic clock); the next one through says
    how many were held back meanwhile."""

    def __init__(self, period_s: float) -> None:
        super().__init__()
        self._period_s = period_s
        self._last: float | None = None
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if self._last is not None and now - self._last < self._period_s:
            self._held += 1
            return False
        if self._held:
            record.msg = (
                f"{record.getMessage()} ({self._held} more like it not logged since the last one)"
            )
            record.args = ()
        self._last, self._held = now, 0
        return True

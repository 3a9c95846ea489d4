"""Small Health Auto Export body builders for the command-line tests, and ``raw_point``.

Bodies are built from raw point bytes, so a test controls exactly what is sent (key order,
escapes, duplicate keys) and can compare the export with those very bytes (``raw_point``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path


def compact(value: object) -> bytes:
    """``value`` as compact JSON, non-ASCII characters kept raw."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def point(date: str, **fields: object) -> bytes:
    """A point stamped by ``date``, then ``fields`` in the order given."""
    return compact({"date": date, **fields})


def metric(name: str, units: str | None, *points: bytes) -> bytes:
    """One entry of ``metrics``: name, units and the raw points."""
    return b'{"name":%s,"units":%s,"data":[%s]}' % (
        compact(name),
        compact(units),
        b",".join(points),
    )


def body(*metrics: bytes, **sections: Sequence[bytes]) -> bytes:
    """An envelope ``{"data": {"metrics": [...], SECTION: [...], ...}}``."""
    parts = [b'"metrics":[%s]' % b",".join(metrics)]
    parts.extend(b"%s:[%s]" % (compact(name), b",".join(items)) for name, items in sections.items())
    return b'{"data":{%s}}' % b",".join(parts)


def write(path: Path, content: bytes) -> Path:
    """Write ``content`` to ``path`` and return the path."""
    path.write_bytes(content)
    return path


def raw_point(line: bytes) -> bytes:
    """The bytes of the ``point`` value of an export line (its last key)."""
    found = re.search(rb'"point"\s*:\s*', line)
    assert found is not None, line
    rest = line[found.end() :].rstrip()
    assert rest.endswith(b"}"), line
    return rest[:-1].rstrip()

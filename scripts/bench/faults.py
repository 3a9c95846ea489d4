"""What an inert fault point costs (X1): a call to ``faults.point`` with no plan loaded, against
an empty call, best of ``REPEATS`` timings of ``CALLS`` calls each. The figure is reported, not
bounded; a fold passes a few fault points per object it writes.
"""

from __future__ import annotations

import timeit

import common

from healthlog import faults

CALLS = 1_000_000
REPEATS = 5


def main() -> None:
    point = min(
        timeit.repeat(lambda: faults.point("fold.object_write"), number=CALLS, repeat=REPEATS)
    )
    empty = min(timeit.repeat(lambda: None, number=CALLS, repeat=REPEATS))
    print(f"faults: {CALLS} calls, best of {REPEATS}; no plan loaded")
    common.print_rows(
        [
            common.Row(
                "inert fault point",
                f"{point / CALLS * 1e9:.0f} ns per call",
                f"empty call {empty / CALLS * 1e9:.0f} ns",
                f"{point / empty:.2f}",
                "reported",
                "ok",
            )
        ]
    )


if __name__ == "__main__":
    main()

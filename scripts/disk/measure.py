#!/usr/bin/env python3
"""Import a data set of make_dataset.py into a fresh data directory and print the README's
disk figures: file sizes, the objects table and its index (SQLite's dbstat), change events,
a snapshot file, verify's copy of the object summaries, and the time and peak memory of
import, reindex and verify. Usage: measure.py BODIES_DIR DATA_DIR (DATA_DIR must not exist)
"""

import argparse
import os
import re
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from healthlog.storage import snapshot_files
from healthlog.storage.datadir import DataDir

HEALTHLOG = Path(sys.executable).with_name("healthlog")
BATCH = 400


def run(label: str, *args: str) -> None:
    """Run ``healthlog ARGS`` under /usr/bin/time -v; print its wall time and peak RSS."""
    cmd = ["/usr/bin/time", "-v", str(HEALTHLOG), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", done.stderr)
    assert rss is not None
    assert wall is not None
    print(f"{label}: {wall.group(1)} wall, largest process {int(rss.group(1)) * 1024:,} B RSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bodies", type=Path)
    parser.add_argument("data", type=Path)
    args = parser.parse_args()
    if args.data.exists():
        parser.error(f"{args.data} exists")
    files = sorted(str(p) for p in args.bodies.glob("*.json"))
    sent = sum(os.path.getsize(f) for f in files)
    days = len(files) / 4
    print(f"data set: {len(files):,} deliveries, {sent:,} B of JSON, {days:,.0f} days")
    start = time.monotonic()
    for i in range(0, len(files), BATCH):
        cmd = [str(HEALTHLOG), "import", "--data", str(args.data), *files[i : i + BATCH]]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(f"import: {time.monotonic() - start:.0f} s, largest process {peak:,} B RSS")
    data = DataDir(args.data)
    for path in sorted(args.data.iterdir()):
        if path.is_file():
            print(f"  {path.name}: {path.stat().st_size:,} B")
    journal, store = data.journal_path.stat().st_size, data.store_path.stat().st_size
    with sqlite3.connect(f"file:{data.store_path}?mode=ro", uri=True) as db:
        stat = (
            "SELECT name, SUM(pgsize), SUM(unused), SUM(pagetype = 'overflow') FROM dbstat"
            " GROUP BY name HAVING SUM(pgsize) > 100000 ORDER BY 2 DESC"
        )
        pages: dict[str, int] = {}
        for name, size, unused, overflow in db.execute(stat):
            pages[name] = size
            print(f"  {name}: {size:,} B, {unused:,} B of it unused, {overflow:,} overflow pages")
        row = "SELECT COUNT(*), SUM(LENGTH(body)) FROM objects"
        objects, bodies = db.execute(row).fetchone()
        (events,) = db.execute("SELECT COUNT(*) FROM events").fetchone()
    print(f"  {objects:,} objects, {bodies:,} B of bodies; {events:,} change events")
    per_year = 365 / days / 1_000_000
    held = pages.get("objects", 0) + pages.get("objects_key", 0)
    print(
        f"per year: journal {journal * per_year:.0f} MB, store {store * per_year:.0f} MB"
        f" ({held * per_year:.0f} MB of it the objects and their key)"
    )
    with data.open_journal() as jnl, data.open_store() as st:
        manifest = snapshot_files.build(data.snapshot_dir, jnl, st, data.signing_key(), "x")
        snap = next(data.snapshot_dir.glob("snapshot-*.snap")).stat().st_size
        print(f"snapshot at seq {manifest.seq:,}: {snap:,} B")
        with tempfile.TemporaryDirectory(dir=args.data) as scratch:
            summaries = Path(scratch) / "summaries.sqlite"
            st.snapshot_into(summaries)
            print(f"verify's copy of the object summaries: {summaries.stat().st_size:,} B")
    run("reindex", "reindex", "--data", str(args.data))
    run("verify", "verify", "--data", str(args.data))


if __name__ == "__main__":
    main()

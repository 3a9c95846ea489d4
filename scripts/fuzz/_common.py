"""What the fuzz harnesses share: their seeds and how libFuzzer is started.

Each harness is run as ``.venv/bin/python scripts/fuzz/NAME.py [libFuzzer flags]``. Its seeds
are written on the first run to ``scripts/fuzz/corpus/NAME/`` (not committed: they are made
again from the sources below), and libFuzzer adds there every input that reached new
coverage. Only a harness's documented outcomes are caught; anything else propagates, and
libFuzzer writes the input that raised it as ``crash-*`` in the working directory. ``-timeout=1``
makes an input that runs for more than a second a finding, ``-rss_limit_mb`` one that grows
memory past the bound.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

DEFAULT_FLAGS = ["-timeout=1", "-rss_limit_mb=1024", "-max_len=65536"]


def delivery_seeds() -> list[bytes]:
    """Bodies of our own: the hostile corpus (generated classes and ``tests/hostile/``) but
    for its oversized bodies, and a few app-shaped deliveries of ``tests/fixtures.py``."""
    from _hostile_corpus import corpus
    from fixtures import make_body, resend

    bodies = [case.body for case in corpus() if len(case.body) <= 65536]
    for seed, layer in enumerate(("seconds", "minutes", "hours", "days")):
        body = make_body(seed, layer=layer, hours=2 if layer != "seconds" else 1, richness=2)
        if len(body) <= 65536:
            bodies += [body, resend(body, seed)]
    bodies.append(
        make_body(
            9, metrics=("sleep_analysis", "heart_rate", "blood_pressure"), layer="hours", hours=3
        )
    )
    return bodies


def run(name: str, test: Callable[[bytes], None], seeds: Callable[[], Iterable[bytes]]) -> None:
    """Write the seeds of harness ``name`` if it has none yet, then fuzz ``test`` from them."""
    corpus = Path(__file__).resolve().parent / "corpus" / name
    if not corpus.is_dir() or not any(corpus.iterdir()):
        corpus.mkdir(parents=True, exist_ok=True)
        for data in seeds():
            (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)
    # What the code under test logs (collisions, mismatches) is not what is fuzzed.
    logging.disable(logging.CRITICAL)
    argv = [sys.argv[0], *DEFAULT_FLAGS, *sys.argv[1:]]
    if not any(not arg.startswith("-") for arg in sys.argv[1:]):
        argv.append(str(corpus))
    atheris.Setup(argv, test)
    atheris.Fuzz()

"""Bench: timing of generated kernels beside the field's baselines.

:mod:`.core` times, checks the result schema and writes results; :mod:`.baselines`
is the one registry of baselines; :mod:`.flops` counts what attention computes;
each suite (:mod:`.prefill`, :mod:`.decode`, :mod:`.backward`) says only which
shapes it runs and what it counts. Importing this package imports no torch.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from specgen.errors import UsageError

SUITES = ("prefill", "decode", "backward")


def parse_suite(name: str, allowed: Sequence[str] = SUITES) -> str:
    """--suite: one of ``allowed`` (tune allows only prefill)."""
    if name not in allowed:
        raise UsageError(f"--suite: unknown {name!r}; allowed: {', '.join(allowed)}")
    return name


def suite_named(name: str):
    """The suite object of specgen.bench.<name> (imported on first use)."""
    return importlib.import_module(f"specgen.bench.{parse_suite(name)}").SUITE


def run_suite(suite: str, paths: list[str], *, results: Path, gen: Path, baselines: Sequence[str],
              shapes: Optional[Sequence] = None,
              log: Optional[Callable[[str], None]] = None) -> list[Path]:
    """`specgen bench --suite SUITE`: time each spec's kernel against ``baselines``
    (names from specgen.bench.baselines); results go to ``results/<gpu>/``.
    ``shapes`` replaces the suite's own (prefill and backward: (batch, heads, seq)
    tuples; decode: (batch, kv_heads, length)). Returns the written results' stems."""
    from specgen.bench.core import run

    return run(suite_named(suite), paths, results=Path(results), gen=Path(gen),
               baselines=tuple(baselines), shapes=shapes,
               log=log or (lambda line: print(line, file=sys.stderr)))

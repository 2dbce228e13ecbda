"""Shared test helpers: the shipped specs and their generated modules."""

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
SPEC_NAMES = [p.stem for p in SPECS]
# Specs whose attention takes [B, H, S, D] tensors (the rest are varlen: packed).
DECODE_SPEC_NAMES = [p.stem for p in SPECS if "\nfamily: decode" in p.read_text()]
VARLEN_SPEC_NAMES = [p.stem for p in SPECS if "\nvarlen: true" in p.read_text()]
DENSE_SPEC_NAMES = [n for n in SPEC_NAMES if n not in DECODE_SPEC_NAMES + VARLEN_SPEC_NAMES]


def generated_module(name: str):
    return importlib.import_module(f"generated.{name}")

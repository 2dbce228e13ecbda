"""Shared test helpers: the shipped specs and their generated modules."""

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
SPEC_NAMES = [p.stem for p in SPECS]


def generated_module(name: str):
    return importlib.import_module(f"generated.{name}")

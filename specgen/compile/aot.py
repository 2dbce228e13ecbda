"""The AOT folder of a generated module: ``<module>.aot/`` beside it, holding the
cubins `specgen build` exported and a manifest the module reads on its first call
(see the ``AotKernel`` of a generated module).

Manifest (format 2)::

    {"format": 2, "cuda_tile": "1.7.0", "source_sha256": <sha256 of the module file>,
     "cubins": {"sm_90-<key>.cubin": <sha256 of its bytes>, ...},
     "entries": [{"kernel": <function name>, "sm": "sm_90", "hints": {...},
                  "signature": <mangled signature>, "symbol": <name in the cubin>,
                  "cubin": "sm_90-<key>.cubin"}, ...]}

The module trusts the folder only while the module's bytes and the running cuda-tile
match the manifest, and a cubin only while its bytes match their hash; a stale,
damaged or unreadable folder is ignored (the JIT compiles instead), never wrong.
`folder_problem` says what `specgen build --check` finds wrong with a folder.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from filelock import FileLock

from specgen.compile.export import (
    CompileResult,
    aot_entries_path,
    atomic_write,
    cache_dir,
    package_version,
)

AOT_FORMAT = 2
# What each manifest entry holds; a generated module's loader requires the same
# (its AOT_ENTRY_KEYS, and AOT_FORMAT beside it: tests/test_aot.py keeps them equal).
ENTRY_KEYS = ("kernel", "sm", "hints", "signature", "symbol", "cubin")


def aot_dir(module_path: Path) -> Path:
    return module_path.with_name(module_path.stem + ".aot")


def write_aot_folder(module_path: Path, source: str, results: list[CompileResult]) -> Path:
    """Copy the cubins of ``results`` beside ``module_path`` and write their manifest;
    cubins of an earlier build that this one does not list are removed."""
    folder = aot_dir(module_path)
    folder.mkdir(parents=True, exist_ok=True)
    # One writer at a time: two builds of other targets would otherwise remove each
    # other's cubins and leave a manifest naming files that are gone.
    with FileLock(str(_lock_path(folder))):
        entries, sums = [], {}
        for result in sorted(results, key=lambda r: r.target):
            for cubin in result.paths:
                name = cubin.name
                data = cubin.read_bytes()
                sums[name] = hashlib.sha256(data).hexdigest()
                if not (folder / name).is_file() or (folder / name).read_bytes() != data:
                    atomic_write(folder / name, data)
                for entry in json.loads(aot_entries_path(cubin).read_text(encoding="utf-8")):
                    entries.append({**entry, "cubin": name})
        text = (json.dumps(_manifest(source, sums, entries), indent=1) + "\n").encode()
        manifest = folder / "manifest.json"
        if not manifest.is_file() or manifest.read_bytes() != text:
            atomic_write(manifest, text)
        # Cubins of an earlier build (never another writer's temporary ".name.xxx" file).
        for stale in folder.glob("*.cubin"):
            if stale.name not in sums:
                stale.unlink(missing_ok=True)
    return folder


def _manifest(source: str, sums: dict, entries: list) -> dict:
    return {
        "format": AOT_FORMAT,
        "cuda_tile": package_version("cuda-tile"),
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "cubins": sums,
        "entries": entries,
    }


def _lock_path(folder: Path) -> Path:
    """A lock file for ``folder`` in the cache (not beside the committed modules)."""
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / f"aot-{key}.lock"


def folder_problem(module_path: Path, source: str, targets, cubins: set | None = None) -> str | None:
    """What makes the AOT folder of ``module_path`` (whose source is ``source``) not
    what a build for ``targets`` leaves, or None: missing, unreadable, for another
    module source or cuda-tile, a target without entries, a cubin gone or changed,
    or (given the names a build would list, ``cubins``) other cubins listed."""
    folder = aot_dir(module_path)
    path = folder / "manifest.json"
    if not path.is_file():
        return f"{folder}: missing (no manifest.json)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        sums, entries = manifest["cubins"], manifest["entries"]
        if not all(all(k in e for k in ENTRY_KEYS) for e in entries):
            raise KeyError("an entry lacks a field")
        listed = {(e["sm"], e["cubin"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path}: unreadable"
    if manifest.get("format") != AOT_FORMAT or manifest.get("cuda_tile") != package_version("cuda-tile"):
        return f"{path}: built by another specgen or cuda-tile"
    if manifest.get("source_sha256") != hashlib.sha256(source.encode()).hexdigest():
        return f"{path}: built from another version of the module"
    missing = sorted(set(targets) - {sm for sm, _ in listed})
    if missing:
        return f"{path}: no cubins for {', '.join(missing)}"
    if cubins is not None and set(sums) != set(cubins):
        return f"{path}: lists other cubins than this build makes (from another build's targets or compiler)"
    for name in sorted({cubin for _, cubin in listed}):
        cubin = folder / name
        if not cubin.is_file():
            return f"{cubin}: listed in the manifest but missing"
        if hashlib.sha256(cubin.read_bytes()).hexdigest() != sums.get(name):
            return f"{cubin}: its bytes do not match the manifest"
    return None

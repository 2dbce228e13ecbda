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

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path

from filelock import FileLock

from specgen.compile.export import (
    ENTRY_FIELDS,
    CompileResult,
    atomic_write,
    cache_dir,
    cached_entries,
    package_version,
)

AOT_FORMAT = 2
# What each manifest entry holds; a generated module's loader requires the same
# (its AOT_ENTRY_KEYS, and AOT_FORMAT beside it: tests/test_aot.py keeps them equal).
ENTRY_KEYS = (*ENTRY_FIELDS, "cubin")


def aot_dir(module_path: Path) -> Path:
    return module_path.with_name(module_path.stem + ".aot")


def _expected(source: str, results: list[CompileResult]) -> tuple[bytes, dict[str, bytes]]:
    """What a build leaves in the AOT folder: (the manifest's bytes, {cubin name: bytes})."""
    entries, sums, cubins = [], {}, {}
    for result in sorted(results, key=lambda r: r.target):
        for cubin in result.paths:
            name = cubin.name
            cubins[name] = data = cubin.read_bytes()
            sums[name] = hashlib.sha256(data).hexdigest()
            for entry in cached_entries(cubin, data) or ():
                entries.append({**entry, "cubin": name})
    return (json.dumps(_manifest(source, sums, entries), indent=1) + "\n").encode(), cubins


def blocked_folder(folder: Path) -> str | None:
    """What keeps ``folder`` from being an AOT folder of its own, or None (a folder,
    or nothing yet): a file there, or a symbolic link (through which a build would
    write, and remove, files elsewhere)."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        kind = "a symbolic link" if folder.is_symlink() else "a file"
        return f"{folder}: {kind}; the module's AOT folder is written there, remove it"
    return None


def _replace(path: Path, data: bytes) -> None:
    """``path`` holding ``data``: a symbolic link there is replaced, never written through."""
    if path.is_symlink():
        path.unlink()
    elif path.is_file() and path.read_bytes() == data:
        return
    atomic_write(path, data)


def write_aot_folder(module_path: Path, source: str, results: list[CompileResult]) -> Path:
    """Copy the cubins of ``results`` beside ``module_path`` and write their manifest;
    cubins of an earlier build that this one does not list are removed."""
    folder = aot_dir(module_path)
    blocked = blocked_folder(folder)
    if blocked:
        raise OSError(blocked)
    folder.mkdir(parents=True, exist_ok=True)
    # One writer at a time: two builds of other targets would otherwise remove each
    # other's cubins and leave a manifest naming files that are gone.
    with _writer_lock(folder):
        text, cubins = _expected(source, results)
        for name, data in cubins.items():
            _replace(folder / name, data)
        _replace(folder / "manifest.json", text)
        # Cubins of an earlier build (never another writer's temporary ".name.xxx" file).
        for stale in folder.glob("*.cubin"):
            if stale.name not in cubins:
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


@contextlib.contextmanager
def _writer_lock(folder: Path):
    """``folder`` for one writer at a time, whatever cache each build uses: an
    exclusive flock on the folder itself (no file added to it). Where the file
    system refuses a directory's flock (NFS), a lock file in the cache instead,
    which orders the builds that share that cache."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            with FileLock(str(_lock_path(folder))):
                yield
            return
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _lock_path(folder: Path) -> Path:
    """A lock file for ``folder`` in the cache (not beside the committed modules)."""
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / f"aot-{key}.lock"


def folder_problem(module_path: Path, source: str, results: list[CompileResult]) -> str | None:
    """What makes the AOT folder of ``module_path`` (whose source is ``source``) not
    what a build of ``results`` leaves, or None: missing, not a folder of its own,
    unreadable, for another module source or cuda-tile, a target without entries, a
    cubin gone, changed or a link, other cubins listed or lying there, or any other
    difference from the manifest the build writes."""
    folder = aot_dir(module_path)
    blocked = blocked_folder(folder)
    if blocked:
        return blocked
    path = folder / "manifest.json"
    if not path.is_file() or path.is_symlink():
        # The one drift a fresh checkout shows for every module: say where it comes from.
        return (f"{folder}: missing (no manifest.json); `specgen build` writes it (git ignores "
                "the .aot folders, so a fresh checkout has none)")
    expected, cubins = _expected(source, results)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        sums, entries = manifest["cubins"], manifest["entries"]
        if not isinstance(sums, dict) or not all(
                isinstance(e, dict) and all(k in e for k in ENTRY_KEYS) and isinstance(e["sm"], str)
                and isinstance(e["cubin"], str) for e in entries):
            raise KeyError("an entry lacks a field")
        listed = {(e["sm"], e["cubin"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{path}: unreadable"
    if manifest.get("format") != AOT_FORMAT or manifest.get("cuda_tile") != package_version("cuda-tile"):
        return f"{path}: built by another specgen or cuda-tile"
    if manifest.get("source_sha256") != hashlib.sha256(source.encode()).hexdigest():
        return f"{path}: built from another version of the module"
    missing = sorted({r.target for r in results} - {sm for sm, _ in listed})
    if missing:
        return f"{path}: no cubins for {', '.join(missing)}"
    if set(sums) != set(cubins) or {cubin for _, cubin in listed} != set(cubins):
        return f"{path}: lists other cubins than this build makes (from another build's targets or compiler)"
    for name, data in sorted(cubins.items()):
        cubin = folder / name
        if cubin.is_symlink() or not cubin.is_file():
            return f"{cubin}: listed in the manifest but missing (or a link)"
        if cubin.read_bytes() != data:
            return f"{cubin}: its bytes are not the ones this build makes"
    if path.read_bytes() != expected:
        return f"{path}: not the manifest this build writes (an entry, a hint or a field differs)"
    others = sorted(p.name for p in folder.iterdir()
                    if p.name != "manifest.json" and p.name not in cubins and not p.name.startswith("."))
    if others:
        return f"{folder}: holds files this build does not write ({', '.join(others)})"
    return None

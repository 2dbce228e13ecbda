"""The AOT folder of a generated module: ``<module>.aot/`` beside it, holding the
cubins `specgen build` exported and a manifest the module reads on its first call
(see the ``AotKernel`` of a generated module).

Manifest (format 1)::

    {"format": 1, "cuda_tile": "1.7.0", "source_sha256": <sha256 of the module file>,
     "entries": [{"kernel": <function name>, "sm": "sm_90", "hints": {...},
                  "signature": <mangled signature>, "symbol": <name in the cubin>,
                  "cubin": "sm_90-<key>.cubin"}, ...]}

The module trusts the folder only while the module's bytes and the running cuda-tile
match the manifest; a stale folder is ignored, never wrong.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specgen.compile.export import CompileResult, aot_entries_path, atomic_write, package_version

AOT_FORMAT = 1


def aot_dir(module_path: Path) -> Path:
    return module_path.with_name(module_path.stem + ".aot")


def write_aot_folder(module_path: Path, source: str, results: list[CompileResult]) -> Path:
    """Copy the cubins of ``results`` beside ``module_path`` and write their manifest;
    cubins of an earlier build that this one does not list are removed."""
    folder = aot_dir(module_path)
    folder.mkdir(parents=True, exist_ok=True)
    entries, keep = [], {"manifest.json"}
    for result in sorted(results, key=lambda r: r.target):
        for cubin in result.paths:
            name = cubin.name
            keep.add(name)
            data = cubin.read_bytes()
            if not (folder / name).is_file() or (folder / name).read_bytes() != data:
                atomic_write(folder / name, data)
            for entry in json.loads(aot_entries_path(cubin).read_text(encoding="utf-8")):
                entries.append({**entry, "cubin": name})
    manifest = {
        "format": AOT_FORMAT,
        "cuda_tile": package_version("cuda-tile"),
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "entries": entries,
    }
    atomic_write(folder / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
    # Cubins of an earlier build (never another writer's temporary ".name.xxx" file:
    # concurrent builds of one module write the same files).
    for stale in folder.glob("*.cubin"):
        if stale.name not in keep:
            stale.unlink(missing_ok=True)
    return folder

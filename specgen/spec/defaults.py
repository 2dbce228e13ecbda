"""Measured launch configs for specs written without ``targets:``.

The table (``default_configs.json`` beside this file) is data: each entry is keyed by
what decides a config and names the ``specgen tune`` or ``specgen bench`` run that
produced it. A spec that writes its own ``targets:`` never reads it.

The key:

- ``family``: prefill or decode;
- ``target``: the ``sm_XY`` the config was measured on;
- ``dtype``: ``16-bit`` (float16 and bfloat16 ran alike in every tune) or
  ``float8_e4m3fn`` (decode: the cache's dtype);
- ``head_dim``: the bucket 64, 128 or 256 that holds max(head_dim, v_head_dim);
- ``split``: present (true) where the kernels run that head dim as two tiles in D
  (``head_dim_split``: 80 as 64 + 16), whose registers and MMAs differ from a padded
  tile's;
- ``masked``: causal or windowed (the diagonal tiles and launch order differ);
- ``extras``: a softcap, a hook, dropout or sinks, which add registers per tile.

A lookup that finds no entry with the spec's own ``extras`` tries the entry without
them, then the other ``masked`` value, and a split head dim then the padded bucket's
entries; the dtype, head-dim bucket and target must match. A target with no entry at
all runs the portable ``default`` config.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from specgen.spec.fields import head_dim_parts, splits_head_dims

# The config of any device the table does not know: small tiles compile and run
# everywhere (sm_80 to sm_120).
PORTABLE = {"tile_m": 64, "tile_n": 64, "occupancy": 2}
DEFAULT_DECODE_TILE_N = 64


@functools.lru_cache(maxsize=None)
def table() -> tuple[dict, ...]:
    """The shipped entries, in file order."""
    text = resources.files("specgen.spec").joinpath("default_configs.json").read_text(encoding="utf-8")
    return tuple(json.loads(text)["entries"])


def head_dim_bucket(head_dim: int, v_head_dim: int | None) -> int:
    """64, 128 or 256: the smallest that holds both head dims."""
    widest = max(head_dim, v_head_dim or head_dim)
    return next(b for b in (64, 128, 256) if widest <= b)


def key_of(data: dict[str, Any]) -> dict[str, Any]:
    """The table key of a validated spec's fields (a dict of them), without the target."""
    family = data.get("family", "prefill")
    dtype = data.get("dtype", "float16")
    if family == "decode":
        dtype = data.get("kv_dtype") or dtype
    extras = any(data.get(name) for name in ("softcap", "score_mod", "mask_mod", "dropout", "sinks"))
    head_dim = data.get("head_dim", 128)
    widest = max(head_dim, data.get("v_head_dim") or head_dim)
    key = {
        "family": family,
        "dtype": "float8_e4m3fn" if dtype == "float8_e4m3fn" else "16-bit",
        "head_dim": head_dim_bucket(head_dim, data.get("v_head_dim")),
        "masked": bool(data.get("causal") or data.get("window")),
        "extras": extras,
    }
    # Where the widest head dim runs split (as Spec.d_parts), its own entries.
    if splits_head_dims(family, dtype, data.get("head_dim_split", "auto")) and head_dim_parts(widest):
        key["split"] = True
    return key


def lookup_tries(key: dict[str, Any]) -> list[dict[str, Any]]:
    """The keys lookup tries for ``key``, in order (see the module docstring)."""
    tries = [
        dict(key),
        {**key, "extras": False},
        {**key, "extras": False, "masked": not key["masked"]},
    ]
    if key.get("split"):  # then the padded bucket's entries
        tries += [{k: v for k, v in want.items() if k != "split"} for want in tries]
    return tries


def lookup(key: dict[str, Any], target: str) -> dict | None:
    """The best entry for ``key`` on ``target`` (see the module docstring), or None."""
    for want in lookup_tries(key):
        for entry in table():
            if entry["key"] == {**want, "target": target}:
                return entry
    return None


def measured_targets(data: dict[str, Any], decode_rows: int | None = None,
                     page_size: int | None = None) -> dict[str, dict]:
    """``targets:`` for a spec that wrote none, as plain dicts a spec would hold.

    Decode configs take ``tile_m`` from the packed query tile (``decode_rows``) and
    keep a key tile inside one page (``page_size``).
    """
    key = key_of(data)
    targets_known = sorted({e["key"]["target"] for e in table()})
    found = {t: lookup(key, t) for t in targets_known}
    configs: dict[str, dict] = {"default": dict(PORTABLE)}
    if key["family"] == "decode":
        configs["default"]["tile_n"] = DEFAULT_DECODE_TILE_N
    configs.update({t: json.loads(json.dumps(e["config"])) for t, e in found.items() if e})
    if key["family"] == "decode":
        for config in configs.values():
            config["tile_m"] = decode_rows
            if page_size is not None:
                config["tile_n"] = min(config["tile_n"], page_size)
    return configs


def provenance(data: dict[str, Any]) -> dict[str, dict | None]:
    """For each target the table knows, the entry a spec with ``data`` would use."""
    key = key_of(data)
    return {t: lookup(key, t) for t in sorted({e["key"]["target"] for e in table()})}

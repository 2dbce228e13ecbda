"""The block map's build time against one forward call, for every sparse spec, in
one process on the same inputs: B4 Hq32 Hkv8 bf16 D128, S = 4k / 8k / 16k, hook
tensors drawn as `specgen bench` draws them (document ids with a start every 256
positions on average, 10% of the blocks of a pattern, a random prefix length).

Other builds of the same modules (an earlier map kernel, variants) can be timed
beside the generated ones, on the same inputs; their maps are checked to list the
same tiles. Run on a GPU from the repository root:

    python3 bench/block_sparse/map_build.py OUT_DIR [LABEL=DIR ...]

LABEL=DIR: the modules fmha_<spec>.py in DIR (those it has), timed as LABEL. Writes
OUT_DIR/map_build.json and prints a table of map µs and its share of the call.
"""

import importlib.util
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from bench.results_json import write_rows  # noqa: E402
from specgen.check.cases import feature_inputs, poisoned_out, random_qkv, shape_dims  # noqa: E402

SPECS = ["fmha_document_mask", "fmha_train_document", "fmha_window_document", "fmha_chunked_local",
         "fmha_prefix_lm", "fmha_block_pattern"]
SPECS = [s for s in SPECS if s in os.environ.get("MAP_SPECS", ",".join(SPECS)).split(",")]
SEQS = (4096, 8192, 16384)
BATCH, HEADS, KV_HEADS = 4, 32, 8


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def same_lists(a, b) -> bool:
    """Two maps list the same tiles in the same places (entries past the counts are
    never read, and never compared)."""
    if not torch.equal(a.counts, b.counts):
        return False
    capacity = a.indices.shape[3]
    slot = torch.arange(capacity, device=a.indices.device)
    partial, full = a.counts[..., :1], a.counts[..., 1:2]
    listed = (slot < partial) | (slot >= capacity - full)
    return torch.equal(torch.where(listed, a.indices, -1), torch.where(listed, b.indices, -1))


def main(out_dir: str, others: list[str]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    versions = [("new", "generated")] + [tuple(o.split("=", 1)) for o in others]
    rows = []
    for name in SPECS:
        modules = {label: load(f"{folder}/{name}.py", f"{label}_{name}") for label, folder in versions
                   if os.path.exists(f"{folder}/{name}.py")}
        mod = modules["new"]
        for seq in SEQS:
            gen = torch.Generator(device="cuda").manual_seed(seq)
            q, k, v = random_qkv(mod.SPEC, BATCH, KV_HEADS, seq, seq, generator=gen)
            extra = feature_inputs(mod.SPEC, shape_dims(q, k), gen)
            tensors = {n: extra[n] for n in mod.SPEC["tensors"]}
            row = {"spec": name, "seq": seq, "map_us": {}, "share": {}}
            maps = {}
            for label, m in modules.items():
                def build(m=m):
                    return m.make_block_map(BATCH, HEADS, seq, seq, device=q.device, **tensors)
                try:
                    maps[label] = build()
                    row["map_us"][label] = 1000 * median_ms(build)
                except Exception as exc:  # noqa: BLE001 - a broken variant is a row, not a crash
                    row["map_us"][label] = None
                    row.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"[:300]
            row["same_lists"] = {label: same_lists(maps["new"], bm) for label, bm in maps.items()
                                 if label != "new" and "new" in maps}
            block_map = maps["new"]
            partial, full, capacity = block_map.tile_counts()
            row["tiles_visited"] = (partial + full) / capacity
            out = poisoned_out(mod.SPEC, q, v)
            row["tile"] = list(block_map.tile)
            # A training spec's attention builds its map in every call: its forward
            # kernel, _forward, takes one built once, as the others' attention does.
            forward = getattr(mod, "_forward", mod.attention)
            row["attention_ms"] = median_ms(lambda: forward(q, k, v, out=out, block_map=block_map, **extra))
            if hasattr(mod, "BWD_TILE_M"):  # the backward's two maps, by query and by key tile
                args = (tensors, BATCH, block_map.num_heads, seq, seq, 0, block_map.device)
                row["backward_maps_us"] = {label: 1000 * median_ms(lambda m=m: (
                    m._map_rows(*args, m.BWD_DQ_TILE_M, m.BWD_DQ_TILE_N, False),
                    m._map_rows(*args, m.BWD_TILE_M, m.BWD_TILE_N, True))) for label, m in modules.items()}
            for label, us in row["map_us"].items():
                row["share"][label] = None if us is None else us / (1000 * row["attention_ms"])
            cells = "  ".join(f"{label} {us:7.1f} µs {100 * row['share'][label]:5.1f}%"
                              if us is not None else f"{label} failed" for label, us in row["map_us"].items())
            backward = "  ".join(f"{label} {us:.1f}" for label, us in row.get("backward_maps_us", {}).items())
            print(f"{name:22s} S={seq:5d} call {row['attention_ms']:7.3f} ms  {cells}  "
                  f"same: {row['same_lists']}" + (f"  backward maps µs: {backward}" if backward else ""),
                  flush=True)
            rows.append(row)
            write_rows(f"{out_dir}/map_build.json", rows, batch=BATCH, heads_q=HEADS, heads_kv=KV_HEADS)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

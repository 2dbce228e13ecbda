"""The block-pattern spec on the same inputs with 10% of its blocks set and with
all of them set (its dense equivalent): time must scale with the listed tiles.
Each call is timed eagerly (do_bench median) and as a CUDA graph of one call (the
kernels without the host's launch path, which weighs on the short sparse calls).

Run on a GPU from the repository root: python3 bench/block_sparse/dense_equivalent.py OUT_DIR
"""

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from bench.results_json import write_rows  # noqa: E402
from specgen.bench.core import graph_time_ms  # noqa: E402
from generated import fmha_block_pattern as mod  # noqa: E402


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for seq in (4096, 8192, 16384):
        gen = torch.Generator(device="cuda").manual_seed(seq)
        q = torch.randn(4, 32, seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(4, 8, seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(4, 8, seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        sparse = (torch.rand(4, 128, 128, device="cuda", generator=gen) < 0.1).to(torch.int32)
        row = {"seq": seq, "batch": 4, "heads_q": 32, "heads_kv": 8}
        for name, blocks in (("density_10pct", sparse), ("dense", torch.ones_like(sparse))):
            block_map = mod.make_block_map(4, 32, seq, seq, blocks=blocks)
            partial, full, capacity = block_map.tile_counts()
            def call():
                return mod.attention(q, k, v, blocks=blocks, block_map=block_map)

            ms = do_bench(call, warmup=25, rep=200, return_mode="median")
            row[name] = {"ms": ms, "ms_graph": graph_time_ms(torch, call, do_bench),
                         "tiles_visited": (partial + full) / capacity}
        row["speedup"] = row["dense"]["ms"] / row["density_10pct"]["ms"]
        row["speedup_graph"] = row["dense"]["ms_graph"] / row["density_10pct"]["ms_graph"]
        print(f"S={seq}: 10% {row['density_10pct']['ms']:.3f} ms, dense {row['dense']['ms']:.3f} ms, "
              f"{row['speedup']:.2f}x; graphs {row['density_10pct']['ms_graph']:.3f} / "
              f"{row['dense']['ms_graph']:.3f} ms, {row['speedup_graph']:.2f}x", flush=True)
        rows.append(row)
    write_rows(f"{out_dir}/block_pattern_dense_equivalent.json", rows, batch=4, heads_q=32, heads_kv=8)


if __name__ == "__main__":
    main(sys.argv[1])

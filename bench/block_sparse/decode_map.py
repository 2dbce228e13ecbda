"""A decode block map's build time, against the decode call it serves, for a
shipped decode spec and variants of its map kernel's step size, in one process on
the same inputs. Times each build two ways: do_bench's median of single calls, and
the steady state of a CUDA graph holding 16 builds (as a serving loop replays a
step), so launch overhead is seen apart from the kernel.

    python3 bench/block_sparse/decode_map.py OUT_DIR

Writes OUT_DIR/decode_map.json and prints one line per (variant, shape).
"""

import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from specgen.bench.core import graph_time_ms  # noqa: E402
from specgen.check.cases import feature_inputs, random_decode  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402

SPEC = "fmha_decode_chunked_local"
SHAPES = ((1, 8, 8192), (1, 8, 131072), (8, 8, 32768), (64, 8, 4096))  # (B, Hkv, L)
STEP_PAIRS = (4096, 16384, 1024)  # MAP_STEP_PAIRS of each variant (the first: the module's)


def variant(pairs: int):
    """The generated module with its map kernel stepping MAP_STEP_PAIRS = pairs."""
    text = open(f"generated/{SPEC}.py").read()
    text = text.replace("MAP_STEP_PAIRS = 4096", f"MAP_STEP_PAIRS = {pairs}")
    return load_module_from_source(f"{SPEC}_p{pairs}", text, f"<{SPEC} pairs {pairs}>")


def main(out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    modules = {pairs: variant(pairs) for pairs in STEP_PAIRS}
    for batch_size, kv_heads, length in SHAPES:
        mod = modules[STEP_PAIRS[0]]
        batch = random_decode(mod.SPEC, [length] * batch_size, kv_heads, 1, gen)
        extra = feature_inputs(mod.SPEC, batch.dims(), gen)
        heads = batch.q.shape[2]
        reference = mod.make_block_map(batch.seq_lens, heads, batch.capacity)
        out = torch.empty_like(batch.q)

        def attend():
            return mod.attention(*batch.args(), out=out, block_map=reference, **extra)

        attend_ms = graph_time_ms(torch, attend, do_bench, calls=16)
        for pairs, variant_mod in modules.items():
            def build(m=variant_mod):
                return m.make_block_map(batch.seq_lens, heads, batch.capacity)

            made = build()
            torch.cuda.synchronize()
            same = torch.equal(made.counts, reference.counts) and all(
                torch.equal(made.indices[b, h, 0, :p], reference.indices[b, h, 0, :p])
                and torch.equal(made.indices[b, h, 0, made.indices.shape[3] - f:],
                                reference.indices[b, h, 0, made.indices.shape[3] - f:])
                for b in range(made.counts.shape[0]) for h in range(made.counts.shape[1])
                for p, f in [made.counts[b, h, 0, :2].tolist()])
            single = do_bench(build, warmup=25, rep=200, return_mode="median")
            graphed = graph_time_ms(torch, build, do_bench, calls=16)
            row = dict(batch=batch_size, kv_heads=kv_heads, seq_k=length, map_step_pairs=pairs,
                       map_ms_do_bench=single, map_ms_graph=graphed, attention_ms_graph=attend_ms,
                       same_map=same)
            rows.append(row)
            print(f"B{batch_size} L{length} pairs {pairs}: map {1000 * single:.1f} us (do_bench), "
                  f"{1000 * graphed:.1f} us (graph); attention {1000 * attend_ms:.1f} us; same map {same}",
                  flush=True)
    with open(os.path.join(out_dir, "decode_map.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "spec": SPEC, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""Where the block-sparse decode's extra time goes where its map lists the whole
cache (L <= 8192 for chunked-local): the shipped kernel, the same kernel with the
map's three counts computed from seq_len instead of loaded (no map read before the
loop), the kernel without its loops over listed tiles (the partial tiles' and the
scattered full tiles': none runs at these shapes), and the dense decode kernel, in
one process on the same inputs.

    python3 bench/block_sparse/decode_overhead.py OUT_DIR
"""

import json
import os
import re
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from specgen.bench.core import graph_time_ms  # noqa: E402
from specgen.check.cases import random_decode  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402

SHAPES = ((1, 8, 8192), (8, 8, 8192), (64, 8, 4096))
# The map's three counts, as the generated kernel loads them, and computed instead.
LOADS = re.compile(r"    num_partial = ct\.load\(MapCounts.*?# first full tile of a run, or -1\n", re.S)
COMPUTED = """    num_partial = 0 * seq_len
    num_full = ct.cdiv(seq_len, TILE_N)
    run = 0 * seq_len
"""


# The loop over listed tiles (partial ones, scattered full ones)..
LISTED_LOOPS = re.compile(r"    # The listed tiles: the partial ones.*?\n(?=\n    if SINGLE_SPLIT:)", re.S)


def module(name: str, text: str):
    return load_module_from_source(name, text, f"<{name}>")


def main(out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    sparse_text = open("generated/fmha_decode_chunked_local.py").read()
    assert LOADS.search(sparse_text)
    kernels = {
        "sparse": module("dec_sparse", sparse_text),
        "sparse_no_map_reads": module("dec_nomap", LOADS.sub(COMPUTED, sparse_text, count=1)),
        "sparse_no_listed_loops": module("dec_noloops", LISTED_LOOPS.sub("", sparse_text, count=1)),
        "dense": module("dec_dense", open("generated/fmha_decode_gqa8_bf16.py").read()),
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch_size, kv_heads, length in SHAPES:
        data = random_decode(kernels["dense"].SPEC, [length] * batch_size, kv_heads, 1, gen)
        heads = data.q.shape[2]
        block_map = kernels["sparse"].make_block_map(data.seq_lens, heads, data.capacity)
        outs = {}
        row = dict(batch=batch_size, kv_heads=kv_heads, seq_k=length)
        for name, mod in kernels.items():
            out = torch.empty_like(data.q)
            extra = {} if name == "dense" else {"block_map": block_map}
            if name.startswith("sparse_no_"):  # its own module's BlockMap class
                extra = {"block_map": mod.make_block_map(data.seq_lens, heads, data.capacity)}

            def call(mod=mod, out=out, extra=extra):
                return mod.attention(*data.args(), out=out, max_seq_len=length, **extra)

            call()
            torch.cuda.synchronize()
            outs[name] = out.clone()
            row[name + "_us"] = 1000 * graph_time_ms(torch, call, do_bench, calls=16)
        row["same_output"] = all(torch.equal(o, outs["dense"]) for o in outs.values())
        rows.append(row)
        print(row, flush=True)
    with open(os.path.join(out_dir, "decode_overhead.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""Packed documents with query tiles aligned to document starts: a prototype timed
beside the shipped block-sparse kernel and Flex in one process.

The shipped packed-document forward (`fmha_document_mask`, packed GQA, 16 positions
x 4 heads per query tile, 64-key tiles) lays its tiles on fixed multiples of the
tile along the sequence. A document that starts inside a tile wastes the pairs of
that tile's rows with the previous document's keys, and its first key tile starts
before the document. Simulated on the suite's layouts (documents of about 256
tokens), the computed pairs are 1.32x the visible ones.

Here each work item is up to TILE_P positions of one document (the first item of a
document starts at its first position), and its keys start at the document's first
key: every pair of an item's key tiles before the last lies inside the document,
and the mask left is causal alone (no document ids are read). Simulated: computed
pairs 1.15-1.17x the visible ones. The work list is built in torch here (the
prototype times the kernel); items are sorted heaviest first.

    python3 bench/block_sparse/doc_aligned.py OUT_DIR [SEQS]
"""

import importlib
import json
import math
import sys
from pathlib import Path

import cuda.tile as ct
import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
sys.path.insert(0, "bench/block_sparse")
from ceiling import BATCH, HEADS, KV_HEADS, SEQS, document_inputs  # noqa: E402
from specgen.bench.baselines import Inputs, _flex  # noqa: E402
from specgen.bench.core import graph_time_ms  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402
from doc_aligned_kernel import _kernel, work_items  # noqa: E402

NAME = "fmha_document_mask"
GROUP = HEADS // KV_HEADS
D = 128


def main(out_dir: str, seqs=SEQS) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    shipped = importlib.import_module(f"generated.{NAME}")
    plan = make_plan(load_spec(f"specs/{NAME}.yaml"))
    flex = _flex(torch, "prefill", plan)
    variants = {"aligned_64x64_o2": (64, 64, 2), "aligned_64x128_o2": (64, 128, 2),
                "aligned_64x64_o3": (64, 64, 3)}
    kernels = {label: _kernel(occ) for label, (_, _, occ) in variants.items()}
    rows = []
    for seq in seqs:
        q, k, v, extra, tensors, _, flops = document_inputs(shipped.SPEC, plan, seq)
        scale = 1.0 / math.sqrt(D)
        row = {"seq": seq, "flops": flops, "ms": {}, "graph_ms": {}, "max_diff": {}}
        out = torch.full_like(q, float("nan"))
        block_map = shipped.make_block_map(BATCH, HEADS, seq, seq, device=q.device, **tensors)

        def ship(out=out, block_map=block_map):
            return shipped.attention(q, k, v, out=out, block_map=block_map, **extra)

        ship()
        ref = out.clone()
        counts = block_map.counts[..., :2].sum(-1).double()
        row["tiles_shipped_pairs"] = counts.sum().item() * 16 * 64 * HEADS
        row["ms"]["shipped"] = do_bench(ship, warmup=25, rep=200, return_mode="median")
        row["graph_ms"]["shipped"] = graph_time_ms(torch, ship, do_bench, calls=20)
        for label, (tm, tn, _) in variants.items():
            items = work_items(tensors["doc"], tm // 4, tn)
            o = torch.full_like(q, float("nan"))
            grid = (items.shape[0], KV_HEADS, 1)
            args = (q, k, v, o, items, scale, tm, tn)

            def call(grid=grid, args=args, label=label):
                # the current stream at call time (a graph captures on its own)
                ct.launch(torch.cuda.current_stream(), grid, kernels[label], args)

            call()
            torch.cuda.synchronize()
            row["max_diff"][label] = (o.float() - ref.float()).abs().max().item()
            ntiles = ((items[:, 1] + items[:, 2] - items[:, 3] + tn - 1) // tn).double().sum().item()
            row[f"pairs_{label}"] = ntiles * (tm // 4) * tn * HEADS
            row["ms"][label] = do_bench(call, warmup=25, rep=200, return_mode="median")
            row["graph_ms"][label] = graph_time_ms(torch, call, do_bench, calls=20)
        inputs = Inputs(q=q, k=k, v=v, extra=extra)
        row["flex_max_diff"] = (flex(inputs).float() - ref.float()).abs().max().item()
        row["ms"]["flex"] = do_bench(lambda: flex(inputs), warmup=25, rep=200, return_mode="median")
        row["graph_ms"]["flex"] = graph_time_ms(torch, lambda: flex(inputs), do_bench, calls=20)
        row["tflops"] = {label: flops / ms / 1e9 for label, ms in row["ms"].items()}
        row["over_flex"] = {label: row["ms"]["flex"] / ms for label, ms in row["ms"].items()}
        row["graph_over_flex"] = {label: row["graph_ms"]["flex"] / ms for label, ms in row["graph_ms"].items()}
        print(f"S={seq:6d} " + "  ".join(
            f"{label} {tf:5.0f} ({row['over_flex'][label]:.2f}x / graph {row['graph_over_flex'][label]:.2f}x)"
            for label, tf in row["tflops"].items()) + f"  diffs {row['max_diff']}", flush=True)
        rows.append(row)
        Path(out_dir, "doc_aligned.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "spec": NAME, "batch": BATCH, "heads": HEADS,
             "kv_heads": KV_HEADS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(s) for s in sys.argv[2].split(",")) if len(sys.argv) > 2 else SEQS)

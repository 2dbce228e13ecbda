"""Packed GQA for the packed-document forward: one CTA per (query tile, KV head)
with the GROUP query heads of that KV head stacked along the tile's rows.

`fmha_document_mask` (B4 Hq32 Hkv8 bf16 D128 causal, the bench suite's documents).
The shipped kernel gives each query head its own CTA: a 64-row tile of one head
visits 2-4 key tiles, and the same K/V tiles are read by the four heads' CTAs. A
packed tile holds TILE_P positions of all four heads (TILE_M = 4 * TILE_P rows): the
key range it visits is that of TILE_P positions (narrower, so less of each partial
tile is wasted), each K/V tile is read once for four heads, and the MMA keeps M =
4 * TILE_P rows. The block map is the module's own, built at (TILE_P, TILE_N).

Each variant's output is checked against the shipped kernel's; TFLOPS count the
visible pairs (the suite's count); Flex is the Triton backend compiled for one shape.

    python3 bench/block_sparse/pack_gqa.py OUT_DIR [SEQS]
"""

import json
import math
import re
import sys
from pathlib import Path

import cuda.tile as ct
import torch

sys.path.insert(0, ".")
from bench.block_sparse.ceiling import BATCH, HEADS, KV_HEADS, NAME, SEQS, document_inputs  # noqa: E402
from specgen.bench.baselines import Inputs, _flex  # noqa: E402
from specgen.bench.core import graph_time_ms  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402

ConstInt = ct.Constant[int]
GROUP = 4
HEAD_DIM = 128
INV_LN2 = 1.0 / math.log(2.0)


@ct.kernel
def packed_document(Q5, K, V, Out5, Doc, MapCounts, MapIdx, qk_scale: float, TILE_P: ConstInt,
                    TILE_N: ConstInt, GROUP_M: ConstInt):
    """TILE_P positions of the GROUP_M query heads of one (batch, KV head)."""
    TILE_M = GROUP_M * TILE_P
    num_kv_heads = Q5.shape[1]
    seq_k = K.shape[2]
    tile_idx = ct.num_blocks(0) - 1 - ct.bid(0)
    batch = ct.bid(1) // num_kv_heads
    kv_head = ct.bid(1) % num_kv_heads
    scale = qk_scale * INV_LN2
    # Row r holds head r // TILE_P at position tile_idx * TILE_P + r % TILE_P.
    rows = tile_idx * TILE_P + (ct.arange(TILE_M, dtype=ct.int32) % TILE_P)[:, None]
    cols = ct.arange(TILE_N, dtype=ct.int32)[None, :]
    doc_0 = ct.gather(Doc, (batch, rows))
    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    acc = ct.full((TILE_M, HEAD_DIM), 0.0, dtype=ct.float32)
    q = ct.load(Q5, index=(batch, kv_head, 0, tile_idx, 0),
                shape=(1, 1, GROUP_M, TILE_P, HEAD_DIM)).reshape((TILE_M, HEAD_DIM))
    q = (q.astype(ct.float32) * scale).astype(Q5.dtype)
    num_partial = ct.load(MapCounts, (batch, 0, tile_idx, 0), shape=())
    num_full = ct.load(MapCounts, (batch, 0, tile_idx, 1), shape=())
    full_run = ct.load(MapCounts, (batch, 0, tile_idx, 2), shape=())
    first = ct.where(full_run >= 0, full_run, 0)  # documents: the full tiles are one run
    for j in range(first, first + num_full):
        k_t = ct.load(K, index=(batch, kv_head, 0, j), shape=(1, 1, HEAD_DIM, TILE_N), order=(0, 1, 3, 2),
                      latency=2).reshape((HEAD_DIM, TILE_N))
        s = ct.mma(q, k_t, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        m_new = max(m_i, ct.max(s, axis=-1, keepdims=True))
        p = ct.exp2(s - m_new, flush_to_zero=True)
        alpha = ct.exp2(m_i - m_new, flush_to_zero=True)
        l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
        acc = acc * alpha
        m_i = m_new
        v = ct.load(V, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, HEAD_DIM),
                    latency=4).reshape((TILE_N, HEAD_DIM))
        acc = ct.mma(p.astype(Q5.dtype), v, acc)
    for i in range(0, num_partial):
        j = ct.load(MapIdx, (batch, 0, tile_idx, i), shape=())
        k_t = ct.load(K, index=(batch, kv_head, 0, j), shape=(1, 1, HEAD_DIM, TILE_N), order=(0, 1, 3, 2),
                      latency=2).reshape((HEAD_DIM, TILE_N))
        keys = j * TILE_N + cols
        doc_1 = ct.gather(Doc, (batch, keys))
        s = ct.mma(q, k_t, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        visible = (keys <= rows) & (keys < seq_k) & (doc_0 == doc_1)
        s = ct.where(visible, s, -math.inf)
        m_new = max(m_i, ct.max(s, axis=-1, keepdims=True))
        m_exp = ct.where(m_new == -math.inf, 0.0, m_new)
        p = ct.exp2(s - m_exp, flush_to_zero=True)
        alpha = ct.exp2(m_i - m_exp, flush_to_zero=True)
        l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
        acc = acc * alpha
        m_i = m_new
        v = ct.load(V, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, HEAD_DIM), latency=4,
                    padding_mode=ct.PaddingMode.ZERO).reshape((TILE_N, HEAD_DIM))
        acc = ct.mma(p.astype(Q5.dtype), v, acc)
    l_div = ct.where(l_i == 0.0, 1.0, l_i)
    out = ct.truediv(acc, l_div, flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX)
    ct.store(Out5, index=(batch, kv_head, 0, tile_idx, 0),
             tile=out.reshape((1, 1, GROUP_M, TILE_P, HEAD_DIM)).astype(Out5.dtype))


# (label, TILE_P, TILE_N, compiler hints)
VARIANTS = (
    ("p16_n128_o2", 16, 128, {"occupancy": 2}),
    ("p16_n64_o2", 16, 64, {"occupancy": 2}),
    ("p32_n128_w8", 32, 128, {"occupancy": 1, "num_worker_warps": 8}),
    ("p32_n64_w8", 32, 64, {"occupancy": 1, "num_worker_warps": 8}),
)


def main(out_dir: str, seqs=SEQS, variants=VARIANTS) -> None:
    from triton.testing import do_bench

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    source = Path(f"generated/{NAME}.py").read_text()
    m = load_module_from_source("pack_shipped", source, "<shipped>")
    plan = make_plan(load_spec(f"specs/{NAME}.yaml"))
    flex = _flex(torch, "prefill", plan)
    kernels = {label: packed_document.replace_hints(**hints) for label, _, _, hints in variants}
    rows = []
    for seq in seqs:
        q, k, v, extra, tensors, _, flops = document_inputs(m.SPEC, plan, seq)
        row = {"seq": seq, "flops": flops, "ms": {}, "graph_ms": {}, "max_diff": {}, "tiles_visited": {}}
        out = torch.full_like(q, float("nan"))
        block_map = m.make_block_map(BATCH, HEADS, seq, seq, device=q.device, **tensors)

        def shipped(out=out, block_map=block_map):
            return m.attention(q, k, v, out=out, block_map=block_map, **extra)

        shipped()
        torch.cuda.synchronize()
        ref = out.clone()
        row["tiles_visited"]["shipped"] = block_map.counts[..., :2].sum().item() * HEADS
        calls = {"shipped": shipped}
        scale = 1.0 / math.sqrt(HEAD_DIM)
        q5 = q.view(BATCH, KV_HEADS, GROUP, seq, HEAD_DIM)
        for label, tile_p, tile_n, _ in variants:
            pmap = m._block_map(tensors, BATCH, HEADS, seq, seq, 0, q.device, (tile_p, tile_n))
            pout = torch.full_like(q, float("nan"))
            grid = (-(-seq // tile_p), BATCH * KV_HEADS, 1)
            args = (q5, k, v, pout.view(BATCH, KV_HEADS, GROUP, seq, HEAD_DIM), tensors["doc"], pmap.counts,
                    pmap.indices, scale, tile_p, tile_n, GROUP)

            def call(kernel=kernels[label], grid=grid, args=args):
                ct.launch(torch.cuda.current_stream(), grid, kernel, args)

            try:
                call()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
                row["max_diff"][label] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"S={seq} {label}: {row['max_diff'][label]}", flush=True)
                continue
            row["max_diff"][label] = (pout.float() - ref.float()).abs().max().item()
            row["tiles_visited"][label] = pmap.counts[..., :2].sum().item() * KV_HEADS
            calls[label] = call
        inputs = Inputs(q=q, k=k, v=v, extra=extra)
        calls["flex"] = lambda: flex(inputs)
        for label, call in calls.items():
            row["ms"][label] = do_bench(call, warmup=25, rep=200, return_mode="median")
            row["graph_ms"][label] = graph_time_ms(torch, call, do_bench, calls=20)
        row["tflops"] = {label: flops / ms / 1e9 for label, ms in row["ms"].items()}
        row["over_flex"] = {label: row["ms"]["flex"] / ms for label, ms in row["ms"].items()}
        row["over_flex_graph"] = {label: row["graph_ms"]["flex"] / ms for label, ms in row["graph_ms"].items()}
        print(f"S={seq:6d} " + "  ".join(
            f"{label} {row['tflops'][label]:4.0f}T {row['over_flex'][label]:.2f}/{row['over_flex_graph'][label]:.2f}x"
            for label in row["ms"]), flush=True)
        print("   diffs " + "  ".join(f"{k_}={v_:.2e}" if isinstance(v_, float) else f"{k_}=ERR"
                                      for k_, v_ in row["max_diff"].items()), flush=True)
        rows.append(row)
        Path(out_dir, "pack_gqa.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "spec": NAME, "batch": BATCH, "heads": HEADS,
             "kv_heads": KV_HEADS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(s) for s in sys.argv[2].split(",")) if len(sys.argv) > 2 else SEQS)

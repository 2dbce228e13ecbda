"""The ceiling of cuTile's attention backward on this GPU.

The smallest kernels with the backward's shape (causal, [B, H, S, D], bf16), with
the softmax left out so that only the matrix products, their loads and the
accumulation remain:
  - ``dkdv``: per (batch, head) and key tile of TILE_N keys, a loop over the query
    tiles that see it: S^T = K Q^T, dP^T = V dO^T, dS^T = S^T * dP^T, then
    dV += S^T dO and dK += dS^T Q (4 MMAs per step; specgen's dK/dV kernel);
  - ``dq``: per query tile, a loop over its key tiles: S = Q K^T, dP = dO V^T,
    dQ += (S * dP) K (3 MMAs per step; specgen's dQ kernel);
  - ``dkdv_atomic_dq``: ``dkdv`` plus dQ^T += K^T dS^T added into a float32 buffer
    with ``ct.atomic_add`` (5 MMAs per step and one atomic per dQ element per step:
    the FlashAttention-2 layout, without a dQ kernel);
  - ``atomic_dq_only``: the atomic adds of ``dkdv_atomic_dq`` alone, with a dQ^T
    tile made by one MMA, to price the atomics.
``dkdv+dq`` is an upper bound on any backward built as specgen's two kernels;
``dkdv_atomic_dq`` on one built with atomics. They are GQA-shaped as the shipped
kernels: a dK/dV CTA per (batch, KV head, key tile) loops over the query heads
that read that KV head, a dQ CTA per query head reads its group's K/V.

Next to them, in the same process and on the same inputs (Hq = H, Hkv = H / 4,
the shipped training specs' ratio): the shipped backward of the training spec at
that head dim (``specs/fmha_train_gqa_causal.yaml`` at D128,
``bench/train/fmha_train_d{64,256}.yaml``) and the baselines of
``specgen bench --suite backward`` (``--baselines cudnn,flex,tilegym``; cuDNN gets
K/V expanded to the query heads outside the timing, as the suite does). TileGym is
timed last: importing it patches ``ct.launch``. ``--graphs`` also times every row
as a CUDA graph of one call (no host launch path). TFLOPS use FlashAttention's
count: 2.5x the forward's FLOPs.

Tiles as the generated backward takes them: D64 and D128 dK/dV 64x64 at occupancy 2
and dQ 128x64 with two warp groups; D256 both 64x64 at one CTA per SM with two warp
groups.

Usage:  python bench/bwd_ceiling.py [--seqs 2048,8192] [--head-dims 128]
            [--baselines cudnn,flex,tilegym] [--graphs] [--json out.json]
"""

from __future__ import annotations

import cuda_device  # noqa: F401 (first: one line and exit 2 without a CUDA GPU)
import argparse
import json
import sys
from pathlib import Path

import cuda.tile as ct
import torch
from results_json import write_rows
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ConstInt = ct.Constant[int]
KINDS = ("dkdv", "dq", "dkdv_atomic_dq", "atomic_dq_only")


def _kt(X, b, h, i, TILE, D):
    """X[b, h] rows i*TILE.. as a transposed [D, TILE] tile."""
    return ct.load(
        X, index=(b, h, 0, i), shape=(1, 1, D, TILE), order=(0, 1, 3, 2), latency=2
    ).reshape((D, TILE))


def _rows(X, b, h, i, TILE, D):
    return ct.load(X, index=(b, h, i, 0), shape=(1, 1, TILE, D), latency=2).reshape(
        (TILE, D)
    )


def dkdv_kernel(
    Q,
    K,
    V,
    dO,
    dK,
    dV,
    dQacc,
    TILE_M: ConstInt,
    TILE_N: ConstInt,
    D: ConstInt,
    KIND: ConstInt,
    RATIO: ConstInt,
):
    n_tile, bh = ct.bid(0), ct.bid(1)
    kv_heads = K.shape[1]
    b, hk = bh // kv_heads, bh % kv_heads
    k = _rows(K, b, hk, n_tile, TILE_N, D)  # [TILE_N, D]
    v = _rows(V, b, hk, n_tile, TILE_N, D)
    k_t = _kt(K, b, hk, n_tile, TILE_N, D)  # [D, TILE_N]
    dk = ct.full((TILE_N, D), 0.0, dtype=ct.float32)
    dv = ct.full((TILE_N, D), 0.0, dtype=ct.float32)
    d_idx = ct.arange(D, dtype=ct.int32)[:, None]  # [D, 1]
    first = n_tile * TILE_N // TILE_M  # causal: rows before the tile see none of it
    for g in range(RATIO):  # the query heads of this KV head, as the shipped kernel
        h = hk * RATIO + g
        for i in range(first, ct.cdiv(Q.shape[2], TILE_M)):
            q_t = _kt(Q, b, h, i, TILE_M, D)  # [D, TILE_M]
            do_t = _kt(dO, b, h, i, TILE_M, D)
            if KIND == 3:
                dqt = ct.mma(
                    k_t,
                    ct.full((TILE_N, TILE_M), 0.0, dtype=Q.dtype),
                    ct.full((D, TILE_M), 0.0, dtype=ct.float32),
                )
            else:
                s_t = ct.mma(k, q_t, ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32))
                dp_t = ct.mma(v, do_t, ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32))
                p_t = s_t.astype(Q.dtype)
                ds_t = (s_t * dp_t).astype(Q.dtype)  # [TILE_N, TILE_M]
                dv = ct.mma(p_t, _rows(dO, b, h, i, TILE_M, D), dv)
                dk = ct.mma(ds_t, _rows(Q, b, h, i, TILE_M, D), dk)
            if KIND >= 2:
                if KIND == 2:
                    dqt = ct.mma(k_t, ds_t, ct.full((D, TILE_M), 0.0, dtype=ct.float32))
                rows = i * TILE_M + ct.arange(TILE_M, dtype=ct.int32)[None, :]
                ct.atomic_add(
                    dQacc,
                    (b, h, d_idx, rows),
                    dqt,
                    memory_order=ct.MemoryOrder.RELAXED,
                )
    ct.store(
        dK,
        index=(b, hk, n_tile, 0),
        tile=dk.reshape((1, 1, TILE_N, D)).astype(dK.dtype),
    )
    ct.store(
        dV,
        index=(b, hk, n_tile, 0),
        tile=dv.reshape((1, 1, TILE_N, D)).astype(dV.dtype),
    )


def dq_kernel(Q, K, V, dO, dQ, TILE_M: ConstInt, TILE_N: ConstInt, D: ConstInt):
    m_tile, bh = ct.bid(0), ct.bid(1)
    heads = Q.shape[1]
    b, h = bh // heads, bh % heads
    hk = h // (heads // K.shape[1])  # the K/V head of this query head
    q = _rows(Q, b, h, m_tile, TILE_M, D)
    do = _rows(dO, b, h, m_tile, TILE_M, D)
    dq = ct.full((TILE_M, D), 0.0, dtype=ct.float32)
    for j in range(ct.cdiv((m_tile + 1) * TILE_M, TILE_N)):
        s = ct.mma(
            q,
            _kt(K, b, hk, j, TILE_N, D),
            ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32),
        )
        dp = ct.mma(
            do,
            _kt(V, b, hk, j, TILE_N, D),
            ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32),
        )
        dq = ct.mma((s * dp).astype(Q.dtype), _rows(K, b, hk, j, TILE_N, D), dq)
    ct.store(
        dQ, index=(b, h, m_tile, 0), tile=dq.reshape((1, 1, TILE_M, D)).astype(dQ.dtype)
    )


ROOT = Path(__file__).resolve().parent.parent
# The shipped training spec at each head dim (causal bf16, GQA 4:1).
TRAIN_SPECS = {
    64: ROOT / "bench/train/fmha_train_d64.yaml",
    128: ROOT / "specs/fmha_train_gqa_causal.yaml",
    256: ROOT / "bench/train/fmha_train_d256.yaml",
}
# The ceiling rows and the compared rows of the summary.
OURS = ("dkdv+dq", "specgen")


def _shipped(head_dim: int):
    """The plan and the module rendered from the training spec at ``head_dim``."""
    from specgen.compile.export import load_module_from_source
    from specgen.compile.jobs import load_jobs

    job = load_jobs([TRAIN_SPECS[head_dim]], ROOT / "generated")[0]
    return job.plan, load_module_from_source(
        job.plan.module_name, job.rendered.text, str(job.out_path)
    )


def _inputs(seq: int, D: int, ratio: int, B: int, H: int):
    """q [B, H, S, D], k/v [B, H / ratio, S, D] and dO, the same for every run of
    this (seq, D)."""
    gen = torch.Generator(device="cuda").manual_seed(seq * 1000 + D)
    q = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(
            B, H // ratio, seq, D, device="cuda", dtype=torch.bfloat16, generator=gen
        )
        for _ in range(2)
    )
    do = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, do


def _baseline_call(baseline, fn, q, k, v, ratio):
    """(forward(*leaves), leaves) of one baseline, as the backward suite makes them."""
    from specgen.bench.backward import baseline_backward

    k_full, v_full = (t.repeat_interleave(ratio, 1).requires_grad_() for t in (k, v))
    return baseline_backward(baseline, fn, q, k, v, k_full, v_full)


def _stream():
    """The current stream at launch time: a graph capture's stream while capturing."""
    return torch.cuda.current_stream()


def _summary(rows: list[dict], graphs: bool) -> list[str]:
    """Speed ratios (baseline ms / ours) of the ceiling and the shipped backward
    against each baseline, per head dim and length."""
    key = "ms_graph" if graphs else "ms"
    ms = {(r["head_dim"], r["seq"], r["kind"]): r.get(key) for r in rows}
    bases = [b for b in ("cudnn", "tilegym", "flex") if any(k[2] == b for k in ms)]
    lines = [
        f"speed ratios ({'one-call CUDA graphs' if graphs else 'eager'}): "
        "baseline ms / ms of the two-kernel MMAs alone (dkdv+dq) and of the shipped "
        "backward (specgen)",
        "| D | S | " + " | ".join(f"{o} vs {b}" for b in bases for o in OURS) + " |",
        "|" + "---:|" * (2 + 2 * len(bases)),
    ]
    for D, seq in sorted({(k[0], k[1]) for k in ms}):
        cells = []
        for b in bases:
            for o in OURS:
                base, ours = ms.get((D, seq, b)), ms.get((D, seq, o))
                cells.append(f"{base / ours:.2f}" if base and ours else "n/a")
        lines.append(f"| {D} | {seq} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--baselines", default="cudnn")
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    from specgen.bench.backward import grad_timer
    from specgen.bench.baselines import REGISTRY, parse_baselines
    from specgen.bench.core import graph_time_ms

    torch.manual_seed(0)
    B, H = 4, 32
    head_dims = [int(d) for d in args.head_dims.split(",")]
    if any(d not in TRAIN_SPECS for d in head_dims):
        parser.error(f"--head-dims: {head_dims}: each of 64, 128, 256")
    seqs = [int(s) for s in args.seqs.split(",")]
    baselines = parse_baselines(args.baselines)
    rows = []

    def record(seq, kind, ms, ms_graph):
        flops = 2.5 * 4 * B * H * seq * seq * D / 2
        rows.append(
            {
                "seq": seq,
                "head_dim": D,
                "kind": kind,
                "ms": ms,
                "tflops": flops / ms / 1e9,
            }
        )
        if ms_graph:
            rows[-1].update(ms_graph=ms_graph, tflops_graph=flops / ms_graph / 1e9)
        print(json.dumps(rows[-1]), flush=True)

    def row(seq, kind, fn):
        """Time a launch callable; with --graphs also as a one-call graph."""
        ms = do_bench(fn, warmup=30, rep=200, return_mode="median")
        record(
            seq, kind, ms, graph_time_ms(torch, fn, do_bench) if args.graphs else None
        )

    def grad_row(seq, kind, forward, leaves, do):
        """Time torch.autograd.grad of forward(*leaves), as the backward suite does."""
        ms, _, ms_graph = grad_timer(torch, do_bench, forward, leaves, do)
        record(seq, kind, ms, ms_graph if args.graphs else None)

    shipped = {D: _shipped(D) for D in head_dims}
    late = [b for b in baselines if REGISTRY[b].late]
    for D, seq in [(d, s) for d in head_dims for s in seqs]:
        if D == 256:  # one CTA per SM, two warp groups, 64x64 in both kernels
            dkdv = ct.kernel(dkdv_kernel, occupancy=1, num_worker_warps=8)
            dq = ct.kernel(dq_kernel, occupancy=1, num_worker_warps=8)
            dq_m = 64
        else:  # dK/dV 64x64 at occupancy 2; dQ 128x64, two warp groups
            dkdv = ct.kernel(dkdv_kernel, occupancy=2)
            dq = ct.kernel(dq_kernel, occupancy=1, num_worker_warps=8)
            dq_m = 128
        plan, module = shipped[D]
        ratio = plan.group_size
        q, kg, vg, do = _inputs(seq, D, ratio, B, H)
        dk, dv = torch.empty_like(kg), torch.empty_like(vg)
        dqo = torch.empty_like(q)
        dqacc = torch.zeros(B, H, D, seq, device="cuda", dtype=torch.float32)
        kv_grid = (seq // 64, B * H // ratio, 1)  # per (batch, KV head), as shipped
        for kind_id, kind in enumerate(KINDS):
            if kind == "dq" or (D != 128 and "atomic" in kind):
                continue  # the atomics are priced at D128 (80x the MMAs there)
            call = (q, kg, vg, do, dk, dv, dqacc, 64, 64, D, kind_id, ratio)
            row(seq, kind, lambda: ct.launch(_stream(), kv_grid, dkdv, call))
        dq_call = (q, kg, vg, do, dqo, dq_m, 64, D)
        row(
            seq,
            "dq",
            lambda: ct.launch(_stream(), (seq // dq_m, B * H, 1), dq, dq_call),
        )

        def both():
            ct.launch(
                _stream(),
                kv_grid,
                dkdv,
                (q, kg, vg, do, dk, dv, dqacc, 64, 64, D, 0, ratio),
            )
            ct.launch(_stream(), (seq // dq_m, B * H, 1), dq, dq_call)

        row(seq, "dkdv+dq", both)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, kg, vg))
        grad_row(seq, "specgen", module.attention, (qs, ks, vs), do)
        for name in baselines:
            if name in late:
                continue
            fn = REGISTRY[name].make(torch, "backward", plan)
            if isinstance(fn, str):
                print(f"{name}: {fn}")
                continue
            forward, leaves = _baseline_call(
                REGISTRY[name], fn, q, kg, vg, plan.group_size
            )
            grad_row(seq, name, forward, leaves, do)
    for name in late:  # after every cuTile kernel above: the import patches ct.launch
        for D, seq in [(d, s) for d in head_dims for s in seqs]:
            plan = shipped[D][0]
            fn = REGISTRY[name].make(torch, "backward", plan)
            if isinstance(fn, str):
                print(f"{name}: {fn}")
                break
            q, kg, vg, do = _inputs(seq, D, plan.group_size, B, H)
            forward, leaves = _baseline_call(
                REGISTRY[name], fn, q, kg, vg, plan.group_size
            )
            grad_row(seq, name, forward, leaves, do)
    print("\n".join(_summary(rows, graphs=False)))
    if args.graphs:
        print("\n".join(_summary(rows, graphs=True)))
    if args.json:
        write_rows(
            args.json,
            rows,
            batch=B,
            heads=H,
            head_dims=head_dims,
            baselines=list(baselines),
            gqa_ratio={D: shipped[D][0].group_size for D in head_dims},
        )


if __name__ == "__main__":
    main()

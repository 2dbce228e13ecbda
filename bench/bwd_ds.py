"""A backward with dS kept: dQ as a plain GEMM over a dS written by the dK/dV kernel.

The shipped backward is two kernels, FlashAttention-2's split: the dK/dV kernel
forms S^T, P^T, dP^T and dS^T per (key tile, query tile) and accumulates dV and dK
(4 MMAs); the dQ kernel forms S, P, dP and dS again per (query tile, key tile) and
accumulates dQ (3 MMAs). Seven MMAs per tile pair where a single kernel needs five;
that single kernel must add dQ across CTAs, which cuTile 1.7 can do only with one
float32 atomic per element (experiments, section 42: 7-9x cuDNN's whole backward).

This probe tries a third way. The dK/dV kernel stores the dS^T tile it already has
in bfloat16 (the value its dK MMA takes) into a [B, Hq, Skv, Sq] scratch array, and
dQ = scale * dS K becomes a GEMM over the visible tiles of that array: one MMA per
tile pair, no exponentials, no atomics, deterministic. The price is memory traffic
(2 bytes per visible score written once and read once) and the scratch itself.

Rows, one process, B4 Hq32 Hkv8 causal bf16 (S a multiple of 128, q_offset 0):
  - ``shipped``: the generated ``_backward`` (delta, Q * pre, dQ, dK/dV);
  - ``shipped_dkdv`` / ``shipped_dq``: its two big kernels alone;
  - ``dkdv_ds``: the dK/dV kernel with the dS^T store;
  - ``dq_gemm_<m>x<n>``: the dQ GEMM at that tile;
  - ``ds_backward``: delta, Q * pre, ``dkdv_ds`` and the best ``dq_gemm``;
  - ``cudnn``: torch SDPA's cuDNN backward (K/V expanded, autograd, as the suite).
Each is timed eagerly (do_bench median) and as a one-call CUDA graph. The gradients
of ``ds_backward`` are compared with the shipped ones.

The scratch is [B, Hq, S, S]: at B4 Hq32 the lengths stop at 4096, where it holds
2**31 - 1 elements at most (cuTile's int32 indexing).

Usage:  python bench/bwd_ds.py [--seqs 1024,2048,4096] [--head-dims 128]
            [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cuda.tile as ct
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ConstInt = ct.Constant[int]
INV_LN2 = 1.4426950408889634
ROOT = Path(__file__).resolve().parent.parent
TRAIN_SPECS = {
    64: ROOT / "bench/train/fmha_train_d64.yaml",
    128: ROOT / "specs/fmha_train_gqa_causal.yaml",
    256: ROOT / "bench/train/fmha_train_d256.yaml",
}


def _rows(X, b, h, i, ROWS, WIDTH):
    return ct.load(X, index=(b, h, i, 0), shape=(1, 1, ROWS, WIDTH)).reshape(
        (ROWS, WIDTH)
    )


def _row_values(X, b, h, i, ROWS):
    return ct.load(X, index=(b, h, i), shape=(1, 1, ROWS)).reshape((1, ROWS))


def dkdv_ds_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DK,
    DV,
    DS,
    post: float,
    GROUP: ConstInt,
    TILE_M: ConstInt,
    TILE_N: ConstInt,
    D: ConstInt,
):
    """The shipped dK/dV kernel's causal loops (diagonal tile masked, the rest not;
    every length a multiple of the tiles, q_offset 0) plus dS^T stored in bfloat16."""
    num_kv_heads = K.shape[1]
    kv_tile = ct.bid(0)
    batch, kv_head = ct.bid(1) // num_kv_heads, ct.bid(1) % num_kv_heads
    k = _rows(K, batch, kv_head, kv_tile, TILE_N, D)
    v = _rows(V, batch, kv_head, kv_tile, TILE_N, D)
    keys = kv_tile * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[:, None]
    scale = post * INV_LN2
    dk = ct.full((TILE_N, D), 0.0, dtype=ct.float32)
    dv = ct.full((TILE_N, D), 0.0, dtype=ct.float32)
    first_m = kv_tile * TILE_N // TILE_M
    lo_m = ct.cdiv((kv_tile + 1) * TILE_N - 1, TILE_M)
    end_m = Q.shape[2] // TILE_M
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for i in range(first_m, lo_m):
            q = _rows(Q, batch, head, i, TILE_M, D)
            do = _rows(DOut, batch, head, i, TILE_M, D)
            lse = _row_values(Lse, batch, head, i, TILE_M)
            delta = _row_values(Delta, batch, head, i, TILE_M)
            rows = i * TILE_M + ct.arange(TILE_M, dtype=ct.int32)[None, :]
            s = ct.mma(
                k, ct.permute(q, (1, 0)), ct.full((TILE_N, TILE_M), 0.0, ct.float32)
            )
            p = ct.where(
                keys <= rows,
                ct.exp2(s * scale - lse * INV_LN2, flush_to_zero=True),
                0.0,
            )
            dv = ct.mma(p.astype(Q.dtype), do, dv)
            dp = ct.mma(
                v, ct.permute(do, (1, 0)), ct.full((TILE_N, TILE_M), 0.0, ct.float32)
            )
            ds = (p * (dp - delta)).astype(Q.dtype)
            dk = ct.mma(ds, q, dk)
            ct.store(
                DS,
                index=(batch, head, kv_tile, i),
                tile=ds.reshape((1, 1, TILE_N, TILE_M)),
            )
        for i in range(lo_m, end_m):
            q = _rows(Q, batch, head, i, TILE_M, D)
            do = _rows(DOut, batch, head, i, TILE_M, D)
            lse = _row_values(Lse, batch, head, i, TILE_M)
            delta = _row_values(Delta, batch, head, i, TILE_M)
            s = ct.mma(
                k, ct.permute(q, (1, 0)), ct.full((TILE_N, TILE_M), 0.0, ct.float32)
            )
            p = ct.exp2(s * scale - lse * INV_LN2, flush_to_zero=True)
            dv = ct.mma(p.astype(Q.dtype), do, dv)
            dp = ct.mma(
                v, ct.permute(do, (1, 0)), ct.full((TILE_N, TILE_M), 0.0, ct.float32)
            )
            ds = (p * (dp - delta)).astype(Q.dtype)
            dk = ct.mma(ds, q, dk)
            ct.store(
                DS,
                index=(batch, head, kv_tile, i),
                tile=ds.reshape((1, 1, TILE_N, TILE_M)),
            )
    ct.store(
        DK,
        index=(batch, kv_head, kv_tile, 0),
        tile=(dk * post).reshape((1, 1, TILE_N, D)).astype(DK.dtype),
    )
    ct.store(
        DV,
        index=(batch, kv_head, kv_tile, 0),
        tile=dv.reshape((1, 1, TILE_N, D)).astype(DV.dtype),
    )


def dq_gemm_kernel(
    DS,
    K,
    DQ,
    qk_scale: float,
    GROUP: ConstInt,
    TILE_M: ConstInt,
    TILE_N: ConstInt,
    D: ConstInt,
):
    """dQ = qk_scale * dS K over the key tiles a causal query tile sees, dS read
    from the dS^T scratch (transposed by the load). The diagonal tile is masked:
    the dK/dV kernel wrote no tile wholly above the diagonal at its own tiles."""
    num_heads = DQ.shape[1]
    tile = ct.num_blocks(0) - 1 - ct.bid(0)  # heaviest first
    batch, head = ct.bid(1) // num_heads, ct.bid(1) % num_heads
    kv_head = head // GROUP
    dq = ct.full((TILE_M, D), 0.0, dtype=ct.float32)
    num_n = ct.cdiv((tile + 1) * TILE_M, TILE_N)
    full_n = tile * TILE_M // TILE_N  # key tiles wholly at or before the first row
    for j in range(0, full_n):
        ds = ct.load(
            DS,
            index=(batch, head, tile, j),
            shape=(1, 1, TILE_M, TILE_N),
            order=(0, 1, 3, 2),
            latency=4,
        ).reshape((TILE_M, TILE_N))
        dq = ct.mma(ds, _rows(K, batch, kv_head, j, TILE_N, D), dq)
    rows = tile * TILE_M + ct.arange(TILE_M, dtype=ct.int32)[:, None]
    for j in range(full_n, num_n):
        ds = ct.load(
            DS,
            index=(batch, head, tile, j),
            shape=(1, 1, TILE_M, TILE_N),
            order=(0, 1, 3, 2),
        ).reshape((TILE_M, TILE_N))
        keys = j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[None, :]
        ds = ct.where(keys <= rows, ds, ct.zeros((TILE_M, TILE_N), dtype=ds.dtype))
        dq = ct.mma(ds, _rows(K, batch, kv_head, j, TILE_N, D), dq)
    ct.store(
        DQ,
        index=(batch, head, tile, 0),
        tile=(dq * qk_scale).reshape((1, 1, TILE_M, D)).astype(DQ.dtype),
    )


# dQ GEMM tiles (rows x keys, occupancy, worker warps) tried at every length.
DQ_TILES = ((128, 64, 1, 8), (128, 128, 1, 8), (64, 128, 2, None), (64, 64, 2, None))


def _module(head_dim: int):
    from specgen.compile.export import load_module_from_source
    from specgen.compile.jobs import load_jobs

    job = load_jobs([TRAIN_SPECS[head_dim]], ROOT / "generated")[0]
    return job.plan, load_module_from_source(
        job.plan.module_name, job.rendered.text, str(job.out_path)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--json")
    args = parser.parse_args()
    from results_json import write_rows
    from triton.testing import do_bench

    from specgen.bench.backward import baseline_backward, grad_timer
    from specgen.bench.baselines import REGISTRY
    from specgen.bench.core import graph_time_ms

    B, H = 4, 32
    rows = []
    for D in [int(d) for d in args.head_dims.split(",")]:
        plan, mod = _module(D)
        group = plan.group_size
        tm, tn = mod.BWD_TILE_M, mod.BWD_TILE_N
        hints = dict(occupancy=1, num_worker_warps=8) if D >= 256 else dict(occupancy=2)
        dkdv_ds = ct.kernel(dkdv_ds_kernel, **hints)
        dq_gemms = {
            t: ct.kernel(
                dq_gemm_kernel,
                occupancy=t[2],
                **({"num_worker_warps": t[3]} if t[3] else {}),
            )
            for t in DQ_TILES
        }
        names = [n for n in dir(mod) if n.startswith("fmha_bwd_")]
        delta_k = next(getattr(mod, n) for n in names if "_delta_" in n)
        dq_k = next(getattr(mod, n) for n in names if "_dq_" in n)
        dkdv_k = next(getattr(mod, n) for n in names if "_dkdv_" in n)
        for seq in [int(s) for s in args.seqs.split(",")]:
            if B * H * seq * seq >= 2**31:
                # cuTile indexes arrays with int32: the scratch must hold < 2**31
                # elements (B4 H32: S <= 4096), else ct.launch raises "stride is too big".
                print(
                    f"S {seq}: a [B, H, S, S] scratch of {B * H * seq * seq} elements "
                    "exceeds int32 indexing; skipped"
                )
                continue
            gen = torch.Generator(device="cuda").manual_seed(seq + D)

            def rnd(*shape):
                return torch.randn(
                    *shape, device="cuda", dtype=torch.bfloat16, generator=gen
                )

            q, k, v = (
                rnd(B, H, seq, D),
                rnd(B, H // group, seq, D),
                rnd(B, H // group, seq, D),
            )
            do = rnd(B, H, seq, D)
            scale = D**-0.5
            out, lse = mod._forward(q, k, v, scale=scale)
            ref = mod._backward(q, k, v, out, lse, do, scale, 0)
            pre = (torch.tensor(scale, dtype=torch.float32) * INV_LN2).item()
            post = scale / pre
            delta = torch.empty(B, H, seq, device="cuda", dtype=torch.float32)
            q_s = q * pre
            ds_buf = torch.empty(B, H, seq, seq, device="cuda", dtype=torch.bfloat16)
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            stream = torch.cuda.current_stream

            def prep():
                ct.launch(
                    stream(), (seq // tm, B * H, 1), delta_k, (out, do, delta, tm)
                )
                q_s.copy_(q * pre)

            def run_dkdv_ds():
                ct.launch(
                    stream(),
                    (seq // tn, B * H // group, 1),
                    dkdv_ds,
                    (q_s, k, v, do, lse, delta, dk, dv, ds_buf, post, group, tm, tn, D),
                )

            def gemm(t):
                return lambda: ct.launch(
                    stream(),
                    (seq // t[0], B * H, 1),
                    dq_gemms[t],
                    (ds_buf, k, dq, float(scale), group, t[0], t[1], D),
                )

            def run_shipped_dkdv():
                ct.launch(
                    stream(),
                    (seq // tn, B * H // group, 1),
                    dkdv_k,
                    (q_s, k, v, do, lse, delta, dk, dv, float(scale), 0, 0, tm, tn),
                )

            def run_shipped_dq():
                ct.launch(
                    stream(),
                    (seq // mod.BWD_DQ_TILE_M, B * H, 1),
                    dq_k,
                    (
                        q_s,
                        k,
                        v,
                        do,
                        lse,
                        delta,
                        dq,
                        float(scale),
                        0,
                        0,
                        0,
                        mod.BWD_DQ_TILE_M,
                        mod.BWD_DQ_TILE_N,
                    ),
                )

            def record(kind, fn, flops_factor=2.5):
                ms = do_bench(fn, warmup=20, rep=150, return_mode="median")
                ms_graph = graph_time_ms(torch, fn, do_bench)
                flops = flops_factor * 4 * B * H * seq * seq * D / 2
                rows.append(
                    dict(
                        head_dim=D,
                        seq=seq,
                        kind=kind,
                        ms=ms,
                        ms_graph=ms_graph,
                        tflops_graph=flops / ms_graph / 1e9,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)

            prep()
            record("shipped", lambda: mod._backward(q, k, v, out, lse, do, scale, 0))
            record("shipped_dkdv", run_shipped_dkdv)
            record("shipped_dq", run_shipped_dq)
            record("delta+prescale", prep)
            record("dkdv_ds", run_dkdv_ds)
            run_dkdv_ds()
            best = None
            for t in DQ_TILES:
                fn = gemm(t)
                fn()
                torch.cuda.synchronize()
                err = (dq.float() - ref[0].float()).abs().max().item()
                kind = f"dq_gemm_{t[0]}x{t[1]}"
                record(kind, fn)
                rows[-1]["dq_max_abs_diff"] = err
                if best is None or rows[-1]["ms_graph"] < best[1]:
                    best = (t, rows[-1]["ms_graph"])
            best_gemm = gemm(best[0])

            def ds_backward():
                prep()
                run_dkdv_ds()
                best_gemm()

            ds_backward()
            torch.cuda.synchronize()
            record(f"ds_backward({best[0][0]}x{best[0][1]})", ds_backward)
            scale_ref = max(t.float().abs().max().item() for t in ref)
            rows[-1].update(
                {
                    f"{n}_max_abs_diff": (a.float() - r.float()).abs().max().item()
                    for n, a, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref)
                },
                grad_max_abs=scale_ref,
            )
            print(json.dumps(rows[-1]), flush=True)
            cudnn = REGISTRY["cudnn"].make(torch, "backward", plan)
            if not isinstance(cudnn, str):
                k_full, v_full = (
                    t.repeat_interleave(group, 1).requires_grad_() for t in (k, v)
                )
                forward, leaves = baseline_backward(
                    REGISTRY["cudnn"], cudnn, q, k, v, k_full, v_full
                )
                ms, _, ms_graph = grad_timer(torch, do_bench, forward, leaves, do)
                flops = 2.5 * 4 * B * H * seq * seq * D / 2
                rows.append(
                    dict(
                        head_dim=D,
                        seq=seq,
                        kind="cudnn",
                        ms=ms,
                        ms_graph=ms_graph,
                        tflops_graph=flops / ms_graph / 1e9,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
            del ds_buf
            torch.cuda.empty_cache()
    print("| D | S | kind | ms | graph ms | TFLOPS (graph) |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['head_dim']} | {r['seq']} | {r['kind']} | {r['ms']:.3f} | "
            f"{r['ms_graph']:.3f} | {r['tflops_graph']:.0f} |"
        )
    if args.json:
        write_rows(args.json, rows, batch=B, heads=H)


if __name__ == "__main__":
    main()

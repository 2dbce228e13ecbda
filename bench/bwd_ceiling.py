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
``dkdv + dq`` is an upper bound on any backward built as specgen's two kernels;
``dkdv_atomic_dq`` on one built with atomics. Next to them, in the same process:
cuDNN's whole backward (torch SDPA) and, if importable, specgen's generated
backward of ``generated/fmha_train_gqa_causal`` on MHA-shaped inputs.
TFLOPS use FlashAttention's count: 2.5x the forward's FLOPs.

Tiles as the generated backward takes them: D64 and D128 dK/dV 64x64 at occupancy 2
and dQ 128x64 with two warp groups; D256 both 64x64 at one CTA per SM with two warp
groups (``--head-dims 64,128,256``; the generated backward's row is D128 only).

Usage:  python bench/bwd_ceiling.py [--seqs 2048,8192] [--head-dims 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import cuda.tile as ct
import torch
from results_json import write_rows
from triton.testing import do_bench

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
):
    n_tile, bh = ct.bid(0), ct.bid(1)
    heads = Q.shape[1]
    b, h = bh // heads, bh % heads
    k = _rows(K, b, h, n_tile, TILE_N, D)  # [TILE_N, D]
    v = _rows(V, b, h, n_tile, TILE_N, D)
    k_t = _kt(K, b, h, n_tile, TILE_N, D)  # [D, TILE_N]
    dk = ct.full((TILE_N, D), 0.0, dtype=ct.float32)
    dv = ct.full((TILE_N, D), 0.0, dtype=ct.float32)
    d_idx = ct.arange(D, dtype=ct.int32)[:, None]  # [D, 1]
    first = n_tile * TILE_N // TILE_M  # causal: rows before the tile see none of it
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
        dK, index=(b, h, n_tile, 0), tile=dk.reshape((1, 1, TILE_N, D)).astype(dK.dtype)
    )
    ct.store(
        dV, index=(b, h, n_tile, 0), tile=dv.reshape((1, 1, TILE_N, D)).astype(dV.dtype)
    )


def dq_kernel(Q, K, V, dO, dQ, TILE_M: ConstInt, TILE_N: ConstInt, D: ConstInt):
    m_tile, bh = ct.bid(0), ct.bid(1)
    heads = Q.shape[1]
    b, h = bh // heads, bh % heads
    q = _rows(Q, b, h, m_tile, TILE_M, D)
    do = _rows(dO, b, h, m_tile, TILE_M, D)
    dq = ct.full((TILE_M, D), 0.0, dtype=ct.float32)
    for j in range(ct.cdiv((m_tile + 1) * TILE_M, TILE_N)):
        s = ct.mma(
            q,
            _kt(K, b, h, j, TILE_N, D),
            ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32),
        )
        dp = ct.mma(
            do,
            _kt(V, b, h, j, TILE_N, D),
            ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32),
        )
        dq = ct.mma((s * dp).astype(Q.dtype), _rows(K, b, h, j, TILE_N, D), dq)
    ct.store(
        dQ, index=(b, h, m_tile, 0), tile=dq.reshape((1, 1, TILE_M, D)).astype(dQ.dtype)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    B, H = 4, 32
    head_dims = [int(d) for d in args.head_dims.split(",")]
    if any(d not in (64, 128, 256) for d in head_dims):
        parser.error(f"--head-dims: {head_dims}: each of 64, 128, 256")
    stream = torch.cuda.current_stream()
    rows = []

    def row(seq, kind, fn):
        flops = 2.5 * 4 * B * H * seq * seq * D / 2
        ms = do_bench(fn, warmup=30, rep=200, return_mode="median")
        rows.append(
            {
                "seq": seq,
                "head_dim": D,
                "kind": kind,
                "ms": ms,
                "tflops": flops / ms / 1e9,
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    for D, seq in [(d, int(s)) for d in head_dims for s in args.seqs.split(",")]:
        if D == 256:  # one CTA per SM, two warp groups, 64x64 in both kernels
            dkdv = ct.kernel(dkdv_kernel, occupancy=1, num_worker_warps=8)
            dq = ct.kernel(dq_kernel, occupancy=1, num_worker_warps=8)
            dq_m = 64
        else:  # dK/dV 64x64 at occupancy 2; dQ 128x64, two warp groups
            dkdv = ct.kernel(dkdv_kernel, occupancy=2)
            dq = ct.kernel(dq_kernel, occupancy=1, num_worker_warps=8)
            dq_m = 128
        q, k, v, do = (
            torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16)
            for _ in range(4)
        )
        dk, dv, dqo = (torch.empty_like(q) for _ in range(3))
        dqacc = torch.zeros(B, H, D, seq, device="cuda", dtype=torch.float32)
        for kind_id, kind in enumerate(KINDS):
            if kind == "dq" or (D != 128 and "atomic" in kind):
                continue  # the atomics are priced at D128 (80x the MMAs there)
            call = (q, k, v, do, dk, dv, dqacc, 64, 64, D, kind_id)
            row(seq, kind, lambda: ct.launch(stream, (seq // 64, B * H, 1), dkdv, call))
        dq_call = (q, k, v, do, dqo, dq_m, 64, D)
        row(seq, "dq", lambda: ct.launch(stream, (seq // dq_m, B * H, 1), dq, dq_call))

        def both():
            ct.launch(
                stream,
                (seq // 64, B * H, 1),
                dkdv,
                (q, k, v, do, dk, dv, dqacc, 64, 64, D, 0),
            )
            ct.launch(stream, (seq // dq_m, B * H, 1), dq, dq_call)

        row(seq, "dkdv+dq", both)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(
                qg, kg, vg, is_causal=True
            )
            row(
                seq,
                "cudnn_backward",
                lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True),
            )
        try:
            if D != 128:
                continue
            import generated.fmha_train_gqa_causal as m

            # The shipped spec is GQA 4:1; give it the same work with Hkv = H / 4.
            kq, vq = k[:, : H // 4].contiguous(), v[:, : H // 4].contiguous()
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, kq, vq))
            o = m.attention(qs, ks, vs)
            row(
                seq,
                "specgen_backward_gqa4",
                lambda: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True),
            )
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o2 = torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, enable_gqa=True
                )
                row(
                    seq,
                    "cudnn_backward_gqa4",
                    lambda: torch.autograd.grad(
                        o2, (qs, ks, vs), do, retain_graph=True
                    ),
                )
        except Exception as exc:  # noqa: BLE001 - reported, the rest still stands
            print(f"specgen backward: {type(exc).__name__}: {exc}")
    if args.json:
        write_rows(args.json, rows, batch=B, heads=H, head_dims=head_dims)


if __name__ == "__main__":
    main()

"""The ceiling of cuTile's attention inner loop on this GPU.

The smallest kernels that still have attention's shape: per (batch, head) and query
tile of TILE_M rows, a loop over key tiles doing S = Q K^T and acc += P V, with
  - ``mma``: P = S cast to the input type (no softmax at all),
  - ``exp``: P = exp2(S - 8) (the exponentials, no running max, no rescale),
  - ``softmax``: the full online softmax of a specgen kernel (max, exp2, rescale),
  - ``softmax_mma_rowsum``: the same with the row sums taken by a second MMA,
    P @ ones[TILE_N, 16], instead of a reduction across threads;
  - ``softmax_lazy``: the full online softmax, but acc, l and m are rescaled only when
    some row's max grew by more than 8 (log2 units; P then stays below 2**8), one
    branch per tile on a CTA-wide test;
  - ``softmax_poly``: the full online softmax over two key half-tiles, the second
    half's exponentials computed by a cubic polynomial on the FMA units instead of
    the MUFU ex2 unit (the two units then work side by side);
  - ``softmax_lazy_poly``: both;
  - ``softmax_skew``: the full online softmax with S of key tile j+1 computed
    before the softmax of tile j (FA3's intra-warpgroup overlap written in the
    source: the next QK^T MMA has no dependence on this tile's exponentials, so
    the tensor cores may run it while the softmax runs).
Non-causal, [B, H, S, D] inputs, B4 H32, D128 by default (``--head-dims 64,128,256``
for others), the same tiles and hints as the shipped sm_90 configs (D128: 128x128,
occupancy 1, two warp groups, and the float8 tiles; D64: 128x64 at occupancy 2;
D256: 128x128 at occupancy 2 and 128x64 at occupancy 1; bf16 only). ``mma`` is an upper bound on
any attention kernel cuTile builds with this loop: whatever the softmax costs comes
on top. Next to it, the same shapes through FlashAttention-3 (where installed) and
cuDNN, timed in the same process.

``--gqa N``: K and V have 32/N heads, each read by N query heads (as the GQA specs).
``--causal``: the query tiles run heaviest first over the keys up to the diagonal,
with no mask (a mask only adds work), for the kinds mma, exp and softmax; FA3 and
cuDNN run causal; FLOPs are halved.

Usage:  python bench/ceiling.py [--seqs 4096,8192] [--head-dims 128] [--graphs] [--causal] [--gqa N] [--json out.json]
"""

from __future__ import annotations

import cuda_device  # noqa: F401 (first: one line and exit 2 without a CUDA GPU)
import argparse
import json
import math
import sys
from pathlib import Path

import cuda.tile as ct
import torch
from results_json import write_rows
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgen.bench.core import graph_time_ms  # noqa: E402

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
KINDS = (
    "mma",
    "exp",
    "softmax",
    "softmax_mma_rowsum",
    "softmax_lazy",
    "softmax_poly",
    "softmax_lazy_poly",
    "softmax_skew",
)
# 2**f on [0, 1) to 8.6e-5 relative (weighted least squares; p(0) = 1 exactly).
POLY = (0.69511545, 0.22765097, 0.07706157)


def exp2_poly(x):
    """2**x for x <= 0 on the FMA pipe: 2**floor(x) from the exponent bits times a
    cubic in the fraction. Below -127 it returns 0 (exponent field 0)."""
    x = ct.maximum(x, -127.0)
    xi = ct.floor(x)
    f = x - xi
    p = (f * POLY[2] + POLY[1]) * f + POLY[0]
    p = p * f + 1.0
    bits = ct.bitcast(p, ct.int32) + ct.bitwise_lshift(ct.astype(xi, ct.int32), 23)
    return ct.bitcast(bits, ct.float32)


def _k_tile(K, b, h, j, TILE_N, D):
    """K^T [D, TILE_N] of key tile j."""
    return ct.load(
        K, index=(b, h, 0, j), shape=(1, 1, D, TILE_N), order=(0, 1, 3, 2), latency=2
    ).reshape((D, TILE_N))


def _v_tile(V, b, h, j, TILE_N, D, V_T):
    """V [TILE_N, D] of key tile j (read from V^T where V_T)."""
    if V_T:
        return ct.load(
            V,
            index=(b, h, j, 0),
            shape=(1, 1, TILE_N, D),
            order=(0, 1, 3, 2),
            latency=4,
        ).reshape((TILE_N, D))
    return ct.load(V, index=(b, h, j, 0), shape=(1, 1, TILE_N, D), latency=4).reshape(
        (TILE_N, D)
    )


def _half_tiles(K, V, b, h, j, HALF, D, V_T):
    """K^T [D, HALF] and V [HALF, D] of key half-tile j."""
    return _k_tile(K, b, h, j, HALF, D), _v_tile(V, b, h, j, HALF, D, V_T)


def split_loop(Q, K, V, q, acc, m_i, l_i, b, h, qk_scale, TILE_N, D, V_T, KIND):
    """The KIND 4-6 loops: TILE_N keys per step as two half-tiles."""
    HALF = TILE_N // 2
    M = q.shape[0]
    lazy = KIND == 4 or KIND == 6
    poly = KIND == 5 or KIND == 6
    for j in range(ct.cdiv(K.shape[2], TILE_N)):
        ka, va = _half_tiles(K, V, b, h, 2 * j, HALF, D, V_T)
        kb, vb = _half_tiles(K, V, b, h, 2 * j + 1, HALF, D, V_T)
        sa = ct.mma(q, ka, ct.full((M, HALF), 0.0, dtype=ct.float32))
        sb = ct.mma(q, kb, ct.full((M, HALF), 0.0, dtype=ct.float32))
        m_tile = max(
            ct.max(sa, axis=-1, keepdims=True), ct.max(sb, axis=-1, keepdims=True)
        )
        m_new = max(m_i, m_tile * qk_scale)
        if lazy:
            # Rescale only when a row's max grew by more than 8: P <= 2**8 otherwise.
            if ct.max(m_new - m_i) > 8.0:
                alpha = ct.exp2(m_i - m_new, flush_to_zero=True)
                acc = acc * alpha
                l_i = l_i * alpha
                m_i = m_new
        else:
            alpha = ct.exp2(m_i - m_new, flush_to_zero=True)
            acc = acc * alpha
            l_i = l_i * alpha
            m_i = m_new
        pa = ct.exp2(sa * qk_scale - m_i, flush_to_zero=True)
        if poly:
            pb = exp2_poly(sb * qk_scale - m_i)
        else:
            pb = ct.exp2(sb * qk_scale - m_i, flush_to_zero=True)
        l_i = (
            l_i
            + ct.sum(pa, axis=-1, keepdims=True)
            + ct.sum(pb, axis=-1, keepdims=True)
        )
        acc = ct.mma(pa.astype(Q.dtype), va, acc)
        acc = ct.mma(pb.astype(Q.dtype), vb, acc)
    return acc, l_i


def _softmax_step(s, v, acc, m_i, l_i, qk_scale, dtype):
    """One online-softmax step on the scores s [M, N] of a key tile with values v."""
    m_new = max(m_i, ct.max(s, axis=-1, keepdims=True) * qk_scale)
    p = ct.exp2(s * qk_scale - m_new, flush_to_zero=True)
    alpha = ct.exp2(m_i - m_new, flush_to_zero=True)
    l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
    acc = ct.mma(p.astype(dtype), v, acc * alpha)
    return acc, m_new, l_i


def skew_loop(Q, K, V, q, acc, m_i, l_i, b, h, qk_scale, TILE_N, D, V_T):
    """KIND 7: S of the next key tile is formed before this tile's softmax."""
    M = q.shape[0]
    n = ct.cdiv(K.shape[2], TILE_N)
    s = ct.mma(
        q, _k_tile(K, b, h, 0, TILE_N, D), ct.full((M, TILE_N), 0.0, dtype=ct.float32)
    )
    for j in range(n - 1):
        s_next = ct.mma(
            q,
            _k_tile(K, b, h, j + 1, TILE_N, D),
            ct.full((M, TILE_N), 0.0, dtype=ct.float32),
        )
        v = _v_tile(V, b, h, j, TILE_N, D, V_T)
        acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, qk_scale, Q.dtype)
        s = s_next
    v = _v_tile(V, b, h, n - 1, TILE_N, D, V_T)
    acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, qk_scale, Q.dtype)
    return acc, l_i


def ceiling_loop(
    Q,
    K,
    V,
    Out,
    qk_scale: float,
    TILE_M: ConstInt,
    TILE_N: ConstInt,
    D: ConstInt,
    V_T: ConstBool,
    KIND: ConstInt,
    CAUSAL: ConstBool,
):
    tile, bh = ct.bid(0), ct.bid(1)
    if CAUSAL:  # heaviest query tiles first; keys up to the diagonal, no mask
        tile = ct.num_blocks(0) - 1 - tile
    heads = Q.shape[1]
    b, hq = bh // heads, bh % heads
    q = ct.load(Q, index=(b, hq, tile, 0), shape=(1, 1, TILE_M, D)).reshape((TILE_M, D))
    h = hq // (heads // K.shape[1])  # the K/V head (GQA: one per group of query heads)
    acc = ct.full((TILE_M, D), 0.0, dtype=ct.float32)
    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    l_acc = ct.full((TILE_M, 16), 0.0, dtype=ct.float32)  # KIND 3: row sums by an MMA
    ones = ct.full((TILE_N, 16), 1.0, dtype=Q.dtype)
    if KIND == 7:
        acc, l_i = skew_loop(Q, K, V, q, acc, m_i, l_i, b, h, qk_scale, TILE_N, D, V_T)
    elif KIND >= 4:
        acc, l_i = split_loop(
            Q, K, V, q, acc, m_i, l_i, b, h, qk_scale, TILE_N, D, V_T, KIND
        )
    n_keys = (tile + 1) * TILE_M if CAUSAL else K.shape[2]
    for j in range(ct.cdiv(n_keys, TILE_N) if KIND < 4 else 0):
        k_t = _k_tile(K, b, h, j, TILE_N, D)
        s = ct.mma(q, k_t, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        if KIND == 0:
            p = s
        elif KIND == 1:
            p = ct.exp2(s * qk_scale - 8.0, flush_to_zero=True)
        elif KIND == 2:
            m_new = max(m_i, ct.max(s, axis=-1, keepdims=True) * qk_scale)
            p = ct.exp2(s * qk_scale - m_new, flush_to_zero=True)
            alpha = ct.exp2(m_i - m_new, flush_to_zero=True)
            l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
            acc = acc * alpha
            m_i = m_new
        else:
            m_new = max(m_i, ct.max(s, axis=-1, keepdims=True) * qk_scale)
            p = ct.exp2(s * qk_scale - m_new, flush_to_zero=True)
            alpha = ct.exp2(m_i - m_new, flush_to_zero=True)
            l_acc = l_acc * alpha
            acc = acc * alpha
            m_i = m_new
        v = _v_tile(V, b, h, j, TILE_N, D, V_T)
        p_in = p.astype(Q.dtype)
        acc = ct.mma(p_in, v, acc)
        if KIND == 3:
            l_acc = ct.mma(p_in, ones, l_acc)
    if KIND == 3:
        l_i = ct.max(l_acc, axis=-1, keepdims=True)  # every column holds the row sum
    if KIND >= 2:
        acc = ct.truediv(
            acc, l_i, flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX
        )
    ct.store(
        Out,
        index=(b, hq, tile, 0),
        tile=acc.reshape((1, 1, TILE_M, D)).astype(Out.dtype),
    )


def time_ms(fn, graphs: bool) -> float:
    """The median ms of ``fn``: eager do_bench, or (``--graphs``) a CUDA graph of one
    call replayed, which leaves out the host's launch path (FA3's eager calls at S=1k
    are bound by it)."""
    if graphs:
        return graph_time_ms(torch, fn, do_bench)
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def _kernel(occupancy: int, warps):
    options = {"occupancy": occupancy}
    if warps:
        options["num_worker_warps"] = warps
    return ct.kernel(ceiling_loop, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,8192")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--gqa", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.gqa < 1 or 32 % args.gqa:
        parser.error(f"--gqa: {args.gqa} does not divide the 32 query heads")
    if args.causal and set(args.kinds.split(",")) - {"mma", "exp", "softmax"}:
        parser.error("--causal: only the kinds mma, exp and softmax")
    torch.manual_seed(0)
    B, H = 4, 32
    configs_by_d = {
        64: [("bfloat16", 128, 64, 2, 8)],
        128: [
            ("bfloat16", 128, 128, 1, 8),
            ("float8_e4m3fn", 128, 128, 1, 8),
            ("float8_e4m3fn", 128, 256, 1, 8),
        ],
        256: [("bfloat16", 128, 128, 2, 8), ("bfloat16", 128, 64, 1, 8)],
    }
    head_dims = [int(d) for d in args.head_dims.split(",")]
    unknown = [d for d in head_dims if d not in configs_by_d]
    if unknown:
        parser.error(f"--head-dims: {unknown} not in {sorted(configs_by_d)}")
    try:
        import sys

        import fa3_fwd_config

        sys.modules["flash_attn_config"] = fa3_fwd_config
        import fa3_fwd_interface as fa3
    except ImportError:
        fa3 = None
    rows = []
    for D, seq in [(d, int(s)) for d in head_dims for s in args.seqs.split(",")]:
        configs = configs_by_d[D]
        flops = 4 * B * H * seq * seq * D // (2 if args.causal else 1)
        base = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16)
        kb, vb = (
            torch.randn(B, H // args.gqa, seq, D, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)
        )
        # Keys grow along the sequence, so row maxima keep rising (the lazy rescale's
        # branch is taken, not only skipped).
        kb = kb * (1 + 2 * torch.arange(seq, device="cuda")[:, None] / seq).to(kb.dtype)
        for dtype, tm, tn, occ, ww in configs:
            tdt = getattr(torch, dtype)
            q, k, v = (t.to(tdt) for t in (base, kb, vb))
            out = torch.empty(B, H, seq, D, device="cuda", dtype=torch.bfloat16)
            vt = v.transpose(2, 3).contiguous()
            kern = _kernel(occ, ww)
            outs = {}
            for kind_id, kind in enumerate(KINDS):
                if kind not in args.kinds.split(","):
                    continue
                for v_t in (dtype != "bfloat16",):
                    grid = (seq // tm, B * H, 1)
                    call = (
                        q,
                        k,
                        vt if v_t else v,
                        out,
                        1.0 / math.sqrt(D) / math.log(2),
                        tm,
                        tn,
                        D,
                        v_t,
                        kind_id,
                        args.causal,
                    )
                    try:
                        # The stream is read per call: a graph captures on its own.
                        ms = time_ms(
                            lambda: ct.launch(
                                torch.cuda.current_stream(), grid, kern, call
                            ),
                            args.graphs,
                        )
                    except (
                        Exception
                    ) as exc:  # noqa: BLE001 - reported, the rest still runs
                        print(f"{dtype} {kind} S={seq}: {type(exc).__name__}: {exc}")
                        continue
                    # The softmax variants must agree with the plain online softmax.
                    outs[kind] = out.float()
                    diff = None
                    if kind.startswith("softmax_") and "softmax" in outs:
                        diff = (outs[kind] - outs["softmax"]).abs().max().item()
                    rows.append(
                        {
                            "seq": seq,
                            "head_dim": D,
                            "causal": args.causal,
                            "dtype": dtype,
                            "kind": kind,
                            "max_diff_vs_softmax": diff,
                            "v_transposed": v_t,
                            "tiles": f"{tm}x{tn} occ{occ} ww{ww}",
                            "ms": ms,
                            "tflops": flops / ms / 1e9,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
            if fa3 is not None:
                qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                kw = {}
                if tdt == torch.float8_e4m3fn:
                    ones = torch.ones(
                        B, H // args.gqa, device="cuda", dtype=torch.float32
                    )
                    kw = dict(q_descale=ones, k_descale=ones, v_descale=ones)
                ms = time_ms(
                    lambda: fa3.flash_attn_func(qs, ks, vs, causal=args.causal, **kw),
                    args.graphs,
                )
                rows.append(
                    {
                        "seq": seq,
                        "head_dim": D,
                        "dtype": dtype,
                        "kind": "fa3",
                        "ms": ms,
                        "tflops": flops / ms / 1e9,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ms = time_ms(
                lambda: torch.nn.functional.scaled_dot_product_attention(
                    base, kb, vb, is_causal=args.causal, enable_gqa=args.gqa > 1
                ),
                args.graphs,
            )
        rows.append(
            {
                "seq": seq,
                "head_dim": D,
                "dtype": "bfloat16",
                "kind": "cudnn",
                "ms": ms,
                "tflops": flops / ms / 1e9,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        timing = "CUDA graph of one call" if args.graphs else "do_bench median"
        write_rows(
            args.json,
            rows,
            batch=B,
            heads=H,
            head_dims=head_dims,
            timing=timing,
            causal=args.causal,
            gqa=args.gqa,
        )


if __name__ == "__main__":
    main()

"""The ceiling of cuTile's attention inner loop on this GPU.

The smallest kernels that still have attention's shape: per (batch, head) and query
tile of TILE_M rows, a loop over key tiles doing S = Q K^T and acc += P V, with
  - ``mma``: P = S cast to the input type (no softmax at all),
  - ``exp``: P = exp2(S - 8) (the exponentials, no running max, no rescale),
  - ``softmax``: the full online softmax of a specgen kernel (max, exp2, rescale),
  - ``softmax_mma_rowsum``: the same with the row sums taken by a second MMA,
    P @ ones[TILE_N, 16], instead of a reduction across threads.
Non-causal, [B, H, S, D] inputs, B4 H32 D128, the same tiles and hints as the shipped
sm_90 configs (128x128, occupancy 1, two warp groups). ``mma`` is an upper bound on
any attention kernel cuTile builds with this loop: whatever the softmax costs comes
on top. Next to it, the same shapes through FlashAttention-3 (where installed) and
cuDNN, timed in the same process.

Usage:  python bench/ceiling.py [--seqs 4096,8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import cuda.tile as ct
import torch
from triton.testing import do_bench

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
KINDS = ("mma", "exp", "softmax", "softmax_mma_rowsum")


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
):
    tile, bh = ct.bid(0), ct.bid(1)
    heads = Q.shape[1]
    b, h = bh // heads, bh % heads
    q = ct.load(Q, index=(b, h, tile, 0), shape=(1, 1, TILE_M, D)).reshape((TILE_M, D))
    acc = ct.full((TILE_M, D), 0.0, dtype=ct.float32)
    m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
    l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
    l_acc = ct.full((TILE_M, 16), 0.0, dtype=ct.float32)  # KIND 3: row sums by an MMA
    ones = ct.full((TILE_N, 16), 1.0, dtype=Q.dtype)
    for j in range(ct.cdiv(K.shape[2], TILE_N)):
        k_t = ct.load(
            K,
            index=(b, h, 0, j),
            shape=(1, 1, D, TILE_N),
            order=(0, 1, 3, 2),
            latency=2,
        ).reshape((D, TILE_N))
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
        if V_T:
            v = ct.load(
                V,
                index=(b, h, j, 0),
                shape=(1, 1, TILE_N, D),
                order=(0, 1, 3, 2),
                latency=4,
            ).reshape((TILE_N, D))
        else:
            v = ct.load(
                V, index=(b, h, j, 0), shape=(1, 1, TILE_N, D), latency=4
            ).reshape((TILE_N, D))
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
        index=(b, h, tile, 0),
        tile=acc.reshape((1, 1, TILE_M, D)).astype(Out.dtype),
    )


def _kernel(occupancy: int, warps):
    options = {"occupancy": occupancy}
    if warps:
        options["num_worker_warps"] = warps
    return ct.kernel(ceiling_loop, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,8192")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    B, H, D = 4, 32, 128
    configs = [("bfloat16", 128, 128, 1, 8), ("float8_e4m3fn", 128, 128, 1, 8)]
    try:
        import sys

        import fa3_fwd_config

        sys.modules["flash_attn_config"] = fa3_fwd_config
        import fa3_fwd_interface as fa3
    except ImportError:
        fa3 = None
    rows = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        flops = 4 * B * H * seq * seq * D
        base = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16)
        kb, vb = torch.randn_like(base), torch.randn_like(base)
        for dtype, tm, tn, occ, ww in configs:
            tdt = getattr(torch, dtype)
            q, k, v = (t.to(tdt) for t in (base, kb, vb))
            out = torch.empty(B, H, seq, D, device="cuda", dtype=torch.bfloat16)
            vt = v.transpose(2, 3).contiguous()
            kern = _kernel(occ, ww)
            for kind_id, kind in enumerate(KINDS):
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
                    )
                    stream = torch.cuda.current_stream()
                    try:
                        ms = do_bench(
                            lambda: ct.launch(stream, grid, kern, call),
                            warmup=50,
                            rep=300,
                        )
                    except (
                        Exception
                    ) as exc:  # noqa: BLE001 - reported, the rest still runs
                        print(f"{dtype} {kind} S={seq}: {type(exc).__name__}: {exc}")
                        continue
                    rows.append(
                        {
                            "seq": seq,
                            "dtype": dtype,
                            "kind": kind,
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
                    ones = torch.ones(B, H, device="cuda", dtype=torch.float32)
                    kw = dict(q_descale=ones, k_descale=ones, v_descale=ones)
                ms = do_bench(
                    lambda: fa3.flash_attn_func(qs, ks, vs, causal=False, **kw),
                    warmup=50,
                    rep=300,
                )
                rows.append(
                    {
                        "seq": seq,
                        "dtype": dtype,
                        "kind": "fa3",
                        "ms": ms,
                        "tflops": flops / ms / 1e9,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ms = do_bench(
                lambda: torch.nn.functional.scaled_dot_product_attention(base, kb, vb),
                warmup=50,
                rep=300,
            )
        rows.append(
            {
                "seq": seq,
                "dtype": "bfloat16",
                "kind": "cudnn",
                "ms": ms,
                "tflops": flops / ms / 1e9,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "batch": B,
                    "heads": H,
                    "head_dim": D,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

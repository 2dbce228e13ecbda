"""Backward tiles of a generated training module, timed beside cuDNN in one process.

The launcher reads its tiles from the module's BWD_TILE_M / BWD_TILE_N (dK/dV
kernel) and BWD_DQ_TILE_M / BWD_DQ_TILE_N (dQ kernel) at each call, so this
script sets them per variant (the JIT compiles each once) and times the backward
alone: autograd.grad of the module's output, B4 Hq32, with the spec's causality, GQA
ratio and head dims (v_head_dim too). Each variant's gradients are checked against
cuDNN's before it is timed.

A variant is "dKdV_MxN/dQ_MxN", optionally followed by "@occupancy:warps" for the
dK/dV kernel and "#occupancy:warps" for the dQ kernel (0: the compiler's choice),
which replace the module's kernel objects for that variant.

Usage:  python bench/bwd_tiles.py generated/fmha_train_d256.py --tiles 64x64/128x64,32x64/64x64@1:8
        [--seqs 2048,8192] [--json out.json]
"""

from __future__ import annotations

import cuda_device  # noqa: F401 (first: one line and exit 2 without a CUDA GPU)
import argparse
import importlib.util
import json
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from results_json import write_rows
from triton.testing import do_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module")
    parser.add_argument("--tiles", required=True, help="dKdV MxN/dQ MxN, comma-separated")
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--json")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location(Path(args.module).stem, args.module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ratio, d = mod.GROUP_SIZE, mod.HEAD_DIM
    dv = mod.SPEC.get("v_head_dim") or d
    causal = bool(mod.SPEC.get("causal"))
    B, HQ = 4, 32
    torch.manual_seed(0)
    # The module's own kernel objects, before any variant replaces them.
    names = [n for n in vars(mod) if n.startswith(("fmha_bwd_dkdv", "fmha_bwd_dq"))]
    shipped = {n: getattr(mod, n) for n in names}
    rows = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        # FlashAttention's count: 2.5 x the forward's, halved if causal
        flops = 2.5 * 2 * B * HQ * seq * seq * (d + dv) / (2 if causal else 1)
        q = torch.randn(B, HQ, seq, d, device="cuda", dtype=mod.DTYPE, requires_grad=True)
        k = torch.randn(B, HQ // ratio, seq, d, device="cuda", dtype=mod.DTYPE, requires_grad=True)
        v = torch.randn(B, HQ // ratio, seq, dv, device="cuda", dtype=mod.DTYPE, requires_grad=True)
        do = torch.randn(B, HQ, seq, dv, device="cuda", dtype=mod.DTYPE)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref_out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=True
            )
            ref = torch.autograd.grad(ref_out, (q, k, v), do, retain_graph=True)
            ms = do_bench(lambda: torch.autograd.grad(ref_out, (q, k, v), do, retain_graph=True))
        rows.append({"seq": seq, "kernel": "cudnn", "ms": ms, "tflops": flops / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
        out = mod.attention(q, k, v)
        for variant in args.tiles.split(","):
            tiles, _, hints = variant.partition("@")
            kv_hints, _, dq_hints = hints.partition("#")
            if "#" in tiles:
                tiles, dq_hints = tiles.split("#")
            for name, kernel in shipped.items():
                text = kv_hints if "dkdv" in name else dq_hints
                if text:
                    occ, warps = (int(x) for x in text.split(":"))
                    kernel = kernel.replace_hints(
                        occupancy=occ or None, num_worker_warps=warps or None
                    )
                setattr(mod, name, kernel)
            kv_tile, dq_tile = tiles.split("/")
            mod.BWD_TILE_M, mod.BWD_TILE_N = map(int, kv_tile.split("x"))
            mod.BWD_DQ_TILE_M, mod.BWD_DQ_TILE_N = map(int, dq_tile.split("x"))
            try:
                grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                err = max(
                    ((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                    for g, r in zip(grads, ref)
                )
                ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
            except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
                print(f"{variant} S={seq}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            rows.append(
                {
                    "seq": seq,
                    "kernel": variant,
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "max_rel_diff_vs_cudnn": err,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        write_rows(args.json, rows, module=args.module, batch=B, heads_q=HQ)


if __name__ == "__main__":
    main()

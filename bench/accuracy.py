"""Accuracy of specgen, FlashAttention-3 and cuDNN against an fp64 reference, on the
same inputs: causal GQA 8:1, head_dim 128, in bfloat16 and in float8 e4m3 (unit
descales, bfloat16 output).

For each kernel: the largest and the mean absolute error against fp64 attention of
the same (rounded) inputs, and the largest difference from cuDNN's output. The
bfloat16 rows include specgen with and without ``prescale_q`` (which rounds the
scaled Q to bfloat16 once more).

Usage:  python bench/accuracy.py --gen DIR [--seq 4096] [--json out.json]
  DIR holds the built modules fmha_gqa8_bf16, acc_gqa8_bf16_no_prescale and
  fmha_fp8_llama (specgen build specs/... bench/fa3/... --gen DIR).
"""

from __future__ import annotations

import cuda_device  # noqa: F401 (first: one line and exit 2 without a CUDA GPU)
import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch


def _module(gen: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, gen / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fa3():
    try:
        import fa3_fwd_config

        sys.modules["flash_attn_config"] = fa3_fwd_config
        import fa3_fwd_interface
    except ImportError:
        return None
    return fa3_fwd_interface


def reference(q, k, v, scale):
    """fp64 causal attention, one query head at a time; [B, Hq, S, D] out."""
    group = q.shape[1] // k.shape[1]
    seq = q.shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            qh = q[b, h].double()
            kh, vh = k[b, h // group].double(), v[b, h // group].double()
            s = (qh @ kh.T) * scale
            s.masked_fill_(~mask, -math.inf)
            out[b, h] = torch.softmax(s, dim=-1) @ vh
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen", required=True, type=Path)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    B, Hq, Hkv, D, S = 1, 32, 4, 128, args.seq
    scale = 1.0 / math.sqrt(D)
    fa3 = _fa3()
    rows = []

    def report(case, name, out, ref, cudnn_out):
        err = (out.double() - ref).abs()
        row = {
            "case": case,
            "kernel": name,
            "max_abs_err": err.max().item(),
            "mean_abs_err": err.mean().item(),
            "max_diff_from_cudnn": (out.float() - cudnn_out.float()).abs().max().item(),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    def bshd(t):
        return t.transpose(1, 2).contiguous()

    # bfloat16
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    ref = reference(q, k, v, scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        g = Hq // Hkv
        cudnn_out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True
        )
    report("bf16", "cuDNN", cudnn_out, ref, cudnn_out)
    for name in ("fmha_gqa8_bf16", "acc_gqa8_bf16_no_prescale"):
        report(
            "bf16",
            f"specgen {name}",
            _module(args.gen, name).attention(q, k, v),
            ref,
            cudnn_out,
        )
    if fa3 is not None:
        out = fa3.flash_attn_func(bshd(q), bshd(k), bshd(v), causal=True)
        out = (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        report("bf16", "FA3", out, ref, cudnn_out)

    # float8 e4m3, unit descales: the reference reads the float8 values exactly
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    ref8 = reference(q8.float(), k8.float(), v8.float(), scale)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn8 = torch.nn.functional.scaled_dot_product_attention(
            q8.to(torch.bfloat16),
            k8.to(torch.bfloat16).repeat_interleave(g, 1),
            v8.to(torch.bfloat16).repeat_interleave(g, 1),
            is_causal=True,
        )
    report("e4m3", "cuDNN (bf16 copies of the e4m3 inputs)", cudnn8, ref8, cudnn8)
    report(
        "e4m3",
        "specgen fmha_fp8_llama",
        _module(args.gen, "fmha_fp8_llama").attention(q8, k8, v8),
        ref8,
        cudnn8,
    )
    if fa3 is not None:
        ones = torch.ones(B, Hkv, device="cuda", dtype=torch.float32)
        out = fa3.flash_attn_func(
            bshd(q8),
            bshd(k8),
            bshd(v8),
            causal=True,
            q_descale=ones,
            k_descale=ones,
            v_descale=ones,
        )
        out = (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        report("e4m3", "FA3", out, ref8, cudnn8)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "shape": f"B{B} Hq{Hq} Hkv{Hkv} S{S} D{D} causal",
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

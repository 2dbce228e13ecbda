"""Backward kernels of several generated training modules, timed in one process.

Each variant is a module path, optionally followed by ``#`` and hint replacements for
its backward kernels: ``dkdv=OCC:WARPS``, ``dq=OCC:WARPS``
(0: the compiler's choice), comma-separated. The script times the backward alone
(autograd.grad of the module's output) at B4 Hq32, the spec's causality, head dims and GQA ratio,
beside cuDNN on the same inputs. The variants are timed in turn for several rounds,
so that a drift of the card's clocks touches them alike, and each variant's median
over the rounds is reported. Every variant's gradients are compared with cuDNN's
before it is timed. With ``--tilegym``, TileGym's backward (tile_fmha_with_backward,
autotuned on its first call) is timed last on the same inputs: importing it patches
cuda.tile.launch, so it comes after every specgen call.

A spec with hook tensors or sinks (an ALiBi slope) gets them drawn as the test suite
draws them, the same for every variant. The gradients of a spec with any mask feature
(specgen.bench.baselines.features: windows, soft-cap, sinks, hooks, dropout) are
compared with the first variant's rather than cuDNN's, which runs without them.

Usage:  python bench/bwd_ab.py /tmp/old/fmha_train_d64.py generated/x.py#dq=2:0
        [--seqs 2048,8192] [--rounds 3] [--tilegym] [--json out.json]
"""

from __future__ import annotations

import cuda_device  # noqa: F401 (first: one line and exit 2 without a CUDA GPU)
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from results_json import write_rows
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgen.bench.baselines import features  # noqa: E402
from specgen.check.cases import feature_inputs, shape_dims  # noqa: E402
from specgen.compile.export import load_module_renamed  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec import validate_spec  # noqa: E402

PREFIXES = {"dkdv": "fmha_bwd_dkdv", "dq": "fmha_bwd_dq"}


def load(variant: str, index: int):
    """The module of ``variant`` with its hint replacements applied, its custom op named
    for the variant (load_module_renamed)."""
    path, _, hints = variant.partition("#")
    mod = load_module_renamed(path, f"ab{index}")
    for item in filter(None, hints.split(",")):
        which, _, value = item.partition("=")
        if which not in PREFIXES:
            raise SystemExit(f"{variant}: unknown kernel {which!r}; expected one of {sorted(PREFIXES)}")
        occ, warps = (int(x) for x in value.split(":"))
        names = [n for n in vars(mod) if n.startswith(PREFIXES[which])]
        if not names:
            raise SystemExit(f"{variant}: {path} has no {PREFIXES[which]}* kernel")
        for name in names:
            setattr(
                mod,
                name,
                getattr(mod, name).replace_hints(occupancy=occ or None, num_worker_warps=warps or None),
            )
    return mod


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tilegym", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    mods = [load(v, i) for i, v in enumerate(args.variants)]
    ratio, d, dtype = mods[0].GROUP_SIZE, mods[0].HEAD_DIM, mods[0].DTYPE
    spec = mods[0].SPEC
    # cuDNN computes none of the mask features (sdpa_kernel is called without them)
    hooked = bool(features(make_plan(validate_spec(spec))))
    causal, dv = bool(spec.get("causal")), spec.get("v_head_dim") or d
    B, HQ = 4, 32
    rows, inputs = [], {}
    for seq in [int(s) for s in args.seqs.split(",")]:
        torch.manual_seed(0)
        # FlashAttention's count: 2.5 x the forward's 2 * B * H * S^2 * (D + Dv), halved if causal
        flops = 2.5 * 2 * B * HQ * seq * seq * (d + dv) / (2 if causal else 1)
        q = torch.randn(B, HQ, seq, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(B, HQ // ratio, seq, d, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(B, HQ // ratio, seq, dv, device="cuda", dtype=dtype, requires_grad=True)
        do = torch.randn(B, HQ, seq, dv, device="cuda", dtype=dtype)
        extra = feature_inputs(spec, shape_dims(q, k), torch.Generator(device="cuda").manual_seed(seq))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref_out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=True
            )
            ref = torch.autograd.grad(ref_out, (q, k, v), do, retain_graph=True)
        outs, errs, times = [], [], {v: [] for v in args.variants}
        for mod in mods:
            out = mod.attention(q, k, v, **extra)
            grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            if hooked and mod is mods[0]:
                ref = grads  # the first variant's: cuDNN has no hooks
            errs.append(
                max(
                    ((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                    for g, r in zip(grads, ref)
                )
            )
            outs.append(out)
        cudnn = []
        for _ in range(args.rounds):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                cudnn.append(
                    do_bench(lambda: torch.autograd.grad(ref_out, (q, k, v), do, retain_graph=True))
                )
            for variant, out in zip(args.variants, outs):
                times[variant].append(
                    do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                )
        ms = statistics.median(cudnn)
        rows.append({"seq": seq, "kernel": "cudnn", "ms": ms, "tflops": flops / ms / 1e9, "runs_ms": cudnn})
        print(json.dumps(rows[-1]), flush=True)
        for variant, err in zip(args.variants, errs):
            ms = statistics.median(times[variant])
            rows.append(
                {
                    "seq": seq,
                    "kernel": variant,
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "runs_ms": times[variant],
                    ("max_rel_diff_vs_first_variant" if hooked else "max_rel_diff_vs_cudnn"): err,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        inputs[seq] = (flops, q, k, v, do, ref)
    if args.tilegym:
        from tilegym.ops.cutile.attention import tile_fmha_with_backward

        for seq, (flops, q, k, v, do, ref) in inputs.items():
            out = tile_fmha_with_backward(q, k, v, None, causal)
            grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            err = max(
                ((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                for g, r in zip(grads, ref)
            )
            runs = [
                do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                for _ in range(args.rounds)
            ]
            ms = statistics.median(runs)
            rows.append(
                {
                    "seq": seq,
                    "kernel": "tilegym",
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "runs_ms": runs,
                    "max_rel_diff_vs_cudnn": err,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        write_rows(args.json, rows, batch=B, heads_q=HQ, rounds=args.rounds)


if __name__ == "__main__":
    main()

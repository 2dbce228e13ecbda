"""The backward of a spec with learnable key-varying hook tensors, beside the same spec
with them frozen and beside FlexAttention with the same score_mod, in one process.

The spec reads a relative-position table and a per-key bias,
``score + rel[h, q_idx - kv_idx] + 0.5 * colb[kv_idx]`` (B4 Hq32 Hkv8 D128 causal,
bf16): the dK/dV kernel adds dS into both tables element by element (the table) and
summed over each query tile (the bias). Both modules are rendered from the current
templates; ``--old-module`` adds an already generated module of the learnable spec
(for example one rendered from older templates) as a third specgen variant. Each
variant's backward alone is timed (autograd.grad with retain_graph, do_bench
medians, two rounds alternated), and the learnable variants' gradients are compared
with Flex's.

Flex's compiled backward with learnable captured tensors does not fit its default
configs at D128 on sm_90 (263 KB of shared memory); the script tries the default
first, then ``num_stages=1``, then smaller blocks, and records which ran.

Usage:  python bench/learnable_tables.py [--seqs 2048,8192] [--old-module PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgen.compile.export import load_module_from_source, load_module_renamed  # noqa: E402
from specgen.emit.render import render  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec import validate_spec  # noqa: E402

HOOK = "score + rel[h, q_idx - kv_idx] + 0.5 * colb[kv_idx]"
B, HQ, HKV, D = 4, 32, 8, 128
TABLE = 8192  # rel's entries per head: sequences up to this length
FLEX_OPTIONS = [None, {"num_stages": 1},
                {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_stages": 1}]


def spec_module(name: str, learnable: bool):
    extra = {"learnable": True} if learnable else {}
    data = {"name": name, "dtype": "bfloat16", "head_dim": D, "gqa_ratio": HQ // HKV,
            "causal": True, "backward": True, "score_mod": HOOK,
            "tensors": {"rel": {"dtype": "float32", "shape": ["heads", TABLE], **extra},
                        "colb": {"dtype": "float32", "shape": ["seq_k"], **extra}}}
    plan = make_plan(validate_spec(data))
    return load_module_from_source(name, render(plan, f"bench/{name}.yaml").text, f"generated/{name}.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--old-module")
    parser.add_argument("--json")
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    learn, frozen = spec_module("tables_learnable", True), spec_module("tables_frozen", False)
    old = load_module_renamed(args.old_module, "old") if args.old_module else None
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    seqs = [int(s) for s in args.seqs.split(",")]
    if max(seqs) > TABLE:
        raise SystemExit(f"--seqs: at most {TABLE} (the table's length)")
    for seq in seqs:
        gen = torch.Generator(device="cuda").manual_seed(seq)
        q = torch.randn(B, HQ, seq, D, device="cuda", generator=gen).bfloat16().requires_grad_()
        k, v = (torch.randn(B, HKV, seq, D, device="cuda", generator=gen).bfloat16().requires_grad_()
                for _ in range(2))
        rel = (torch.randn(HQ, TABLE, device="cuda", generator=gen) * 0.1).requires_grad_()
        colb = (torch.randn(seq, device="cuda", generator=gen) * 0.1).requires_grad_()
        dout = torch.randn(B, HQ, seq, D, device="cuda", generator=gen).bfloat16()
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq, seq, device="cuda")
        row = {"seq": seq, "batch": B, "heads_q": HQ, "heads_kv": HKV, "head_dim": D, "score_mod": HOOK}
        grads, chosen = {}, {}

        def flex_call(r, c, options):
            def score_mod(score, b, h, qi, ki):  # masked pairs read entry 0: their dS is 0
                return score + r[h, torch.clamp(qi - ki, min=0)] + 0.5 * c[ki]
            return lambda: flex(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True,
                                kernel_options=options)

        def timed(name, call, leaves):
            out = call()
            grads[name] = torch.autograd.grad(out, leaves, dout, retain_graph=True)
            ms = do_bench(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                          warmup=30, rep=200, return_mode="median")
            row.setdefault(name + "_ms", []).append(round(ms, 4))
            print(f"S={seq} {name}: {ms:.4f} ms", flush=True)

        for _ in range(2):
            for name, r, c, leaves in (("flex_frozen", rel.detach(), colb.detach(), (q, k, v)),
                                       ("flex_learnable", rel, colb, (q, k, v, rel, colb))):
                for options in [chosen[name]] if name in chosen else FLEX_OPTIONS:
                    try:
                        timed(name, flex_call(r, c, options), leaves)
                    except Exception as exc:  # a config that does not fit: try the next
                        print(f"S={seq} {name} {options}: {str(exc).splitlines()[-1][:160]}", flush=True)
                        continue
                    chosen[name] = options
                    row[name + "_options"] = options
                    break
            timed("specgen_frozen", lambda: frozen.attention(q, k, v, rel=rel.detach(), colb=colb.detach()),
                  (q, k, v))
            timed("specgen_learnable", lambda: learn.attention(q, k, v, rel=rel, colb=colb),
                  (q, k, v, rel, colb))
            if old is not None:
                timed("specgen_old", lambda: old.attention(q, k, v, rel=rel, colb=colb), (q, k, v, rel, colb))
        for key in [k for k in row if k.endswith("_ms")]:
            row[key.removesuffix("_ms") + "_median_ms"] = sorted(row[key])[len(row[key]) // 2]
        if "flex_learnable" in grads:
            for i, n in enumerate(("dq", "dk", "dv", "drel", "dcolb")):
                got, ref = grads["specgen_learnable"][i].float(), grads["flex_learnable"][i].float()
                row[f"{n}_max_diff_vs_flex"] = (got - ref).abs().max().item()
                row[f"{n}_max"] = ref.abs().max().item()
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

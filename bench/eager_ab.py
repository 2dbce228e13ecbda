"""Eager calls of training modules, two builds of each in one process, beside cuDNN.

Each argument is ``OLD.py=NEW.py``: two generated modules of one training spec (for
example the committed module before and after a template change). For every pair and
length, at B4 Hq32 with the spec's head dims, GQA ratio and causality, the script
times in interleaved rounds, each with ``triton.testing.do_bench`` (median ms), as an
eager caller runs them:

- ``backward``: ``torch.autograd.grad`` of a saved forward graph (what the backward
  suite times);
- ``step``: the forward with gradients and its backward;
- ``forward``: the forward under ``torch.no_grad()`` (inference);

then the host's time per call of each (perf_counter over many calls without a
synchronisation; the GPU queue drained before and after). cuDNN (SDPA) runs the same
three on the same inputs for plain specs. Outputs and gradients of the two builds are
compared first (they must agree bit for bit where the kernels are the same).

Usage:  python bench/eager_ab.py OLD.py=NEW.py [...] [--seqs 1024,2048,4096]
        [--rounds 3] [--calls 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from host_overhead import host_us
from results_json import write_rows
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgen.bench.baselines import features  # noqa: E402
from specgen.check.cases import feature_inputs, shape_dims  # noqa: E402
from specgen.compile.export import load_module_renamed  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec import validate_spec  # noqa: E402

B, HQ = 4, 32


def calls_of(attend, q, k, v, do):
    """The three timed calls of one attention function on leaves q, k, v."""
    out = attend(q, k, v)

    def backward():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    def step():
        return torch.autograd.grad(attend(q, k, v), (q, k, v), do)

    def forward():
        with torch.no_grad():
            return attend(q, k, v)

    return {"backward": backward, "step": step, "forward": forward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+", help="OLD.py=NEW.py")
    parser.add_argument("--seqs", default="1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for index, pair in enumerate(args.pairs):
        old_path, sep, new_path = pair.partition("=")
        if not sep:
            raise SystemExit(f"{pair}: expected OLD.py=NEW.py")
        old, new = load_module_renamed(old_path, f"old{index}"), load_module_renamed(new_path, f"new{index}")
        spec, ratio, d = new.SPEC, new.GROUP_SIZE, new.HEAD_DIM
        dv, causal = spec.get("v_head_dim") or d, bool(spec.get("causal"))
        plain = not features(make_plan(validate_spec(spec)))  # cuDNN runs without any mask feature
        for seq in [int(s) for s in args.seqs.split(",")]:
            torch.manual_seed(seq)
            q = torch.randn(B, HQ, seq, d, device="cuda", dtype=new.DTYPE, requires_grad=True)
            k = torch.randn(B, HQ // ratio, seq, d, device="cuda", dtype=new.DTYPE, requires_grad=True)
            v = torch.randn(B, HQ // ratio, seq, dv, device="cuda", dtype=new.DTYPE, requires_grad=True)
            do = torch.randn(B, HQ, seq, dv, device="cuda", dtype=new.DTYPE)
            extra = feature_inputs(spec, shape_dims(q, k), torch.Generator(device="cuda").manual_seed(seq))

            def first(out):
                return out[0] if isinstance(out, tuple) else out

            kernels = {
                "old": calls_of(lambda q, k, v, m=old: first(m.attention(q, k, v, **extra)), q, k, v, do),
                "new": calls_of(lambda q, k, v, m=new: first(m.attention(q, k, v, **extra)), q, k, v, do),
            }
            if plain:
                def cudnn(q, k, v):
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=causal, enable_gqa=True)

                kernels["cudnn"] = calls_of(cudnn, q, k, v, do)
            same = all(torch.equal(a, b) for a, b in zip(kernels["old"]["step"](), kernels["new"]["step"]()))
            same = same and torch.equal(kernels["old"]["forward"](), kernels["new"]["forward"]())
            times = {(kernel, call): [] for kernel in kernels for call in kernels[kernel]}
            for _ in range(args.rounds):
                for kernel, calls in kernels.items():
                    for call, fn in calls.items():
                        times[kernel, call].append(do_bench(fn))
            for (kernel, call), runs in times.items():
                row = {"spec": spec["name"], "seq": seq, "kernel": kernel, "call": call,
                       "ms": statistics.median(runs), "runs_ms": runs,
                       "host_us": host_us(kernels[kernel][call], args.calls)}
                if kernel == "new":
                    row["bits_equal_old"] = same
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\nspec | S | call | old ms | new ms | new/old speed | cuDNN ms | host µs old -> new")
    for row in rows:
        if row["kernel"] != "new":
            continue
        key = (row["spec"], row["seq"], row["call"])
        old = next(r for r in rows if r["kernel"] == "old" and (r["spec"], r["seq"], r["call"]) == key)
        ref = next((r for r in rows if r["kernel"] == "cudnn" and (r["spec"], r["seq"], r["call"]) == key), None)
        print(f"{row['spec']} | {row['seq']} | {row['call']} | {old['ms']:.3f} | {row['ms']:.3f} | "
              f"{old['ms'] / row['ms']:.2f} | {ref['ms'] if ref else float('nan'):.3f} | "
              f"{old['host_us']:.0f} -> {row['host_us']:.0f}")
    if args.json:
        write_rows(args.json, rows, batch=B, heads_q=HQ, rounds=args.rounds)


if __name__ == "__main__":
    main()

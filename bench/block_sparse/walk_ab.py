"""Two renderings of the same training specs, their backward kernels timed
in one process on the same inputs and maps: for example the templates before and
after a change to how the backward walks its block map.

Each spec is rendered from the current templates (`new`) and loaded a second time
from a module file of the same name in OLD_DIR (`old`, for example rendered at an
earlier commit). Inputs are the backward suite's (B4 Hq32, the spec's GQA ratio and
hook tensors as `specgen bench --suite backward` draws them); each module builds its
own maps (block-sparse specs) once per length (make_block_map(..., backward=True), not timed) and its
`_backward` is called directly on the forward's output and LSE (no autograd), the two
modules alternately, three rounds of do_bench medians each. The gradients of the two
are compared (largest difference over the largest value). TFLOPS: 2.5 x the forward
FLOPs of the visible pairs, as the suite counts them.

    python3 bench/block_sparse/walk_ab.py OLD_DIR OUT_DIR SPEC.yaml... [--seqs 1024,4096]
        [--variant LABEL:CONSTANT=VALUE ...]

`--variant` times the new module once more with module constants set (for example
`heads:BWD_GLOBAL_ORDER_WAVES=0`); the speed-ups are over `old`.
"""

import argparse
import inspect
import json
import math
import sys
from pathlib import Path

import torch

sys.path[:0] = ["."]
from specgen.bench.backward import BACKWARD_FLOP_FACTOR, backward_flops  # noqa: E402
from specgen.bench.flops import mask_mod_flops  # noqa: E402
from specgen.check.cases import feature_inputs, random_qkv, shape_dims  # noqa: E402
from specgen.compile.export import load_module_from_source, rename_op  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.emit.render import render  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402

BATCH, HEADS = 4, 32
SEQS = (1024, 2048, 4096, 8192, 16384)
ROUNDS = 3


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def modules(spec_path: str, old_dir: Path, variants=()):
    """{"old": module, "new": module, and one more new module per variant (label,
    {module constant: value}) with those constants set}."""
    plan = make_plan(load_spec(spec_path))
    new_text = render(plan, spec_path).text
    old_text = (old_dir / f"{plan.module_name}.py").read_text()
    # Each module its own custom-op name: an op is registered once per process and name.
    old_text = rename_op(old_text, "old", str(old_dir / f"{plan.module_name}.py"))
    mods = {"old": load_module_from_source(f"old_{plan.module_name}", old_text, "<old>"),
            "new": load_module_from_source(f"new_{plan.module_name}", new_text, "<new>")}
    for label, constants in variants:
        mod = load_module_from_source(f"{label}_{plan.module_name}", new_text, f"<{label}>")
        for name, value in constants.items():
            if hasattr(mod, name):
                setattr(mod, name, value)
        mods[label] = mod
    return plan, mods


def backward_calls(plan, mods: dict, seq: int):
    """For each module, a call of its `_backward` on the backward suite's inputs at
    length ``seq`` (its own block maps built first, not timed) and the gradients it
    gave; and the suite's FLOPs of one call. -> (calls, grads, flops)"""
    kv_heads = HEADS // plan.group_size
    gen = torch.Generator(device="cuda").manual_seed(seq)
    q, k, v = random_qkv(plan.spec_dict, BATCH, kv_heads, seq, seq, generator=gen)
    dout = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    extra = feature_inputs(plan.spec_dict, shape_dims(q, k), gen)
    tensors = {n: extra[n] for n in plan.spec_dict["tensors"]}
    flops = (int(BACKWARD_FLOP_FACTOR * mask_mod_flops(torch, plan, extra, BATCH, HEADS, seq, seq))
             if plan.mask_mod else backward_flops(plan, BATCH, HEADS, seq, seq))
    scale = 1.0 / math.sqrt(plan.head_dim)
    calls, grads = {}, {}
    for name, mod in mods.items():
        # _backward's extra positional tensors (sinks, hook tensors) follow q_offset.
        params = list(inspect.signature(mod._backward).parameters)
        positional = [extra[p] for p in params[params.index("q_offset") + 1:] if p in extra]
        kwargs, maps = {}, {}
        if hasattr(mod, "make_block_map"):
            block_map = mod.make_block_map(BATCH, HEADS, seq, seq, device=q.device, backward=True, **tensors)
            kwargs["block_map"] = block_map
            maps = dict(zip(("dq_counts", "dq_indices", "kv_counts", "kv_indices"), block_map.grads))
        out, lse = mod._forward(q, k, v, scale=scale, **extra, **kwargs)

        def call(mod=mod, out=out, lse=lse, maps=maps, positional=positional):
            return mod._backward(q, k, v, out, lse, dout, scale, 0, *positional, **maps)

        calls[name], grads[name] = call, call()
    torch.cuda.synchronize()
    return calls, grads, flops


def medians(calls: dict) -> tuple[dict, dict]:
    """ROUNDS do_bench medians of each call, the calls alternately: (the median of
    the rounds, every round's) in ms, by name."""
    times = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            times[name].append(median_ms(call))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}, times


def run_spec(spec_path: str, old_dir: Path, seqs, variants=()) -> list:
    plan, mods = modules(spec_path, old_dir, variants)
    rows = []
    for seq in seqs:
        calls, grads, flops = backward_calls(plan, mods, seq)
        largest = max(g.abs().max().item() for g in grads["new"][:3])
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads["old"][:3], grads["new"][:3]))
        ms, times = medians(calls)
        speed = {n: ms["old"] / t for n, t in ms.items() if n != "old"}
        row = dict(spec=plan.module_name, seq=seq, flops=flops, ms=ms, ms_rounds=times,
                   tflops={n: flops / (t * 1e9) for n, t in ms.items()}, new_over_old=speed["new"],
                   speed_over_old=speed, grad_diff=diff, grad_largest=largest)
        others = "".join(f", {n} {ms[n]:.3f} ms ({speed[n]:.3f})" for n in ms if n not in ("old", "new"))
        print(f"[{plan.module_name}] S={seq}: old {ms['old']:.3f} ms, new {ms['new']:.3f} ms, "
              f"new/old speed {row['new_over_old']:.3f}{others}, grads differ by {diff:.3g} "
              f"(largest {largest:.3g})", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)))
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:NAME=VALUE[,NAME=VALUE]",
                        help="also time the new module with these module constants (ints) set")
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    variants = []
    for text in args.variant:
        label, _, assignments = text.partition(":")
        variants.append((label, {k: int(v) for k, v in (a.split("=") for a in assignments.split(","))}))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = [row for spec in args.specs for row in run_spec(spec, args.old_dir, seqs, variants)]
    device = torch.cuda.get_device_name()
    (args.out_dir / "walk_ab.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

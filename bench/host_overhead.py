"""Host time of a training module's calls: how long the Python side of the forward
and the backward takes, apart from the GPU's work.

For each spec (the backward suite's inputs, B4 Hq32, at one length), times on the
host (perf_counter, no synchronisation inside the loop; the GPU queue is drained
before and after) the average of N calls of:

- `attention` through autograd (forward with LSE), and `torch.autograd.grad` of a
  saved forward graph (what the backward suite times; sinks are leaves too);
- the module's `_backward` called directly;
- `ct.launch` alone, summed over the launches of one `_backward`;

then runs cProfile over `_backward` calls and torch.profiler over
`torch.autograd.grad` calls, and prints the functions with the most cumulative time
and the torch ops with the most host time (each CUDA op's dispatch, allocation and
launch). Where the host time of a call exceeds its GPU time, the eager call is bound
by the host.

    python3 bench/host_overhead.py OUT_DIR [SPEC.yaml ...] [--seq 1024] [--calls 200]
"""

import argparse
import cProfile
import io
import json
import math
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = ["."]
from specgen.check.cases import feature_inputs, random_qkv, shape_dims  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402
from specgen.emit.render import render  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402

BATCH, HEADS = 4, 32
SPECS = ("specs/fmha_train_gqa_causal.yaml", "bench/train/fmha_train_d64.yaml",
         "specs/fmha_train_gptoss_sinks.yaml")


def host_us(fn, calls: int) -> float:
    """Average host µs of one call of fn (the GPU queue drained before and after)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return host * 1e6


def gpu_us(fn) -> float:
    from triton.testing import do_bench

    from specgen.bench.core import median_ms

    return median_ms(do_bench, fn) * 1e3


def run_spec(spec_path: str, seq: int, calls: int) -> dict:
    plan = make_plan(load_spec(spec_path))
    module = load_module_from_source(plan.module_name, render(plan, spec_path).text, spec_path)
    gen = torch.Generator(device="cuda").manual_seed(seq)
    q, k, v = random_qkv(plan.spec_dict, BATCH, HEADS // plan.group_size, seq, seq, generator=gen)
    extra = feature_inputs(plan.spec_dict, shape_dims(q, k), gen)
    scale = 1.0 / math.sqrt(plan.head_dim)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if "sinks" in extra:  # learnable, as a training run has them
        extra["sinks"] = extra["sinks"].detach().requires_grad_(True)
    leaves = (q, k, v) + tuple(t for t in extra.values() if t.requires_grad)
    out = module.attention(q, k, v, **extra)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn_like(out)
    out_d, lse = module._forward(q.detach(), k.detach(), v.detach(), scale=scale, **extra)

    def forward():
        return module.attention(q, k, v, **extra)

    def backward():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    def direct():
        return module._backward(q.detach(), k.detach(), v.detach(), out_d, lse, dout, scale, 0,
                                **{n: t.detach() for n, t in extra.items()})

    row = {"spec": plan.module_name, "seq": seq}
    for name, fn in (("forward", forward), ("autograd_grad", backward), ("_backward", direct)):
        row[f"{name}_host_us"] = host_us(fn, calls)
        row[f"{name}_gpu_us"] = gpu_us(fn)
    launches, real = [], module.ct.launch

    def timed_launch(*args, **options):
        start = time.perf_counter()
        result = real(*args, **options)
        launches.append(time.perf_counter() - start)
        return result

    module.ct.launch = timed_launch
    host_us(direct, calls)
    module.ct.launch = real
    per_call = len(launches) / (calls + 3)
    row["launches_per_backward"] = per_call
    row["ct_launch_host_us_per_backward"] = sum(launches) / (calls + 3) * 1e6
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        direct()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    row["profile"] = text.getvalue()
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            backward()
    torch.cuda.synchronize()
    row["torch_profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    print(f"[{plan.module_name}] S={seq}: " + ", ".join(
        f"{n} host {row[n + '_host_us']:.0f} µs / GPU {row[n + '_gpu_us']:.0f} µs"
        for n in ("forward", "autograd_grad", "_backward"))
          + f"; ct.launch {row['ct_launch_host_us_per_backward']:.0f} µs over {per_call:.1f} launches",
          flush=True)
    print(row["profile"], flush=True)
    print(f"torch ops of {calls} torch.autograd.grad calls:\n" + row["torch_profile"], flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("specs", nargs="*", default=list(SPECS))
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    rows = [run_spec(spec, args.seq, args.calls) for spec in args.specs]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "host_overhead.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

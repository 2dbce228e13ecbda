"""fmha_train_gqa_causal's backward at S 8192 / 16384 (B4 Hq32 Hkv8): eager
autograd.grad (do_bench as the backward suite calls it, and with the longer warm-up
and repetitions of its graph timing) and a CUDA graph of it, interleaved in three
rounds, with the SM clock, power and temperature read between.

Usage: python bench/bwd_eager_graph_clocks.py OUT.json
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgen.bench.backward import grad_graph_ms  # noqa: E402
from specgen.bench.core import median_ms  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402
from specgen.compile.jobs import load_jobs  # noqa: E402

job = load_jobs([Path("specs/fmha_train_gqa_causal.yaml")], Path("generated"))[0]
mod = load_module_from_source(
    job.plan.module_name, job.rendered.text, str(job.out_path)
)
rows = []


def clock():
    return subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=clocks.sm,power.draw,temperature.gpu",
            "--format=csv,noheader",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()


for S in (8192, 16384):
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(
        4, 32, S, 128, device="cuda", dtype=torch.bfloat16, generator=g
    ).requires_grad_()
    k, v = (
        torch.randn(
            4, 8, S, 128, device="cuda", dtype=torch.bfloat16, generator=g
        ).requires_grad_()
        for _ in range(2)
    )
    dout = torch.randn(4, 32, S, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    fwd = lambda *t: mod.attention(*t)
    out = fwd(q, k, v)
    for r in range(3):
        c0 = clock()
        eager = do_bench(
            lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
            warmup=10,
            rep=200,
            return_mode="median",
        )
        c1 = clock()
        eager_long = median_ms(
            do_bench,
            lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
            warmup=50,
            rep=300,
        )
        c2 = clock()
        graph = grad_graph_ms(torch, do_bench, fwd, (q, k, v), dout)
        c3 = clock()
        row = dict(
            S=S,
            round=r,
            eager_ms=eager,
            eager_long_ms=eager_long,
            graph_ms=graph,
            clocks=[c0, c1, c2, c3],
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(
    {"device": torch.cuda.get_device_name(), "rows": rows},
    open(sys.argv[1], "w"),
    indent=1,
)

"""The transformers adapter's output layout, two ways, one process: the kernel's own
[B, H, S, D] output then ``.transpose(1, 2).contiguous()`` (what the adapter did), and
the kernel storing [B, S, H, D] itself through ``out=`` a transposed view (what it does
without gradients). B4 Hq32 Hkv8 D128 causal float16 (``specs/fmha_gqa_causal.yaml``),
do_bench medians of three interleaved rounds, ms; the two outputs must be equal.

Usage: python bench/transposed_out_ab.py OUT.json [--seqs 1024,4096,16384]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgen.compile.export import load_module_from_source  # noqa: E402
from specgen.compile.jobs import load_jobs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seqs", default="1024,4096,16384")
    args = parser.parse_args()
    job = load_jobs([ROOT / "specs/fmha_gqa_causal.yaml"], ROOT / "generated")[0]
    mod = load_module_from_source(
        job.plan.module_name, job.rendered.text, str(job.out_path)
    )
    rows = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(seq)
        q = torch.randn(
            4, 32, seq, 128, device="cuda", dtype=torch.float16, generator=g
        )
        k, v = (
            torch.randn(4, 8, seq, 128, device="cuda", dtype=torch.float16, generator=g)
            for _ in range(2)
        )

        def copy():
            return mod.attention(q, k, v).transpose(1, 2).contiguous()

        def direct():
            out = q.new_empty((4, seq, 32, 128))
            mod.attention(q, k, v, out=out.transpose(1, 2))
            return out

        same = torch.equal(copy(), direct())
        times = {"copy": [], "direct": []}
        for _ in range(3):
            for name, fn in (("copy", copy), ("direct", direct)):
                times[name].append(
                    do_bench(fn, warmup=25, rep=200, return_mode="median")
                )
        row = {
            "seq": seq,
            "equal": same,
            **{f"{n}_ms": statistics.median(t) for n, t in times.items()},
            "runs": times,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()

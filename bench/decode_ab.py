"""Decode modules of one spec, timed side by side in one process.

Each argument is a generated decode module's path (for example an older version
written out with ``git show REV:generated/x.py > /tmp/old/x.py`` beside the current
one). At each shape of the decode suite, every module gets the same inputs (random
caches of full length, as ``specgen bench --suite decode`` draws them) and is timed
the way that suite times it: many calls per CUDA graph, rotating over input copies
that exceed the L2 cache. The modules are timed in turn for several rounds, so a
drift of the card's clocks touches them alike; each module's median over the
rounds is reported, with the largest difference of its output from the first
module's (0 where they agree bitwise).

Usage:  python bench/decode_ab.py /tmp/old/fmha_decode_gqa8_bf16.py generated/fmha_decode_gqa8_bf16.py
        [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgen.bench.core import (
    graph_time_ms,
    rotation_copies,
    steady_calls,
)  # noqa: E402
from specgen.bench.decode import DECODE_SHAPES, kv_bytes  # noqa: E402
from specgen.check.cases import feature_inputs, random_decode  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402


def load(path: str, index: int):
    path = Path(path).resolve()
    return load_module_from_source(
        f"{path.stem}_ab{index}", path.read_text(), str(path)
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    modules = [load(path, i) for i, path in enumerate(args.modules)]
    spec = modules[0].SPEC
    if any(m.SPEC != spec for m in modules[1:]):
        print(
            "note: the modules' SPEC dicts differ; inputs follow the first one's",
            file=sys.stderr,
        )
    ratio = spec.get("gqa_ratio", 1)
    kv_bits = torch.finfo(getattr(torch, spec.get("kv_dtype") or spec["dtype"])).bits
    rows = []
    for batch, kv_heads, length in DECODE_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        nbytes = kv_bytes(batch, kv_heads, length, spec["head_dim"], kv_bits)
        copies = rotation_copies(torch, nbytes)
        calls = steady_calls(copies)
        datas = [
            random_decode(spec, [length] * batch, kv_heads, 1, gen)
            for _ in range(copies)
        ]
        extra = feature_inputs(spec, datas[0].dims(), gen)
        hooks = {n: extra[n] for n in spec.get("tensors") or {}}
        # A module with a block map gets its own for each input copy (a map is tied
        # to the seq_lens tensor it was built from).
        maps = [
            [
                (
                    dict(
                        block_map=module.make_block_map(
                            d.seq_lens, ratio * kv_heads, d.capacity, **hooks
                        )
                    )
                    if hasattr(module, "make_block_map")
                    else {}
                )
                for d in datas
            ]
            for module in modules
        ]
        outs = [[torch.empty_like(d.q) for d in datas] for _ in modules]

        def calls_of(m, module):
            return [
                lambda i=i: module.attention(
                    *datas[i].args(),
                    out=outs[m][i],
                    max_seq_len=length,
                    **extra,
                    **maps[m][i],
                )
                for i in range(copies)
            ]

        fns = [calls_of(m, module) for m, module in enumerate(modules)]
        for f in fns:
            f[0]()
        torch.cuda.synchronize()
        diffs = [
            (outs[m][0].float() - outs[0][0].float()).abs().max().item()
            for m in range(len(modules))
        ]
        times = [[] for _ in modules]
        for _ in range(args.rounds):
            for m, f in enumerate(fns):
                times[m].append(graph_time_ms(torch, f, do_bench, calls=calls) * 1000)
        label = f"B{batch} Hq{ratio * kv_heads}/Hkv{kv_heads} L{length}"
        medians = [statistics.median(t) for t in times]
        cells = "  ".join(
            f"{us:8.2f} µs ({medians[0] / us:.3f}x, diff {d:.1e})"
            for us, d in zip(medians, diffs)
        )
        print(f"{label:28s} {cells}", flush=True)
        rows.append(
            dict(
                batch=batch,
                kv_heads=kv_heads,
                heads_q=ratio * kv_heads,
                length=length,
                bytes=nbytes,
                calls_per_graph=calls,
                input_copies=copies,
                us=[
                    dict(module=p, rounds=t, median=med, max_abs_diff_vs_first=d)
                    for p, t, med, d in zip(args.modules, times, medians, diffs)
                ],
            )
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time the measured defaults of suspicious spec classes against alternatives (sm_90).

Each `*.yaml` here has the format of a `specgen bench --variants` file (spec, shapes,
variants); its first variant, `default (table)`, is the spec as written, without
`targets:`, so its sm_90 config is what specgen/spec/default_configs.json gives (or
the portable 64x64 occupancy 2 where the table has no row); the others pin
`targets.sm_90`. Unlike `bench --variants`, no cuDNN runs beside them, so specs with
hooks, dropout or block maps can be probed too. All files run in one process, most
suspicious first: each variant is rendered, checked against fp64 on the smoke case
(max rel err, the dtype's tolerance; a wrong one is not timed), then timed with
triton do_bench medians at B4 Hq32, S 2048 and 8192 (block-sparse: a block map built
per variant, outside the timing). A file's table prints as soon as it is done;
`--budget` skips the files that would start too late. JSON goes to $OUT (or --results).

    PYTHONPATH=/tmp/site:$PWD python bench/defaults_probe/run_probe.py            # GPU, < 5 min
    PYTHONPATH=$PWD python bench/defaults_probe/run_probe.py --dry-run            # no GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

# Most suspicious first (see README.md); --only picks others or a subset.
ORDER = ["d256_alibi", "fp8_d64", "fp8_d256", "doc_sparse", "d256_dropout", "mla_192_128", "d160", "d96"]


def load(path: Path):
    """(config, {label: plan}, {label: source}): every variant validated and rendered."""
    from specgen.commands.diff import apply_sets
    from specgen.commands.explore import VariantsFile
    from specgen.emit.render import render
    from specgen.plan.make import make_plan
    from specgen.spec import load_spec, parse_spec_text, read_spec_text, spec_to_dict, validate_spec

    config = VariantsFile.model_validate(parse_spec_text(read_spec_text(path), path))
    base = apply_sets(spec_to_dict(load_spec(ROOT / config.spec)), config.base, f"{path}: base")
    plans, sources = {}, {}
    for label, assignments in config.variants.items():
        plan = make_plan(validate_spec(apply_sets(base, assignments, f"{path}: {label}"), f"{path}: {label}"))
        plans[label], sources[label] = plan, render(plan, config.spec).text
    return config, plans, sources


def sm90(plan) -> str:
    names = [t.name for t in plan.targets]
    t = plan.targets[names.index("sm_90" if "sm_90" in names else "default")]
    hints = dict(t.configs[-1].hints) if hasattr(t.configs[-1], "hints") else {}
    w = hints.get("num_worker_warps")
    buckets = " +by_seq_k" if len(t.configs) > 1 else ""
    return f"{t.name}: {t.tile_m}x{t.tile_n} occ{t.occupancy}{f' ww{w}' if w else ''}{buckets}"


def dry_run(files) -> int:
    from specgen.spec import defaults as D, load_spec

    bad = 0
    for f in files:
        try:
            config, plans, sources = load(f)
        except Exception as exc:  # noqa: BLE001
            print(f"{f.name}: INVALID: {exc}")
            bad += 1
            continue
        entry = D.provenance(load_spec(ROOT / config.spec).model_dump(mode="json")).get("sm_90")
        src = entry["source"]["spec"] if entry else "no sm_90 row: the portable default"
        print(f"{f.stem}: {config.spec}; default from {src}; shapes {config.shapes.model_dump()}")
        for label, plan in plans.items():
            print(f"   {label:40s} {sm90(plan)}  ({len(sources[label].splitlines())} lines rendered)")
    return 1 if bad else 0


def run_file(f: Path, torch, do_bench, deadline: float, tmp: Path) -> dict:
    from specgen.bench.flops import forward_flops, mask_mod_flops
    from specgen.check.cases import (TOLERANCES, call_kernel, compare, feature_inputs, poisoned_out,
                                     random_qkv, shape_dims, smoke_case)
    from specgen.commands.explore import import_variants

    config, plans, sources = load(f)
    modules = import_variants(sources, tmp, f.stem)
    first = next(iter(plans.values()))
    spec = first.spec_dict
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"file": f.name, "spec": config.spec, "configs": {l: sm90(p) for l, p in plans.items()},
           "err": {}, "ok": {}, "ms": {}, "tflops": {}, "seqs": config.shapes.seqs}
    case = smoke_case(spec, generator=gen)
    for label, module in modules.items():
        try:
            out = poisoned_out(spec, case.q, case.v)
            call_kernel(module, case.q, case.k, case.v, case.extra, q_offset=case.q_offset, out=out)
            torch.cuda.synchronize()
            c = compare(out, case.ref, first.dtype)
            res["err"][label], res["ok"][label] = c.rel_err, bool(c.ok)
        except Exception as exc:  # noqa: BLE001
            res["err"][label], res["ok"][label] = None, False
            print(f"   [{label}] failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  flush=True)
    B, H = config.shapes.batch, config.shapes.heads
    for seq in config.shapes.seqs:
        if time.monotonic() > deadline:
            print(f"   S={seq} skipped: budget", flush=True)
            break
        q, k, v = random_qkv(spec, B, H // first.group_size, seq, seq, generator=gen)
        extra = feature_inputs(spec, shape_dims(q, k), gen)
        out = poisoned_out(spec, q, v)
        flops = (mask_mod_flops(torch, first, extra, B, H, seq, seq) if first.mask_mod
                 else forward_flops(first, B, H, seq, seq))
        for label, module in modules.items():
            if not res["ok"].get(label):
                continue
            kwargs = {}
            if hasattr(module, "make_block_map"):  # each variant's own tiles
                tensors = {n: extra[n] for n in module.SPEC["tensors"]}
                kwargs["block_map"] = module.make_block_map(B, H, seq, seq, device=q.device, **tensors)
            try:
                call_kernel(module, q, k, v, extra, out=out, **kwargs)  # JIT outside the timing
                torch.cuda.synchronize()
                ms = do_bench(lambda: call_kernel(module, q, k, v, extra, out=out, **kwargs),
                              warmup=25, rep=150, return_mode="median")
            except Exception as exc:  # noqa: BLE001
                print(f"   [{label}] S={seq} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
                continue
            res["ms"][f"{label}|{seq}"] = ms
            res["tflops"][f"{label}|{seq}"] = flops / ms / 1e9
        del q, k, v, out, extra
    return res


def table(res: dict) -> str:
    seqs = res["seqs"]
    lines = [f"{Path(res['file']).stem}: {res['spec']}",
             f"   {'variant':34s} {'sm_90 config':34s} {'rel err':>8s} "
             + " ".join(f"{'S' + str(s):>15s}" for s in seqs)]
    for label, cfg in res["configs"].items():
        err = res["err"].get(label)
        e = "-" if err is None else f"{err:.1e}" + ("" if res["ok"].get(label) else "!")
        cells = []
        for s in seqs:
            ms, base = res["ms"].get(f"{label}|{s}"), res["ms"].get(f"default (table)|{s}")
            if ms is None:
                cells.append(f"{'WRONG' if err is not None and not res['ok'].get(label) else '-':>15s}")
            else:
                cells.append(f"{res['tflops'][f'{label}|{s}']:6.0f} ({(base / ms if base else float('nan')):4.2f}x)")
        lines.append(f"   {label[:34]:34s} {cfg[:34]:34s} {e:>8s} " + " ".join(cells))
    lines.append("   (TFLOPS; in brackets the default's time / the variant's: > 1 means faster than the default;"
                 " '!' after an error: over tolerance, not timed)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="validate and render every variant; no GPU")
    ap.add_argument("--only", default=None, help=f"comma-separated files (stems) from {','.join(ORDER)}")
    ap.add_argument("--results", default=os.environ.get("OUT") or "/tmp/defaults_probe_results",
                    help="folder for probe.json (default: $OUT, else /tmp/defaults_probe_results)")
    ap.add_argument("--budget", type=float, default=220.0,
                    help="seconds: no file starts after this, no length after budget + 30 (default 220)")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else ORDER
    files = [HERE / f"{n}.yaml" for n in names]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        print("no such probe file: " + ", ".join(missing), file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(files)
    import torch
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (use --dry-run without one)", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    start = time.monotonic()
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    results, tmp = [], Path(tempfile.mkdtemp(prefix="defaults-probe-"))
    out_dir = Path(args.results)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in files:
        elapsed = time.monotonic() - start
        if elapsed > args.budget:
            print(f"\n{f.stem}: skipped (budget: {elapsed:.0f} s used)", flush=True)
            continue
        t0 = time.monotonic()
        try:
            res = run_file(f, torch, do_bench, start + args.budget + 30, tmp)
        except Exception as exc:  # noqa: BLE001
            print(f"\n{f.stem}: failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        res["seconds"] = time.monotonic() - t0
        results.append(res)
        print("\n" + table(res) + f"\n   ({res['seconds']:.0f} s)", flush=True)
        (out_dir / "probe.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    print(f"\ntotal {time.monotonic() - start:.0f} s; JSON: {out_dir / 'probe.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Enumerate specs written without `targets:` and record the config every target
gets from specgen/spec/default_configs.json, and where it came from.

    PYTHONPATH=$PWD python bench/defaults_probe/enumerate.py [--render] [--out grid.json]

No GPU. Each spec is validated (invalid combos are skipped and counted); with
--render its plan is made and its module rendered too.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys

from specgen.spec import validate_spec, spec_to_dict
from specgen.spec import defaults as D

HEAD_DIMS = [(32, None), (48, None), (64, None), (80, None), (96, None), (128, None),
             (160, None), (192, None), (256, None), (192, 128)]
EXTRAS = {
    "plain": {},
    "window": {"window": {"left": 1023}},
    "softcap": {"softcap": 50.0},
    "sinks": {"sinks": True},
    "score_mod": {"tensors": {"slope": {"dtype": "float32", "shape": ["heads"]}},
                  "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
    "mask_mod": {"tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
                 "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"},
    "block_sparse": {"tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
                     "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]", "block_sparse": True},
    "dropout": {"dropout": True},
    "varlen": {"varlen": True},
    "backward": {"backward": True},
}


def matched(key: dict, target: str):
    """(try index, entry) as defaults.lookup walks its tries; (None, None) if none."""
    for i, want in enumerate(D.lookup_tries(key)):
        for j, entry in enumerate(D.table()):
            if entry["key"] == {**want, "target": target}:
                return i, j, entry
    return None, None, None


def classify(key: dict, entry: dict | None, data: dict) -> tuple[str, list[str]]:
    """'exact' / 'near' / 'fallback', and what differs between the case and the row."""
    if entry is None:
        return "fallback", ["no row for target"]
    ek = entry["key"]
    diffs = []
    if key["extras"] and not ek["extras"]:
        what = [n for n in ("softcap", "score_mod", "mask_mod", "dropout", "sinks") if data.get(n)]
        diffs.append("extras(" + ",".join(what) + ") on no-extras row")
    if key["masked"] != ek["masked"]:
        diffs.append(("causal/window case on non-causal row" if key["masked"]
                      else "non-causal case on causal row"))
    if key.get("split") and not ek.get("split"):
        diffs.append("split head dim on padded row")
    if bool(ek.get("split")) and not key.get("split"):
        diffs.append("padded case on split row")
    # What the key does not hold, against the measured spec of the row.
    src = entry["source"]["spec"]
    hd = data.get("head_dim", 128)
    widest = max(hd, data.get("v_head_dim") or hd)
    import re
    m = re.search(r"D(\d+)", src)
    if m and int(m.group(1)) != widest:
        diffs.append(f"D{widest} on a D{m.group(1)} row")
    fam = data.get("family", "prefill")
    if fam == "prefill":
        dt = data.get("dtype", "float16")
        srcdt = "bf16" if "bf16" in src else ("fp16" if "fp16" in src else ("e4m3" if "e4m3" in src else "?"))
        if data.get("window"):
            diffs.append("window on a causal row")
        if data.get("varlen"):
            diffs.append("varlen on a dense row")
        if data.get("block_sparse"):
            diffs.append("block_sparse on a dense row")
        if data.get("backward"):
            diffs.append("backward spec (forward row; bwd tiles fixed in plan)")
        g = data.get("gqa_ratio", 1)
        mg = re.search(r"GQA (\d+)", src)
        rg = int(mg.group(1)) if mg else 1
        if g != rg:
            diffs.append(f"gqa {g} on a gqa {rg} row")
    else:
        g = data.get("gqa_ratio", 1)
        mg = re.search(r"GQA (\d+)", src)
        rg = int(mg.group(1)) if mg else 1
        rows = data.get("gqa_ratio", 1) * data.get("max_q_len", 1)
        if rows != rg:
            diffs.append(f"{rows} packed rows (gqa {g} x q_len {data.get('max_q_len', 1)}) on a gqa {rg} row")
        if data.get("paged"):
            diffs.append("paged on a contiguous row")
    structural = [d for d in diffs if not d.startswith("gqa ") and "packed rows" not in d
                  and not d.startswith("backward") and not d.startswith("varlen")]
    major = any(("on a D" in d) or ("causal" in d) or ("split" in d) or ("extras" in d)
                for d in diffs)
    return ("near" if major else "exact"), diffs


def prefill_grid():
    for dtype, (hd, vhd), causal, gqa, extra in itertools.product(
            ["float16", "bfloat16", "float8_e4m3fn"], HEAD_DIMS, [True, False], [1, 4, 8], EXTRAS):
        data = {"name": "probe", "dtype": dtype, "head_dim": hd, "causal": causal, "gqa_ratio": gqa,
                **json.loads(json.dumps(EXTRAS[extra]))}
        if vhd:
            data["v_head_dim"] = vhd
        yield f"prefill {dtype} D{hd}{'/' + str(vhd) if vhd else ''} {'causal' if causal else 'full'} g{gqa} {extra}", data


def decode_grid():
    for kv, hd, paged, qlen, gqa, extra in itertools.product(
            [None, "float8_e4m3fn"], [64, 128, 256], [None, 16, 64], [1, 2, 4, 8], [1, 4, 8],
            ["plain", "window", "sinks"]):
        data = {"name": "probe", "family": "decode", "dtype": "bfloat16", "head_dim": hd,
                "gqa_ratio": gqa, "max_q_len": qlen}
        if kv:
            data["kv_dtype"] = kv
        if paged:
            data["paged"] = {"page_size": paged}
        if extra == "window":
            data["window"] = {"left": 1023}
        if extra == "sinks":
            data["sinks"] = True
        yield (f"decode kv={kv or 'bf16'} D{hd} paged={paged} qlen{qlen} g{gqa} {extra}", data)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="also make the plan and render each spec")
    ap.add_argument("--out", default=None, help="write every record as JSON here")
    ap.add_argument("--family", choices=["prefill", "decode", "both"], default="both")
    ap.add_argument("--render-every", type=int, default=1,
                    help="with --render, render every Nth valid spec only (renders take ~0.5 s each)")
    args = ap.parse_args(argv)
    if args.render:
        from specgen.plan.make import make_plan
        from specgen.emit.render import render
    records, invalid = [], collections.Counter()
    grids = []
    if args.family in ("prefill", "both"):
        grids.append(prefill_grid())
    if args.family in ("decode", "both"):
        grids.append(decode_grid())
    for label, data in itertools.chain(*grids):
        try:
            spec = validate_spec(data)
        except Exception as exc:  # the validator refuses the combo
            msg = str(exc).strip().splitlines()
            invalid[(label.split()[0], msg[-1][:140] if msg else type(exc).__name__)] += 1
            continue
        full = spec.model_dump(mode="json")
        key = D.key_of(full)
        targets = spec_to_dict(spec)["targets"]
        rec = {"label": label, "data": data, "key": key, "targets": targets, "per_target": {}}
        for t in sorted({e["key"]["target"] for e in D.table()} | {"sm_100"}):
            i, j, entry = matched(key, t)
            src, diffs = classify(key, entry, full)
            rec["per_target"][t] = {"row": j, "try": i, "class": src, "diffs": diffs,
                                    "config": targets.get(t, targets.get("default")),
                                    "from": (entry["source"]["spec"] if entry else "portable default")}
        if args.render and len(records) % args.render_every == 0:
            plan = make_plan(spec)
            text = render(plan, "specs/probe.yaml").text
            rec["rendered_lines"] = text.count("\n")
            rec["bwd"] = ({k: getattr(plan, k) for k in ("bwd_tile", "bwd_dq_tile", "bwd_dkdv_occupancy",
                                                          "bwd_dkdv_warps", "bwd_dq_occupancy", "bwd_dq_warps",
                                                          "bwd_wide")} if plan.backward else None)
            rec["plan_targets"] = [(tp.name, tp.tile_m, tp.tile_n, tp.occupancy) for tp in plan.targets]
        records.append(rec)
    # Summary
    print(f"valid specs: {len(records)}; invalid (skipped): {sum(invalid.values())}")
    for (fam, msg), n in sorted(invalid.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  invalid {fam} x{n}: {msg}")
    for t in ("sm_90", "sm_100"):
        c = collections.Counter(r["per_target"][t]["class"] for r in records)
        print(f"{t}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        for fam in ("prefill", "decode"):
            c = collections.Counter(r["per_target"][t]["class"] for r in records if r["label"].startswith(fam))
            print(f"   {fam}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    by_row = collections.Counter((r["per_target"]["sm_90"]["row"], r["per_target"]["sm_90"]["class"]) for r in records)
    print("sm_90 by table row (row, class): count")
    for (row, cls), n in sorted(by_row.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        print(f"   row {row} {cls}: {n}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

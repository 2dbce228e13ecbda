"""Packed GQA (`pack_gqa: true`) on the block-sparse prefill specs (and any other
GQA prefill spec named on the command line, such as fmha_gqa_causal): the shipped
module beside packed variants at several tiles, one process, the same inputs.

Each variant is the spec with its sm_90 target replaced; the block map is built once
per (variant, length) and reused, as the bench does. Outputs are compared with the
shipped module's. TFLOPS count the visible pairs (the suite's count).

    python3 bench/block_sparse/pack_specs.py OUT_DIR [SPEC,...] [SEQS]
"""

import json
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, ".")
from specgen.bench.core import graph_time_ms  # noqa: E402
from specgen.bench.flops import forward_flops, mask_mod_flops  # noqa: E402
from specgen.check.cases import feature_inputs, random_qkv, shape_dims  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402
from specgen.emit.render import render  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec import validate_spec  # noqa: E402

BATCH, HEADS, KV_HEADS = 4, 32, 8
SEQS = (1024, 4096, 16384)
SPECS = ("fmha_document_mask", "fmha_window_document", "fmha_chunked_local", "fmha_prefix_lm",
         "fmha_block_pattern")
# label -> sm_90 config of the packed variant (tile_m counts rows: 4 heads x tile_m / 4 positions)
PACKED = {
    "pack 64x64 o2": {"tile_m": 64, "tile_n": 64, "occupancy": 2},
    "pack 64x128 o2": {"tile_m": 64, "tile_n": 128, "occupancy": 2},
    "pack 128x64 w8": {"tile_m": 128, "tile_n": 64, "occupancy": 1, "num_worker_warps": 8},
}
# Dense specs (named on the command line) also try the dense prefill's own large tile.
DENSE_EXTRA = {"pack 128x128 w8": {"tile_m": 128, "tile_n": 128, "occupancy": 1, "num_worker_warps": 8}}


def variant_module(name: str, label: str, sm_90: dict | None):
    data = yaml.safe_load(Path(f"specs/{name}.yaml").read_text())
    if sm_90 is not None:
        data = dict(data, pack_gqa=True, targets=dict(data.get("targets") or {}, sm_90=sm_90))
    plan = make_plan(validate_spec(data))
    source = render(plan, f"specs/{name}.yaml").text
    return plan, load_module_from_source(f"pack_{name}_{abs(hash(label))}", source, f"<{name} {label}>")


def main(out_dir: str, specs=SPECS, seqs=SEQS) -> None:
    from triton.testing import do_bench

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "batch": BATCH, "heads": HEADS, "kv_heads": KV_HEADS,
              "specs": {}}
    for name in specs:
        modules = {"shipped": variant_module(name, "shipped", None)}
        plan = modules["shipped"][0]
        packed = PACKED if plan.block_sparse else {**PACKED, **DENSE_EXTRA}
        modules.update({label: variant_module(name, label, cfg) for label, cfg in packed.items()})
        rows = []
        for seq in seqs:
            gen = torch.Generator(device="cuda").manual_seed(seq)
            spec = modules["shipped"][1].SPEC
            q, k, v = random_qkv(spec, BATCH, KV_HEADS, seq, seq, generator=gen)
            extra = feature_inputs(spec, shape_dims(q, k), gen)
            tensors = {n: extra[n] for n in spec["tensors"]}
            flops = (mask_mod_flops(torch, plan, extra, BATCH, HEADS, seq, seq) if plan.mask_mod
                     else forward_flops(plan, BATCH, HEADS, seq, seq))
            row = {"seq": seq, "flops": flops, "ms": {}, "graph_ms": {}, "max_diff": {}}
            ref = None
            for label, (_, m) in modules.items():
                out = torch.full_like(q, float("nan"))
                try:
                    maps = ({"block_map": m.make_block_map(BATCH, HEADS, seq, seq, device=q.device, **tensors)}
                            if hasattr(m, "make_block_map") else {})

                    def call(m=m, out=out, maps=maps):
                        return m.attention(q, k, v, out=out, **maps, **extra)

                    call()
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - reported in the row
                    row["max_diff"][label] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                if ref is None:
                    ref = out.clone()
                row["max_diff"][label] = (out.float() - ref.float()).abs().max().item()
                row["ms"][label] = do_bench(call, warmup=25, rep=150, return_mode="median")
                row["graph_ms"][label] = graph_time_ms(torch, call, do_bench, calls=20)
            base = row["ms"]["shipped"]
            row["tflops"] = {label: flops / ms / 1e9 for label, ms in row["ms"].items()}
            print(f"{name} S={seq:6d} " + "  ".join(
                f"{label} {row['tflops'][label]:4.0f}T {base / row['ms'][label]:.2f}x" for label in row["ms"]),
                flush=True)
            bad = {k_: v_ for k_, v_ in row["max_diff"].items() if not isinstance(v_, float) or v_ > 0.05}
            if bad:
                print(f"   diffs {bad}", flush=True)
            rows.append(row)
        report["specs"][name] = rows
        Path(out_dir, "pack_specs.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else SPECS,
         tuple(int(s) for s in sys.argv[3].split(",")) if len(sys.argv) > 3 else SEQS)

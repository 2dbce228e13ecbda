"""Tile configs of a block-sparse spec at chosen lengths, with a prebuilt map, next
to Flex (Triton backend), in one process on the same inputs (B4 Hq32 Hkv8).

Each variant is the spec with its sm_90 config replaced; it is rendered to
OUT_DIR/tiles/, checked against the shipped module's output, and timed by
do_bench median and inside a CUDA graph of 20 calls. Run on a GPU from the
repository root:

    python3 bench/block_sparse/tiles.py OUT_DIR SPEC SEQS "LABEL={tile_m: 64, ...}" ...

e.g. SPEC fmha_chunked_local, SEQS 1024,2048. Writes OUT_DIR/tiles-SPEC.json.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "bench/block_sparse")
from loop_variants import BATCH, HEADS, KV_HEADS, load, time_flex, time_variant  # noqa: E402
from specgen.bench.baselines import Inputs, _flex  # noqa: E402
from specgen.bench.flops import mask_mod_flops  # noqa: E402
from specgen.check.cases import feature_inputs, random_qkv, shape_dims  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402


def render(name: str, label: str, config: str, folder: Path) -> Path:
    text = Path(f"specs/{name}.yaml").read_text()
    slug = re.sub(r"\W+", "_", label).strip("_")
    text = re.sub(r"^  sm_90:.*$", f"  sm_90: {config}", text, flags=re.M)
    text = re.sub(r"^name: .*$", f"name: {name}_{slug}", text, flags=re.M)
    yaml = folder / f"{name}_{slug}.yaml"
    yaml.write_text(text)
    subprocess.run([sys.executable, "-m", "specgen", "build", str(yaml), "--gen", str(folder), "--no-compile"],
                   check=True, stdout=subprocess.DEVNULL)
    return folder / f"{name}_{slug}.py"


def main(out_dir: str, name: str, seqs: str, *variants: str) -> None:
    folder = Path(out_dir) / "tiles"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"shipped": Path(f"generated/{name}.py")}
    for item in variants:
        label, config = item.split("=", 1)
        paths[label] = render(name, label, config, folder)
    modules = {label: load(p, f"tiles_{i}") for i, (label, p) in enumerate(paths.items())}
    plan = make_plan(load_spec(f"specs/{name}.yaml"))
    flex = _flex(torch, "prefill", plan)
    rows = []
    for seq in map(int, seqs.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(seq)
        spec = modules["shipped"].SPEC
        q, k, v = random_qkv(spec, BATCH, KV_HEADS, seq, seq, generator=gen)
        extra = feature_inputs(spec, shape_dims(q, k), gen)
        tensors = {n: extra[n] for n in spec["tensors"]}
        flops = mask_mod_flops(torch, plan, extra, BATCH, HEADS, seq, seq)
        row = {"spec": name, "seq": seq, "flops": flops, "ms": {}, "graph_ms": {}, "max_diff": {}}
        reference = None
        for label, m in modules.items():
            out = torch.full_like(q, float("nan"))
            kwargs = dict(extra, block_map=m.make_block_map(BATCH, HEADS, seq, seq, device=q.device, **tensors))

            reference = time_variant(row, label, lambda m=m, out=out, kwargs=kwargs: m.attention(
                q, k, v, out=out, **kwargs), out, reference)
        time_flex(row, flex, Inputs(q=q, k=k, v=v, extra=extra))
        tf = lambda ms: flops / ms / 1e9  # noqa: E731
        print(f"{name} S={seq:5d} " + "  ".join(
            f"[{label}] {tf(ms):4.0f}/{tf(row['graph_ms'][label]):4.0f}" for label, ms in row["ms"].items()
            if label in row["graph_ms"]) + f"  max diff {max(row['max_diff'].values())}  {row.get('errors', '')}",
            flush=True)
        rows.append(row)
        Path(out_dir, f"tiles-{name}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])

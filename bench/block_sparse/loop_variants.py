"""How a block-sparse forward walks its map, timed against the dense kernel that
needs no map, in one process on the same inputs (B4 Hq32 Hkv8 bf16 D128 causal).

Variants of a generated sparse module, made by editing its key loops:
  gather    each step loads its key tile's index from the map's list;
  prefetch  each step loads the next step's index, so the K/V loads of a step do
            not wait on a dependent load;
  range     the full tiles as one ascending run from the first full tile. The
            shipped modules walk the run where the map records one (and the list
            elsewhere): they are this variant, and the other two force the list.
            On modules that only walk the list, the run is edited in (right only
            where the full tiles are consecutive, as on every mask timed here:
            outputs are compared with gather's).
The dense twin is the same spec without mask_mod and block_sparse (causal only):
on a chunked-local mask below the chunk length the two compute the same thing.

Every kernel is also timed inside a CUDA graph of 20 calls, which takes the
launch cost off; Flex (Triton backend) is timed both ways beside them.

Run on a GPU from the repository root:

    python3 bench/block_sparse/loop_variants.py OUT_DIR
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from specgen.bench.baselines import Inputs, _flex  # noqa: E402
from specgen.bench.core import graph_time_ms  # noqa: E402
from specgen.bench.flops import mask_mod_flops  # noqa: E402
from specgen.check.cases import feature_inputs, random_qkv, shape_dims  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402

BATCH, HEADS, KV_HEADS = 4, 32, 8
CASES = {"fmha_chunked_local": (1024, 2048, 4096, 8192), "fmha_document_mask": (1024, 2048, 4096, 16384),
         "fmha_prefix_lm": (1024, 4096, 16384)}

FULL_LOOP = re.compile(
    r"(?P<ind> +)for i in range\(capacity - num_full, capacity\):\n"
    r"(?P=ind)    j = ct\.load\(MapIdx, \(batch, map_head, tile_idx, i\), shape=\(\)\)\n")
PARTIAL_LOOP = re.compile(
    r"(?P<ind> +)for i in range\(0, num_partial\):\n"
    r"(?P=ind)    j = ct\.load\(MapIdx, \(batch, map_head, tile_idx, i\), shape=\(\)\)\n")


def prefetch(text: str) -> str:
    def full(m):
        ind = m["ind"]
        at = "(batch, map_head, tile_idx, {})"
        return (f"{ind}j_next = ct.load(MapIdx, {at.format('min(capacity - num_full, capacity - 1)')}, shape=())\n"
                f"{ind}for i in range(capacity - num_full, capacity):\n"
                f"{ind}    j = j_next\n"
                f"{ind}    j_next = ct.load(MapIdx, {at.format('min(i + 1, capacity - 1)')}, shape=())\n")

    def partial(m):
        ind = m["ind"]
        at = "(batch, map_head, tile_idx, {})"
        return (f"{ind}p_next = ct.load(MapIdx, {at.format('0')}, shape=())\n"
                f"{ind}for i in range(0, num_partial):\n"
                f"{ind}    j = p_next\n"
                f"{ind}    p_next = ct.load(MapIdx, {at.format('min(i + 1, capacity - 1)')}, shape=())\n")

    out, n = FULL_LOOP.subn(full, text)
    out, m = PARTIAL_LOOP.subn(partial, out)
    assert n == 1 and m == 1, (n, m)
    return out


def ranged(text: str) -> str:
    def full(m):
        ind = m["ind"]
        return (f"{ind}full_lo = min(ct.load(MapIdx, (batch, map_head, tile_idx, capacity - 1), shape=()),\n"
                f"{ind}              ct.load(MapIdx, (batch, map_head, tile_idx, max(capacity - num_full, 0)), shape=()))\n"
                f"{ind}for j in range(full_lo, full_lo + num_full):\n")

    out, n = FULL_LOOP.subn(full, text)
    assert n == 1, n
    return out


def as_list(text: str) -> str:
    """A module that walks its full tiles as a run where it can, made to walk the
    list everywhere (unchanged if it only walks the list)."""
    return text.replace("    if full_run >= 0:\n", "    if full_run >= NO_TILE:  # never: the list walk\n", 1)


def time_variant(row: dict, label: str, call, out, reference):
    """Times call() (which writes out) into row by do_bench and in a CUDA graph of 20
    calls, with its largest difference from reference (the first variant's output:
    returned for the next); a variant that fails is an entry of row["errors"]."""
    try:
        call()
        torch.cuda.synchronize()
        reference = out.clone() if reference is None else reference
        row["max_diff"][label] = (out.float() - reference.float()).abs().max().item()
        row["ms"][label] = do_bench(call, warmup=25, rep=200, return_mode="median")
        row["graph_ms"][label] = graph_time_ms(torch, call, do_bench, calls=20)
    except Exception as exc:  # noqa: BLE001 - a failed variant is a row entry
        row.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"[:400]
    return reference


def time_flex(row: dict, flex, inputs) -> None:
    """Flex on the same inputs, both ways, into row."""
    flex(inputs)
    row["ms"]["flex"] = do_bench(lambda: flex(inputs), warmup=25, rep=200, return_mode="median")
    try:
        row["graph_ms"]["flex"] = graph_time_ms(torch, lambda: flex(inputs), do_bench, calls=20)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        row.setdefault("errors", {})["flex_graph"] = f"{type(exc).__name__}: {exc}"[:400]


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dense_twin(spec_name: str, folder: Path) -> Path | None:
    text = Path(f"specs/{spec_name}.yaml").read_text()
    if "causal: true" not in text:
        return None
    text = re.sub(r"^(mask_mod|block_sparse|tensors):.*\n(  .*\n)*", "", text, flags=re.M)
    text = re.sub(r"^name: .*$", f"name: {spec_name}_dense", text, flags=re.M)
    yaml = folder / f"{spec_name}_dense.yaml"
    yaml.write_text(text)
    subprocess.run([sys.executable, "-m", "specgen", "build", str(yaml), "--gen", str(folder), "--no-compile"],
                   check=True)
    return folder / f"{spec_name}_dense.py"


def main(out_dir: str) -> None:
    folder = Path(out_dir) / "variants"
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, seqs in CASES.items():
        source = Path(f"generated/{name}.py").read_text()
        runs = "full_run = ct.load" in source
        edits = {"gather": as_list, "prefetch": lambda text: prefetch(as_list(text)),
                 "range": (lambda text: text) if runs else ranged}
        paths = {}
        for label, edit in edits.items():
            paths[label] = folder / f"{label}_{name}.py"
            paths[label].write_text(edit(source))
        twin = dense_twin(name, folder)
        if twin is not None:
            paths["dense"] = twin
        modules = {label: load(p, f"{label}_{name}") for label, p in paths.items()}
        plan = make_plan(load_spec(f"specs/{name}.yaml"))
        flex = _flex(torch, "prefill", plan)
        for seq in seqs:
            gen = torch.Generator(device="cuda").manual_seed(seq)
            mod = modules["gather"]
            q, k, v = random_qkv(mod.SPEC, BATCH, KV_HEADS, seq, seq, generator=gen)
            extra = feature_inputs(mod.SPEC, shape_dims(q, k), gen)
            tensors = {n: extra[n] for n in mod.SPEC["tensors"]}
            flops = mask_mod_flops(torch, plan, extra, BATCH, HEADS, seq, seq)
            row = {"spec": name, "seq": seq, "flops": flops, "ms": {}, "graph_ms": {}, "max_diff": {}}
            reference = None
            for label, m in modules.items():
                out = torch.full_like(q, float("nan"))
                kwargs = dict(extra)
                if label != "dense":  # each module's own BlockMap class, the same tiles
                    kwargs["block_map"] = m.make_block_map(BATCH, HEADS, seq, seq, device=q.device, **tensors)
                if label == "dense" and (name != "fmha_chunked_local" or seq > 8192):
                    continue

                reference = time_variant(row, label, lambda m=m, out=out, kwargs=kwargs: m.attention(
                    q, k, v, out=out, **kwargs), out, reference)
            time_flex(row, flex, Inputs(q=q, k=k, v=v, extra=extra))
            tf = lambda ms: flops / ms / 1e9  # noqa: E731
            print(f"{name:20s} S={seq:5d} " + "  ".join(
                f"{label} {tf(ms):5.0f}/{tf(row['graph_ms'].get(label, float('nan'))):5.0f}"
                for label, ms in row["ms"].items()) + f"  diff {row['max_diff']}  {row.get('errors', '')}",
                flush=True)
            rows.append(row)
            Path(out_dir, "loop_variants.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])

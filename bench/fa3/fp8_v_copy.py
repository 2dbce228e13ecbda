"""What the float8 prefill's per-call V transpose costs: `fmha_fp8_llama` as
shipped (V copied to [B, Hkv, D, Skv] in every call), the same module with V handed
over already transposed (`v_transposed=True` on the copy that `transposed_v` made
once, outside the timing: a cache written transposed), the shipped call without programmatic dependent launch (V_PDL off), the
copy alone, and FlashAttention-3's e4m3 forward where the
`fa3-fwd` wheel imports.

B4 Hq32 Hkv4 D128 causal, float8 inputs with float descales (as the prefill suite
calls it); triton do_bench medians, and CUDA graphs of one call per replay.

    python3 bench/fa3/fp8_v_copy.py OUT_DIR [--seqs 1024,2048,4096,8192,16384]
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = ["."]

BATCH, HEADS, KV_HEADS, D = 4, 32, 4, 128
SEQS = (1024, 2048, 4096, 8192, 16384)
DESCALES = (0.5, 0.25, 0.125)


def load_module():
    spec = importlib.util.spec_from_file_location("fmha_fp8_llama", "generated/fmha_fp8_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fa3():
    """FA3's flash_attn_func, or None where the wheel does not import."""
    from specgen.bench.baselines import _fa3_module

    try:
        return _fa3_module().flash_attn_func
    except ImportError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seqs", default=",".join(map(str, SEQS)))
    args = parser.parse_args()
    from triton.testing import do_bench

    from specgen.bench.core import graph_time_ms, median_ms
    module, flash = load_module(), fa3()
    fp8 = torch.float8_e4m3fn
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(seq)
        q, k, v = (torch.randn(shape, generator=gen, device="cuda").to(fp8)
                   for shape in ((BATCH, HEADS, seq, D), (BATCH, KV_HEADS, seq, D), (BATCH, KV_HEADS, seq, D)))
        qd, kd, vd = DESCALES
        v_t = module.transposed_v(v)

        def shipped():
            return module.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)

        def pre_transposed():
            return module.attention(q, k, v_t, q_descale=qd, k_descale=kd, v_descale=vd, v_transposed=True)

        def no_pdl():
            module.V_PDL = False
            try:
                return module.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
            finally:
                module.V_PDL = True

        def copy_only():
            return module.transposed_v(v)

        calls = {"shipped": shipped, "no_pdl": no_pdl, "v_pre_transposed": pre_transposed,
                 "v_copy_alone": copy_only}
        if flash is not None:
            # FA3 takes [B, S, H, D] and float32 [B, Hkv] descales, made once.
            q4, k4, v4 = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            descale = [torch.full((BATCH, KV_HEADS), d, device="cuda", dtype=torch.float32) for d in DESCALES]

            def fa3_call():
                return flash(q4, k4, v4, causal=True, q_descale=descale[0], k_descale=descale[1],
                             v_descale=descale[2])

            calls["fa3"] = fa3_call
        a, b = shipped(), pre_transposed()
        torch.cuda.synchronize()
        assert torch.equal(a, b), "the pre-transposed V changed the output"
        flops = 4 * BATCH * HEADS * seq * seq * D // 2  # causal: half the pairs
        eager = {n: median_ms(do_bench, f) for n, f in calls.items()}
        graph = {n: graph_time_ms(torch, f, do_bench) for n, f in calls.items()}
        row = dict(seq=seq, flops=flops, ms=eager, ms_graph=graph,
                   tflops={n: flops / (t * 1e9) for n, t in eager.items() if n != "v_copy_alone"},
                   tflops_graph={n: flops / (t * 1e9) for n, t in graph.items() if n != "v_copy_alone"})
        if flash is not None:
            row["over_fa3_graph"] = {n: graph["fa3"] / graph[n] for n in ("shipped", "no_pdl", "v_pre_transposed")}
        rows.append(row)
        print(f"S={seq}: " + ", ".join(f"{n} {eager[n]:.4f} ms (graph {graph[n]:.4f})" for n in calls)
              + ("".join(f"; {n} / FA3 (graph) {r:.3f}" for n, r in row["over_fa3_graph"].items())
                 if flash is not None else ""), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "fp8_v_copy.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

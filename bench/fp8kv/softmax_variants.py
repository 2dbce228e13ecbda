"""What the online softmax of the float8-cache decode costs, and cheaper forms of it.

Times, in one process on the same inputs, the shipped float8-cache decode
(``fmha_decode_gqa8_fp8kv``), edited copies of its module, and the bf16-cache
decode (``fmha_decode_gqa8_bf16``, on a bf16 copy of the same cache):

- ``shipped``: the module as generated, which keeps each row's sum of P per column
  ([TILE_M, TILE_N]) and reduces it once after the loop, so a step makes one row
  reduction (the max). With 16 query rows an MMA's columns lie across the CTA's
  warps, so every row reduction crosses warps through shared memory.
- ``row_sums``: the per-step row sum edited back in (two reductions per step).
- ``max_once`` (diagnostic, not a correct kernel for every input): the row max is
  taken once, from the first tile, plus 8, and never updated, so the unmasked loop
  makes no row reduction and no rescale. It bounds what the max bookkeeping costs.
- ``lat{k}_{v}``: the K and V loads' latency hints (the spec's k_latency and
  v_latency, shipped 2 and 4) set to k and v.
- ``split{n}``: the auto split count aiming at n split CTAs per SM (shipped 2).

Each variant's output is compared with the shipped kernel's. Timing as the decode
suite's steady state: CUDA graphs of 16 calls, median replay per call.

    python3 bench/fp8kv/softmax_variants.py OUT_DIR [VARIANT,...] [SHAPES: B:L,...]
"""

import json
import os
import re
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from specgen.bench.core import graph_time_ms  # noqa: E402
from specgen.check.cases import FP8_DESCALES, random_decode  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402

SHAPES = ((64, 8, 4096), (8, 8, 8192), (1, 8, 32768), (1, 8, 8192))


def edit(text: str, pattern: str, repl: str, count: int) -> str:
    new, n = re.subn(pattern, repl, text)
    assert n == count, (pattern, n)
    return new


SHIPPED_SUM = "l_cols = l_cols * alpha + p"


def row_sums(text: str) -> str:
    """The per-step row sum of P (the template before the sum per column)."""
    text = edit(text, re.escape("l_cols = ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)"),
                "l_cols = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)", 1)
    text = edit(text, re.escape(SHIPPED_SUM), "l_cols = l_cols * alpha + ct.sum(p, axis=-1, keepdims=True)", 2)
    return edit(text, re.escape("l_i = ct.sum(l_cols, axis=-1, keepdims=True)"), "l_i = l_cols", 1)


def latency(k: int, v: int):
    def apply(text: str) -> str:
        text = edit(text, r"latency=2,", "latency=K_LATENCY,", 2)
        text = edit(text, r"latency=4,", f"latency={v},", 2)
        return text.replace("latency=K_LATENCY,", f"latency={k},")
    return apply


def split_ctas(n: int):
    """The auto split rule aiming at ``n`` split CTAs per SM (shipped: 2)."""
    def apply(text: str) -> str:
        return edit(text, r"\nSPLIT_CTAS_PER_SM = 2\n", f"\nSPLIT_CTAS_PER_SM = {n}\n", 1)
    return apply


def max_once(text: str) -> str:
    """The diagnostic: the row max of the first unmasked tile, computed before the loop."""
    loop = "    for j in range(start, hi):\n"
    first = ("    if start < hi:\n"
             "        k0 = (ct.load(K, index=(batch, 0, kv_head, start), shape=(1, HEAD_DIM, 1, TILE_N),"
             " order=(0, 3, 2, 1)).reshape((HEAD_DIM, TILE_N)).astype(ct.float16))\n"
             "        s0 = ct.mma(q, k0, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))\n"
             "        m_i = ct.max(s0, axis=-1, keepdims=True) * scale + 8.0\n")
    text = edit(text, re.escape(loop), first + loop, 1)
    # Inside the unmasked loop only: no max, no rescale.
    head, sep, tail = text.partition(loop)
    body, sep2, rest = tail.partition("\n    j = hi\n")
    body = edit(body, r"        m_new = max\(m_i, ct\.max\(s, axis=-1, keepdims=True\) \* scale\)\n",
                "        m_new = m_i\n", 1)
    body = edit(body, r"        alpha = ct\.exp2\(m_i - m_new, flush_to_zero=True\)\n", "", 1)
    body = edit(body, r"        l_cols = l_cols \* alpha \+ p\n", "        l_cols = l_cols + p\n", 1)
    body = edit(body, r"        acc = acc \* alpha\n", "", 1)
    return head + sep + body + sep2 + rest


def main(out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    fp8_text = open("generated/fmha_decode_gqa8_fp8kv.py").read()
    variants = {"shipped": lambda text: text, "row_sums": row_sums, "max_once": max_once,
                "lat3_6": latency(3, 6), "lat4_8": latency(4, 8), "lat1_3": latency(1, 3),
                "lat2_2": latency(2, 2), "split1": split_ctas(1), "split3": split_ctas(3),
                "split4": split_ctas(4)}
    chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else list(variants)
    kernels = {name: load_module_from_source(f"fp8_{name}", variants[name](fp8_text), f"<{name}>")
               for name in chosen}
    import generated.fmha_decode_gqa8_bf16 as bf16_mod

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    shapes = SHAPES
    if len(sys.argv) > 3:
        shapes = tuple((int(b), 8, int(n)) for b, n in (s.split(":") for s in sys.argv[3].split(",")))
    repeats = int(os.environ.get("REPEATS", "1"))
    for batch_size, kv_heads, length in shapes * repeats:
        data = random_decode(kernels["shipped"].SPEC, [length] * batch_size, kv_heads, 1, gen)
        kd, vd = FP8_DESCALES["k_descale"], FP8_DESCALES["v_descale"]
        k16 = (data.k_cache.float() * kd).to(torch.bfloat16)
        v16 = (data.v_cache.float() * vd).to(torch.bfloat16)[..., :length].permute(0, 3, 1, 2).contiguous()
        row = dict(batch=batch_size, kv_heads=kv_heads, seq_k=length)
        outs = {}
        for name, mod in kernels.items():
            out = torch.empty_like(data.q)

            def call(mod=mod, out=out):
                return mod.attention(*data.args(), out=out, max_seq_len=length, k_descale=kd, v_descale=vd)

            call()
            torch.cuda.synchronize()
            outs[name] = out.clone()
            row[name + "_us"] = round(1000 * graph_time_ms(torch, call, do_bench, calls=16), 2)
        out16 = torch.empty_like(data.q)

        def call16():
            return bf16_mod.attention(data.q, k16, v16, data.seq_lens, out=out16, max_seq_len=length)

        call16()
        torch.cuda.synchronize()
        row["bf16_cache_us"] = round(1000 * graph_time_ms(torch, call16, do_bench, calls=16), 2)
        for name, out in outs.items():
            row[name + "_maxdiff_vs_shipped"] = float((out.float() - outs["shipped"].float()).abs().max())
            row[name + "_speed_over_bf16"] = round(row["bf16_cache_us"] / row[name + "_us"], 3)
        row["bf16_maxdiff_vs_shipped"] = float((out16.float() - outs["shipped"].float()).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "fp8kv_softmax_variants.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

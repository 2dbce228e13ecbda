"""`specgen bench --suite decode`: decode kernels at the memory speed of light.

Decode reads the KV cache once: its speed of light is the KV bytes over the HBM
bandwidth (quack's method). What it counts: the K and V bytes a kernel reads.
Each row reports the time, those bytes per second, that as a share of the
device-to-device copy bandwidth measured in the same run, and the ratio to each
baseline. Every kernel, ours and the baselines, is captured in a CUDA graph and
timed by replaying it, so launch overhead is not compared with launch overhead,
in two ways (:func:`specgen.bench.core.graph_time_ms`):

- steady state (the headline, ``ms``): STEADY_CALLS calls in one graph, cycling
  through input copies that together hold ROTATE_L2_MULTIPLE times the L2 cache,
  the median replay divided by the calls. A serving loop replays a whole decode
  step as one graph, so a kernel there pays a graph node's cost, not a graph launch;
- one call per graph (``ms_one_call``): what a graph of just this call costs,
  its launch floor included (4.6 µs for an empty kernel on the H200).
"""

from __future__ import annotations

from typing import Optional

from specgen.bench.baselines import Inputs
from specgen.bench.core import (
    ROTATE_L2_MULTIPLE,
    BenchResult,
    Case,
    Context,
    Report,
    Suite,
    Timing,
    copy_bandwidth,
    graph_time_ms,
    provenance,
    rotation_copies,
    steady_calls,
    tbps,
)
from specgen.bench.baselines import label

# (batch, KV heads, cached length); query heads = gqa_ratio * KV heads.
DECODE_SHAPES = ((1, 8, 8192), (1, 8, 32768), (8, 8, 8192), (64, 8, 4096))
# block_sparse specs add long caches, where a mask (a chunk, a document) hides most keys.
SPARSE_SHAPES = ((8, 8, 32768), (1, 8, 131072))


def kv_bytes(batch: int, kv_heads: int, length: int, head_dim: int, dtype_bits: int) -> int:
    """The K and V bytes one decode call reads: 2 * B * L * Hkv * D elements."""
    return 2 * batch * length * kv_heads * head_dim * dtype_bits // 8


def _calls(result: BenchResult) -> str:
    counts = sorted({row.calls_per_graph for row in result.rows if row.calls_per_graph})
    return "/".join(str(c) for c in counts) or "?"


def _intro(result: BenchResult) -> str:
    return (f"Suite `decode`: one new token per sequence, {result.layout}. Steady state: "
            f"each kernel is captured {_calls(result)} times in one CUDA graph, cycling through "
            f"input copies that together hold at least {ROTATE_L2_MULTIPLE}× the L2 cache (so "
            f"every call reads its KV from HBM), and the median replay is divided by the "
            f"calls. KV TB/s = K and V bytes read / time; copy bandwidth "
            f"{result.copy_tbps:.2f} TB/s (a 1 GiB copy kernel, read + write) in the same run. "
            + provenance(result))


def _one_call_table(result: BenchResult) -> list[str]:
    names = ["specgen"] + result.baselines
    lines = [
        "",
        "One call per graph replay (each figure then carries the graph's launch floor; "
        "an empty kernel's graph replays in 4.6 µs on an H200):",
        "",
        "| B | Hq/Hkv | L | " + " | ".join(f"{label(n)} µs" for n in names) + " |",
        "|" + "---:|" * (3 + len(names)),
    ]
    for row in result.rows:
        cells = []
        for n in names:
            t = row.timings.get(n)
            cells.append(f"{1000 * t.ms_one_call:.1f}" if t and t.ms_one_call else "n/a")
        lines.append(f"| {row.batch} | {row.heads_q}/{row.heads_kv} | {row.seq_k} | "
                     + " | ".join(cells) + " |")
    return lines


REPORT = Report(
    intro=_intro,
    keys=(("B", lambda r: str(r.batch)), ("Hq/Hkv", lambda r: f"{r.heads_q}/{r.heads_kv}"),
          ("L", lambda r: str(r.seq_k)),
          ("splits", lambda r: f"{r.splits}, PDL" if r.pdl else str(r.splits))),
    unit="µs (TB/s)",
    cell=lambda t: f"{1000 * t.ms:.1f} ({t.tbps:.2f})" if t.ms and t.tbps is not None else None,
    share="copy",
    share_of=lambda t: t.pct_of_copy,
    more=_one_call_table,
)


class Decode(Suite):
    name = "decode"
    report = REPORT

    def yardstick(self, torch, do_bench, log) -> dict:
        return {"copy_tbps": copy_bandwidth(torch, do_bench, log)}

    def skip(self, plan) -> Optional[str]:
        return None if plan.spec.family == "decode" else "not a decode spec (use --suite prefill)"

    def shapes(self, plan, override=None) -> list:
        return list(override or DECODE_SHAPES + (SPARSE_SHAPES if plan.block_sparse else ()))

    def case(self, ctx: Context, module, plan, shape) -> Case:
        from specgen.check.cases import feature_inputs, random_decode

        torch = ctx.torch
        batch, kv_heads, length = shape
        ratio, d, spec = plan.group_size, plan.head_dim, plan.spec_dict
        gen = torch.Generator(device="cuda").manual_seed(0)
        nbytes = kv_bytes(batch, kv_heads, length, d, torch.finfo(getattr(torch, plan.kv_dtype)).bits)
        # A float8 cache: the baselines (no float8 KV in SDPA or Flex) read it
        # dequantised to the query dtype, twice the bytes; their TB/s counts those.
        base_bytes = kv_bytes(batch, kv_heads, length, d, torch.finfo(getattr(torch, plan.dtype)).bits)
        copies = rotation_copies(torch, nbytes)
        calls = steady_calls(copies)
        label_ = f"B{batch} Hq{ratio * kv_heads}/Hkv{kv_heads} L{length}"
        ctx.log(f"[{plan.module_name}] {label_}: {copies} input copies, {calls} calls per steady-state graph")
        datas = [random_decode(spec, [length] * batch, kv_heads, 1, gen) for _ in range(copies)]
        extra = feature_inputs(spec, datas[0].dims(), gen)
        hooks = {n: extra[n] for n in spec.get("tensors") or {}}  # the mask_mod's tensors
        outs = [torch.empty_like(data.q) for data in datas]
        map_fields, kwargs = {}, {}
        if hasattr(module, "make_block_map"):
            # One map serves every copy (the same lengths and hook tensors); a serving
            # loop builds it once per step for all layers, so its build is timed apart.
            def build():
                return module.make_block_map(datas[0].seq_lens, ratio * kv_heads, datas[0].capacity,
                                             **hooks)

            kwargs["block_map"] = build()
            partial, full, _ = kwargs["block_map"].tile_counts()
            map_heads = kwargs["block_map"].num_heads
            tile_n = kwargs["block_map"].tile_n
            # The bytes the kernel reads: the listed tiles' keys, for every KV head.
            nbytes = base_bytes = kv_bytes(1, kv_heads // map_heads, (partial + full) * tile_n, d,
                                           torch.finfo(getattr(torch, plan.kv_dtype)).bits)
            map_fields = dict(block_map_ms=graph_time_ms(torch, build, ctx.do_bench, calls=16),
                              tiles_visited=(partial + full) / (batch * map_heads * -(-length // tile_n)))
            ctx.log(f"[{plan.module_name}] {label_}: the block map lists {partial} partial + {full} full "
                    f"tiles of {tile_n} keys")

        def call(i):
            return lambda: module.attention(*datas[i].args(), out=outs[i], max_seq_len=length, **extra,
                                            **kwargs)

        # Baselines read [B, H, L, D] copies of the caches, made outside the timing
        # (a float8 cache dequantised to the query dtype).
        descales = (float(extra.get("k_descale", 1.0)), float(extra.get("v_descale", 1.0)))

        def baseline_cache(data, which):
            cache = torch.stack([data.keys(b)[which] for b in range(batch)])
            if cache.dtype == data.q.dtype:
                return cache.contiguous()
            return (cache.float() * descales[which]).to(data.q.dtype).contiguous()

        inputs = [Inputs(q=data.q.transpose(1, 2).contiguous(), k=baseline_cache(data, 0),
                         v=baseline_cache(data, 1), extra=hooks) for data in datas]
        _, splits, pdl = module.launch_plan(batch, kv_heads, length, torch.device("cuda"))
        row = dict(batch=batch, heads_q=ratio * kv_heads, heads_kv=kv_heads, seq_q=1, seq_k=length,
                   head_dim=d, dtype=plan.dtype, causal=plan.causal, bytes=nbytes, splits=splits,
                   pdl=pdl, input_copies=copies, calls_per_graph=calls)
        return Case(label_, row, inputs, kernel=([call(i) for i in range(copies)], outs, base_bytes,
                                                 map_fields))

    def _rate(self, ctx: Context, case: Case, fns, read_bytes: int, **more) -> Timing:
        torch, do_bench = ctx.torch, ctx.do_bench
        ms = graph_time_ms(torch, fns, do_bench, calls=case.row["calls_per_graph"])
        rate = tbps(read_bytes, ms)
        return Timing(ms=ms, tbps=rate, pct_of_copy=100 * rate / ctx.yardstick["copy_tbps"],
                      ms_one_call=graph_time_ms(torch, fns[0], do_bench), **more)

    def time_kernel(self, ctx: Context, module, case: Case) -> Timing:
        ours, outs, _, map_fields = case.kernel
        ours[0]()
        ctx.torch.cuda.synchronize()
        case.ours = outs[0].float().clone()
        return self._rate(ctx, case, ours, case.row["bytes"], **map_fields)

    def time_baseline(self, ctx: Context, case: Case, baseline, fn) -> Timing:
        base_bytes = case.kernel[2]
        ref = fn(case.inputs[0])
        ctx.torch.cuda.synchronize()
        diff = (ref.transpose(1, 2).float() - case.ours).abs().max().item()
        note = (f"reads the cache dequantised to {case.row['dtype']} ({base_bytes} bytes)"
                if base_bytes != case.row["bytes"] else baseline.note)
        return self._rate(ctx, case, [lambda x=x: fn(x) for x in case.inputs], base_bytes,
                          max_abs_diff_vs_specgen=diff, note=note)

    def layout(self, plan) -> str:
        return (("paged KV cache, page_size %d" % plan.page_size if plan.page_size
                 else "contiguous KV cache [B, L, Hkv, D]")
                + (", V stored keys last" if plan.v_cache_transposed else "")
                + (f", {plan.kv_dtype} (baselines: the cache dequantised to {plan.dtype})"
                   if plan.kv_dtype != plan.dtype else ""))


SUITE = Decode()

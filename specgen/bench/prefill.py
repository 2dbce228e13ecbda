"""`specgen bench --suite prefill`: the generated kernel next to the baselines
(cuDNN, FlashAttention-2 and FlexAttention by default), timed in one process on
the same inputs: B4 Hq32 (rounded down to a multiple of gqa_ratio), Sq = Skv
from 1024 to 16384, median of triton's do_bench. What it counts: the FLOPs of
the query-key pairs the kernel computes (:mod:`specgen.bench.flops`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from specgen.bench.baselines import Inputs, label
from specgen.bench.core import (
    BenchResult,
    Case,
    Context,
    Report,
    Suite,
    Timing,
    graph_time_ms,
    matmul_rate,
    median_ms,
    provenance,
    timed,
    tflops,
)
from specgen.bench.flops import forward_flops, mask_mod_flops
from specgen.errors import UsageError

BATCH = 4
HEADS = 32  # query heads, rounded down to a multiple of gqa_ratio (suite_heads)
SEQS = (1024, 2048, 4096, 8192, 16384)  # Sq = Skv


def suite_heads(heads: int, gqa_ratio: int) -> int:
    """The suite's query heads, rounded down to a multiple of gqa_ratio (at least
    one KV head): Hq32 for GQA 8, Hq28 for Qwen2's 7."""
    return max(gqa_ratio, heads - heads % gqa_ratio)


def varlen_lengths(batch: int, seq: int) -> list[int]:
    """The sequence lengths of a varlen bench row: S/2, S, 3S/2, S, ... (mean S)."""
    return [(seq // 2, seq, 3 * seq // 2, seq)[i % 4] for i in range(batch)]


def checked_shapes(plan, shapes: Sequence, heads_default: int = HEADS) -> list[tuple[int, int, int]]:
    """(batch, heads, seq) shapes given in place of the suite's: heads must be a
    multiple of the spec's gqa_ratio. A batch or heads of None takes the suite's
    (``bench --seqs`` changes the lengths only)."""
    out = []
    for batch, heads, seq in shapes:
        batch = BATCH if batch is None else batch
        heads = heads_default if heads is None else heads
        if heads % plan.group_size:
            raise UsageError(f"shapes: {heads} query heads are not a multiple of "
                             f"{plan.module_name}'s gqa_ratio {plan.group_size}")
        out.append((batch, heads, seq))
    return out


def tflops_intro(result: BenchResult) -> str:
    first = result.rows[0] if result.rows else None
    shape = (
        f"B={first.batch}, Hq={first.heads_q}, Hkv={first.heads_kv}, {first.dtype}, "
        f"D={first.head_dim}, {'causal' if first.causal else 'non-causal'}"
        if first
        else "no rows"
    )
    return (f"Suite `{result.suite}`: {shape}, {result.layout}. "
            f"Median of triton `do_bench`; dense fp16 matmul {result.matmul_tflops:.0f} TFLOPS "
            f"in the same run. " + provenance(result))


def tflops_cell(t: Timing) -> Optional[str]:
    return f"{t.tflops:.0f} ({t.ms:.3f})" if t.ms is not None and t.tflops is not None else None


def graph_table(result: BenchResult) -> list[str]:
    """Where the rows carry them: each kernel's TFLOPS from a CUDA graph of one call,
    and specgen's ratio to each baseline by those times. The eager figures above
    include the host's launch path, which bounds short calls of some baselines."""
    if not any(t.ms_one_call for row in result.rows for t in row.timings.values()):
        return []
    names = ["specgen"] + result.baselines
    lines = ["", "CUDA graph of one call per replay (no host launch path), TFLOPS and ratios:", "",
             "| S | " + " | ".join(label(n) for n in names) + " | "
             + " | ".join(f"vs {label(n)}" for n in result.baselines) + " |",
             "|" + "---:|" * (1 + len(names) + len(result.baselines))]
    for row in result.rows:
        graph = {n: row.timings[n].ms_one_call for n in names if n in row.timings}
        cells = [f"{tflops(row.flops, graph[n]):.0f}" if graph.get(n) and row.flops else "n/a"
                 for n in names]
        ours = graph.get("specgen")
        ratios = [f"{graph[n] / ours:.2f}×" if ours and graph.get(n) else "n/a" for n in result.baselines]
        lines.append(f"| {row.seq_q} | " + " | ".join(cells + ratios) + " |")
    return lines


# The table of the compute-bound suites (prefill, backward): TFLOPS per length.
REPORT = Report(
    intro=tflops_intro,
    keys=(("S", lambda row: str(row.seq_q)),),
    unit="TFLOPS (ms)",
    cell=tflops_cell,
    share="matmul",
    share_of=lambda t: t.pct_of_matmul,
    more=graph_table,
    plot_x=("sequence length (Sq = Skv)", lambda row: row.seq_q),
)


class Prefill(Suite):
    name = "prefill"
    report = REPORT

    def yardstick(self, torch, do_bench, log) -> dict:
        return {"matmul_tflops": matmul_rate(torch, do_bench, log)}

    def skip(self, plan) -> Optional[str]:
        return "a decode spec (use --suite decode)" if plan.spec.family == "decode" else None

    def shapes(self, plan, override=None) -> list:
        heads = suite_heads(HEADS, plan.group_size)
        if override:
            return checked_shapes(plan, override, heads)
        return [(BATCH, heads, seq) for seq in SEQS]

    def case(self, ctx: Context, module, plan, shape) -> Case:
        from specgen.check.cases import feature_inputs, poisoned_out, random_packed, random_qkv, shape_dims

        torch = ctx.torch
        batch, heads, seq = shape
        ratio = plan.group_size
        kv_heads, spec = heads // ratio, plan.spec_dict
        gen = torch.Generator(device="cuda").manual_seed(seq)
        row = dict(batch=batch, heads_q=heads, heads_kv=kv_heads, seq_q=seq, seq_k=seq,
                   head_dim=plan.head_dim, dtype=plan.dtype, causal=plan.causal)
        if plan.varlen:
            # A ragged packed batch averaging S per sequence: S/2, S, 3S/2, S, ...
            lengths = varlen_lengths(batch, seq)
            packed = random_packed(spec, [(n, n) for n in lengths], kv_heads, generator=gen)
            q, k, v, kwargs = packed.q, packed.k, packed.v, packed.kwargs()
            out = torch.full((*q.shape[:2], v.shape[2]), float("nan"), dtype=q.dtype, device="cuda")
            extra = feature_inputs(spec, {"heads": heads}, gen)
            row["flops"] = sum(forward_flops(plan, 1, heads, n, n) for n in lengths)
            inputs = Inputs(packed=packed, extra=extra)
        else:
            q, k, v = random_qkv(spec, batch, kv_heads, seq, seq, generator=gen)
            kwargs = {}
            # torch has no float8 attention: baselines run on 16-bit copies (fa3 reads q, k, v).
            bq, bk, bv = ((t.to(getattr(torch, plan.out_dtype)) for t in (q, k, v)) if plan.fp8
                          else (q, k, v))
            # Expanded K/V for baselines needing equal head counts, outside timing.
            k_full, v_full = ((t.repeat_interleave(ratio, 1) for t in (bk, bv)) if ratio > 1
                              else (bk, bv))
            out = poisoned_out(spec, q, v)
            extra = feature_inputs(spec, shape_dims(q, k), gen)
            if plan.fp8:  # unit descales: outputs comparable
                extra.update(q_descale=1.0, k_descale=1.0, v_descale=1.0)
            if plan.mask_mod:  # only the pairs the mask leaves: no phantom FLOPs
                row["flops"] = mask_mod_flops(torch, plan, extra, batch, heads, seq, seq)
            else:
                row["flops"] = forward_flops(plan, batch, heads, seq, seq)
            inputs = Inputs(q=bq, k=bk, v=bv, k_full=k_full, v_full=v_full, extra=extra,
                            kernel_qkv=(q, k, v) if plan.fp8 else None)
        return Case(f"S={seq}", row, inputs, kernel=(q, k, v, extra, out, kwargs))

    def time_kernel(self, ctx: Context, module, case: Case) -> Timing:
        from specgen.check.cases import call_kernel

        q, k, v, extra, out, kwargs = case.kernel
        map_fields = {}
        if hasattr(module, "make_block_map"):
            # Built once per batch and reused, as Flex's block mask is: timed apart.
            tensors = {n: extra[n] for n in module.SPEC["tensors"]}
            def build():
                return module.make_block_map(q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                                             device=q.device, **tensors)
            kwargs = dict(kwargs, block_map=build())
            partial, full, capacity = kwargs["block_map"].tile_counts()
            map_fields = dict(block_map_ms=median_ms(ctx.do_bench, build),
                              tiles_visited=(partial + full) / max(capacity, 1))
        call_kernel(module, q, k, v, extra, out=out, **kwargs)  # JIT compile; the baselines' reference
        ctx.torch.cuda.synchronize()
        case.ours = out.clone()
        def call():
            return call_kernel(module, q, k, v, extra, out=out, **kwargs)

        ms = median_ms(ctx.do_bench, call)
        timing = timed(ms, case.row["flops"], ctx.yardstick["matmul_tflops"],
                       ms_one_call=one_call_graph_ms(ctx, call), **map_fields)
        if not ctx.torch.isfinite(case.ours).all():
            timing.error = "non-finite output"
        return timing

    def time_baseline(self, ctx: Context, case: Case, baseline, fn) -> Timing:
        ref = fn(case.inputs)
        ctx.torch.cuda.synchronize()
        diff = (ref.float() - case.ours.float()).abs().max().item()
        ms = median_ms(ctx.do_bench, lambda: fn(case.inputs))
        ms_graph = one_call_graph_ms(ctx, lambda: fn(case.inputs))
        note = ("reads the float8 inputs (unit descales)"
                if baseline.float8 and case.inputs.kernel_qkv is not None else baseline.note)
        return timed(ms, case.row["flops"], ctx.yardstick["matmul_tflops"],
                     max_abs_diff_vs_specgen=diff, note=note, ms_one_call=ms_graph)

    def layout(self, plan) -> str:
        return (("packed varlen batch of B sequences of S/2, S, 3S/2, S, ... (mean S) tokens, "
                 "Sq=Skv per sequence" if plan.varlen else "Sq=Skv")
                + (f"; baselines run on {plan.out_dtype} copies of the float8 inputs (torch "
                   "exposes no float8 attention)" if plan.fp8 else ""))


def one_call_graph_ms(ctx: Context, fn) -> Optional[float]:
    """The median ms of replaying a CUDA graph of one call of ``fn``: the kernel's time
    without the host's launch path, which bounds short eager calls (an FA3 call at
    S=1k spends longer on the host than on the GPU). None where ``fn`` cannot be
    captured."""
    try:
        return graph_time_ms(ctx.torch, fn, ctx.do_bench)
    except Exception:  # noqa: BLE001 - a baseline that cannot be captured keeps its eager time
        ctx.torch.cuda.synchronize()
        return None


SUITE = Prefill()

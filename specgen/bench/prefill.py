"""`specgen bench`: the generated kernel next to cuDNN, FlashAttention-2 and
FlexAttention, timed in one process on the same inputs.

Pure parts (FLOP counting, the result schema, the markdown table) run anywhere;
timing needs a CUDA GPU and triton.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict

from specgen.compile.export import atomic_write
from specgen.errors import UsageError

SUITES = {
    # name: (batch, query heads, sequence lengths); Sq = Skv.
    "prefill": (4, 32, (1024, 2048, 4096, 8192, 16384)),
}
BASELINES = ("cudnn", "flash", "flex")
KERNEL_LABELS = {
    "specgen": "specgen (cuTile)",
    "cudnn": "SDPA cuDNN",
    "flash": "SDPA FA2",
    "flex": "FlexAttention",
}
MATMUL_N = 8192
SCHEMA_VERSION = 1


def parse_baselines(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise UsageError(
            f"--baselines: unknown {', '.join(unknown)}; allowed: {', '.join(BASELINES)}"
        )
    return names


DECODE_SUITE = "decode"  # specgen.bench.decode: decode specs at the memory speed of light
BACKWARD_SUITE = "backward"  # specgen.bench.backward: the backward kernels of training specs


def parse_suite(name: str, allow_decode: bool = True) -> str:
    """A suite name; ``allow_decode`` False (tune) allows only the forward prefill suites."""
    allowed = list(SUITES) + ([DECODE_SUITE, BACKWARD_SUITE] if allow_decode else [])
    if name not in allowed:
        raise UsageError(f"--suite: unknown {name!r}; allowed: {', '.join(allowed)}")
    return name


def suite_heads(heads: int, gqa_ratio: int) -> int:
    """The suite's query heads, rounded down to a multiple of gqa_ratio (at least
    one KV head): Hq32 for GQA 8, Hq28 for Qwen2's 7."""
    return max(gqa_ratio, heads - heads % gqa_ratio)


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool,
                    v_head_dim: Optional[int] = None) -> int:
    """2 * B * Hq * Sq * Skv * (D + Dv) (two matmuls, multiply-add = 2; 4 * ... * D
    when Dv = D), halved for causal."""
    flops = 2 * batch * heads * seq_q * seq_k * (head_dim + (v_head_dim or head_dim))
    return flops // 2 if causal else flops


def visible_pairs(seq_q: int, seq_k: int, causal: bool, window: Optional[dict] = None,
                  q_offset: int = 0) -> int:
    """Query-key pairs a kernel computes: every pair, or those under the causal
    diagonal and inside the window (row i at position q_offset + i)."""
    from specgen.check.reference import key_range

    left = window.get("left") if window else None
    right = window.get("right") if window else None
    total = 0
    for i in range(seq_q):
        lo, hi = key_range(q_offset + i, seq_k, causal=causal, left=left, right=right)
        total += max(hi - lo + 1, 0)
    return total


def mask_mod_pairs(torch, spec: dict, extra: dict, batch: int, heads: int, seq_q: int,
                   seq_k: int) -> int:
    """Query-key pairs a mask_mod spec leaves visible (with its causal mask and
    window), summed over batch and heads: evaluated with torch, 1024 rows at a time."""
    from specgen.spec.hooks import compile_hook, torch_fn
    from specgen.check.reference import visible_mask

    allowed_fn = torch_fn(spec["mask_mod"])
    tensors = {n: extra[n] for n in spec.get("tensors") or {}}
    window = spec.get("window")
    declared = {n: (t["dtype"], len(t["shape"])) for n, t in (spec.get("tensors") or {}).items()}
    per_head = "h" in compile_hook(spec["mask_mod"], "mask_mod", declared).uses
    keys = torch.arange(seq_k, device="cuda")[None, :]
    total = 0
    for b in range(batch):
        for h in range(heads) if per_head else (0,):
            for start in range(0, seq_q, 1024):
                rows = torch.arange(start, min(start + 1024, seq_q), device="cuda")[:, None]
                env = {"b": torch.tensor(b, device="cuda"), "h": torch.tensor(h, device="cuda"),
                       "q_idx": rows, "kv_idx": keys}
                allowed = torch.broadcast_to(allowed_fn(env, tensors), (rows.shape[0], seq_k))
                allowed = allowed & visible_mask(
                    rows.shape[0], seq_k, causal=spec["causal"], q_offset=start,
                    window=(window["left"], window["right"]) if window else None, device="cuda")
                total += int(allowed.sum())
    return total if per_head else total * heads


def spec_flops(spec: dict, batch: int, heads: int, seq_q: int, seq_k: int) -> int:
    """4 * B * Hq * D * visible pairs; the classic formula (causal: half) where no
    window applies, so dense and causal figures compare with published ones."""
    d, dv = spec["head_dim"], spec.get("v_head_dim") or spec["head_dim"]
    if not spec.get("window"):
        return attention_flops(batch, heads, seq_q, seq_k, d, spec["causal"], dv)
    pairs = visible_pairs(seq_q, seq_k, spec["causal"], spec["window"])
    return 2 * batch * heads * pairs * (d + dv)


def tflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# --- the result schema (validated on write, exported for readers) ------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Timing(_Model):
    ms: Optional[float] = None  # median
    tflops: Optional[float] = None
    pct_of_matmul: Optional[float] = None
    max_abs_diff_vs_specgen: Optional[float] = None  # sanity: same function?
    error: Optional[str] = None  # why a kernel has no number


class Row(_Model):
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str
    causal: bool
    flops: int
    timings: dict[str, Timing]  # "specgen", "cudnn", "flash", "flex"
    speedup: dict[str, Optional[float]]  # baseline ms / specgen ms


class BenchResult(_Model):
    schema_version: int = SCHEMA_VERSION
    spec: str
    kernel: str
    suite: str
    created: str  # ISO date of the run
    device: dict
    matmul_tflops: float  # fp16 8192^3 torch.matmul in the same run
    baselines: list[str]
    rows: list[Row]
    # How the inputs were laid out when not a dense [B, H, S, D] batch with Sq = Skv.
    layout: str = "Sq=Skv"


def result_schema() -> dict:
    return BenchResult.model_json_schema()


def speedups(timings: dict[str, Timing]) -> dict[str, Optional[float]]:
    ours = timings["specgen"].ms
    out = {}
    for name, timing in timings.items():
        if name == "specgen":
            continue
        out[name] = timing.ms / ours if ours and timing.ms else None
    return out


def format_markdown(result: BenchResult) -> str:
    """One table: time and TFLOPS per kernel per length, speedups against baselines."""
    names = ["specgen"] + result.baselines
    dev = result.device
    first = result.rows[0] if result.rows else None
    shape = (
        f"B={first.batch}, Hq={first.heads_q}, Hkv={first.heads_kv}, {first.dtype}, "
        f"D={first.head_dim}, {'causal' if first.causal else 'non-causal'}"
        if first
        else "no rows"
    )
    lines = [
        f"### {result.spec} (`{result.kernel}`) on {dev.get('name', '?')}",
        "",
        f"Suite `{result.suite}`: {shape}, {result.layout}. "
        f"Median of triton `do_bench`; dense fp16 matmul {result.matmul_tflops:.0f} TFLOPS "
        f"in the same run. {result.created}, driver {dev.get('driver', '?')}, "
        f"torch {dev.get('torch', '?')}, cuda-tile {dev.get('cuda_tile', '?')}.",
        "",
        "| S | " + " | ".join(f"{KERNEL_LABELS.get(n, n)} TFLOPS (ms)" for n in names)
        + " | " + " | ".join(f"vs {KERNEL_LABELS.get(n, n)}" for n in result.baselines)
        + " | specgen % of matmul |",
        "|---:|" + "---:|" * (len(names) + len(result.baselines) + 1),
    ]
    for row in result.rows:
        cells = []
        for name in names:
            t = row.timings.get(name)
            if t is None or t.ms is None:
                reason = (t.error if t and t.error else "missing").replace("|", "/")
                cells.append(f"n/a ({reason[:60]})")
            else:
                cells.append(f"{t.tflops:.0f} ({t.ms:.3f})")
        ratios = [
            f"{row.speedup[n]:.2f}×" if row.speedup.get(n) else "n/a" for n in result.baselines
        ]
        ours = row.timings["specgen"].pct_of_matmul
        pct = f"{ours:.0f}%" if ours is not None else "n/a"
        lines.append(f"| {row.seq_q} | " + " | ".join(cells + ratios + [pct]) + " |")
    return "\n".join(lines) + "\n"


def plot(result: BenchResult, path: Path) -> Optional[str]:
    """TFLOPS against sequence length, one line per kernel. Returns an error
    string if matplotlib is missing (the JSON and table are still written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name in ["specgen"] + result.baselines:
        points = [
            (row.seq_q, row.timings[name].tflops)
            for row in result.rows
            if name in row.timings and row.timings[name].tflops is not None
        ]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=KERNEL_LABELS.get(name, name))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (Sq = Skv)")
    ax.set_ylabel("TFLOPS")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{result.spec} on {result.device.get('name', '?')}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def write_result(result: BenchResult, out_dir: Path, log: Callable[[str], None]) -> Path:
    from specgen.check.gpu import device_slug

    folder = out_dir / device_slug(result.device.get("name", "gpu"))
    stem = folder / f"{result.spec}-{result.suite}"
    BenchResult.model_validate(result.model_dump())  # the schema holds
    paths = result_paths(stem)
    atomic_write(paths["json"], (result.model_dump_json(indent=2) + "\n").encode())
    atomic_write(paths["md"], format_markdown(result).encode())
    problem = plot(result, paths["png"])
    if problem:
        log(problem)
    return stem


def result_paths(stem: Path) -> dict[str, Path]:
    """The JSON, markdown and PNG files of one result (stem: <dir>/<spec>-<suite>)."""
    return {kind: stem.parent / f"{stem.name}.{kind}" for kind in ("json", "md", "png")}


def timed(ms: float, flops: int, matmul_tflops: float, **extra) -> Timing:
    """A Timing from a median time: TFLOPS and the share of the matmul rate."""
    rate = tflops(flops, ms)
    return Timing(ms=ms, tflops=rate, pct_of_matmul=100 * rate / matmul_tflops, **extra)


def error_line(exc: Exception) -> str:
    """'TypeName: first line of the message', at most 300 characters."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message}"[:300]


def failed_timing(exc: Exception) -> Timing:
    """A baseline that raised: reported with the first line of its error."""
    return Timing(error=error_line(exc))


def device_and_matmul_rate(torch, do_bench, log) -> tuple[dict, float]:
    """The device description and the fp16 MATMUL_N^3 matmul rate (TFLOPS) of this
    run, each logged: the yardstick every suite's percentages are read against."""
    from specgen.check.gpu import device_info

    device = device_info()
    log(f"device: {device['name']} ({device['sm']}), driver {device['driver']}, torch {device['torch']}")
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    matmul = tflops(2 * MATMUL_N**3, do_bench(lambda: torch.matmul(a, b), warmup=100, rep=500,
                                              return_mode="median"))
    del a, b
    log(f"fp16 {MATMUL_N}^3 matmul: {matmul:.0f} TFLOPS")
    return device, matmul


def load_result(path: Path) -> BenchResult:
    return BenchResult.model_validate(json.loads(path.read_text()))


# --- timing (GPU) --------------------------------------------------------------


def _make_baselines(torch, names, causal: bool, ratio: int, spec: Optional[dict] = None):
    """Callables (q, k_full, v_full, k, v, extra) -> out for each baseline, or the
    reason it is missing.

    SDPA's cuDNN and FA2 backends take neither a window, a soft-cap, sinks nor
    hooks, but do take dropout (their own RNG). FlexAttention gets the window and
    mask_mod as a block mask, the soft-cap and score_mod as its score_mod (both
    evaluated from the spec's checked expressions); it has no sinks or dropout."""
    spec = spec or {}
    window, softcap = spec.get("window"), spec.get("softcap")
    score_mod, mask_mod = spec.get("score_mod"), spec.get("mask_mod")
    unsupported = [n for n, on in (("window", window), ("softcap", softcap), ("sinks", spec.get("sinks")),
                                   ("score_mod", score_mod), ("mask_mod", mask_mod))
                   if on]
    # SDPA has its own dropout (another RNG: the outputs differ, the work is the same).
    dropout = spec.get("dropout", False)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    made: dict[str, object] = {}

    def sdpa_with(backend):
        def run(q, k_full, v_full, _k, _v, extra):
            with sdpa_kernel([backend]):
                return sdpa(q, k_full, v_full, is_causal=causal,
                            dropout_p=extra.get("dropout_p", 0.0) if dropout else 0.0)

        return run

    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        if name in names:
            made[name] = (f"SDPA has no {', '.join(unsupported)}" if unsupported
                          else sdpa_with(backend))
    if "flex" in names and spec.get("sinks"):
        made["flex"] = "FlexAttention has no attention sinks"
    elif "flex" in names and dropout:
        made["flex"] = "FlexAttention has no dropout"
    elif "flex" in names:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            compiled = torch.compile(flex_attention)
            masks: dict[tuple, object] = {}

            left = window.get("left") if window else None
            right = window.get("right") if window else None

            from specgen.spec.hooks import torch_fn
            from specgen.check.reference import visible as visible_rule

            score_fn = torch_fn(score_mod) if score_mod else None
            mask_fn = torch_fn(mask_mod) if mask_mod else None
            hook_tensors: dict = {}  # the current call's extra tensors, read by the hooks

            def visible(b, h, qi, ki):
                allowed = visible_rule(qi, ki, causal=causal, left=left, right=right)
                if mask_fn:
                    allowed = allowed & mask_fn({"b": b, "h": h, "q_idx": qi, "kv_idx": ki}, hook_tensors)
                return allowed

            def modify(score, b, h, qi, ki):
                if softcap:
                    score = softcap * torch.tanh(score / softcap)
                if score_fn:
                    env = {"score": score, "b": b, "h": h, "q_idx": qi, "kv_idx": ki}
                    score = score_fn(env, hook_tensors).to(score.dtype)
                return score

            def run_flex(q, _kf, _vf, k, v, extra):
                key = (q.shape[2], k.shape[2])
                hook_tensors.clear()
                hook_tensors.update({n: extra[n] for n in spec.get("tensors") or {}})
                if (causal or window or mask_mod) and key not in masks:
                    masks[key] = create_block_mask(visible, q.shape[0] if mask_mod else None,
                                                   None, key[0], key[1], device="cuda")
                return compiled(q, k, v, block_mask=masks.get(key), enable_gqa=ratio > 1,
                                score_mod=modify if softcap or score_mod else None)

            made["flex"] = run_flex
        except Exception as exc:  # noqa: BLE001 - reported, not dropped
            made["flex"] = f"{type(exc).__name__}: {exc}"
    return made


def varlen_lengths(batch: int, seq: int) -> list[int]:
    """The sequence lengths of a varlen bench row: S/2, S, 3S/2, S, ... (mean S)."""
    return [(seq // 2, seq, 3 * seq // 2, seq)[i % 4] for i in range(batch)]


def _make_varlen_baselines(torch, names, spec: dict):
    """Callables (packed, extra) -> out [total_q, Hq, Dv] for a varlen spec.

    FA2 and cuDNN through torch's own varlen ops (aten._flash_attention_forward,
    aten._cudnn_attention_forward with cum_seq; cuDNN's K/V expanded to the query
    heads once, outside the timing); FlexAttention gets the packed
    batch as one sequence with a block mask that keeps each query in its own
    sequence (and causal, windowed by position)."""
    causal, ratio = spec["causal"], spec["gqa_ratio"]
    window = spec.get("window") or {}
    left, right = window.get("left"), window.get("right")
    unsupported = [n for n, on in (("window", window), ("softcap", spec.get("softcap")),
                                   ("sinks", spec.get("sinks"))) if on]
    made: dict[str, object] = {}

    def fa2(packed, _extra):
        # FlashAttention-2's own varlen entry point (GQA in the kernel).
        sizes = packed.kwargs()  # host-side lengths: no device read while timed
        max_q, max_k = sizes["max_seqlen_q"], sizes["max_seqlen_k"]
        return torch.ops.aten._flash_attention_forward(
            packed.q, packed.k, packed.v, packed.cu_seqlens_q, packed.cu_seqlens_k, max_q, max_k,
            0.0, causal, False)[0]

    expanded: dict[int, tuple] = {}

    def cudnn(packed, _extra):
        sizes = packed.kwargs()
        max_q, max_k = sizes["max_seqlen_q"], sizes["max_seqlen_k"]
        if id(packed) not in expanded:  # cuDNN's op wants Hq K/V heads: expanded once, untimed
            expanded.clear()
            expanded[id(packed)] = tuple(t.repeat_interleave(ratio, 1) if ratio > 1 else t
                                         for t in (packed.k, packed.v))
        k, v = expanded[id(packed)]
        return torch.ops.aten._cudnn_attention_forward(
            packed.q, k, v, None, packed.cu_seqlens_q, packed.cu_seqlens_k, max_q, max_k, False, 0.0,
            causal)[0]

    for name, fn in (("cudnn", cudnn), ("flash", fa2)):
        if name in names:
            made[name] = f"no {', '.join(unsupported)} in the varlen op" if unsupported else fn
    if "flex" in names and spec.get("sinks"):
        made["flex"] = "FlexAttention has no attention sinks"
    elif "flex" in names:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from specgen.check.reference import visible as visible_rule

        compiled = torch.compile(flex_attention)
        masks: dict[int, object] = {}
        softcap = spec.get("softcap")

        def run_flex(packed, _extra):
            total = packed.q.shape[0]
            if id(packed) not in masks:
                masks.clear()
                cu = packed.cu_seqlens_q.long()
                doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device="cuda"), cu[1:] - cu[:-1])

                def visible(b, h, qi, ki):  # equal q/k lengths: packed offsets are positions
                    return (doc[qi] == doc[ki]) & visible_rule(qi, ki, causal=causal, left=left,
                                                                    right=right)

                masks[id(packed)] = create_block_mask(visible, None, None, total, total, device="cuda")

            def cap(score, b, h, qi, ki):
                return softcap * torch.tanh(score / softcap)

            q, k, v = (t.transpose(0, 1)[None] for t in (packed.q, packed.k, packed.v))
            out = compiled(q, k, v, block_mask=masks[id(packed)], enable_gqa=ratio > 1,
                           score_mod=cap if softcap else None)
            return out[0].transpose(0, 1)

        made["flex"] = run_flex
    return made


def run_bench(
    paths: list[str],
    out_dir: Path,
    gen_dir: Path,
    suite: str,
    baselines: tuple[str, ...],
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> list[Path]:
    from specgen.check.cases import (
        call_kernel,
        feature_inputs,
        output_dtype,
        poisoned_out,
        random_packed,
        random_qkv,
        shape_dims,
    )
    from specgen.check.gpu import fresh_modules, require_cuda

    torch = require_cuda("bench")
    from triton.testing import do_bench

    batch, heads, seqs = SUITES[suite]
    device, matmul = device_and_matmul_rate(torch, do_bench, log)

    written = []
    for job, module in fresh_modules(paths, gen_dir, log):
        spec = module.SPEC
        ratio, causal = spec["gqa_ratio"], spec["causal"]
        heads = suite_heads(SUITES[suite][1], ratio)
        kv_heads, d = heads // ratio, spec["head_dim"]
        varlen = bool(spec.get("varlen"))
        fns = (_make_varlen_baselines(torch, baselines, spec) if varlen
               else _make_baselines(torch, baselines, causal, ratio, spec))
        rows = []
        for seq in seqs:
            log(f"[{job.plan.module_name}] S={seq}")
            if varlen:
                # A ragged packed batch averaging S per sequence: S/2, S, 3S/2, S, ...
                lengths = varlen_lengths(batch, seq)
                packed = random_packed(spec, [(n, n) for n in lengths], kv_heads)
                q, k, v, kwargs = packed.q, packed.k, packed.v, packed.kwargs()
                out = torch.full((*q.shape[:2], v.shape[2]), float("nan"), dtype=q.dtype, device="cuda")
                extra = feature_inputs(spec, {"heads": heads})
                flops = sum(spec_flops(spec, 1, heads, n, n) for n in lengths)
                baseline_args = (packed, extra)
            else:
                q, k, v = random_qkv(spec, batch, kv_heads, seq, seq)
                kwargs = {}
                # torch has no float8 attention: baselines run on 16-bit copies.
                bq, bk, bv = ((t.to(getattr(torch, output_dtype(spec))) for t in (q, k, v))
                              if spec["dtype"] == "float8_e4m3fn" else (q, k, v))
                # Expanded K/V for baselines needing equal head counts, outside timing.
                k_full = bk.repeat_interleave(ratio, 1) if ratio > 1 else bk
                v_full = bv.repeat_interleave(ratio, 1) if ratio > 1 else bv
                out = poisoned_out(spec, q, v)
                extra = feature_inputs(spec, shape_dims(q, k))
                if spec["dtype"] == "float8_e4m3fn":  # unit descales: outputs comparable
                    extra.update(q_descale=1.0, k_descale=1.0, v_descale=1.0)
                if spec.get("mask_mod"):  # only the pairs the mask leaves: no phantom FLOPs
                    dims = spec["head_dim"] + (spec.get("v_head_dim") or spec["head_dim"])
                    flops = 2 * dims * mask_mod_pairs(torch, spec, extra, batch, heads, seq, seq)
                else:
                    flops = spec_flops(spec, batch, heads, seq, seq)
                baseline_args = (bq, k_full, v_full, bk, bv, extra)
            timings: dict[str, Timing] = {}

            call_kernel(module, q, k, v, extra, out=out, **kwargs)  # JIT compile + correctness below
            torch.cuda.synchronize()
            ours = out.clone()
            ms = do_bench(lambda: call_kernel(module, q, k, v, extra, out=out, **kwargs), warmup=25,
                          rep=200, return_mode="median")
            timings["specgen"] = timed(ms, flops, matmul)
            if not torch.isfinite(ours).all():
                timings["specgen"].error = "non-finite output"
            for name in baselines:
                fn = fns.get(name)
                if not callable(fn):
                    timings[name] = Timing(error=str(fn or "not available"))
                    continue
                try:
                    ref = fn(*baseline_args)
                    torch.cuda.synchronize()
                    diff = (ref.float() - ours.float()).abs().max().item()
                    ms = do_bench(lambda: fn(*baseline_args), warmup=25, rep=200,
                                  return_mode="median")
                    timings[name] = timed(ms, flops, matmul, max_abs_diff_vs_specgen=diff)
                except Exception as exc:  # noqa: BLE001 - a missing baseline is reported
                    timings[name] = failed_timing(exc)
            row = Row(batch=batch, heads_q=heads, heads_kv=kv_heads, seq_q=seq, seq_k=seq,
                      head_dim=d, dtype=spec["dtype"], causal=causal, flops=flops,
                      timings=timings, speedup=speedups(timings))
            rows.append(row)
            summary = "  ".join(
                f"{n} {t.tflops:.0f}" if t.tflops else f"{n} n/a" for n, t in timings.items()
            )
            log(f"[{job.plan.module_name}] S={seq}: TFLOPS {summary}")
            del q, k, v, out, ours, baseline_args
        result = BenchResult(
            spec=job.plan.module_name, kernel=job.plan.kernel_name, suite=suite,
            created=datetime.date.today().isoformat(), device=device,
            matmul_tflops=matmul, baselines=list(baselines), rows=rows,
            layout=("packed varlen batch of B sequences of S/2, S, 3S/2, S, ... (mean S) tokens, "
                    "Sq=Skv per sequence" if varlen else "Sq=Skv")
            + ("; baselines run on bfloat16 copies of the float8 inputs (torch exposes no float8 "
               "attention)" if spec["dtype"] == "float8_e4m3fn" else ""),
        )
        stem = write_result(result, out_dir, log)
        print(format_markdown(result))
        written.append(stem)
    return written

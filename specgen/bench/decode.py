"""`specgen bench --suite decode`: decode kernels at the memory speed of light.

Decode reads the KV cache once: its speed of light is the KV bytes over the HBM
bandwidth (quack's method). Each row reports the time, the TB/s of KV bytes
read, that as a share of the device-to-device copy bandwidth measured in the
same run, and the ratio to SDPA's cuDNN and FA2 backends and FlexAttention (its
decoding path). Every kernel, ours and the baselines, is captured in a CUDA
graph and timed by replaying it, so launch overhead is not compared with launch
overhead, in two ways:

- steady state (the headline): STEADY_CALLS calls in one graph, cycling through
  input copies that together hold ROTATE_L2_MULTIPLE times the L2 cache, the
  median replay divided by the calls. A serving loop replays a whole decode step
  as one graph, so a kernel there pays a graph node's cost, not a graph launch;
- one call per graph (``us_one_call``): what a graph of just this call costs,
  its launch floor included (4.6 µs for an empty kernel on the H200).
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict

from specgen.bench.prefill import error_line
from specgen.compile.export import atomic_write

# (batch, KV heads, cached length); query heads = gqa_ratio * KV heads.
DECODE_SHAPES = ((1, 8, 8192), (1, 8, 32768), (8, 8, 8192), (64, 8, 4096))
COPY_BYTES = 1 << 30
# Steady-state timing: calls per captured graph, and how many times the L2 cache
# the rotated input copies must hold together.
STEADY_CALLS = 16
ROTATE_L2_MULTIPLE = 4
LABELS = {"specgen": "specgen (cuTile)", "cudnn": "SDPA cuDNN", "flash": "SDPA FA2",
          "flex": "FlexAttention"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DecodeTiming(_Model):
    us: Optional[float] = None  # steady state: median graph replay / calls per graph
    us_one_call: Optional[float] = None  # median replay of a graph holding one call
    kv_tbps: Optional[float] = None  # KV bytes read / time
    pct_of_copy: Optional[float] = None
    max_abs_diff_vs_specgen: Optional[float] = None
    note: Optional[str] = None  # e.g. "K/V expanded to Hq heads (no GQA in this backend)"
    error: Optional[str] = None


class DecodeRow(_Model):
    batch: int
    heads_q: int
    heads_kv: int
    seq_len: int
    q_len: int
    kv_bytes: int
    splits: int
    pdl: Optional[bool] = None  # launched with programmatic dependent launch (None: not recorded)
    input_copies: int  # the steady-state graph cycles through this many input copies
    calls_per_graph: int
    timings: dict[str, DecodeTiming]


class DecodeResult(_Model):
    schema_version: int = 2  # 2: `us` is the steady state; 1's one-call figure is `us_one_call`
    spec: str
    kernel: str
    suite: str = "decode"
    created: str
    device: dict
    copy_tbps: float  # device-to-device copy, (read + write) bytes / time
    baselines: list[str]
    layout: str
    rows: list[DecodeRow]


def graph_time_us(torch, fns, do_bench, calls: int = 1) -> float:
    """Median µs per call of replaying a CUDA graph that holds ``calls`` calls,
    cycling through ``fns`` (warmed up first on a side stream, as torch.cuda.graphs
    requires). ``fns`` is one callable or a list of them, one per copy of the inputs.

    With ``calls=1`` the figure carries the graph's own launch floor (an empty
    kernel replays in 4.6 µs on the H200, bench/NOTES.md 18). With many calls
    per graph that floor is shared, as in a serving loop that replays a whole
    decode step; the inputs then rotate over copies that together exceed the L2
    cache (``rotation_copies``), so no call reads what the one before left in L2.
    """
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    if calls < 1:
        raise ValueError(f"graph_time_us: calls must be at least 1, got {calls}")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    torch.cuda.synchronize()
    return 1000 * do_bench(graph.replay, warmup=50, rep=300, return_mode="median") / calls


def rotation_copies(torch, input_bytes: int) -> int:
    """Copies of the inputs a steady-state graph cycles through: at least two, and
    enough that together they hold ROTATE_L2_MULTIPLE times the L2 cache."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 0) or 64 << 20
    return max(2, -(-ROTATE_L2_MULTIPLE * l2 // max(1, input_bytes)))


def steady_calls(copies: int) -> int:
    """Calls per steady-state graph: at least STEADY_CALLS, a multiple of ``copies``."""
    return copies * -(-STEADY_CALLS // copies)


def copy_bandwidth(torch, do_bench) -> float:
    """TB/s of a 1 GiB copy by an elementwise kernel: (read + write) bytes over the
    time. (A captured dst.copy_(src) becomes a memcpy node: 2.70 TB/s on H200
    against 4.21 for the kernel, so the kernel is the bar.)"""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(torch, lambda: torch.mul(src, 1, out=dst), do_bench)
    del src, dst
    return 2 * COPY_BYTES / (us * 1e-6) / 1e12


def _baselines(torch, names, ratio: int, window: Optional[dict], sinks: bool):
    """Callables (q [B, Hq, 1, D], k, v [B, Hkv, L, D]) -> out for each baseline,
    or why it is missing. SDPA gets enable_gqa (K/V not expanded); Flex its
    compiled decoding path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    made: dict[str, object] = {}
    missing = [n for n, on in (("window", window), ("sinks", sinks)) if on]

    def with_backend(backend):
        def run(q, k, v):
            with sdpa_kernel([backend]):
                return sdpa(q, k, v, enable_gqa=ratio > 1)
        return run

    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        if name in names:
            made[name] = f"SDPA has no {', '.join(missing)}" if missing else with_backend(backend)
    if "flex" in names:
        if missing:
            made["flex"] = f"not compared: {', '.join(missing)}"
        else:
            from torch.nn.attention.flex_attention import flex_attention

            compiled = torch.compile(flex_attention)
            made["flex"] = lambda q, k, v: compiled(q, k, v, enable_gqa=ratio > 1)
    return made


def run_decode_bench(paths: list[str], out_dir: Path, gen_dir: Path, baselines: tuple[str, ...],
                     log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> list[Path]:
    from specgen.check.cases import feature_inputs, random_decode
    from specgen.check.gpu import device_info, device_slug, fresh_modules, require_cuda

    torch = require_cuda("bench")
    from triton.testing import do_bench

    device = device_info()
    log(f"device: {device['name']} ({device['sm']}), driver {device['driver']}, torch {device['torch']}")
    copy = copy_bandwidth(torch, do_bench)
    log(f"device-to-device copy: {copy:.2f} TB/s (read + write)")
    written = []
    for job, module in fresh_modules(paths, gen_dir, log):
        spec = module.SPEC
        if spec.get("family") != "decode":
            log(f"{job.plan.module_name}: skipped, not a decode spec (use --suite prefill)")
            continue
        ratio, d = spec["gqa_ratio"], spec["head_dim"]
        fns = _baselines(torch, baselines, ratio, spec.get("window"), spec.get("sinks"))
        rows = []
        for batch, kv_heads, length in DECODE_SHAPES:
            label = f"[{job.plan.module_name}] B{batch} Hq{ratio * kv_heads}/Hkv{kv_heads} L{length}"
            gen = torch.Generator(device="cuda").manual_seed(0)
            elements = 2 * batch * length * kv_heads * d  # K and V
            kv_bytes = elements * torch.finfo(getattr(torch, spec.get("kv_dtype") or spec["dtype"])).bits // 8
            # A float8 cache: the baselines (no float8 KV in SDPA or Flex) read it
            # dequantised to the query dtype, twice the bytes; their TB/s counts those.
            base_bytes = elements * torch.finfo(getattr(torch, spec["dtype"])).bits // 8
            copies = rotation_copies(torch, kv_bytes)
            calls = steady_calls(copies)
            log(f"{label}: {copies} input copies, {calls} calls per steady-state graph")
            datas = [random_decode(spec, [length] * batch, kv_heads, 1, gen) for _ in range(copies)]
            extra = feature_inputs(spec, {"batch": batch, "heads": ratio * kv_heads, "kv_heads": kv_heads}, gen)
            outs = [torch.empty_like(data.q) for data in datas]

            def call(i):
                return lambda: module.attention(*datas[i].args(), out=outs[i], max_seq_len=length, **extra)

            ours = [call(i) for i in range(copies)]
            timings: dict[str, DecodeTiming] = {}

            def rate(fns, read_bytes=kv_bytes, **more) -> DecodeTiming:
                us = graph_time_us(torch, fns, do_bench, calls=calls)
                tbps = read_bytes / (us * 1e-6) / 1e12
                return DecodeTiming(us=us, kv_tbps=tbps, pct_of_copy=100 * tbps / copy,
                                    us_one_call=graph_time_us(torch, fns[0], do_bench), **more)

            ours[0]()
            torch.cuda.synchronize()
            mine = outs[0].float().clone()
            timings["specgen"] = rate(ours)
            # Baselines on [B, H, L, D] copies of the caches, made outside the timing
            # (a float8 cache dequantised to the query dtype).
            descales = (float(extra.get("k_descale", 1.0)), float(extra.get("v_descale", 1.0)))

            def baseline_cache(data, which):
                cache = torch.stack([data.keys(b)[which] for b in range(batch)])
                if cache.dtype == data.q.dtype:
                    return cache.contiguous()
                return (cache.float() * descales[which]).to(data.q.dtype).contiguous()

            qkv = []
            for data in datas:
                qkv.append((data.q.transpose(1, 2).contiguous(), baseline_cache(data, 0),
                            baseline_cache(data, 1)))
            del datas
            for name in baselines:
                fn = fns.get(name)
                if not callable(fn):
                    timings[name] = DecodeTiming(error=str(fn or "not available"))
                    continue
                try:
                    ref = fn(*qkv[0])
                    torch.cuda.synchronize()
                    diff = (ref.transpose(1, 2).float() - mine).abs().max().item()
                    note = (f"reads the cache dequantised to {spec['dtype']} ({base_bytes} bytes)"
                            if base_bytes != kv_bytes else None)
                    timings[name] = rate([lambda a=args: fn(*a) for args in qkv], read_bytes=base_bytes,
                                         max_abs_diff_vs_specgen=diff, note=note)
                except Exception as exc:  # noqa: BLE001 - a missing baseline is reported
                    timings[name] = DecodeTiming(error=error_line(exc))
            _, splits, pdl = module.launch_plan(batch, kv_heads, length, torch.device("cuda"))
            rows.append(DecodeRow(batch=batch, heads_q=ratio * kv_heads, heads_kv=kv_heads,
                                  seq_len=length, q_len=1, kv_bytes=kv_bytes, splits=splits, pdl=pdl,
                                  input_copies=copies, calls_per_graph=calls, timings=timings))
            log(label + ": " + "  ".join(
                f"{n} {t.us:.1f} us {t.kv_tbps:.2f} TB/s (one call {t.us_one_call:.1f})" if t.us
                else f"{n} n/a" for n, t in timings.items()))
            del qkv
        result = DecodeResult(
            spec=job.plan.module_name, kernel=job.plan.kernel_name,
            created=datetime.date.today().isoformat(), device=device, copy_tbps=copy,
            baselines=list(baselines), rows=rows,
            layout=("paged KV cache, page_size %d" % spec["paged"]["page_size"]
                    if spec.get("paged") else "contiguous KV cache [B, L, Hkv, D]")
            + (f", {spec['kv_dtype']} (baselines: the cache dequantised to {spec['dtype']})"
               if spec.get("kv_dtype") not in (None, spec["dtype"]) else ""),
        )
        folder = out_dir / device_slug(device.get("name", "gpu"))
        stem = folder / f"{result.spec}-decode"
        atomic_write(stem.with_suffix(".json"), (result.model_dump_json(indent=2) + "\n").encode())
        atomic_write(stem.with_suffix(".md"), format_decode_markdown(result).encode())
        print(format_decode_markdown(result))
        written.append(stem)
    return written


def _calls(result: DecodeResult) -> str:
    counts = sorted({row.calls_per_graph for row in result.rows})
    return "/".join(str(c) for c in counts) or "?"


def format_decode_markdown(result: DecodeResult) -> str:
    names = ["specgen"] + result.baselines
    dev = result.device
    lines = [
        f"### {result.spec} (`{result.kernel}`) on {dev.get('name', '?')}",
        "",
        f"Suite `decode`: one new token per sequence, {result.layout}. Steady state: "
        f"each kernel is captured {_calls(result)} times in one CUDA graph, cycling through "
        f"input copies that together hold at least {ROTATE_L2_MULTIPLE}× the L2 cache (so "
        f"every call reads its KV from HBM), and the median replay is divided by the "
        f"calls. KV TB/s = K and V bytes read / time; copy bandwidth "
        f"{result.copy_tbps:.2f} TB/s (a 1 GiB copy kernel, read + write) in the same run. "
        f"{result.created}, driver {dev.get('driver', '?')}, torch {dev.get('torch', '?')}, "
        f"cuda-tile {dev.get('cuda_tile', '?')}.",
        "",
        "| B | Hq/Hkv | L | splits | " + " | ".join(f"{LABELS[n]} µs (TB/s)" for n in names)
        + " | specgen % of copy | " + " | ".join(f"vs {LABELS[n]}" for n in names[1:]) + " |",
        "|" + "---:|" * (4 + 2 * len(names)),
    ]
    for row in result.rows:
        ours = row.timings["specgen"]
        cells = []
        for n in names:
            t = row.timings.get(n)
            cells.append(f"{t.us:.1f} ({t.kv_tbps:.2f})" if t and t.us else
                         f"n/a ({(t.error or 'missing') if t else 'missing'})")
        ratios = []
        for n in names[1:]:
            t = row.timings.get(n)
            ratios.append(f"{t.us / ours.us:.2f}×" if t and t.us and ours.us else "n/a")
        pct = f"{ours.pct_of_copy:.0f}%" if ours.pct_of_copy else "n/a"
        splits = f"{row.splits}, PDL" if row.pdl else str(row.splits)
        lines.append(f"| {row.batch} | {row.heads_q}/{row.heads_kv} | {row.seq_len} | {splits} | "
                     + " | ".join(cells) + f" | {pct} | " + " | ".join(ratios) + " |")
    lines += [
        "",
        "One call per graph replay (each figure then carries the graph's launch floor, "
        "4.6 µs for an empty kernel on the H200):",
        "",
        "| B | Hq/Hkv | L | " + " | ".join(f"{LABELS[n]} µs" for n in names) + " |",
        "|" + "---:|" * (3 + len(names)),
    ]
    for row in result.rows:
        cells = []
        for n in names:
            t = row.timings.get(n)
            cells.append(f"{t.us_one_call:.1f}" if t and t.us_one_call else "n/a")
        lines.append(f"| {row.batch} | {row.heads_q}/{row.heads_kv} | {row.seq_len} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

"""The bench core every suite runs on: timing, the result schema, the writers
(JSON, markdown, plot) and the driver that times a suite's cases against the
baselines of :mod:`specgen.bench.baselines`.

A suite (prefill, decode, backward) says only which shapes it runs, how it
makes a case's inputs and what it counts; :func:`run` does the rest. The pure
parts (schema, tables, FLOP and byte counts) run anywhere; timing needs a CUDA
GPU and triton.
"""

from __future__ import annotations

import datetime
import gzip
import json
import re
import stat
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specgen.bench.baselines import REGISTRY, label
from specgen.compile.export import atomic_write
from specgen.errors import UsageError

# 3: one schema for every suite (decode's `us`, `kv_tbps`, `seq_len` became `ms`,
# `tbps`, `seq_k`; every row has `speedup`); the version key is `schema`.
# 2: decode's `us` is the steady state. 1: the first prefill/backward schema.
SCHEMA_VERSION = 3
MATMUL_N = 8192
COPY_BYTES = 1 << 30
# Decode's steady state: calls per captured graph, and how many times the L2
# cache the rotated input copies must hold together.
STEADY_CALLS = 16
ROTATE_L2_MULTIPLE = 4
PENDING = "not timed: the run stopped before its late pass"
_LATE = object()  # a late baseline's place until the late pass


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def error_line(exc: BaseException) -> str:
    """'TypeName: first line of the message', at most 300 characters."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message}"[:300]


def tflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def tbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


# --- the result schema (validated on write, exported for readers) ------------


class _Model(BaseModel):
    # Strict: a number is a JSON number (not "0.09"), and NaN or infinity is refused,
    # so what the docs pages print is what was measured.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


Time = Annotated[float, Field(gt=0)]  # ms: a kernel takes some time
Rate = Annotated[float, Field(ge=0)]  # TFLOPS, TB/s, shares
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
PositiveCount = Annotated[int, Field(ge=1, le=2**63 - 1)]


class Timing(_Model):
    """One kernel on one row. ``ms`` is the headline time per call: the do_bench
    median (prefill, backward) or the CUDA-graph steady state (decode)."""

    ms: Optional[Time] = None
    # A CUDA graph of one call, its launch floor included (prefill: the time without
    # the host's launch path, which bounds short eager calls).
    ms_one_call: Optional[Time] = None
    tflops: Optional[Rate] = None  # the row's flops / ms
    tbps: Optional[Rate] = None  # the row's bytes (this kernel's, see note) / ms
    pct_of_matmul: Optional[Rate] = None  # tflops over the run's fp16 matmul rate
    pct_of_copy: Optional[Rate] = None  # tbps over the run's copy bandwidth
    max_abs_diff_vs_specgen: Optional[Annotated[float, Field(allow_inf_nan=True)]] = None  # sanity: same function?
    note: Optional[str] = None  # e.g. "reads the cache dequantised to bfloat16 (... bytes)"
    error: Optional[str] = None  # why a kernel has no number
    # block_sparse specs: the block map's build (timed apart, not in ms) and the share
    # of all (query tile, key tile) pairs the forward visits.
    block_map_ms: Optional[Time] = None
    tiles_visited: Optional[Rate] = None


class Row(_Model):
    batch: PositiveCount
    heads_q: PositiveCount
    heads_kv: PositiveCount
    seq_q: Count  # decode: the new tokens per sequence
    seq_k: Count  # decode: the cached length L
    # None only in decode rows upgraded from schema 2, which did not record them.
    head_dim: Optional[Count] = None
    dtype: Optional[str] = None
    causal: Optional[bool] = None
    flops: Optional[Count] = None  # prefill, backward: what the kernel computes
    bytes: Optional[Count] = None  # decode: the K and V bytes the kernel reads
    splits: Optional[Count] = None  # decode: KV splits of the launch
    pdl: Optional[bool] = None  # decode: programmatic dependent launch (None: not recorded)
    input_copies: Optional[Count] = None  # decode: the steady-state graph cycles through these
    calls_per_graph: Optional[Count] = None
    timings: dict[str, Timing]  # "specgen" and each baseline
    speedup: dict[str, Optional[Rate]]  # per baseline: its ms / specgen's ms (None: no number)


class BenchResult(_Model):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_version: int = Field(SCHEMA_VERSION, alias="schema")
    spec: str
    kernel: str
    suite: str
    created: str  # ISO date of the run
    device: dict
    baselines: list[str]
    # How the inputs were laid out when not a dense [B, H, S, D] batch with Sq = Skv.
    layout: str = "Sq=Skv"
    matmul_tflops: Optional[Rate] = None  # prefill, backward: fp16 8192^3 matmul, same run
    copy_tbps: Optional[Rate] = None  # decode: 1 GiB copy kernel, (read + write) / time
    rows: list[Row]

    @field_validator("baselines")
    @classmethod
    def _baseline_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(f"a baseline's name is letters, digits, '_', '.' and '-', got {name!r}")
        return value

    @model_validator(mode="after")
    def _suite_fields(self):
        # What each suite's tables print: None where a number is printed would be a
        # traceback on the docs page, not a row.
        if self.suite in ("prefill", "backward"):
            if self.matmul_tflops is None:
                raise ValueError(f"matmul_tflops: a {self.suite} result needs the run's matmul rate")
            for i, row in enumerate(self.rows):
                for field in ("flops", "head_dim", "dtype", "causal"):
                    if getattr(row, field) is None:
                        raise ValueError(f"rows.{i}.{field}: a {self.suite} row needs it")
                for name, timing in row.timings.items():
                    if (timing.ms is None) != (timing.tflops is None):
                        raise ValueError(f"rows.{i}.timings.{name}: ms and tflops come together")
        elif self.suite == "decode" and self.copy_tbps is None:
            raise ValueError("copy_tbps: a decode result needs the run's copy bandwidth")
        return self

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: dict) -> dict:
        if not isinstance(value.get("name"), str) or not value["name"].strip():
            raise ValueError("device.name must be the GPU's name, a non-empty string")
        return value


def result_schema() -> dict:
    return BenchResult.model_json_schema()


def _upgrade_decode_row(row: dict, version: int) -> dict:
    timings = {}
    for name, t in row["timings"].items():
        us, one = t.get("us"), t.get("us_one_call")
        if version == 1:  # schema 1 timed one call per graph, as `us`
            us, one = None, us
        timings[name] = {
            "ms": us / 1000 if us is not None else None,
            "ms_one_call": one / 1000 if one is not None else None,
            "tbps": t.get("kv_tbps"), "pct_of_copy": t.get("pct_of_copy"),
            "max_abs_diff_vs_specgen": t.get("max_abs_diff_vs_specgen"),
            "note": t.get("note"), "error": t.get("error"),
        }
    out = {"batch": row["batch"], "heads_q": row["heads_q"], "heads_kv": row["heads_kv"],
           "seq_q": row.get("q_len", 1), "seq_k": row["seq_len"], "bytes": row.get("kv_bytes"),
           "timings": timings}
    out.update({k: row[k] for k in ("splits", "pdl", "input_copies", "calls_per_graph") if k in row})
    out["speedup"] = speedups({n: Timing(**t) for n, t in timings.items()})
    return out


def schema_of(data: dict):
    """The schema a results file's JSON declares: its "schema" key, else (older files)
    "schema_version", else 1."""
    version = data.get("schema")
    return data.get("schema_version", 1) if version is None else version


def upgrade(data: dict) -> dict:
    """A results file's JSON of any schema, as the current schema reads it."""
    data = dict(data)
    version = schema_of(data)
    if data.pop("schema", None) is None:
        data.pop("schema_version", None)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(f"schema: expected a version from 1 to {SCHEMA_VERSION}, got {version!r}")
    if version < 3 and data.get("suite") == "decode":
        data["rows"] = [_upgrade_decode_row(r, version) for r in data["rows"]]
    data["schema"] = SCHEMA_VERSION
    return data


# A bench result is a few KB (the largest committed about 10 KB); a cap well above that.
MAX_RESULT_BYTES = 64 << 20


def read_result_text(path: Path) -> str:
    """A result file's text: <stem>.json, or <stem>.json.gz (committed results may be
    kept gzipped to keep the checkout small)."""
    path = Path(path)
    if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or a device may never end
        raise ResultError(f"{path}: not a regular file, not a bench result")
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:  # at most the cap: not a whole gzip bomb
        data = f.read(MAX_RESULT_BYTES + 1)
    if len(data) > MAX_RESULT_BYTES:
        raise ResultError(f"{path}: larger than {MAX_RESULT_BYTES >> 20} MiB, not a bench result")
    return data.decode("utf-8")


def result_stem(path: Path) -> Path:
    """<dir>/<spec>-<suite> of a result file, .json or .json.gz."""
    path = Path(path)
    name = path.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix):
            return path.with_name(name[: -len(suffix)])
    return path.with_suffix("")


def find_result(stem: Path) -> Optional[Path]:
    """<stem>.json where it exists, else <stem>.json.gz, else None."""
    for suffix in (".json", ".json.gz"):
        path = Path(f"{stem}{suffix}")
        if path.is_file():
            return path
    return None


class ResultError(ValueError):
    """A results file that cannot be read as a bench result; the message names it."""


def checked_result(path: Path, data: Any) -> BenchResult:
    """``data`` read from ``path``, upgraded to the current schema and validated."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise ResultError(f"{path}: a bench result is a JSON object, got {type(data).__name__}")
    try:
        result = BenchResult.model_validate(upgrade(data))
    except ValidationError as exc:
        error = exc.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        if error["loc"]:
            message = ".".join(str(p) for p in error["loc"]) + ": " + message
        elif error["type"] != "value_error":  # a whole-result check names its own field
            message = "(top level): " + message
        raise ResultError(f"{path}: not a bench result of this schema: {message}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ResultError(f"{path}: not a bench result of this schema: {exc}") from None
    for i, row in enumerate(result.rows):
        if "specgen" not in row.timings:
            raise ResultError(f"{path}: not a bench result of this schema: "
                              f"rows.{i}.timings: specgen's timing is missing")
    return result


def read_result_json(path: Path) -> Any:
    """The JSON of a results file, or ResultError naming the file and what is wrong."""
    try:
        return json.loads(read_result_text(path))
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:  # zlib: compressed data damaged
        raise ResultError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    except UnicodeDecodeError:
        raise ResultError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ResultError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno})") from None
    except ResultError:
        raise
    except ValueError as exc:  # an integer beyond Python's digit limit
        raise ResultError(f"{path}: not a bench result ({exc})") from None
    except (RecursionError, MemoryError):
        raise ResultError(f"{path}: nested too deeply or too large to be a bench result") from None


def load_result(path: Path) -> BenchResult:
    """A results file (.json or .json.gz) of any suite and schema (older ones upgraded
    in memory); ResultError (a ValueError) names the file when it is not one."""
    return checked_result(path, read_result_json(path))


def speedups(timings: dict[str, Timing]) -> dict[str, Optional[float]]:
    """Each baseline's time over specgen's (above 1: specgen is faster)."""
    ours = timings["specgen"].ms
    return {name: t.ms / ours if ours and t.ms else None
            for name, t in timings.items() if name != "specgen"}


def timed(ms: float, flops: int, matmul_tflops: float, **extra) -> Timing:
    """A Timing from a median time: TFLOPS and the share of the matmul rate."""
    rate = tflops(flops, ms)
    return Timing(ms=ms, tflops=rate, pct_of_matmul=100 * rate / matmul_tflops, **extra)


def failed_timing(exc: BaseException) -> Timing:
    """A kernel that raised: reported with the first line of its error."""
    return Timing(error=error_line(exc))


# --- timing (GPU) --------------------------------------------------------------


def median_ms(do_bench, fn: Callable[[], Any], warmup: int = 25, rep: int = 200) -> float:
    """The median ms of triton's do_bench (warmup and rep in ms)."""
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_time_ms(torch, fns, do_bench, calls: int = 1, prepare=None) -> float:
    """Median ms per call of replaying a CUDA graph that holds ``calls`` calls,
    cycling through ``fns`` (warmed up first on a side stream, as torch.cuda.graphs
    requires, and captured on that stream). ``fns`` is one callable or a list of
    them, one per copy of the inputs. ``prepare`` runs once on that stream before
    the warm-up, untimed: a forward whose backward the graph then holds (autograd
    runs each backward op on the stream of its forward op).

    With ``calls=1`` the figure carries the graph's own launch floor (an empty
    kernel replays in 4.6 µs on the H200, docs/experiments.md 18). With many calls
    per graph that floor is shared, as in a serving loop that replays a whole
    decode step; the inputs then rotate over copies that together exceed the L2
    cache (``rotation_copies``), so no call reads what the one before left in L2.
    """
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    if calls < 1:
        raise ValueError(f"graph_time_ms: calls must be at least 1, got {calls}")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if prepare is not None:
            prepare()
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fns[i % len(fns)]()
    torch.cuda.synchronize()
    return median_ms(do_bench, graph.replay, warmup=50, rep=300) / calls


def rotation_copies(torch, input_bytes: int) -> int:
    """Copies of the inputs a steady-state graph cycles through: at least two, and
    enough that together they hold ROTATE_L2_MULTIPLE times the L2 cache."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 0) or 64 << 20
    return max(2, -(-ROTATE_L2_MULTIPLE * l2 // max(1, input_bytes)))


def steady_calls(copies: int) -> int:
    """Calls per steady-state graph: at least STEADY_CALLS, a multiple of ``copies``."""
    return copies * -(-STEADY_CALLS // copies)


def matmul_rate(torch, do_bench, log) -> float:
    """The fp16 MATMUL_N^3 matmul rate (TFLOPS) of this run, logged: the yardstick
    the compute-bound suites' percentages are read against."""
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.float16)
    rate = tflops(2 * MATMUL_N**3, median_ms(do_bench, lambda: torch.matmul(a, b), 100, 500))
    log(f"fp16 {MATMUL_N}^3 matmul: {rate:.0f} TFLOPS")
    return rate


def copy_bandwidth(torch, do_bench, log) -> float:
    """TB/s of a 1 GiB copy by an elementwise kernel: (read + write) bytes over the
    time, logged. (A captured dst.copy_(src) becomes a memcpy node: 2.70 TB/s on
    H200 against 4.21 for the kernel, so the kernel is the bar.)"""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = graph_time_ms(torch, lambda: torch.mul(src, 1, out=dst), do_bench)
    rate = tbps(2 * COPY_BYTES, ms)
    log(f"device-to-device copy: {rate:.2f} TB/s (read + write)")
    return rate


def describe_device(log) -> dict:
    """The device a result depends on, logged."""
    from specgen.check.gpu import device_info

    device = device_info()
    log(f"device: {device['name']} ({device['sm']}), driver {device['driver']}, torch {device['torch']}")
    return device


# --- reports -----------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    """How a suite's result reads as a table: the columns that name a row, the
    figure in each kernel's cell, specgen's share of the run's yardstick, and
    (for a plot) TFLOPS against which row key."""

    intro: Callable[["BenchResult"], str]  # the paragraph under the title
    keys: tuple[tuple[str, Callable[[Row], str]], ...]
    unit: str  # after each kernel's label in the header: "TFLOPS (ms)"
    cell: Callable[[Timing], Optional[str]]  # None: no number
    share: str  # "matmul": the last column is "specgen % of matmul"
    share_of: Callable[[Timing], Optional[float]]
    more: Callable[["BenchResult"], list[str]] = lambda result: []
    plot_x: Optional[tuple[str, Callable[[Row], float]]] = None  # axis label, value


def provenance(result: BenchResult) -> str:
    dev = result.device
    return (f"{result.created}, driver {dev.get('driver', '?')}, torch {dev.get('torch', '?')}, "
            f"cuda-tile {dev.get('cuda_tile', '?')}.")


def report_for(suite: str) -> Report:
    from specgen.bench import suite_named

    return suite_named(suite).report


def format_markdown(result: BenchResult, report: Optional[Report] = None) -> str:
    """One table: each kernel's figure per row, speedups against the baselines,
    specgen's share of the yardstick; then the report's further tables."""
    report = report or report_for(result.suite)
    names = ["specgen"] + result.baselines
    lines = [
        f"### {result.spec} (`{result.kernel}`) on {result.device.get('name', '?')}",
        "",
        report.intro(result),
        "",
        "| " + " | ".join(key for key, _ in report.keys) + " | "
        + " | ".join(f"{label(n)} {report.unit}" for n in names)
        + " | " + " | ".join(f"vs {label(n)}" for n in result.baselines)
        + f" | specgen % of {report.share} |",
        "|" + "---:|" * (len(report.keys) + len(names) + len(result.baselines) + 1),
    ]
    for row in result.rows:
        cells = []
        for name in names:
            t = row.timings.get(name)
            figure = report.cell(t) if t is not None else None
            if figure is None:
                reason = (t.error if t and t.error else "missing").replace("|", "/")
                figure = f"n/a ({reason[:60]})"
            cells.append(figure)
        ratios = [f"{row.speedup[n]:.2f}×" if row.speedup.get(n) else "n/a" for n in result.baselines]
        share = report.share_of(row.timings["specgen"])
        pct = f"{share:.0f}%" if share is not None else "n/a"
        keys = [value(row) for _, value in report.keys]
        lines.append("| " + " | ".join(keys + cells + ratios + [pct]) + " |")
    lines += report.more(result)
    lines += block_map_table(result, report)
    return "\n".join(lines) + "\n"


def block_map_table(result: BenchResult, report: Report) -> list[str]:
    """For a block-sparse spec: each row's block map build (timed apart: built once
    and reused, it is not in the times above), its share of one specgen call, and
    the share of the tiles the kernel visits."""
    mapped = [row for row in result.rows if row.timings["specgen"].block_map_ms is not None]
    if not mapped:
        return []
    lines = [
        "",
        "Block map: built once per batch (decode: per step) and reused by every call, so "
        "timed apart; its share of one specgen call, and the share of all tiles the kernel visits:",
        "",
        "| " + " | ".join(key for key, _ in report.keys) + " | map build µs | of one call | tiles visited |",
        "|" + "---:|" * (len(report.keys) + 3),
    ]
    for row in mapped:
        keys = [value(row) for _, value in report.keys]
        lines.append("| " + " | ".join(keys + list(block_map_cells(row.timings["specgen"]))) + " |")
    return lines


def block_map_cells(t: Timing) -> tuple[str, str, str]:
    """A block-sparse timing's map build in µs, its share of one specgen call, and the
    share of all tiles the kernel visits ("n/a" where the timing lacks one)."""
    share = f"{100 * t.block_map_ms / t.ms:.1f}%" if t.ms else "n/a"
    visited = f"{100 * t.tiles_visited:.1f}%" if t.tiles_visited is not None else "n/a"
    return f"{1000 * t.block_map_ms:.1f}", share, visited


def plot(result: BenchResult, report: Report, path: Path) -> Optional[str]:
    """TFLOPS against the report's x key, one line per kernel. Returns an error
    string if matplotlib is missing (the JSON and table are still written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    x_label, x_of = report.plot_x
    # Without anti-aliasing a plot has a handful of colours and compresses to about
    # 4 KB: results are committed, and the checkout travels to the GPU under a cap.
    with plt.rc_context(_CRISP):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=80)
        for name in ["specgen"] + result.baselines:
            points = [(x_of(row), row.timings[name].tflops) for row in result.rows
                      if name in row.timings and row.timings[name].tflops is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=label(name))
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x_label)
        ax.set_ylabel("TFLOPS")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{result.spec} on {result.device.get('name', '?')}", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
    _shrink_png(path)
    return None


_CRISP = {"lines.antialiased": False, "patch.antialiased": False, "text.antialiased": False}


def _shrink_png(path: Path) -> None:
    """A line plot drawn without anti-aliasing needs few colours: a 16-colour palette
    keeps every one (Pillow comes with matplotlib; without it the plot stays)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=16, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def result_paths(stem: Path) -> dict[str, Path]:
    """The JSON, markdown and PNG files of one result (stem: <dir>/<spec>-<suite>)."""
    return {kind: stem.parent / f"{stem.name}.{kind}" for kind in ("json", "md", "png")}


def result_json(result: BenchResult) -> str:
    BenchResult.model_validate(result.model_dump(by_alias=True))  # the schema holds
    return result.model_dump_json(indent=2, by_alias=True) + "\n"


def write_report(stem: Path, json_text: str, markdown: str) -> dict[str, Path]:
    """<stem>.json and <stem>.md, each written atomically (a reader never sees half a
    file). A gzipped result of the same stem, now stale, is removed."""
    paths = result_paths(stem)
    atomic_write(paths["json"], json_text.encode())
    atomic_write(paths["md"], markdown.encode())
    Path(f"{stem}.json.gz").unlink(missing_ok=True)
    return paths


def write_result(result: BenchResult, results_dir: Path, log: Callable[[str], None] = _stderr,
                 report: Optional[Report] = None) -> Path:
    """<results_dir>/<gpu>/<spec>-<suite>.json, .md and (where the report plots) .png."""
    from specgen.check.gpu import device_slug

    report = report or report_for(result.suite)
    stem = results_dir / device_slug(result.device.get("name", "gpu")) / f"{result.spec}-{result.suite}"
    paths = write_report(stem, result_json(result), format_markdown(result, report))
    if report.plot_x:
        problem = plot(result, report, paths["png"])
        if problem:
            log(problem)
    return stem


# --- the driver ----------------------------------------------------------------------


_PATCHED: list[str] = []  # baselines imported in this process that patched cuda.tile.launch


def note_launch_patched(name: str) -> None:
    """Called before importing a baseline that patches cuda.tile.launch (tilegym)."""
    if name not in _PATCHED:
        _PATCHED.append(name)


def require_unpatched_launch() -> None:
    """Refuse to launch specgen kernels in a process where a baseline patched
    cuda.tile.launch: their launchers break there."""
    patched = _PATCHED + [n for n in ("tilegym",) if n in sys.modules and n not in _PATCHED]
    if patched:
        raise UsageError(
            f"bench: {', '.join(patched)} was imported in this process and patched cuda.tile.launch, "
            "which specgen's launchers use; run the bench in a new process"
        )


@dataclass
class Context:
    """What a suite's methods share during one run."""

    torch: Any
    do_bench: Callable
    log: Callable[[str], None]
    yardstick: dict  # the BenchResult fields of the run's yardstick: {"matmul_tflops": ...}


@dataclass
class Case:
    """One shape of a suite for one kernel: its tensors and what it counts."""

    label: str  # for the log: "S=4096", "B1 Hq64/Hkv8 L8192"
    row: dict  # the Row's fields but timings and speedup
    inputs: Any = None  # what the baselines read (suite-defined)
    kernel: Any = None  # what the suite's time_kernel calls
    ours: Any = None  # specgen's output, set by time_kernel: the baselines' diff reference


class Suite:
    """What a suite says: its shapes, how it makes a case and times a kernel on
    it, and what it counts. Subclasses set ``name`` and ``report``."""

    name: str
    report: Report

    def check(self, plans: list) -> None:
        """Refuse bad input before the GPU is asked for (UsageError)."""

    def yardstick(self, torch, do_bench, log) -> dict:
        raise NotImplementedError

    def skip(self, plan) -> Optional[str]:
        """Why this suite does not time this spec (logged), None to time it."""
        return None

    def shapes(self, plan, override: Optional[Sequence] = None) -> list:
        raise NotImplementedError

    def case(self, ctx: Context, module, plan, shape) -> Case:
        """The shape's inputs, drawn from a seeded generator: the late pass draws
        them again and gets the same tensors."""
        raise NotImplementedError

    def time_kernel(self, ctx: Context, module, case: Case) -> Timing:
        raise NotImplementedError

    def time_baseline(self, ctx: Context, case: Case, baseline, fn) -> Timing:
        raise NotImplementedError

    def layout(self, plan) -> str:
        return "Sq=Skv"


@dataclass
class _Late:
    """A late baseline's row, timed after every specgen kernel of the run."""

    result: int
    row: int
    name: str
    module: Any
    plan: Any
    shape: Any
    ours: Any  # specgen's output on the host


def _moved(x, how):
    if isinstance(x, (tuple, list)):
        return type(x)(_moved(t, how) for t in x)
    return how(x) if hasattr(x, "device") else x


def run(suite: Suite, paths: list[str], *, results: Path, gen: Path, baselines: Sequence[str],
        shapes: Optional[Sequence] = None, log: Callable[[str], None] = _stderr) -> list[Path]:
    """Time every spec's kernel in ``paths`` on the suite's shapes (``shapes``
    overrides them) next to ``baselines``; write each result under
    ``results/<gpu>/`` and print its table. Returns the results' stems.

    Baselines marked ``late`` (tilegym: its import patches cuda.tile.launch) are
    timed in a pass after every specgen kernel of the run, on the same seeded
    inputs, against specgen's outputs kept on the host; the results are then
    written again with their rows filled in."""
    from specgen.check.gpu import import_module_file, require_cuda, require_do_bench
    from specgen.compile.jobs import (load_jobs, load_plans, module_refusals, refuse_foreign_modules,
                                      write_jobs)

    plans = load_plans(paths)
    suite.check([plan for _, plan in plans])
    # Bad input before the GPU is asked for: a run that would time nothing, and
    # shapes a spec cannot take.
    skipped = {plan.module_name: suite.skip(plan) for _, plan in plans}
    if all(skipped.values()):
        raise UsageError(f"--suite {suite.name}: nothing to time: " + "; ".join(
            f"{name} is {why}" if why.startswith(("a ", "not ")) else f"{name}: {why}"
            for name, why in skipped.items()))
    for _, plan in plans:
        if not skipped[plan.module_name]:
            suite.shapes(plan, shapes)
    # A module the run may not replace (another spec's, or edited by hand), read from
    # the files: named before the GPU is asked for, as build and test name it.
    refusals = module_refusals(plans, gen, "replace it with `specgen build --force` first")
    if refusals:
        raise UsageError("\n".join(refusals))
    torch = require_cuda("bench")  # before rendering: without a GPU, say so at once
    require_unpatched_launch()
    do_bench = require_do_bench("bench")
    jobs = load_jobs(paths, gen, plans)
    # Another spec's module of the same name (a copied spec that kept its name:) is
    # refused before anything is timed or written, as build and test refuse it.
    refuse_foreign_modules(jobs, "replace it with `specgen build --force` first")

    device = describe_device(log)
    ctx = Context(torch, do_bench, log, suite.yardstick(torch, do_bench, log))
    refused = write_jobs(jobs, gen, force=False, log=log)
    if refused:
        raise UsageError("; ".join(refused))
    names = list(baselines)
    written: list[Path] = []
    done: list[BenchResult] = []
    late: list[_Late] = []
    for job in jobs:
        plan = job.plan
        why = suite.skip(plan)
        if why:
            log(f"{plan.module_name}: skipped, {why}")
            continue
        module = import_module_file(job.out_path)
        fns = {n: (REGISTRY[n].reason(suite.name, plan) or _LATE) if REGISTRY[n].late
               else REGISTRY[n].make(torch, suite.name, plan) for n in names}
        rows = []
        for shape in suite.shapes(plan, shapes):
            case = suite.case(ctx, module, plan, shape)
            log(f"[{plan.module_name}] {case.label}")
            timings = {"specgen": suite.time_kernel(ctx, module, case)}
            for name in names:
                fn = fns[name]
                if fn is _LATE:
                    timings[name] = Timing(error=PENDING)
                    late.append(_Late(len(done), len(rows), name, module, plan, shape,
                                      _moved(case.ours, lambda t: t.cpu())))
                elif not callable(fn):
                    timings[name] = Timing(error=str(fn))
                else:
                    try:
                        timings[name] = suite.time_baseline(ctx, case, REGISTRY[name], fn)
                    except Exception as exc:  # noqa: BLE001 - a failed baseline is reported
                        timings[name] = failed_timing(exc)
            rows.append(Row(**case.row, timings=timings, speedup=speedups(timings)))
            log(f"[{plan.module_name}] {case.label}: " + "  ".join(
                f"{n} {suite.report.cell(t) or 'n/a'}" for n, t in timings.items()))
            del case
            torch.cuda.empty_cache()
        result = BenchResult(
            spec=plan.module_name, kernel=plan.kernel_name, suite=suite.name,
            created=datetime.date.today().isoformat(), device=device, baselines=names,
            layout=suite.layout(plan), rows=rows, **ctx.yardstick)
        written.append(write_result(result, results, log, suite.report))
        print(format_markdown(result, suite.report))
        done.append(result)
    if late:
        _late_pass(suite, ctx, late, done, log)
        for result in sorted({item.result for item in late}):
            write_result(done[result], results, log, suite.report)
            print(format_markdown(done[result], suite.report))
    return written


def _late_pass(suite: Suite, ctx: Context, late: list[_Late], done: list[BenchResult], log) -> None:
    """Time the late baselines, now that no specgen kernel is left to launch."""
    log(f"late pass: {', '.join(sorted({i.name for i in late}))} after every specgen kernel "
        "(importing tilegym patches cuda.tile.launch)")
    built: dict[tuple, Any] = {}
    for item in late:
        key = (item.name, item.result)
        if key not in built:
            built[key] = REGISTRY[item.name].make(ctx.torch, suite.name, item.plan)
        fn = built[key]
        row = done[item.result].rows[item.row]
        if not callable(fn):
            row.timings[item.name] = Timing(error=str(fn))
        else:
            try:
                case = suite.case(ctx, item.module, item.plan, item.shape)
                case.ours = _moved(item.ours, lambda t: t.cuda())
                row.timings[item.name] = suite.time_baseline(ctx, case, REGISTRY[item.name], fn)
                del case
            except Exception as exc:  # noqa: BLE001 - a failed baseline is reported
                row.timings[item.name] = failed_timing(exc)
            ctx.torch.cuda.empty_cache()
        row.speedup = speedups(row.timings)
        log(f"[{item.plan.module_name}] late {item.name}: "
            f"{suite.report.cell(row.timings[item.name]) or row.timings[item.name].error}")

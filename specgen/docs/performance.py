"""docs/performance.md, read from the JSON that `specgen bench` committed under
bench/results/."""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from pathlib import Path
from typing import Annotated, Any

from specgen.spec import Spec

from .base import REGENERATE, DocsError
from .reference import load_specs



# --- markdown from result files: their strings are data, not markup --------------

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def _text(value) -> str:
    """A string from a result file as plain text on one line of a paragraph or a
    table cell: control characters and line breaks become spaces, and the characters
    that would start markup here (table pipes, code spans, asterisk emphasis, HTML
    tags, backslash escapes) are escaped with a backslash. Underscores inside words
    and brackets not followed by a link target stay as they are: markdown reads them
    as text."""
    text = _CONTROL.sub(" ", str(value))
    text = re.sub(r"([\\`*<>|])", r"\\\1", text)
    return re.sub(r"\](?=[(\[])", r"\\]", text)  # "[x](y)" or "[x][y]" would be a link


def _code(value) -> str:
    """``value`` as a code span on one line: fenced by one backtick more than its
    longest run of backticks, and padded where it starts or ends with one."""
    text = _CONTROL.sub(" ", str(value))
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    code = f"{fence}{pad}{text}{pad}{fence}"
    # In a table cell a pipe ends the cell even inside a code span (GFM): escaped.
    return code.replace("|", "\\|")


def _href(relative: str) -> str:
    """A relative path as a link target: percent-encoded, so that spaces, brackets
    and other characters in file names keep the link whole."""
    return urllib.parse.quote(relative, safe="/")


# --- performance: the committed bench results --------------------------------

LABELS = {"specgen": "specgen", "cudnn": "SDPA cuDNN", "flash": "SDPA FA2", "flex": "FlexAttention",
          "fa3": "FlashAttention-3", "tilegym": "TileGym"}  # a name not listed prints as is
# The suites of `specgen bench` results this page reads; every schema version is read
# through specgen.bench.core.upgrade, as the current one.
SUITES = ("prefill", "backward", "decode")
SHAPE_KEYS = {
    "prefill": ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "dtype", "causal"),
    # decode rows: seq_k is the cached length L, seq_q the new tokens per sequence
    "decode": ("batch", "heads_q", "heads_kv", "seq_k", "seq_q"),
}
SHAPE_LABELS = {"batch": "B", "heads_q": "Hq", "heads_kv": "Hkv", "seq_q": "Sq", "seq_k": "Skv",
                "head_dim": "D", "dtype": "dtype", "causal": "causal"}
DECODE_LABELS = dict(SHAPE_LABELS, seq_k="L", seq_q="q_len")

PERFORMANCE_INTRO = """\
Every figure in this page's tables is read from the JSON that `specgen bench` wrote
under [`bench/results/`](../bench/results/); none is typed in by hand (the † note
below quotes the experiment log). Each run's table is
one bench call, in which the kernel and every baseline ran in one process on the
same inputs, so a ratio always compares timings of one call. Between calls on a
shared machine, a few percent is noise (see "Noise" in the
[experiment log](experiments.md)); the summary tables gather runs of several calls.

- **prefill, backward:** TFLOPS, with the median time in ms (triton `do_bench`). A
  ratio is baseline time / specgen time: above 1, specgen is faster.
- **decode:** µs per call in steady state (many calls replayed in one CUDA graph,
  reading the KV cache from HBM), with the KV bytes read per second.
- **block-sparse specs:** two more columns give the block map's build (built once per
  batch, at decode per step, and reused by every call, so timed apart: µs and its
  share of one specgen call) and the share of all tiles the kernel visits.
- A baseline that cannot compute a spec reads `n/a` with its reason; the layout line
  of a run says what its inputs were, and whether a baseline ran on other inputs.

Baselines: SDPA cuDNN and SDPA FA2 are torch's `scaled_dot_product_attention`
backends, FlexAttention is torch's `flex_attention`, compiled with static shapes
(a kernel specialised to each length).

† A Flex ratio marked † comes from a run that compiled Flex with torch.compile's
default, which recompiles it for dynamic shapes once a second length is seen: a
kernel up to 1.5× slower than the static one (packed documents at S=2048: 85
against 132 TFLOPS on the H200; experiments, section 36). Such a ratio can overstate specgen's lead; the
unmarked ones are against the static kernel. In the decode suite those runs also
called Flex without a block mask, which on an H100 ran up to 18× slower than with
one that marks every block full (B1 L8192: 284 against 22 µs; B1 L32768: 1101
against 60 µs; B64 L4096: about the same; experiments, section 37): their Flex
ratios are not Flex's speed.
"""

DYNAMIC_MARK = "†"


def _label(name: str) -> str:
    return LABELS.get(name) or _text(name)


def _shape_value(key: str, value: Any) -> str:
    if key == "causal":
        return "causal" if value else "non-causal"
    return _text(value)


def _split_shape(rows: list[dict], keys: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The shape keys that vary across rows (table columns) and the constant ones."""
    varying = [k for k in keys if len({json.dumps(r.get(k)) for r in rows}) > 1]
    constant = [k for k in keys if k not in varying and k in rows[0]]
    return varying, constant


def _constant_text(rows: list[dict], constant: list[str], labels: dict = SHAPE_LABELS) -> str:
    return ", ".join(
        _shape_value(k, rows[0][k]) if k in ("dtype", "causal") else f"{labels[k]}={rows[0][k]}"
        for k in constant
    )


def _ratio(value: float | None) -> str:
    return f"{value:.2f}×" if value else "–"


def _ratio_cell(row: dict, name: str, value: float | None) -> str:
    """A ratio column's cell, with the mark of a dynamic-shape Flex."""
    return _ratio(value) + (DYNAMIC_MARK if value and name == "flex" and _dynamic_flex(row) else "")


def _cell_error(timing: dict | None) -> str:
    reason = (timing or {}).get("error") or "missing"
    return "n/a: " + _text(reason)


def _load_results(results_dir: Path) -> tuple[list[tuple[Path, dict]], dict[Path, str | None]]:
    """(bench results with their paths, {other JSON file: the GPU it names}), in path
    order. Any of them may be gzipped (.json.gz). The other files are the bench
    scripts' ``{"device": "<name>", ...}`` (their device read once, here), or None
    where a file names no device or is not JSON. A bench result of an unknown suite
    or schema version, or one kept both plain and gzipped, raises DocsError."""
    from specgen.bench.core import ResultError, checked_result, read_result_json, result_stem, upgrade

    bench, other, stems = [], {}, {}
    paths = sorted([*results_dir.rglob("*.json"), *results_dir.rglob("*.json.gz")], key=result_stem)
    suite_named = re.compile(r".+-(" + "|".join(SUITES) + r")\.json(\.gz)?")
    for path in paths:
        try:
            data = read_result_json(path)
        except ResultError as exc:
            # The experiments' own gzipped files are listed as they are; a file named as
            # a bench result (<spec>-<suite>.json) or any plain .json must read.
            if path.name.endswith(".gz") and not suite_named.fullmatch(path.name):
                other[path] = None
                continue
            raise DocsError(str(exc)) from None
        if suite_named.fullmatch(path.name) and not isinstance(data, dict):
            raise DocsError(f"{path}: a bench result is a JSON object, got {type(data).__name__}")
        if not (isinstance(data, dict) and ("schema" in data or "schema_version" in data)
                and "rows" in data):
            if suite_named.fullmatch(path.name):
                missing = [k for k in ("schema", "rows") if k not in data
                           and not (k == "schema" and "schema_version" in data)]
                raise DocsError(f"{path}: named as a bench result (<spec>-<suite>.json), but it has no "
                                f"{' and no '.join(repr(k) for k in missing)} key")
            device = data.get("device") if isinstance(data, dict) else None
            other[path] = device if isinstance(device, str) else None
            continue
        stem = result_stem(path)
        if stem in stems:
            raise DocsError(f"{stems[stem]} and {path}: one bench result kept twice (plain and "
                            f"gzipped); keep one")
        stems[stem] = path
        suite = data.get("suite")
        if suite not in SUITES:
            raise DocsError(f"{path}: bench result of suite {suite!r}; specgen.docs reads {SUITES}")
        try:
            checked_result(path, data)  # every field the tables read, of the right type
            data = upgrade(data)
        except ResultError as exc:
            raise DocsError(str(exc)) from None
        if not data["rows"]:
            raise DocsError(f"{path}: a bench result without rows")
        bench.append((path, data))
    return bench, dict(sorted(other.items()))


def _run_meta(data: dict) -> str:
    dev = data["device"]
    return (f"{_text(data['created'])}; {_text(dev.get('name', '?'))}, driver {_text(dev.get('driver', '?'))}, "
            f"torch {_text(dev.get('torch', '?'))}, cuda-tile {_text(dev.get('cuda_tile', '?'))}")


def _files_line(path: Path, link_base: Path) -> str:
    def link(p: Path) -> str:
        return Path(os.path.relpath(p, link_base)).as_posix()

    from specgen.bench.core import result_stem

    # The bench's own markdown table beside the JSON is not linked: this page holds
    # the same table, and the repository keeps the JSON and the plot only.
    files = [f"[JSON]({_href(link(path))})"]
    plot = Path(f"{result_stem(path)}.png")
    if plot.is_file():
        files.append(f"[plot]({_href(link(plot))})")
    return "Files: " + ", ".join(files) + "."


def _result(data: dict):
    """A run's JSON as the bench's BenchResult (validated)."""
    from specgen.bench.core import BenchResult

    return BenchResult.model_validate(data)


def _run_heading(data: dict, suite: str, sizes: str) -> list[str]:
    """A run's title and the line under it: kernel, ``sizes`` (the constant shape and
    the run's yardstick) and the run's date and versions."""
    return [f"#### {_code(data['spec'])}, {suite}", "",
            f"Kernel {_code(data['kernel'])}. {sizes} {_run_meta(data)}.", ""]


def _flops_run(path: Path, data: dict, link_base: Path) -> list[str]:
    """A prefill or backward run: TFLOPS (ms) per shape, ratios, share of the matmul."""
    rows, baselines = data["rows"], data["baselines"]
    varying, constant = _split_shape(rows, SHAPE_KEYS["prefill"])
    if varying == ["seq_q", "seq_k"] and all(r["seq_q"] == r["seq_k"] for r in rows):
        varying, shape_head = ["seq_q"], ["S"]
    else:
        shape_head = [SHAPE_LABELS[k] for k in varying]
    result = _result(data)
    map_head, map_cells = _map_columns(result)
    lines = _run_heading(
        data, data["suite"],
        f"{_constant_text(rows, constant)}; {_text(data.get('layout', 'Sq=Skv'))}. "
        f"Dense fp16 matmul {data['matmul_tflops']:.0f} TFLOPS in the same run.") + [
        "| " + " | ".join(shape_head + [f"{_label(n)} TFLOPS (ms)" for n in ["specgen", *baselines]]
                         + [f"vs {_label(n)}" for n in baselines] + ["specgen % of matmul"] + map_head) + " |",
        "|" + "---:|" * (len(shape_head) + 2 * len(baselines) + 2 + len(map_head)),
    ]
    for i, row in enumerate(rows):
        cells = [_text(row[k]) for k in varying]
        for name in ["specgen", *baselines]:
            t = row["timings"].get(name)
            cells.append(f"{t['tflops']:.0f} ({t['ms']:.3f})" if t and t.get("ms") else _cell_error(t))
        cells += [_ratio_cell(row, n, row.get("speedup", {}).get(n)) for n in baselines]
        pct = row["timings"]["specgen"].get("pct_of_matmul")
        cells.append(f"{pct:.0f}%" if pct is not None else "–")
        lines.append("| " + " | ".join(cells + map_cells[i]) + " |")
    # The bench's own second table (specgen.bench.prefill.graph_table): rows that carry
    # one-call CUDA-graph times get TFLOPS and ratios from those too.
    from specgen.bench.prefill import graph_table

    return lines + graph_table(result) + ["", _files_line(path, link_base), ""]


def _map_columns(result) -> tuple[list[str], list[list[str]]]:
    """For a block-sparse run (a BenchResult): two more columns (the block map's
    build, µs and share of one specgen call; the share of all tiles visited) and each
    row's cells, as the bench's own table gives them; for a dense run, none."""
    from specgen.bench.core import block_map_cells

    timings = [row.timings["specgen"] for row in result.rows]
    if all(t.block_map_ms is None for t in timings):
        return [], [[] for _ in timings]
    cells = []
    for t in timings:
        if t.block_map_ms is None:
            cells.append(["–", "–"])
        else:
            build, share, visited = block_map_cells(t)
            cells.append([f"{build} ({share})", visited])
    return ["map build µs (of a call)", "tiles visited"], cells


def _decode_ratio(row: dict, name: str) -> float | None:
    ours, theirs = row["timings"]["specgen"].get("ms"), (row["timings"].get(name) or {}).get("ms")
    return theirs / ours if ours and theirs else None


def _decode_run(path: Path, data: dict, link_base: Path) -> list[str]:
    """A decode run: steady-state µs (KV TB/s) per shape, ratios, share of the copy
    bandwidth; then the same kernels with one call per graph replay."""
    rows, baselines = data["rows"], data["baselines"]
    varying, constant = _split_shape(rows, SHAPE_KEYS["decode"])
    head = [DECODE_LABELS[k] for k in varying] + ["splits"]
    names = ["specgen", *baselines]
    result = _result(data)
    map_head, map_cells = _map_columns(result)
    lines = _run_heading(
        data, "decode",
        f"{_constant_text(rows, constant, DECODE_LABELS)}; {_text(data.get('layout', ''))}. "
        f"Copy bandwidth {data['copy_tbps']:.2f} TB/s in the same run.") + [
        "| " + " | ".join(head + [f"{_label(n)} µs (TB/s)" for n in names]
                         + ["specgen % of copy"] + [f"vs {_label(n)}" for n in baselines] + map_head) + " |",
        "|" + "---:|" * (len(head) + len(names) + 1 + len(baselines) + len(map_head)),
    ]

    def shape(row):
        return [_text(row[k]) for k in varying]

    for i, row in enumerate(rows):
        cells = shape(row) + [f"{row.get('splits') or '–'}" + (", PDL" if row.get("pdl") else "")]
        for name in names:
            t = row["timings"].get(name)
            cells.append(f"{t['ms'] * 1000:.1f} ({t['tbps']:.2f})" if t and t.get("ms") and t.get("tbps")
                         else f"{t['ms'] * 1000:.1f}" if t and t.get("ms") else _cell_error(t))
        pct = row["timings"]["specgen"].get("pct_of_copy")
        cells.append(f"{pct:.0f}%" if pct is not None else "–")
        cells += [_ratio_cell(row, n, _decode_ratio(row, n)) for n in baselines]
        lines.append("| " + " | ".join(cells + map_cells[i]) + " |")
    lines += [
        "",
        "One call per graph replay (each figure carries the graph's launch floor):",
        "",
        "| " + " | ".join([DECODE_LABELS[k] for k in varying] + [f"{_label(n)} µs" for n in names]) + " |",
        "|" + "---:|" * (len(varying) + len(names)),
    ]
    for row in rows:
        cells = shape(row)
        for name in names:
            t = row["timings"].get(name)
            cells.append(f"{t['ms_one_call'] * 1000:.1f}" if t and t.get("ms_one_call") else _cell_error(t))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", _files_line(path, link_base), ""]


SHORT_LABELS = {"cudnn": "cuDNN", "flash": "FA2", "flex": "Flex", "fa3": "FA3", "tilegym": "TileGym"}


def _dynamic_flex(row: dict) -> bool:
    """Whether the row's Flex timing is of a Flex compiled for dynamic shapes (a run
    before the bench compiled it per shape): its ratio overstates specgen's lead."""
    from specgen.bench.baselines import FLEX_STATIC

    t = row["timings"].get("flex") or {}
    return bool(t.get("ms")) and t.get("note") != FLEX_STATIC


def _against_fastest(ratios: dict[str, float | None], row: dict | None = None) -> str:
    """' (0.98× cuDNN)': the ratio to the fastest baseline that ran, and which."""
    ran = {name: r for name, r in ratios.items() if r}
    if not ran:
        return ""
    name = min(ran, key=ran.get)  # the smallest ratio: the fastest baseline
    mark = DYNAMIC_MARK if name == "flex" and row is not None and _dynamic_flex(row) else ""
    return f" ({ran[name]:.2f}× {SHORT_LABELS.get(name, name)}{mark})"


SUMMARY_NOTE = ("In brackets: baseline time / specgen time for the fastest baseline that "
                "ran in the same call (above 1, specgen is faster); none where no baseline "
                "computes the spec.")


def _flops_summary(runs: list[dict]) -> list[str]:
    """specgen TFLOPS per length, each against the fastest baseline of its row."""
    seqs = sorted({r["seq_q"] for d in runs for r in d["rows"]})
    lines = [
        "specgen TFLOPS at Sq = Skv = S. " + SUMMARY_NOTE,
        "",
        "| spec | " + " | ".join(f"S={s}" for s in seqs) + " |",
        "|---|" + "---:|" * len(seqs),
    ]
    for data in runs:
        by_seq = {}
        for row in data["rows"]:
            if row["seq_q"] != row["seq_k"]:
                continue
            t = row["timings"]["specgen"]
            by_seq[row["seq_q"]] = (f"{t['tflops']:.0f}" + _against_fastest(row.get("speedup", {}), row)
                                    if t.get("ms") else "n/a")
        lines.append(f"| {_code(data['spec'])} | " + " | ".join(by_seq.get(s, "") for s in seqs) + " |")
    return lines + [""]


def _decode_summary(runs: list[dict]) -> list[str]:
    """specgen steady-state µs per shape, each against the fastest baseline of its row."""
    shapes = sorted({(r["batch"], r["seq_k"], r["seq_q"]) for d in runs for r in d["rows"]})

    def label(shape):
        return f"B{shape[0]} L{shape[1]}" + (f" q{shape[2]}" if shape[2] != 1 else "")

    lines = [
        "specgen µs per call in steady state. " + SUMMARY_NOTE,
        "",
        "| spec | Hq/Hkv | " + " | ".join(label(s) for s in shapes) + " |",
        "|---|---:|" + "---:|" * len(shapes),
    ]
    for data in runs:
        cells = {}
        for row in data["rows"]:
            ms = row["timings"]["specgen"].get("ms")
            ratios = {n: _decode_ratio(row, n) for n in data["baselines"]}
            cells[(row["batch"], row["seq_k"], row["seq_q"])] = (
                f"{ms * 1000:.1f}" + _against_fastest(ratios, row) if ms else "n/a")
        heads = sorted({f"{r['heads_q']}/{r['heads_kv']}" for r in data["rows"]})
        lines.append(f"| {_code(data['spec'])} | {', '.join(heads)} | "
                     + " | ".join(cells.get(s, "") for s in shapes) + " |")
    return lines + [""]


SUITE_TITLES = {"prefill": "Prefill", "backward": "Backward", "decode": "Decode"}


def _context_parallel_model():
    """The pydantic model of a context-parallel result file: the fields its table
    reads, strictly typed (numbers as JSON numbers, no NaN or infinity, times above
    0), others kept as they are. Built on first use: pydantic is imported lazily."""
    from typing import Optional

    from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

    from specgen.bench.core import PositiveCount, Rate, Time

    class _Strict(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    fields = {}
    for phase in PHASES:
        fields.update({
            f"specgen_{phase}_ms": (Time, ...),
            f"specgen_{phase}_tflops_per_gpu": (Rate, ...),
            f"torch_cp_{phase}_ms": (Optional[Time], None),
            f"torch_cp_{phase}_tflops_per_gpu": (Optional[Rate], None),
            f"torch_cp_{phase}_best": (Optional[str], None),
            f"speedup_vs_torch_cp_{phase}": (Optional[Rate], None),
            f"single_full_{phase}_tflops": (Optional[Rate], None),
            f"efficiency_vs_full_{phase}": (Optional[Rate], None),
            f"efficiency_vs_shard_{phase}": (Optional[Rate], None),
            f"comm_hidden_{phase}": (Optional[Rate], None),
            f"kernels_only_{phase}_ms": (Optional[Time], None),
        })

    class _Row(_Strict):
        seq: PositiveCount
        world: PositiveCount
        device: Annotated[str, Field(min_length=1)]
        batch: PositiveCount
        heads: PositiveCount
        kv_heads: PositiveCount
        head_dim: PositiveCount

        @model_validator(mode="after")
        def _torch_cp_whole(self):
            for phase in PHASES:
                if getattr(self, f"torch_cp_{phase}_ms") is not None:
                    for name in (f"torch_cp_{phase}_tflops_per_gpu", f"torch_cp_{phase}_best"):
                        if getattr(self, name) is None:
                            raise ValueError(f"torch_cp_{phase}_ms is given without {name}")
            return self

    Row = create_model("ContextParallelRow", __base__=_Row, **fields)

    class Result(_Strict):
        spec: str
        torch: str
        rows: Annotated[list[Row], Field(min_length=1)]

    return Result


PHASES = ("fwd", "fwdbwd")


def _context_parallel_run(path: Path, data_path_base: Path) -> list[str]:
    """A context-parallel run (bench/context_parallel/bench.py): per S and phase,
    TFLOPS per GPU against torch's context parallel, the scaling efficiency and the
    hidden share of the transfers. Validated first (_context_parallel_model): a
    field the table reads that is missing or not a finite number of its range is
    named, with the file."""
    from pydantic import ValidationError

    from specgen.bench.core import ResultError, read_result_json

    try:
        data = read_result_json(path)
    except ResultError as exc:
        raise DocsError(str(exc)) from None
    if not isinstance(data, dict):
        raise DocsError(f"{path}: a context-parallel result is a JSON object, got {type(data).__name__}")
    try:
        result = _context_parallel_model().model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "(top level)"
        raise DocsError(f"{path}: not a context-parallel result of this form: {where}: {error['msg']}") from None
    return _context_parallel_lines(path, data_path_base, result.model_dump())


def _context_parallel_lines(path: Path, data_path_base: Path, data: dict) -> list[str]:
    rows = data["rows"]
    first = rows[0]
    lines = [
        "### Context parallelism",
        "",
        f"{_code(data['spec'])} over {first['world']}× {_text(first['device'])}: ring attention, zigzag layout, "
        f"B{first['batch']} Hq{first['heads']} Hkv{first['kv_heads']} D{first['head_dim']}, causal; "
        f"torch {_text(data['torch'])}. torch CP is `context_parallel` around SDPA on the same inputs (KV heads "
        "expanded), the fastest of its rotations and backends. Efficiency: TFLOPS per GPU over the same "
        "kernel's TFLOPS on one GPU, on the whole sequence (full) and on one rank's length (shard). "
        "Hidden: the share of the ring's transfer time that does not add to its wall time. "
        "Ring cost: the ring's wall time over that of its kernel calls and merges run without "
        "transfers (the transfers, waits and their effect on the kernels). Kernel bound: the same "
        "kernel on one GPU over the whole sequence, in TFLOPS, over torch CP's TFLOPS per GPU, the "
        "most the ring can reach against torch CP with these kernels.",
        "",
        "| S | phase | specgen TFLOPS/GPU (ms) | torch CP TFLOPS/GPU (ms) | vs torch CP | kernel bound "
        "| efficiency (full) | efficiency (shard) | transfers hidden | ring cost |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def pct(value):
        return f"{100 * value:.0f}%" if value is not None else "–"

    def bound(row, phase):
        single, torch_cp = row.get(f"single_full_{phase}_tflops"), row.get(f"torch_cp_{phase}_tflops_per_gpu")
        return single / torch_cp if single and torch_cp else None

    def ring_cost(row, phase):
        alone = row.get(f"kernels_only_{phase}_ms")
        return f"{100 * (row[f'specgen_{phase}_ms'] / alone - 1):+.1f}%" if alone else "–"

    for row in rows:
        for phase, label in (("fwd", "forward"), ("fwdbwd", "fwd+bwd")):
            torch_ms = row.get(f"torch_cp_{phase}_ms")
            torch_cell = (f"{row[f'torch_cp_{phase}_tflops_per_gpu']:.0f} ({torch_ms:.2f}, "
                          f"{_text(row[f'torch_cp_{phase}_best'])})" if torch_ms else "–")
            lines.append(
                f"| {row['seq']} | {label} | {row[f'specgen_{phase}_tflops_per_gpu']:.0f} "
                f"({row[f'specgen_{phase}_ms']:.2f}) | {torch_cell} | "
                f"{_ratio(row.get(f'speedup_vs_torch_cp_{phase}'))} | {_ratio(bound(row, phase))} | "
                f"{pct(row.get(f'efficiency_vs_full_{phase}'))} | {pct(row.get(f'efficiency_vs_shard_{phase}'))} | "
                f"{pct(row.get(f'comm_hidden_{phase}'))} | {ring_cost(row, phase)} |")
    rel = Path(os.path.relpath(path, data_path_base)).as_posix()
    return lines + ["", f"Results: [{_code(path.name)}]({_href(rel)}).", ""]


def performance_markdown(results_dir: Path, specs_dir: Path | None = None,
                         specs: list[tuple[Path, Spec]] | None = None) -> str:
    """docs/performance.md from ``results_dir``/<gpu>/*.json (the `specgen bench` results):
    per GPU folder, a summary per suite, then each run's table with links to its JSON,
    markdown table and plot. Links are relative to the docs/ folder beside
    ``results_dir``'s grandparent (the repository layout). With ``specs_dir``, runs of
    specs it does not hold are listed after the shipped ones."""
    results_dir = Path(results_dir)
    link_base = results_dir.parent.parent / "docs"
    bench, other = _load_results(results_dir)
    # By the specs' names (results are named after them), not their files'.
    if specs is None and specs_dir is not None:
        specs = load_specs(specs_dir)
    shipped = {spec.name for _, spec in specs} if specs is not None else None
    lines = [
        f"<!-- Generated by specgen.docs from bench/results/**/*.json and *.json.gz. Do not edit: run `{REGENERATE}`. -->",
        "",
        "# Performance",
        "",
        PERFORMANCE_INTRO,
    ]
    folders = sorted({p.parent for p, _ in bench} | {p.parent for p in other})
    for folder in folders:
        runs = [(p, d) for p, d in bench if p.parent == folder]
        named = {name for p, name in other.items() if p.parent == folder and name}
        names = sorted({d["device"].get("name", "?") for _, d in runs}) or sorted(named) or [folder.name]
        rel = Path(os.path.relpath(folder, link_base)).as_posix()
        shown = folder.relative_to(results_dir.parent.parent).as_posix()
        lines += [f"## {', '.join(_text(n) for n in names)} ([{_code(shown + '/')}]({_href(rel)}/))", ""]
        groups = [("", runs)]
        if shipped is not None:
            groups = [("", [(p, d) for p, d in runs if d["spec"] in shipped]),
                      ("other", [(p, d) for p, d in runs if d["spec"] not in shipped])]
        for kind, group in groups:
            if not group:
                continue
            if kind == "other":
                lines += ["### Other runs", "",
                          "Runs of specs that do not ship in `specs/` (experiments, such as the "
                          "measured-defaults specs of `bench/defaults/`).", ""]
            for suite in ("prefill", "backward", "decode"):
                suite_runs = sorted((d for _, d in group if d["suite"] == suite), key=lambda d: d["spec"])
                if not suite_runs:
                    continue
                title = SUITE_TITLES[suite] + (" (other runs)" if kind else "")
                lines += [f"### {title}", ""]
                lines += _decode_summary(suite_runs) if suite == "decode" else _flops_summary(suite_runs)
                for path, data in sorted(((p, d) for p, d in group if d["suite"] == suite),
                                         key=lambda pd: pd[1]["spec"]):
                    run = _decode_run if suite == "decode" else _flops_run
                    lines += run(path, data, link_base)
        parallel = [p for p in other if p.parent == folder and p.name.startswith("context_parallel")]
        for p in parallel:
            lines += _context_parallel_run(p, link_base)
        extra = [p for p in other if p.parent == folder and p not in parallel]
        if extra:
            lines += ["### Other result files", "",
                      "Tuning reports (`tune-*`), variant runs (`variants-*`) and other "
                      "measurements, as written, in the folder linked above:", ""]
            for p in extra:
                lines.append(f"- {_code(p.name)}")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"

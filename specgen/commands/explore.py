"""Variants of one spec, timed side by side against cuDNN (and any other
baselines asked for) in one process.

A variants file names a base spec and a set of variants, each a list of
``key.path=value`` assignments (the syntax of ``specgen diff --set``)::

    spec: specs/fmha_gqa_causal.yaml
    base: ["targets.sm_90={tile_m: 64, tile_n: 64, occupancy: 2}"]  # before every variant
    shapes: {batch: 4, heads: 32, seqs: [2048, 8192]}
    variants:
      base: []
      prescale: [prescale_q=true]
      128x64 occ1 ww8: [targets.sm_90.tile_m=128, targets.sm_90.occupancy=1,
                        targets.sm_90.num_worker_warps=8]

Every variant is validated and rendered before anything runs on the GPU. On the
GPU each is first checked against the fp64 reference on a small ragged shape (a
wrong variant is reported and not timed), then timed at every length next to the
cuDNN SDPA backend on the same inputs, and next to the other ``--baselines``
(FA3, FA2, Flex) where they can compute the spec. The result is one JSON and one markdown
table under ``<out>/<gpu>/variants-<file stem>.{json,md}``.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specgen.bench.baselines import REGISTRY
from specgen.bench.baselines import label as baseline_label
from specgen.commands.tune import MAX_SEQ
from specgen.errors import SpecError, UsageError
from specgen.plan.make import Plan, make_plan
from specgen.emit.render import render_raw
from specgen.spec import load_spec, parse_spec_text, read_spec_text, spec_to_dict, validate_spec


class Shapes(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    batch: int = Field(4, ge=1, le=1024)
    heads: int = Field(32, ge=1, le=1024)
    seqs: list[Annotated[int, Field(ge=1, le=MAX_SEQ)]] = Field(
        default_factory=lambda: [2048, 8192], min_length=1)

    @field_validator("seqs")
    @classmethod
    def _seqs_once(cls, value: list[int]) -> list[int]:
        repeated = sorted({s for s in value if value.count(s) > 1})
        if repeated:
            raise ValueError(f"lists {', '.join(map(str, repeated))} twice; give each length once")
        return value


# What a variant may not change: the call every variant is timed with (and checked
# against one fp64 reference of) is made from the first variant's spec.
CALL_FIELDS = ("family", "dtype", "out_dtype", "kv_dtype", "head_dim", "v_head_dim", "gqa_ratio",
               "causal", "window", "softcap", "tensors", "score_mod", "mask_mod", "block_sparse",
               "dropout", "varlen", "sinks", "return_lse")
# Variant labels become table cells and JSON keys: plain words.
LABEL = r"[A-Za-z0-9][A-Za-z0-9 _.:+=,()/-]{0,63}"


class VariantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    spec: str
    # Assignments applied before every variant's own: pin the spec's state of the
    # day, so the file reproduces after the spec is tuned.
    base: list[str] = Field(default_factory=list)
    shapes: Shapes = Field(default_factory=Shapes)
    # eager: triton do_bench medians of each call; graph: medians of replaying a CUDA
    # graph of one call, which leaves out the host's launch path (short calls of
    # some baselines, FA3's at S=1k, are bound by it).
    timing: Literal["eager", "graph"] = "eager"
    variants: dict[str, list[str]] = Field(min_length=1)


class VariantTiming(BaseModel):
    model_config = ConfigDict(extra="forbid")
    variant: str
    seq: int
    ms: Optional[float] = None
    tflops: Optional[float] = None
    cudnn_ms: Optional[float] = None
    cudnn_tflops: Optional[float] = None
    vs_cudnn: Optional[float] = None  # cuDNN time / variant time (> 1: faster)
    # The other baselines of the run at this length: name -> ms, and name -> their
    # time / the variant's time; a baseline that cannot run the case is absent.
    baseline_ms: dict[str, float] = Field(default_factory=dict)
    baseline_tflops: dict[str, float] = Field(default_factory=dict)
    speedup: dict[str, float] = Field(default_factory=dict)
    error: Optional[str] = None


class VariantsResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str
    spec: str
    base: list[str] = []
    created: str
    device: dict
    shapes: Shapes
    timing: str = "eager"
    variants: dict[str, list[str]]
    max_rel_err: dict[str, Optional[float]]
    rows: list[VariantTiming]
    # Baselines beyond cuDNN asked for, and why any of them did not run.
    baselines: list[str] = Field(default_factory=list)
    skipped: dict[str, str] = Field(default_factory=dict)


def load_variants(path: Path) -> tuple[VariantsFile, dict[str, Plan], dict[str, str]]:
    """Parse the file and render every variant; any problem is a UsageError."""
    from specgen.commands.diff import apply_sets

    try:
        # The spec files' reader and loader: size cap, UTF-8, duplicate keys and YAML
        # 1.1 scalars refused alike.
        raw = parse_spec_text(read_spec_text(path), path)
        if isinstance(raw, dict) and "name" in raw and "variants" not in raw:
            raise UsageError(f"{path}: a spec file, not a variants file (one holds spec: <a spec's path> "
                             "and variants: {label: [key.path=value, ...]}); see docs/tuning.md")
        config = VariantsFile.model_validate(raw)
    except SpecError as exc:
        raise UsageError("\n".join(exc.lines())) from None
    except ValidationError as exc:  # one line per problem, worded as a spec's are
        from specgen.spec.load import problem_lines

        raise UsageError("\n".join(f"{path}: {field or '(top level)'}: {message}"
                                   for field, message in problem_lines(exc, VariantsFile))) from None
    try:
        base = spec_to_dict(load_spec(config.spec))
    except SpecError as exc:  # named with the file and field that point at it
        raise UsageError("\n".join(f"{path}: spec: {line}" for line in exc.lines())) from None
    # The assignments every variant shares, applied once: a bad one is the base's.
    base = apply_sets(base, config.base, f"{path}: base")
    plans, sources = {}, {}
    for label, assignments in config.variants.items():
        where = f"{path}: variant {label!r}"
        if not re.fullmatch(LABEL, label):
            raise UsageError(f"{where}: a label is 1-64 letters, digits, spaces and _.:+=,()/- "
                             "(it names a table row)")
        data = apply_sets(base, assignments, where)
        try:
            plan = make_plan(validate_spec(data, where))
        except SpecError as exc:
            raise UsageError("\n".join(exc.lines())) from None
        if plan.spec.family != "prefill" or plan.varlen:
            raise UsageError(f"{where}: bench --variants times dense prefill calls; "
                             f"{'a decode spec' if plan.spec.family != 'prefill' else 'varlen'} "
                             "is timed with specgen bench")
        if plans:
            first_label, first = next(iter(plans.items()))
            changed = [name for name in CALL_FIELDS
                       if plan.spec_dict.get(name) != first.spec_dict.get(name)]
            if changed:
                raise UsageError(f"{where}: changes {', '.join(changed)} from variant "
                                 f"{first_label!r}; every variant is timed on the same call, so "
                                 "only how it is computed may differ")
        if config.shapes.heads % plan.group_size:
            raise UsageError(f"{path}: shapes.heads: {config.shapes.heads} query heads are not "
                             f"a multiple of gqa_ratio {plan.group_size}")
        # Every variant is timed beside cuDNN: what it cannot compute is refused here,
        # before any GPU is asked for.
        why = REGISTRY["cudnn"].limits("prefill", plan)
        if why:
            raise UsageError(f"{path}: variant {label!r}: the cuDNN baseline of bench --variants "
                             f"cannot run it ({why}); time the spec with specgen bench, or search "
                             "its tiles with specgen tune")
        plans[label] = plan
        # Imported and timed, never kept: black's formatting (a third of a second a
        # variant) would change no kernel, so the template's output is imported as is.
        sources[label] = render_raw(plan)
    return config, plans, sources


def format_markdown(result: VariantsResult) -> str:
    seqs = result.shapes.seqs
    head = "| variant | max rel err | " + " | ".join(f"S={s} TFLOPS (×cuDNN)" for s in seqs) + " |"
    lines = [
        f"Variants of `{result.spec}` from `{result.file}` on {result.device.get('name')}, "
        f"{result.created}; B={result.shapes.batch}, Hq={result.shapes.heads}, Sq=Skv"
        + ("; CUDA graphs of one call." if result.timing == "graph" else "."),
        "",
        head,
        "|" + "---|" * (2 + len(seqs)),
    ]
    by_key = {(r.variant, r.seq): r for r in result.rows}
    cudnn = {s: next((r.cudnn_tflops for r in result.rows if r.seq == s and r.cudnn_tflops), None) for s in seqs}
    for label in result.variants:
        err = result.max_rel_err.get(label)
        cells = []
        for s in seqs:
            row = by_key.get((label, s))
            if row is None or row.tflops is None:
                cells.append(row.error if row and row.error else "–")
            else:
                cell = f"{row.tflops:.0f} ({row.vs_cudnn:.2f}×)" if row.vs_cudnn else f"{row.tflops:.0f}"
                others = [f"{row.speedup[n]:.2f}× {baseline_label(n)}"
                          for n in result.baselines if n in row.speedup]
                cells.append(cell + (" " + ", ".join(others) if others else ""))
        lines.append(f"| {label} | {'–' if err is None else f'{err:.1e}'} | " + " | ".join(cells) + " |")
    lines.append("| cuDNN (same run) | | " + " | ".join(f"{cudnn[s]:.0f}" if cudnn[s] else "–" for s in seqs) + " |")
    for name in result.baselines:
        if name in result.skipped:
            reason = result.skipped[name]
            lines.append(f"| {baseline_label(name)} | | " + " | ".join(reason for _ in seqs) + " |")
            continue
        cells = []
        for s in seqs:
            row = next((r for r in result.rows if r.seq == s and name in r.baseline_tflops), None)
            cells.append(f"{row.baseline_tflops[name]:.0f}" if row else "–")
        lines.append(f"| {baseline_label(name)} (same run) | | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def import_variants(sources: dict[str, str], folder: Path, stem: str = "variant") -> dict:
    """Each variant's rendered source written to ``folder`` and imported: {label: module}."""
    from specgen.check.gpu import import_module_file

    modules = {}
    for i, (label, source) in enumerate(sources.items()):
        file = folder / f"{stem}_{i}.py"
        file.write_text(source, encoding="utf-8")
        modules[label] = import_module_file(file)
    return modules


def run_variants(
    path: Path,
    out_dir: Path,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    baselines: Sequence[str] = ("cudnn",),
) -> Path:
    from specgen.bench.baselines import Inputs
    from specgen.bench.core import graph_time_ms, median_ms, tflops, write_report
    from specgen.bench.flops import attention_flops
    from specgen.check.cases import TOLERANCES, call_kernel, compare, poisoned_out, random_qkv, smoke_case
    from specgen.check.gpu import device_info, device_slug, require_cuda, require_do_bench

    late = [n for n in baselines if REGISTRY[n].late]
    if late:
        raise UsageError(f"specgen bench: --variants: {', '.join(late)} cannot be timed beside the variants "
                         "(importing it changes cuda.tile.launch); use specgen bench")
    config, plans, sources = load_variants(path)  # every variant valid before the GPU
    torch = require_cuda("bench --variants")
    do_bench = require_do_bench("bench --variants")

    def measure(fn) -> float:
        if config.timing == "graph":
            return graph_time_ms(torch, fn, do_bench)
        return median_ms(do_bench, fn)

    device = device_info()
    log(f"device: {device['name']} ({device['sm']}); {len(plans)} variants of {config.spec}")
    modules = import_variants(sources, Path(tempfile.mkdtemp(prefix="specgen-variants-")))

    first = next(iter(plans.values()))
    cudnn = REGISTRY["cudnn"].make(torch, "prefill", first)
    if isinstance(cudnn, str):
        raise UsageError(f"{path}: the cuDNN baseline cannot run {config.spec}: {cudnn}")
    others, skipped = {}, {}
    for name in dict.fromkeys(n for n in baselines if n != "cudnn"):
        runner = REGISTRY[name].make(torch, "prefill", first)
        if isinstance(runner, str):
            skipped[name] = runner
            log(f"[{name}] not timed: {runner}")
        else:
            others[name] = runner
    ratio, causal, d = first.group_size, first.causal, first.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)

    # Correctness first: a ragged chunked-prefill shape, against fp64.
    errs: dict[str, Optional[float]] = {}
    case = smoke_case(first.spec_dict, generator=gen)
    for label, module in modules.items():
        try:
            out = poisoned_out(first.spec_dict, case.q, case.v)
            call_kernel(module, case.q, case.k, case.v, case.extra, q_offset=case.q_offset, out=out)
            torch.cuda.synchronize()
            result = compare(out, case.ref, first.dtype)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            errs[label] = None
            log(f"[{label}] failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        errs[label] = result.rel_err
        log(f"[{label}] max rel err {result.rel_err:.2e} {'ok' if result.ok else 'WRONG'}")

    rows = []
    shapes = config.shapes
    kv_heads = shapes.heads // ratio
    for seq in shapes.seqs:
        q, k, v = random_qkv(first.spec_dict, shapes.batch, kv_heads, seq, seq)
        # torch has no float8 attention: cuDNN runs on 16-bit copies of the same values.
        bq, bk, bv = ((t.to(getattr(torch, first.out_dtype)) for t in (q, k, v)) if first.fp8
                      else (q, k, v))
        kf = bk.repeat_interleave(ratio, 1) if ratio > 1 else bk
        vf = bv.repeat_interleave(ratio, 1) if ratio > 1 else bv
        out = poisoned_out(first.spec_dict, q, v)
        flops = attention_flops(shapes.batch, shapes.heads, seq, seq, d, causal, first.v_head_dim)
        extra = {"q_descale": 1.0, "k_descale": 1.0, "v_descale": 1.0} if first.fp8 else {}

        inputs = Inputs(q=bq, k=bk, v=bv, k_full=kf, v_full=vf,
                        kernel_qkv=(q, k, v) if first.fp8 else None)
        cudnn_ms = measure(lambda: cudnn(inputs))
        other_ms = {}
        for name, runner in others.items():
            try:
                runner(inputs)  # its one-time copies and JIT outside the timing
                other_ms[name] = measure(lambda: runner(inputs))
            except Exception as exc:  # noqa: BLE001 - reported, the variants still run
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                log(f"[{name}] S={seq} failed: {type(exc).__name__}: {first_line}")
        for name, ms in other_ms.items():
            log(f"[{name}] S={seq}: {tflops(flops, ms):.0f} TFLOPS")
        for label, module in modules.items():
            err = errs.get(label)
            if err is None or err > TOLERANCES[first.dtype]:
                rows.append(VariantTiming(variant=label, seq=seq, error="incorrect or failed"))
                continue
            call_kernel(module, q, k, v, extra, out=out)  # JIT outside the timing
            ms = measure(lambda: call_kernel(module, q, k, v, extra, out=out))
            row = VariantTiming(
                variant=label, seq=seq, ms=ms, tflops=tflops(flops, ms), cudnn_ms=cudnn_ms,
                cudnn_tflops=tflops(flops, cudnn_ms), vs_cudnn=cudnn_ms / ms,
                baseline_ms=other_ms, baseline_tflops={n: tflops(flops, m) for n, m in other_ms.items()},
                speedup={n: m / ms for n, m in other_ms.items()},
            )
            rows.append(row)
            vs = "".join(f", {r:.2f}x {n}" for n, r in row.speedup.items())
            log(f"[{label}] S={seq}: {row.tflops:.0f} TFLOPS, {row.vs_cudnn:.2f}x cuDNN ({row.cudnn_tflops:.0f}){vs}")
        del q, k, v, bq, bk, bv, kf, vf, out

    result = VariantsResult(
        file=path.as_posix(), spec=config.spec, base=config.base, created=datetime.date.today().isoformat(),
        device=device, shapes=shapes, timing=config.timing, variants=config.variants, max_rel_err=errs,
        rows=rows, baselines=[n for n in dict.fromkeys(baselines) if n != "cudnn"], skipped=skipped,
    )
    stem = out_dir / device_slug(device["name"]) / f"variants-{path.stem}"
    table = format_markdown(result)
    write_report(stem, json.dumps(result.model_dump(mode="json"), indent=2) + "\n", table)
    print(table)
    log(f"wrote {stem}.json and .md")
    return stem

"""`specgen diff`: what a flag, a target or a template change does, section by
section: spec, plan, source, compiled resources, measured speed."""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

from specgen.errors import CompileError, SpecError, UsageError
from specgen.plan.make import Plan, make_plan
from specgen.compile.sass import describe_mix
from specgen.emit.render import HEADER_RE, hand_edited, render
from specgen.spec import parse_spec_text, read_spec_text, validate_spec
from specgen.spec.hooks import Hook

ARROW = "→"


@dataclass
class Side:
    """One side of a diff: a validated plan and the module source it stands for."""

    label: str
    plan: Plan
    source: str
    module: bool = False  # the text of a generated module as written, not a fresh render
    # A --set variant: no bench run has timed it, so results under its name (a --set
    # name=... that names another spec) are another spec's, never its own.
    variant: bool = False


# --- loading the two sides ------------------------------------------------------


# A generated module is far larger than a spec (the largest shipped is about 90 KB).
MAX_MODULE_BYTES = 8 << 20


def _spec_data_from_module(path: Path, text: str) -> dict:
    """The SPEC dict of a generated module, read without importing it."""
    try:
        tree = ast.parse(text, str(path))
    except SyntaxError as exc:
        raise UsageError(f"{path}: not a generated module (not Python: line {exc.lineno}: "
                         f"{exc.msg})") from None
    except (RecursionError, MemoryError):
        raise UsageError(f"{path}: not a generated module (nested too deeply to parse)") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SPEC" for t in node.targets
        ):
            try:
                data = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                data = None
            if not isinstance(data, dict):
                raise UsageError(f"{path}: not a generated module (its SPEC is not a literal "
                                 "mapping)")
            return data
    raise UsageError(f"{path}: not a generated module (no SPEC = {{...}})")


def _legacy_fields_dropped(data: dict) -> dict:
    """A module's SPEC without the other family's fields at their defaults: modules
    written before SPEC dicts left them out hold them (a prefill module's
    ``"pdl": "auto"``), which the spec model now refuses even at their default."""
    from specgen.spec.model import Spec, other_family_fields

    defaults = {name: Spec.model_fields[name].get_default(call_default_factory=True)
                for name in other_family_fields(data.get("family", "prefill"))}
    return {k: v for k, v in data.items() if not (k in defaults and v == defaults[k])}


def load_side(path_text: str) -> tuple[dict, Side]:
    path = Path(path_text)
    if path.exists() and not path.is_file():
        raise UsageError(f"{path_text}: not a file (give a spec file or a generated module)")
    if not path.is_file():
        raise UsageError(f"{path_text}: no such spec file or generated module")
    if path.suffix == ".py":
        text = read_spec_text(path, MAX_MODULE_BYTES)
        # The compiled section imports the module: only specgen's own output, byte for
        # byte as its header's hash says, is ever run.
        if not HEADER_RE.match(text.replace("\r\n", "\n")):
            raise UsageError(f"{path}: not a generated module (no specgen header)")
        if hand_edited(text):
            raise UsageError(f"{path}: edited by hand (its content no longer matches its header's "
                             "hash); diff its spec, or rebuild the module")
        data = _legacy_fields_dropped(_spec_data_from_module(path, text))
        plan = make_plan(validate_spec(data, path))
        return data, Side(str(path), plan, text, module=True)
    data = parse_spec_text(read_spec_text(path), path)
    plan = make_plan(validate_spec(data, path))
    return data, Side(str(path), plan, render(plan, path.as_posix()).text)


def apply_sets(data: dict, assignments: list[str], where: str = "--set", once: bool = False) -> dict:
    """A copy of spec data with `key.path=value` assignments (values parsed as YAML),
    applied in order. ``where`` names the assignments' origin in errors (a variants
    file's variant). ``once``: refuse a key given twice, and a key after one inside
    it (which it would undo), where the assignments are one list (the command line)."""
    data = copy.deepcopy(data)
    given = []
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        key = key.strip()
        if not sep or not key or not all(part.strip() for part in key.split(".")):
            raise UsageError(f"{where}: expected key.path=value (names joined by dots), got {assignment!r}")
        path = tuple(part.strip() for part in key.split("."))
        for earlier in given if once else ():
            if path == earlier:
                raise UsageError(f"{where}: {key} is given twice; give each key once")
            if earlier[:len(path)] == path:
                raise UsageError(f"{where}: {key} would replace {'.'.join(earlier)}, given before it; "
                                 f"give {key} first")
        given.append(path)
        try:
            # The loader of spec files: the same numbers, and its guards against
            # numbers too long to read and nesting too deep.
            value = parse_spec_text(raw, f"{where} {key}") if raw.strip() else None
        except SpecError as exc:
            raise UsageError("\n".join(exc.lines())) from None
        node = data
        parts = [part.strip() for part in key.split(".")]
        for part in parts[:-1]:
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                kind = "a list" if isinstance(child, list) else f"the value {child!r}"
                raise UsageError(f"{where}: {key}: {part} is {kind}, not a mapping; a dotted key "
                                 "goes through mappings only (set the whole value instead)")
            node = child
        node[parts[-1]] = value
    return data


def variant_side(data: dict, base: Side, assignments: list[str]) -> Side:
    label = f"{base.label} with " + ", ".join(assignments)
    new_data = apply_sets(data, assignments, once=True)
    keys = " ".join(a.partition("=")[0].strip() for a in assignments)
    try:
        plan = make_plan(validate_spec(new_data, f"--set {keys}"))
    except SpecError as exc:
        raise UsageError("\n".join(exc.lines())) from None
    spec_path = _header_path(base.source) or "variant.yaml"
    return Side(label, plan, render(plan, spec_path).text, variant=True)


def rendered_now(side: Side, log: Callable[[str], None]) -> Side:
    """A module side as the installed templates render its spec, where its body differs
    (a module written by other templates or another specgen): --set asks what the
    fields change, so both sides come from the same templates; a stale module's drift
    is what `diff --templates` shows."""
    spec_path = _header_path(side.source)
    if not side.module or spec_path is None:
        return side
    fresh = render(side.plan, spec_path).text
    if _body(fresh) == _body(side.source):
        return side
    log(f"note: {side.label} is stale against the installed templates (`specgen diff --templates` "
        "shows how); a is its spec rendered with them, so that only the --set fields differ")
    return Side(f"{side.label} (re-rendered with the installed templates)", side.plan, fresh)


def _header_path(source: str) -> Optional[str]:
    match = HEADER_RE.match(source)
    return match.group("spec_path") if match else None


# --- sections ---------------------------------------------------------------------


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


_ABSENT = object()


def _leaf_pairs(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(field, a's value, b's value) for every field where a and b differ. Two dicts
    are compared key by key (dotted names); where only one side holds a dict (a
    field absent, null or a scalar on the other side), the field is one pair with
    the whole dict, so `window: null -> {"left": 4095, ...}` reads as one change."""
    if isinstance(a, dict) and isinstance(b, dict):
        pairs = []
        for key in list(a) + [k for k in b if k not in a]:
            name = f"{prefix}.{key}" if prefix else str(key)
            pairs += _leaf_pairs(a.get(key, _ABSENT), b.get(key, _ABSENT), name)
        return pairs
    return [] if a is not _ABSENT and b is not _ABSENT and a == b else [(prefix, a, b)]


def _changes(a: dict, b: dict) -> list[dict]:
    changes = []
    for field, value_a, value_b in _leaf_pairs(a, b):
        change = {"field": field, "a": value_a, "b": value_b}
        # --json writes an absent side as null, as it writes a field set to null:
        # "absent" names the side that lacks the field.
        absent = [side for side in ("a", "b") if change[side] is _ABSENT]
        if absent:
            change["absent"] = absent[0]
        changes.append(change)
    return changes


def spec_section(a: Side, b: Side) -> list[dict]:
    return _changes(a.plan.spec_dict, b.plan.spec_dict)


def _plain(value: Any) -> Any:
    """A plan value as JSON data: a hook as its source text, a dataclass as a dict."""
    if isinstance(value, Hook):
        return value.source
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def plan_summary(plan: Plan) -> dict:
    """The derived values worth comparing (the spec itself is section 1)."""
    skip = {"spec", "spec_dict", "targets", "optimizations"}
    out = {f.name: _plain(getattr(plan, f.name)) for f in fields(plan) if f.name not in skip}
    out["kernel_constants"] = list(plan.kernel_constants)
    for t in plan.targets:
        out[f"tiles.{t.name}"] = "; ".join(c.describe() for c in t.configs)
    return out


def plan_section(a: Side, b: Side) -> list[dict]:
    return _changes(plan_summary(a.plan), plan_summary(b.plan))


def _body(source: str) -> str:
    match = HEADER_RE.match(source)
    return source[match.end() :] if match else source


def source_section(a: Side, b: Side) -> dict:
    """A unified diff of the module bodies (the hash header always differs)."""
    lines = list(
        difflib.unified_diff(
            _body(a.source).splitlines(True),
            _body(b.source).splitlines(True),
            a.label,
            b.label,
            n=3,
        )
    )
    added = sum(1 for l in lines if l.startswith("+") and not l.startswith("+++"))
    removed = sum(1 for l in lines if l.startswith("-") and not l.startswith("---"))
    hunks = sum(1 for l in lines if l.startswith("@@"))
    return {"diff": "".join(lines), "added": added, "removed": removed, "hunks": hunks}


_RESOURCE_RE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cubin: Path, plan: Plan) -> Optional[list[dict]]:
    """Per kernel in a cubin: registers, stack, shared and local memory (spills
    land in local memory), and the schedules of its inner loops where nvdisasm is
    there too (specgen.compile.sass). None where cuobjdump is not available."""
    from specgen.compile.sass import cubin_loops, cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        return None
    text = subprocess.run(
        [tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    loops = cubin_loops(cubin) or {}
    kernels = []
    name = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Function "):
            name = line[len("Function ") :].rstrip(":")
        elif name and (match := _RESOURCE_RE.search(line)):
            reg, stack, shared, local = map(int, match.groups())
            kernels.append({"kernel": _variant_label(name, plan), "registers": reg,
                            "stack": stack, "shared": shared, "local": local,
                            "loops": [lp["schedule"] for lp in loops[name]] if name in loops else None,
                            "loop_mix": [{k: v for k, v in lp.items() if k != "schedule"}
                                         for lp in loops[name]] if name in loops else None})
            name = None
    return kernels


def _variant_label(symbol: str, plan: Plan) -> str:
    """'TILE_M=64 TILE_N=64 EVEN_N=False' for a mangled symbol of the spec's main
    kernel; '<name> (8)' (its constants' values) for another kernel of the module."""
    try:
        from cuda.tile.compilation import ConstantConstraint, demangle_kernel_name

        name, signature = demangle_kernel_name(symbol)
        values = [p.value for p in signature.parameters if isinstance(p, ConstantConstraint)]
        if name != plan.kernel_name:
            return f"{name} ({', '.join(map(str, values))})" if values else name
        return " ".join(f"{n}={v}" for n, v in zip(plan.kernel_constants, values))
    except Exception:  # noqa: BLE001 - an unknown mangling still gets a label
        return symbol


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def compiled_section(a: Side, b: Side, log: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Each side compiled for every target of either; ``log`` gets a line per cubin
    set as it is done (a compile takes seconds to minutes)."""
    from specgen.compile.export import compile_target

    targets = list(dict.fromkeys(a.plan.compile_for + b.plan.compile_for))
    rows = []
    total, done = 2 * len(targets), 0
    for target in targets:
        row: dict[str, Any] = {"target": target}
        for key, side in (("a", a), ("b", b)):
            started = time.monotonic()
            try:
                result = compile_target(side.plan, side.source, f"{side.plan.module_name}.py", target)
            except CompileError as exc:
                row[key] = {"error": str(exc)}
                continue
            finally:
                done += 1
                if log:
                    log(f"  [{done}/{total}] {key} {target}  {time.monotonic() - started:.1f} s")
            usage = [resource_usage(path, side.plan) for path in result.paths]
            row[key] = {"cubin_bytes": result.size,
                        "kernels": None if None in usage else [k for u in usage for k in u]}
        rows.append(row)
    return rows


def performance_section(a: Side, b: Side, results_dir: Path,
                        log: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Where both specs were benchmarked on one device in the same suite: TFLOPS per
    sequence length (prefill, backward), or steady-state µs per shape (decode). A
    result of another kernel than its side's (a spec changed since its run) is left
    out, with a note to ``log``."""
    from specgen.bench.core import (ResultError, checked_result, find_result, read_result_json,
                                    result_stem)

    out = []
    if (a.plan.module_name == b.plan.module_name or a.variant or b.variant
            or not results_dir.is_dir()):
        return out
    # A device's own folder (bench/results/h200) is read as the results of one device.
    own = any(results_dir.glob(f"{a.plan.module_name}-*.json*"))
    device_dirs = [results_dir] * own + sorted(p for p in results_dir.iterdir() if p.is_dir())
    for device_dir in device_dirs:
        prefix = f"{a.plan.module_name}-*"
        stems = {result_stem(p) for ext in (".json", ".json.gz") for p in device_dir.glob(prefix + ext)}
        for stem in sorted(stems):
            suite = stem.name[len(a.plan.module_name) + 1 :]
            path_a = find_result(stem)
            path_b = find_result(device_dir / f"{b.plan.module_name}-{suite}")
            if path_a is None or path_b is None:  # (a folder or a broken link by that name)
                continue
            try:
                raw = [read_result_json(p) for p in (path_a, path_b)]
                ra, rb = checked_result(path_a, raw[0]), checked_result(path_b, raw[1])
            except ResultError as exc:  # the file and what is wrong with it
                raise UsageError(f"specgen diff: --results: {exc}") from None
            stale = [f"{path} times {result.kernel}, not {side.plan.kernel_name}"
                     for path, result, side in ((path_a, ra, a), (path_b, rb, b))
                     if result.kernel != side.plan.kernel_name]
            if stale:
                if log:
                    log(f"note: {'; '.join(stale)} (its spec changed since the run): suite {suite} "
                        f"on {ra.device.get('name', device_dir.name)} left out of the performance section")
                continue
            block = (_decode_performance(ra, rb, raw) if suite == "decode"
                     else _tflops_performance(ra, rb))
            if block:
                out.append({"device": ra.device.get("name", device_dir.name), "suite": suite,
                            "unit": block[0], "a_date": ra.created, "b_date": rb.created,
                            "rows": block[1]})
    return out


def _paired_rows(ra, rb, key: Callable) -> list[tuple[Any, Any, Any]]:
    """(key, a's row, b's row) for every key either result timed: a's rows in its
    order, then those only b timed (None on the side that lacks the key)."""
    by_key_b = {key(r): r for r in rb.rows}
    keys_a = {key(r) for r in ra.rows}
    return ([(key(r), r, by_key_b.get(key(r))) for r in ra.rows]
            + [(k, None, r) for k, r in by_key_b.items() if k not in keys_a])


def _tflops_performance(ra, rb) -> tuple[str, list[dict]]:
    """The specgen kernel's TFLOPS of both results per sequence length; ratio = b / a."""
    rows = []
    for seq, row_a, row_b in _paired_rows(ra, rb, lambda r: r.seq_q):
        a_t, b_t = (r.timings["specgen"].tflops if r else None for r in (row_a, row_b))
        rows.append({"seq": seq, "a_tflops": a_t, "b_tflops": b_t,
                     "ratio": b_t / a_t if a_t and b_t else None})
    return "TFLOPS", rows


def _decode_performance(ra, rb, raw: list) -> Optional[tuple[str, list[dict]]]:
    """Steady-state µs of both decode results per (B, Hkv, L); ratio = a µs / b µs
    (above 1: b is faster). None unless both files have the steady-state schema."""
    from specgen.bench.core import schema_of

    # Schema 1 timed one call per graph: not comparable with the steady state.
    if any(isinstance(d, dict) and schema_of(d) == 1 for d in raw):
        return None
    rows = []
    for (batch, heads_kv, seq_k), row_a, row_b in _paired_rows(
            ra, rb, lambda r: (r.batch, r.heads_kv, r.seq_k)):
        a_us, b_us = (1000 * r.timings["specgen"].ms if r and r.timings["specgen"].ms else None
                      for r in (row_a, row_b))
        rows.append({"shape": f"B{batch} Hkv{heads_kv} L{seq_k}", "a_us": a_us, "b_us": b_us,
                     "ratio": a_us / b_us if a_us and b_us else None})
    return "µs", rows


# --- output --------------------------------------------------------------------


def _colour(diff: str) -> str:
    out = []
    for line in diff.splitlines(True):
        if line.startswith(("+++", "---")):
            out.append(f"\033[1m{line.rstrip(chr(10))}\033[0m\n")
        elif line.startswith("+"):
            out.append(f"\033[32m{line.rstrip(chr(10))}\033[0m\n")
        elif line.startswith("-"):
            out.append(f"\033[31m{line.rstrip(chr(10))}\033[0m\n")
        elif line.startswith("@@"):
            out.append(f"\033[36m{line.rstrip(chr(10))}\033[0m\n")
        else:
            out.append(line)
    return "".join(out)


def _delta(a: Optional[int], b: Optional[int]) -> str:
    if a is None or b is None:
        return ""
    return f"{b - a:+d}" if b != a else "="


def _kernel_name(label: str) -> str:
    """The kernel a variant label belongs to: "name (constants)" for the helper
    kernels, "" for the attention kernel's "TILE_M=... TILE_N=..." labels."""
    return label.split(" (", 1)[0] if " (" in label else ""


def _constants(label: str) -> set[str]:
    """The words of a variant label: its constants ("TILE_M=64", or the values of a
    helper kernel's "(16, 64, False)")."""
    return set(re.findall(r"[^\s(),]+", label))


def pair_kernels(a: list[dict], b: list[dict]) -> list[tuple[dict, dict]]:
    """Kernels of two cubins side by side: same variant label first, then the
    leftovers of the same kernel, those sharing the most constants first (a flag
    that changes a constant changes the labels), then any others in order (a flag
    that renames a kernel)."""
    b_by_label = {k["kernel"]: k for k in b}
    pairs = [(k, b_by_label.pop(k["kernel"])) for k in a if k["kernel"] in b_by_label]
    left_a = [k for k in a if not any(k is pa for pa, _ in pairs)]
    left_b = list(b_by_label.values())
    # Leftovers of one kernel: the pairs that share the most constants first (a's
    # TILE_M=64 variants with b's TILE_M=64, not with b's 128 because it came next).
    candidates = sorted(
        ((-len(_constants(ka["kernel"]) & _constants(kb["kernel"])), i, j)
         for i, ka in enumerate(left_a) for j, kb in enumerate(left_b)
         if _kernel_name(ka["kernel"]) == _kernel_name(kb["kernel"])))
    used_a, used_b = set(), set()
    for _, i, j in candidates:
        if i not in used_a and j not in used_b:
            used_a.add(i)
            used_b.add(j)
            pairs.append((left_a[i], left_b[j]))
    left_a = [k for i, k in enumerate(left_a) if i not in used_a]
    left_b = [k for j, k in enumerate(left_b) if j not in used_b]
    for i in range(max(len(left_a), len(left_b))):
        pairs.append((left_a[i] if i < len(left_a) else {}, left_b[i] if i < len(left_b) else {}))
    return pairs


def _num(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def format_text(report: dict, stat: bool, colour: bool) -> str:
    lines = [f"a: {report['a']}", f"b: {report['b']}", "", "1. Spec"]
    lines += [f"  {c['field']}: {_show(c['a'])} {ARROW} {_show(c['b'])}" for c in report["spec"]] or ["  identical"]
    lines += ["", "2. Plan"]
    lines += [f"  {c['field']}: {_show(c['a'])} {ARROW} {_show(c['b'])}" for c in report["plan"]] or ["  identical"]
    src = report["source"]
    lines += ["", f"3. Source: +{src['added']} -{src['removed']} lines in {src['hunks']} hunk(s)"]
    if not stat and src["diff"]:
        lines.append((_colour(src["diff"]) if colour else src["diff"]).rstrip("\n"))
    for change in report.get("header") or ():
        lines.append(f"  header {change['field']}: {change['a'] or '(none)'} {ARROW} {change['b'] or '(none)'}")
    return "\n".join(lines) + "\n" + format_tail(report)


def format_tail(report: dict) -> str:
    """Sections 4 (compiled, when present) and 5 (performance), or nothing."""
    lines = []
    if report.get("compiled") is not None:
        lines += ["", "4. Compiled"]
        for row in report["compiled"]:
            a, b = row["a"], row["b"]
            if "error" in a or "error" in b:
                lines.append(f"  {row['target']}: a {a.get('error', 'ok')}; b {b.get('error', 'ok')}")
                continue
            lines.append(
                f"  {row['target']}: cubin {a['cubin_bytes']:,} {ARROW} {b['cubin_bytes']:,} bytes "
                f"({_delta(a['cubin_bytes'], b['cubin_bytes'])})"
            )
            if a["kernels"] is None or b["kernels"] is None:
                lines.append("    (registers/spills/shared: install nvidia-cuda-cuobjdump)")
                continue
            for ka, kb in pair_kernels(a["kernels"], b["kernels"]):
                parts = []
                for key, name in (("registers", "reg"), ("shared", "smem"),
                                  ("local", "local/spill"), ("stack", "stack")):
                    va, vb = ka.get(key), kb.get(key)
                    delta = _delta(va, vb)
                    parts.append(f"{name} {_num(va)} {ARROW} {_num(vb)}" + (f" ({delta})" if delta else ""))
                la, lb = ka.get("kernel", "(absent)"), kb.get("kernel", "(absent)")
                label = la if la == lb else f"{la} {ARROW} {lb}"
                lines.append(f"    [{label}] " + ", ".join(parts))
                loops_a, loops_b = ka.get("loops"), kb.get("loops")
                if (loops_a or loops_b) and loops_a != loops_b:
                    # The inner loops' schedules (specgen.compile.sass), where they differ.
                    lines.append(f"      loops: {' | '.join(loops_a or ['-'])}")
                    lines.append(f"         {ARROW} {' | '.join(loops_b or ['-'])}")
                mix_a, mix_b = ka.get("loop_mix"), kb.get("loop_mix")
                if (mix_a or mix_b) and mix_a != mix_b:
                    # What one step of each inner loop issues (specgen.compile.sass.loop_mix).
                    lines.append(f"      a step: {' | '.join(describe_mix(m) for m in mix_a or []) or '-'}")
                    lines.append(f"         {ARROW} {' | '.join(describe_mix(m) for m in mix_b or []) or '-'}")
    if report.get("performance"):
        lines += ["", "5. Performance (specgen kernel, from bench/results; ratio above 1: b is faster)"]
        for block in report["performance"]:
            lines.append(f"  {block['device']}, suite {block['suite']}, {block['unit']} "
                         f"(a {block['a_date']}, b {block['b_date']}):")
            for row in block["rows"]:
                ratio = f"{row['ratio']:.2f}×" if row["ratio"] else "n/a"
                if block["unit"] == "µs":
                    a_t = f"{row['a_us']:.1f}" if row["a_us"] else "n/a"
                    b_t = f"{row['b_us']:.1f}" if row["b_us"] else "n/a"
                    lines.append(f"    {row['shape']}: {a_t} {ARROW} {b_t} µs ({ratio})")
                    continue
                a_t = f"{row['a_tflops']:.0f}" if row["a_tflops"] else "n/a"
                b_t = f"{row['b_tflops']:.0f}" if row["b_tflops"] else "n/a"
                lines.append(f"    S={row['seq']}: {a_t} {ARROW} {b_t} ({ratio})")
    return "\n".join(lines) + "\n" if lines else ""


def build_report(a: Side, b: Side, compiled: bool, results_dir: Path) -> dict:
    return {
        "a": a.label,
        "b": b.label,
        "spec": spec_section(a, b),
        "plan": plan_section(a, b),
        "source": source_section(a, b),
        "compiled": compiled_section(a, b, _stderr) if compiled else None,
        "performance": performance_section(a, b, results_dir, _stderr),
    }


def differs(report: dict) -> bool:
    return bool(report["spec"] or report["plan"] or report["source"]["diff"] or report.get("header"))


HEADER_FIELDS = ("version", "spec_path", "spec_sha", "template_sha", "content_sha")


def header_changes(a: str, b: str) -> list[dict]:
    """The header fields (specgen's version, the spec's path, the three hashes) that
    differ between two module texts; a text without a header has none of them. A
    module whose body is unchanged but whose header is not (a template edit that
    renders nothing, a new version) is still out of date: `build --check` says so."""
    match_a, match_b = HEADER_RE.match(a), HEADER_RE.match(b)
    changes = []
    for field in HEADER_FIELDS:
        value_a = match_a[field] if match_a else None
        value_b = match_b[field] if match_b else None
        if value_a != value_b:
            changes.append({"field": field.replace("_sha", "-sha256").replace("_", " "),
                            "a": value_a, "b": value_b})
    return changes


def _json_default(value):
    if value is _ABSENT:
        return None
    raise TypeError(type(value).__name__)


def run_diff(
    paths: list[str],
    sets: list[str],
    templates: bool,
    stat: bool,
    as_json: bool,
    compiled: bool,
    results_dir: Path,
    gen_dir: Path,
) -> int:
    """Exit 0 identical, 1 different, 2 bad input (as diff(1) does)."""
    if templates:
        if sets:
            raise UsageError("specgen diff: --templates re-renders specs as they are; it takes no --set")
        reports = template_reports(paths or ["specs"], gen_dir)
    else:
        if sets and len(paths) != 1:
            raise UsageError("specgen diff: --set takes exactly one spec or module (A)")
        if not sets and len(paths) != 2:
            raise UsageError("specgen diff: give two specs or modules (A B), one with --set key=value, "
                             "or --templates [SPEC...] to compare generated/ with the templates")
        data_a, side_a = load_side(paths[0])
        if sets:
            side_a, side_b = rendered_now(side_a, _stderr), variant_side(data_a, side_a, sets)
        else:
            side_b = load_side(paths[1])[1]
        if compiled and not as_json:
            # The spec, plan and source sections need no compile: print them at once,
            # then the compiled and performance sections when the cubins are built.
            report = build_report(side_a, side_b, False, results_dir)
            colour = sys.stdout.isatty()
            head = format_text({**report, "performance": None}, stat, colour)
            sys.stdout.write(head + "\n4. Compiled\n")
            sys.stdout.flush()
            print("diff: compiling a and b for their targets (cached cubins are instant)...",
                  file=sys.stderr, flush=True)
            report["compiled"] = compiled_section(side_a, side_b, _stderr)
            tail = format_tail(report).split("\n4. Compiled\n", 1)[-1]
            sys.stdout.write(tail)
            return 1 if differs(report) else 0
        reports = [build_report(side_a, side_b, compiled, results_dir)]
    colour = sys.stdout.isatty() and not as_json
    if as_json:
        payload = reports if templates else reports[0]
        sys.stdout.write(json.dumps(payload, indent=2, default=_json_default) + "\n")
    else:
        for report in reports:
            sys.stdout.write(format_text(report, stat, colour))
    return 1 if any(differs(r) for r in reports) else 0


def _spec_of(path: str) -> str:
    """A spec path for --templates: a generated module stands for the spec its
    header names (from the project that holds its folder)."""
    from specgen.compile.jobs import module_text, project_dir
    from specgen.emit.render import module_header

    if not path.endswith(".py"):
        return path
    module = Path(path)
    match = module_header(module_text(module)) if module.is_file() else None
    if match is None:
        raise UsageError(f"specgen diff: --templates takes specs or folders of specs; {path} is "
                         "not a generated module whose header names its spec")
    # The project as a build names it (project_dir): the folder that holds the module's
    # folder as named, a folder that is a symbolic link (generated -> a cache disk) kept.
    spec = project_dir(Path(os.path.abspath(module)).parent) / match["spec_path"]
    if not spec.is_file():
        raise UsageError(f"specgen diff: --templates: {path} was made from {match['spec_path']}, "
                         "which is gone")
    return str(spec)  # (load_jobs names it relative to the working folder where it lies there)


def template_reports(paths: list[str], gen_dir: Path) -> list[dict]:
    """Each spec re-rendered with the installed templates (a checkout's working tree)
    against its module as written in gen_dir."""
    from specgen.compile.jobs import load_jobs, module_text

    reports = []
    for job in load_jobs([_spec_of(path) for path in paths], gen_dir):
        committed = module_text(job.out_path) if job.out_path.is_file() else ""
        a = Side(f"{job.out_path} ({'as written' if job.out_path.is_file() else 'missing'})",
                 job.plan, committed)
        b = Side(f"{job.out_path} (re-rendered with the installed templates)", job.plan,
                 job.rendered.text)
        report = build_report(a, b, compiled=False, results_dir=Path("/nonexistent"))
        report["header"] = header_changes(committed, job.rendered.text)
        reports.append(report)
    return reports

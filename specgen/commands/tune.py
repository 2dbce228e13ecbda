"""`specgen tune`: search a spec's declared config space on the GPU and write the
winners back into the spec's ``targets``.

The space is the spec's ``autotune.<target>`` (tile sizes and compiler hints);
every combination is timed with cuda-tile's ``cuda.tile.tune.exhaustive_search``
at each sequence length of a bench suite. The winner of the longest length
becomes the target's own config; a shorter length whose winner beats it by at
least ``min_gain`` gets a ``by_seq_k`` bucket. Every winner is checked against
the fp64 reference before it is written. The spec is edited in place with
ruamel.yaml, so comments, key order and the rest of the file survive; the edited
text is validated before it replaces the file, and the generated module is
re-rendered. The launcher then picks the config by device and key length, with
no search at call time.
"""

from __future__ import annotations

import datetime
import io
import itertools
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from specgen.errors import SpecError, UsageError
from specgen.spec import (
    HINT_DEFAULTS,
    HINT_FIELDS,
    TUNABLE_FIELDS,
    AutotuneSpace,
    Spec,
    TargetConfig,
    compact_config,
    parse_spec_text,
    read_spec_text,
    spec_to_dict,
    validate_spec,
)


def launch_grid(plan, config: dict, seq_q: int, batch_heads: int, sm_count: int) -> tuple[int, int, int]:
    """The prefill kernel's grid for a launch config, as the generated launcher
    computes it: query tiles x (batch, head) in the config's tile order, a 1-D grid
    of work items where the plan loops over them (persistent: one wave), and with
    pack_gqa tiles of tile_m / gqa_ratio positions over (batch, KV head)."""
    if plan.pack_gqa:
        batch_heads //= plan.group_size
    tiles = math.ceil(seq_q / plan.map_rows(config["tile_m"]))
    if plan.persistent_loop:
        work = tiles * batch_heads
        return (min(work, sm_count * config["occupancy"]) if config.get("persistent") else work, 1, 1)
    if config.get("tile_order") == "global":
        return (batch_heads, tiles, 1)
    return (tiles, batch_heads, 1)


# The longest length --seqs and a variants file take: far past one GPU's memory at
# the suites' B4 Hq32, and within the kernels' int32 positions.
MAX_SEQ = 1 << 20


def parse_seqs(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    parts = [part.strip() for part in text.split(",")]
    # Plain decimal digits (int() would also take "1_024", "+8" and "²"), no empty items.
    seqs = sorted({int(part) for part in parts}) if all(
        re.fullmatch(r"[0-9]{1,8}", part) for part in parts) else []
    if not seqs or seqs[0] < 1 or seqs[-1] > MAX_SEQ:
        raise UsageError(f"--seqs: expected comma-separated lengths in [1, {MAX_SEQ}] like "
                         f"2048,8192, got {text!r}")
    return seqs


@dataclass(frozen=True)
class Timed:
    config: dict  # tile_m, tile_n and the hint fields (None: auto)
    mean_us: float


def config_key(config: dict) -> tuple:
    return tuple(config.get(name) for name in TUNABLE_FIELDS)


def search_space(space: AutotuneSpace, q_subtiles: int = 1) -> list[dict]:
    """Every combination of the space, minus those the kernel cannot take."""
    values = [getattr(space, name) for name in TUNABLE_FIELDS]
    configs = []
    for combo in itertools.product(*values):
        config = dict(zip(TUNABLE_FIELDS, combo))
        if config["tile_m"] // q_subtiles < 16:
            continue
        configs.append(config)
    return configs


def launch_key(config: dict, v_default: bool) -> tuple:
    """What a config launches: its null fields read as the kernel reads them (opt_level
    null is 3, persistent null is false, v_transposed null is the spec's default), so
    that two configs that launch the same kernel the same way have one key."""
    read = {**config, "opt_level": HINT_DEFAULTS["opt_level"] if config.get("opt_level") is None
            else config["opt_level"],
            "persistent": bool(config.get("persistent")),
            "v_transposed": v_default if config.get("v_transposed") is None else config["v_transposed"]}
    return config_key(read)


def distinct_launches(configs: list[dict], v_default: bool) -> list[dict]:
    """The configs without those that launch what an earlier one launches (a space
    with ``persistent: [null, false]`` would time each launch twice, and could keep a
    bucket of the own config's launch under another spelling)."""
    seen, kept = set(), []
    for config in configs:
        key = launch_key(config, v_default)
        if key not in seen:
            seen.add(key)
            kept.append(config)
    return kept


def finalists(timed: list[Timed], count: int, own: Optional[dict]) -> list[dict]:
    """The configs re-timed the way ``specgen bench`` times: the ``count`` fastest
    by the search's mean, plus ``own`` (the longest length's winner, so that
    ``choose`` can weigh a bucket against it) where it ran at this length."""
    ranked = [t.config for t in sorted(timed, key=lambda t: t.mean_us)]
    picked = ranked[:count]
    if own is not None and config_key(own) not in {config_key(c) for c in picked}:
        picked += [c for c in ranked if config_key(c) == config_key(own)]
    return picked


def describe(config: dict) -> str:
    text = f"{config['tile_m']}x{config['tile_n']} occ{config['occupancy']}"
    for name, short in (("num_ctas", "ctas"), ("num_worker_warps", "ww"), ("opt_level", "O")):
        if config.get(name) is not None:
            text += f" {short}{config[name]}"
    if config.get("tile_order") == "global":
        text += " global"
    if config.get("v_transposed") is not None:
        text += " vT" if config["v_transposed"] else " vN"
    if config.get("persistent"):
        text += " persistent"
    return text


def choose(
    results: dict[int, list[Timed]], *, seq_buckets: bool, min_gain: float
) -> tuple[dict, list[dict]]:
    """The target's own config and its by_seq_k buckets from timings per length.

    The longest length's winner is the target's own config. Each shorter length
    keeps its own winner only if that beats the own config, timed at that
    length, by at least ``min_gain``; otherwise it uses the own config too. Runs
    of lengths with one config become one bucket (max_seq_k: the run's longest
    length), and the run that ends at the longest length is the own config.
    """
    if not results:
        raise ValueError("no timings")
    seqs = sorted(results)
    best = {s: min(results[s], key=lambda t: t.mean_us) for s in seqs}
    own = best[seqs[-1]].config
    if not seq_buckets:
        return own, []
    picked = []
    for seq in seqs:
        winner = best[seq].config
        own_here = next((t for t in results[seq] if config_key(t.config) == config_key(own)), None)
        if own_here is not None and best[seq].mean_us > own_here.mean_us * (1 - min_gain):
            winner = own  # not worth a bucket: the own config is within min_gain
        picked.append((seq, winner))
    buckets: list[dict] = []
    for seq, config in picked:
        if buckets and config_key(buckets[-1]) == config_key(config):
            buckets[-1]["max_seq_k"] = seq
        else:
            buckets.append({"max_seq_k": seq, **config})
    buckets.pop()  # the last run ends at the longest length: the own config
    return own, buckets


def _clean(config: dict) -> dict:
    """A config as the spec writes it (occupancy kept)."""
    return compact_config(config)


def _detach_tail(targets, target: str) -> Optional[tuple[str, object, str, object]]:
    """Take the comments that end ``targets.<target>`` out of the tree. ruamel.yaml
    keeps the text after a node (its end-of-line comment, then the blank lines and
    comments before the next key, or the end of the file) on the node's last value,
    so it would go with a key or bucket that tuning replaces. Returns (eol, owner,
    rest, mark) or None: the end-of-line comment, where it was (``"entry"``: the
    target's own line, a key of the target, or None: inside a bucket), the lines
    after, and the comment's position (its column is kept)."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    collection = (CommentedMap, CommentedSeq)
    entry = targets[target]
    path = [(targets.ca.items.get(target), 2, "entry"), (entry.ca.comment, 0, "entry")]
    end = []  # comments at the end of the file hang on the collections they end
    node, owner = entry, "entry"
    while isinstance(node, collection) and len(node):
        end += node.ca.end or []
        node.ca.end = []
        last = list(node)[-1] if isinstance(node, CommentedMap) else len(node) - 1
        owner = last if node is entry else None
        path.append((node.ca.items.get(last), 2 if isinstance(node, CommentedMap) else 0, owner))
        node = node[last]
        if isinstance(node, collection):
            path.append((node.ca.comment, 0, owner))
    found = [(holder, i, who) for holder, i, who in path
             if holder and len(holder) > i and holder[i] is not None]
    eol, owner, rest, mark = "", None, "", None
    if found:
        holder, i, _ = found[-1]  # the deepest: the one the text after the entry is on
        token = holder[i]
        mark = token.start_mark
        owner = next(who for holder, i, who in found if holder[i] is token)
        for holder, i, _ in found:
            if holder[i] is token:
                holder[i] = None
        if token.value.startswith("#"):
            eol, _, rest = token.value.partition("\n")
        else:
            rest = token.value[1:]
    rest += "".join(token.value for token in end)
    return (eol, owner, rest, mark) if eol or rest else None


def _attach_tail(targets, target: str, tail: tuple[str, object, str, object]) -> None:
    """Put the comments ``_detach_tail`` took back: the end-of-line comment on the
    target's line or on its key (dropped with a key or bucket that is gone), the lines
    after it after the target's new last line."""
    from ruamel.yaml.comments import CommentedSeq
    from ruamel.yaml.error import CommentMark
    from ruamel.yaml.tokens import CommentToken

    eol, owner, rest, mark = tail

    def token(value, at=mark):
        return CommentToken(value, at or CommentMark(0), None)

    entry = targets[target]
    keys = list(entry)
    if owner == "entry" and not entry.fa.flow_style():
        if eol:  # the one-line target's comment, now on its key's line
            targets.ca.items.setdefault(target, [None, None, None, None])[2] = token(
                eol + "\n", CommentMark(0))
        eol = ""
    elif owner != "entry":
        if eol and owner in keys[:-1]:
            entry.ca.items.setdefault(owner, [None, None, None, None])[2] = token(eol + "\n")
        if owner is None or owner != keys[-1]:
            eol = ""
    if not (eol or rest):
        return
    value = eol + "\n" + rest
    if entry.fa.flow_style():
        targets.ca.items.setdefault(target, [None, None, None, None])[2] = token(value)
    elif isinstance(entry[keys[-1]], CommentedSeq) and len(entry[keys[-1]]):
        seq = entry[keys[-1]]
        seq.ca.items.setdefault(len(seq) - 1, [None, None, None, None])[0] = token(value)
    else:
        entry.ca.items.setdefault(keys[-1], [None, None, None, None])[2] = token(value)


class _Null:
    """A null as the file spells it (``null``, ``~``, ``Null`` or nothing): ruamel.yaml
    reads every one as None and writes None as nothing, which changed every
    ``window: null`` of a tuned file."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _round_trip_yaml(text: str):
    """ruamel.yaml in round-trip mode for ``text``: nulls kept as written, and block
    sequences indented as the text indents them (ruamel.yaml re-indents every one)."""
    from ruamel.yaml import YAML
    from ruamel.yaml.constructor import RoundTripConstructor
    from ruamel.yaml.representer import RoundTripRepresenter

    class Constructor(RoundTripConstructor):  # subclasses: the library's own stay as they are
        pass

    class Representer(RoundTripRepresenter):
        pass

    Constructor.add_constructor("tag:yaml.org,2002:null", lambda self, node: _Null(node.value))
    Representer.add_representer(
        _Null, lambda self, data: self.represent_scalar("tag:yaml.org,2002:null", data.text))
    yaml = YAML()  # round-trip mode
    yaml.Constructor, yaml.Representer = Constructor, Representer
    yaml.preserve_quotes = True
    yaml.width = 100
    from ruamel.yaml.util import load_yaml_guess_indent

    try:
        _, sequence, offset = load_yaml_guess_indent(text)
    except Exception:  # the load that follows names what is wrong
        sequence = offset = None
    if offset is None:  # no block sequence: as the shipped specs write them
        sequence, offset = 4, 2
    yaml.indent(mapping=2, sequence=sequence, offset=offset)
    return yaml


def _words(line: str) -> str:
    """A line with the spaces between its words made one (its indentation kept)."""
    return line[:len(line) - len(line.lstrip())] + " ".join(line.split())


_KEY_RE = re.compile(r"(\s*[\w.-]+:)( +)(?=\S)")


def _key_spacing(old: str, new: str) -> str:
    """``new``, whose value differs from ``old``'s, with the spaces after its key
    that ``old`` has (the tuned target's own line keeps its alignment)."""
    a, b = _KEY_RE.match(old), _KEY_RE.match(new)
    if a and b and a.group(1) == b.group(1) and a.group(2) != b.group(2):
        return a.group(0) + new[b.end():]
    return new


def _keep_spacing(old: str, new: str) -> str:
    """``new`` (ruamel.yaml's dump of ``old`` with a target changed) with each line
    that differs from its line in ``old`` only in the spaces between words written
    as ``old`` writes it: ruamel.yaml writes one space after a colon, which lost the
    spaces that align the values of ``sm_90:   {...}`` under ``sm_100: {...}``. Where
    the result would read as other data than ``new`` (never seen; a safeguard, since
    a quoted value's inner spaces matter), ``new`` as it is."""
    import difflib

    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, [_words(x) for x in a], [_words(y) for y in b], autojunk=False)
    lines = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":  # the same words: the line as the file wrote it
            lines += a[i1:i2]
        elif tag == "replace" and i2 - i1 == j2 - j1:
            lines += [_key_spacing(x, y) for x, y in zip(a[i1:i2], b[j1:j2])]
        else:
            lines += b[j1:j2]
    kept = "".join(lines)
    if kept == new:
        return new
    from specgen.spec import parse_spec_text

    try:
        same = parse_spec_text(kept) == parse_spec_text(new)
    except SpecError:
        same = False
    return kept if same else new


def write_back(text: str, path: str, target: str, own: dict, buckets: list[dict]) -> str:
    """The spec text with ``targets.<target>`` set to the tuned config.

    Comments, key order and formatting elsewhere are kept (ruamel.yaml round
    trip); the target's existing mapping is updated in place, so a comment on it
    survives too, and so does its style: a block mapping without buckets stays one;
    a target with buckets is a block, and one without is one line, as the shipped
    specs write them. A key whose value does not change is left as written, and the
    comments and blank lines after the target stay after it. The result is
    validated before it is returned.
    """
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    yaml = _round_trip_yaml(text)
    data = yaml.load(text)
    if not isinstance(data, CommentedMap):
        raise UsageError(f"{path}: the spec is not a mapping")
    targets = data.get("targets")
    if targets is None or isinstance(targets, _Null):
        targets = CommentedMap()
        data["targets"] = targets
    new = _clean(own)
    entry = targets.get(target)
    existed = isinstance(entry, CommentedMap)
    # A block mapping the user wrote stays one; one that holds buckets (as tune writes
    # them) goes back to one line without them.
    block = existed and not entry.fa.flow_style() and "by_seq_k" not in entry
    tail = _detach_tail(targets, target) if existed else None
    if not existed:
        entry = CommentedMap()
        targets[target] = entry
    for key in list(entry):
        # A key the tuned config leaves out is deleted, unless it says what the tuned
        # config means (tile_order: per_head, a null hint).
        written = None if isinstance(entry[key], _Null) else entry[key]
        if key not in new and key != "by_seq_k" and not (key in own and written == own[key]):
            del entry[key]
    for key, value in new.items():
        if key not in entry or entry[key] != value or type(entry[key]) is not type(value):
            entry[key] = value
    if "by_seq_k" in entry:
        del entry["by_seq_k"]  # replaced, after the target's own fields
    if buckets:
        seq = CommentedSeq()
        for bucket in buckets:
            item = CommentedMap(_clean(bucket))
            item.fa.set_flow_style()
            seq.append(item)
        entry["by_seq_k"] = seq
    # A comment inside a mapping would break its one line: such a target stays a block.
    inside = [entry.ca.comment] + list(entry.ca.items.values())
    if buckets or block or any(item for holder in inside if holder for item in holder):
        entry.fa.set_block_style()
    else:
        entry.fa.set_flow_style()
    if tail is not None:
        _attach_tail(targets, target, tail)
    out = io.StringIO()
    yaml.dump(data, out)
    new_text = _keep_spacing(text, out.getvalue())
    from specgen.spec import parse_spec_text, validate_spec

    try:
        validate_spec(parse_spec_text(new_text, path), path)
    except SpecError as exc:  # a tuned value the spec rejects is a bug: keep the file
        raise UsageError("tune produced an invalid spec, file left unchanged: "
                         + "; ".join(exc.lines())) from None
    return new_text


def _valid_targets(spec: Spec, path, target: str, configs: list[dict], log) -> list[dict]:
    """The configs the spec takes as its ``targets.<target>`` (the rules between a
    target and the spec's features: pack_gqa's rows, block_sparse's launches, ...),
    checked before a GPU is asked for; UsageError where none is."""
    from specgen.spec import validate_spec

    data = spec_to_dict(spec)
    kept, problem = [], None
    for config in configs:
        trial = {**data, "targets": {**data["targets"], target: _clean(config)}}
        try:
            validate_spec(trial, path)
        except SpecError as exc:
            problem = problem or exc.lines()[0].split(": ", 1)[-1]
            continue
        kept.append(config)
    if not kept:
        raise UsageError(f"{path}: autotune.{target}: no config of the space is a valid target "
                         f"({problem})")
    if len(kept) < len(configs):
        log(f"autotune.{target}: {len(configs) - len(kept)} of {len(configs)} configs skipped, "
            f"not valid targets of this spec (first: {problem})")
    return kept


# --- GPU side ---------------------------------------------------------------------


def _hints(config: dict) -> dict:
    """Every kernel option, null ones reset to their defaults (the decorator's
    per-target values must not leak into another config)."""
    return {name: HINT_DEFAULTS[name] if config.get(name) is None else config[name]
            for name in HINT_FIELDS}


def rewrite_spec_file(path: Path, rewrite: Callable[[str], str], expected: Optional[bytes] = None,
                      kept: str = "") -> bool:
    """Replace a spec file's text by ``rewrite(text)`` (given and returning "\n" line
    ends), keeping the file's byte-order mark and line endings; atomically, and only
    on a change. Returns whether the file changed. ``expected``: the bytes the file
    must still hold (as the search read them), else UsageError ending in ``kept``."""
    from specgen.compile.export import atomic_write

    data = path.read_bytes()
    if expected is not None and data != expected:
        raise UsageError(f"{path}: changed since tune read it, so the configs searched for the old "
                         f"spec were not written into it{kept}")
    raw = data.decode("utf-8")
    bom = "\ufeff" if raw.startswith("\ufeff") else ""
    newline = "\r\n" if "\r\n" in raw else "\n"
    text = raw[len(bom):].replace("\r\n", "\n")
    new_text = rewrite(text)
    if new_text == text:
        return False
    atomic_write(path, (bom + new_text.replace("\n", newline)).encode("utf-8"))
    return True


def run_tune(
    path: Path,
    target: str,
    suite: str,
    out_dir: Path,
    gen_dir: Path,
    *,
    seqs: Optional[list[int]] = None,
    dry_run: bool = False,
    confirm: int = 4,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> int:
    from specgen.bench.core import tflops
    from specgen.bench.flops import forward_flops
    from specgen.bench.prefill import BATCH, HEADS, SEQS, suite_heads
    from specgen.compile.jobs import hand_edited_file, load_jobs, module_path, refuse_foreign_modules, write_jobs
    from specgen.check.cases import (
        Comparison,
        compare,
        feature_inputs,
        poisoned_out,
        random_qkv,
        shape_dims,
        smoke_case,
    )
    from specgen.compile.export import atomic_write, load_module_from_source
    from specgen.check.gpu import device_info, device_slug, require_cuda, require_do_bench
    from specgen.plan.make import default_v_transposed, make_plan
    from specgen.emit.render import render

    # Read once: the search is for this text, and is written back only into it.
    text = read_spec_text(path)
    spec: Spec = validate_spec(parse_spec_text(text, path), path)
    if spec.family != "prefill":
        raise UsageError(f"{path}: tune searches prefill specs; set a decode spec's tile_n and "
                         "occupancy by hand and compare with specgen bench --suite decode")
    if spec.varlen:
        raise UsageError(f"{path}: tune times [B, H, S, D] batches; a varlen spec is not supported "
                         "yet (tune a copy with varlen: false and paste its targets)")
    space = spec.autotune.get(target)
    if space is None:
        declared = ", ".join(spec.autotune) or "none"
        raise UsageError(
            f"{path}: autotune.{target}: no search space for {target} (declared: {declared}); "
            f"add e.g. autotune: {{{target}: {{tile_m: [64, 128], tile_n: [64, 128]}}}}"
        )
    configs = search_space(space, spec.q_subtiles)
    if not configs:
        raise UsageError(f"{path}: autotune.{target}: no config fits q_subtiles {spec.q_subtiles}")
    if len(configs) < space.size():
        log(f"autotune.{target}: {space.size() - len(configs)} of {space.size()} configs skipped, "
            f"tile_m / q_subtiles {spec.q_subtiles} below 16 rows")
    v_default = default_v_transposed(spec)
    distinct = distinct_launches(configs, v_default)
    if len(distinct) < len(configs):
        log(f"autotune.{target}: {len(configs) - len(distinct)} of {len(configs)} configs skipped, "
            "the same launch as an earlier one (null opt_level is 3, null persistent is false, "
            f"null v_transposed is {str(v_default).lower()})")
    configs = _valid_targets(spec, path, target, distinct, log)
    batch, heads, suite_seqs = BATCH, HEADS, SEQS
    seqs = sorted(seqs or suite_seqs)
    heads = suite_heads(heads, spec.gqa_ratio)

    # A hand-edited module would be refused after the search, with the spec already
    # rewritten: refuse it before anything runs.
    generated = module_path(gen_dir, spec.name)
    if not dry_run and hand_edited_file(generated):
        raise UsageError(f"{generated}: edited by hand; tune would not overwrite it (move it "
                         "away, or run specgen build --force first, or use --dry-run)")
    # So would another spec's module of this name (a copied spec that kept its name:),
    # which the re-render would replace, as build refuses to.
    if not dry_run:
        refuse_foreign_modules(load_jobs([str(path)], gen_dir),
                               "replace it with `specgen build --force` first, or use --dry-run")
    plan_line = (f"tuning {spec.name} for {target}: {len(configs)} configs x {len(seqs)} lengths "
                f"(B={batch}, Hq={heads}, S={','.join(map(str, sorted(seqs, reverse=True)))})")
    if dry_run:
        # What will be searched, in its order, before the GPU is asked for: --dry-run
        # shows the space, its size and the lengths on any machine.
        log(plan_line)
        for config in configs:
            log(f"  {describe(config)}")
    # The spec is rewritten through a temporary file beside it (beside its target, for
    # a link): a folder that cannot be written would fail only after the search.
    folder = Path(os.path.realpath(path)).parent
    if not dry_run and not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: tune rewrites the spec, and its folder {folder} is not "
                         "writable (use --dry-run, or tune a copy)")
    torch = require_cuda("tune")
    import cuda.tile as ct
    from cuda.tile.tune import exhaustive_search
    do_bench = require_do_bench("tune")

    device = device_info()
    if device["sm"] != target:
        raise UsageError(f"--target {target}: this GPU is {device['name']} ({device['sm']}); "
                         f"tune on a {target} device")
    log(f"device: {device['name']} ({device['sm']})" + ("" if dry_run else f"; {plan_line}"))

    # One kernel for both tile orders when the space has "global".
    # And one kernel for both V layouts when the space asks for a transposed V.
    v_choices = {v_default if v is None else v for v in space.v_transposed}
    # And one kernel in the work-item loop form when the space has persistent launches.
    plan = make_plan(spec, tile_order_param=space.tile_order != ["per_head"],
                     v_layout_param=True in v_choices,
                     persistent_loop=True in space.persistent)
    source = render(plan, path.as_posix()).text
    module = load_module_from_source(f"{spec.name}_tune", source, f"{spec.name}_tune.py")
    kernel = getattr(module, plan.kernel_name)
    spec_dict = spec_to_dict(spec)
    kv_heads, d = heads // spec.gqa_ratio, spec.head_dim
    scale = 1.0 / math.sqrt(d)
    stream = torch.cuda.current_stream()

    def kernel_args(q, k, v, out, config, extra, q_offset=0):
        """The launch arguments, in the order of the plan's parameter list;
        ``extra``: sinks and hook tensors (feature_inputs)."""
        v_t = v_default if config.get("v_transposed") is None else config["v_transposed"]
        v_arg = module.transposed_v(v) if v_t else v  # as the launcher passes it
        values = {"q": q, "k": k, "v": v_arg, "out": out, "scale": scale,
                  "q_offset": q_offset, "v_transposed": v_t,
                  "tile_m": config["tile_m"], "tile_n": config["tile_n"],
                  "even_n": k.shape[2] % config["tile_n"] == 0,
                  "tiles_outer": config["tile_order"] == "global"}
        if plan.sinks:
            values["sinks"] = extra["sinks"].float()
        if plan.return_lse:
            values["lse"] = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        for name, _, _, _ in plan.extra_tensors:
            values[f"tensor:{name}"] = extra[name].contiguous()
        if plan.fp8:
            values["descales"] = torch.tensor([extra["q_descale"], extra["k_descale"], extra["v_descale"]],
                                              dtype=torch.float32, device="cuda")
        if plan.dropout:
            from specgen.check.reference import dropout_threshold

            p = extra["dropout_p"]
            values.update(dropout_threshold=dropout_threshold(p), dropout_scale=2**16 / (2**16 - dropout_threshold(p)),
                          seed=extra["seed"])
        if plan.block_sparse:
            block_map = map_for(q, k, config, extra, q_offset)
            values.update(map_counts=block_map.counts, map_indices=block_map.indices)
        return tuple(values[param.role] for param in plan.params)

    # A block-sparse kernel walks a map made for its tiles: one per tile shape and
    # inputs, built before the config is timed (a model builds it once per batch).
    maps: dict[tuple, object] = {}

    def map_for(q, k, config, extra, q_offset):
        key = (id(q), q_offset, config["tile_m"], config["tile_n"])
        if key not in maps:
            tensors = {name: extra[name] for name in module.SPEC["tensors"]}
            maps[key] = module._block_map(tensors, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q_offset,
                                          q.device, (plan.map_rows(config["tile_m"]), config["tile_n"]))
        return maps[key]

    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def grid(config, seq_q, batch_heads):
        return launch_grid(plan, config, seq_q, batch_heads, sm_count)

    results: dict[int, list[Timed]] = {}
    report: dict = {"spec": spec.name, "target": target, "suite": suite,
                    "created": datetime.date.today().isoformat(), "device": device,
                    "batch": batch, "heads_q": heads, "space": space.model_dump(mode="json"),
                    "confirm": confirm, "lengths": []}
    variants: dict[tuple, object] = {}

    def variant(config):
        key = config_key(config)
        if key not in variants:  # made once: a kernel object owns its JIT cache
            variants[key] = kernel.replace_hints(**_hints(config))
        return variants[key]

    own = None
    # Longest first: its winner is the own config, re-timed at every shorter length.
    for seq in sorted(seqs, reverse=True):
        q, k, v = random_qkv(spec_dict, batch, kv_heads, seq, seq)
        out = poisoned_out(spec_dict, q, v)
        extra = feature_inputs(spec_dict, shape_dims(q, k))
        maps.clear()  # the previous length's maps (keyed by its q, now freed)
        log(f"[S={seq}] searching {len(configs)} configs")
        result = exhaustive_search(
            configs, stream,
            grid_fn=lambda c: grid(c, seq, batch * heads),
            kernel=kernel,
            args_fn=lambda c: kernel_args(q, k, v, out, c, extra),
            hints_fn=_hints,
            quiet=True,
        )
        flops = forward_flops(plan, batch, heads, seq, seq)
        searched = [Timed(m.config, m.mean_us) for m in result.successes]
        if result.failures:
            log(f"[S={seq}]   {len(result.failures)} configs failed, e.g. "
                f"{describe(result.failures[0][0])}: {result.failures[0][1].__name__}")
        length = {
            "seq": seq,
            "measurements": [{"config": m.config, "mean_us": m.mean_us,
                              "error_margin_us": m.error_margin_us,
                              "tflops": tflops(flops, m.mean_us / 1000)}
                             for m in sorted(result.successes, key=lambda m: m.mean_us)],
            "failures": [{"config": c, "error": f"{t.__name__}: {msg.splitlines()[0] if msg else ''}"[:300]}
                         for c, t, msg in result.failures],
        }
        if confirm and searched:
            # The search's means rank; the choice uses the bench's own measure
            # (do_bench median), so tune and `specgen bench` agree on the winner.
            timed = []
            for config in finalists(searched, confirm, own):
                launch = variant(config)
                grid_c, args_c = grid(config, seq, batch * heads), kernel_args(q, k, v, out, config, extra)
                ms = do_bench(lambda: ct.launch(stream, grid_c, launch, args_c),
                              warmup=25, rep=200, return_mode="median")
                timed.append(Timed(config, ms * 1000))
            length["confirmed"] = [{"config": t.config, "median_us": t.mean_us,
                                    "tflops": tflops(flops, t.mean_us / 1000)}
                                   for t in sorted(timed, key=lambda t: t.mean_us)]
        else:
            timed = searched
        results[seq] = timed
        for t in sorted(timed, key=lambda t: t.mean_us)[:5]:
            log(f"[S={seq}]   {describe(t.config):28s} {t.mean_us:9.1f} us "
                f"{tflops(flops, t.mean_us / 1000):6.0f} TFLOPS"
                + (" (do_bench median)" if confirm else ""))
        if own is None and timed:
            own = min(timed, key=lambda t: t.mean_us).config
        report["lengths"].insert(0, length)
        del q, k, v, out

    # Correctness before anything is written: a ragged chunked-prefill shape.
    case = smoke_case(spec_dict)
    maps.clear()
    checked: dict[tuple, Comparison] = {}

    def correct(config: dict) -> bool:
        key = config_key(config)
        if key not in checked:
            out = poisoned_out(spec_dict, case.q, case.v)
            ct.launch(stream, grid(config, case.q.shape[2], case.q.shape[0] * case.q.shape[1]), variant(config),
                      kernel_args(case.q, case.k, case.v, out, config, case.extra, case.q_offset))
            torch.cuda.synchronize()
            checked[key] = compare(out, case.ref, spec.dtype)
            log(f"check {describe(config)}: max rel err {checked[key].rel_err:.2e}")
        return checked[key].ok

    # Only the chosen configs are checked; a wrong one is dropped and the choice redone.
    while True:
        results = {s: r for s, r in results.items() if r}
        if not results:
            log("no config ran correctly; the spec is unchanged")
            return 1
        own, buckets = choose(results, seq_buckets=space.seq_buckets, min_gain=space.min_gain)
        wrong = [c for c in [own, *buckets] if not correct(c)]
        if not wrong:
            break
        bad = {config_key(c) for c in wrong}
        results = {s: [t for t in r if config_key(t.config) not in bad] for s, r in results.items()}
    report["chosen"] = {"own": own, "by_seq_k": buckets, "checked": {
        describe(dict(zip(TUNABLE_FIELDS, key))): c.rel_err for key, c in checked.items()}}

    slug = device_slug(device["name"])
    report_path = out_dir / slug / f"tune-{spec.name}-{target}.json"
    report_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(report_path, (json.dumps(report, indent=2) + "\n").encode())
    log(f"wrote {report_path}")

    summary = f"{target}: {describe(own)}" + "".join(
        f"; seq_k <= {b['max_seq_k']}: {describe(b)}" for b in buckets)
    print(summary)
    if dry_run:
        log("--dry-run: the spec is unchanged")
        return 0
    tuned = TargetConfig.model_validate({**_clean(own), "by_seq_k": [_clean(b) for b in buckets]})
    current = spec.targets.get(target)
    changed = current != tuned and rewrite_spec_file(
        path, lambda now: write_back(now, str(path), target, own, buckets), expected=text.encode("utf-8"),
        kept=f"; the choice is in {report_path} (run tune again, or copy it into targets.{target})")
    if not changed:
        log(f"{path}: unchanged (already tuned to these configs)")
    else:
        log(f"{path}: targets.{target} updated")
    jobs = load_jobs([str(path)], gen_dir)
    refused = write_jobs(jobs, gen_dir, force=False, log=log)
    if refused:
        raise UsageError("; ".join(refused))
    return 0

"""Loading a spec: strict YAML (no duplicate keys, size-capped), validation with
one line per problem, and the spec as plain data (``spec_to_dict``)."""

from __future__ import annotations

import json
import math
import re
import stat
import sys
import types
import typing
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ValidationError

from specgen.errors import SpecError, shortened
from specgen.spec.fields import MAX_SPEC_BYTES, Problems, TargetConfig
from specgen.spec.model import Spec, other_family_fields

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one, and
    aliases: a spec is short, and nested aliases expand exponentially (a few
    hundred bytes of "billion laughs" would hold the validator for minutes)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None,
                f"alias *{event.anchor}: YAML aliases are not allowed in a spec; write the value out",
                event.start_mark,
            )
        return super().compose_node(parent, index)


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep=False):
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # YAML 1.1's `<<`, gone from 1.2
            raise yaml.constructor.ConstructorError(
                None, None, "merge keys (<<) are not allowed in a spec; write the keys out",
                key_node.start_mark)
    loader.flatten_mapping(node)
    seen = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            # `? [a, b]` or `{[a]: 1}`: a spec's keys are names (a list or mapping as
            # a key cannot be hashed, let alone name a field).
            kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
            raise yaml.constructor.ConstructorError(
                None, None, f"a {kind} cannot be a mapping key; keys are plain names",
                key_node.start_mark,
            )
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str):  # 1, true, null: a spec's keys are all names
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a name, got "
                f"{shortened(key_node.value or 'null')!r} (quote it if it is one)", key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {shortened(key)!r} (first at line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)

# Numbers as YAML 1.2's core schema reads them, not YAML 1.1's (PyYAML's default):
# 1.1 reads `0200` as octal 128, `2:08` as base 60 (128), and takes `0x80` and
# `1_28`, while it leaves `5e1` a string. Here an integer is plain decimal with an
# optional sign and no leading zero (`0200` stays a string, so it is refused as one
# rather than read as 200 or 128), and a float is the 1.2 form (`5e1`, `1.5e-3`,
# `.5`, `.inf`, `.nan`); anything else is a string and gets the field's type error.
# Booleans are 1.2's too: `true`/`false` (any of three casings); YAML 1.1's `yes`,
# `no`, `on`, `off` and `y` stay strings, so `causal: on` is refused, not read as true.
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_BOOL_TAG = "tag:yaml.org,2002:bool"
# Dates are not 1.2 core either: `2001-12-14` stays a string.
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in (_INT_TAG, _FLOAT_TAG, _BOOL_TAG, _TIMESTAMP_TAG)
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_FLOAT_RE = re.compile(r"^(?:[-+]?(?:(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_DECIMAL_RE = re.compile(r"[-+]?[0-9]+")  # what an explicit !!int (or !!float) may be
_UniqueKeyLoader.add_implicit_resolver(_BOOL_TAG, _BOOL_RE, list("tTfF"))
_UniqueKeyLoader.add_implicit_resolver(
    _INT_TAG, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))
_UniqueKeyLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def _construct_int(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> int:
    # Decimal only, also for an explicit !!int (YAML 1.1's octal, hex and base 60 are gone).
    text = loader.construct_scalar(node)
    if not _DECIMAL_RE.fullmatch(text):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a decimal integer", node.start_mark)
    return int(text)


_UniqueKeyLoader.add_constructor(_INT_TAG, _construct_int)

def _construct_float(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> float:
    # An explicit !!float in 1.2's form only, or a decimal integer (1.1's base 60
    # `1:30` and `1_0` are gone).
    text = loader.construct_scalar(node)
    # fullmatch: the patterns' $ also matches before a final line break ("5e1\n" of a
    # block scalar, `!!float |`).
    if not (_FLOAT_RE.fullmatch(text) or _DECIMAL_RE.fullmatch(text)):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a number", node.start_mark)
    return loader.construct_yaml_float(node)


def _construct_bool(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> bool:
    # An explicit !!bool in 1.2's form only: true or false (not yes, on, y).
    text = loader.construct_scalar(node)
    # fullmatch: `!!bool |` reads "true\n", which a match would take and compare
    # unequal to "true", making it false.
    if not _BOOL_RE.fullmatch(text):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not true or false", node.start_mark)
    return text.lower() == "true"


_NULL_RE = re.compile(r"~|null|Null|NULL|")


def _construct_null(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> None:
    # An explicit !!null of a null only: PyYAML's reads `!!null 50` as null.
    text = loader.construct_scalar(node)
    if not _NULL_RE.fullmatch(text):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not null", node.start_mark)


def _refuse_tag(loader: _UniqueKeyLoader, node: yaml.Node):
    raise yaml.constructor.ConstructorError(
        None, None, f"the tag {node.tag.replace('tag:yaml.org,2002:', '!!')} is not allowed in a spec",
        node.start_mark)


_UniqueKeyLoader.add_constructor(_FLOAT_TAG, _construct_float)
_UniqueKeyLoader.add_constructor(_BOOL_TAG, _construct_bool)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:null", _construct_null)
for _tag in ("timestamp", "binary", "set", "omap", "pairs"):
    _UniqueKeyLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _refuse_tag)
# Any other tag (`!!python/object:...`, a local `!foo`): the same line, instead of
# PyYAML's "could not determine a constructor for the tag 'tag:yaml.org,2002:...'".
_UniqueKeyLoader.add_constructor(None, _refuse_tag)


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML/JSON terms, shortened."""
    if isinstance(value, float) and not math.isfinite(value):  # JSON's Infinity is no YAML
        return ".nan" if math.isnan(value) else "-.inf" if value < 0 else ".inf"
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return shortened(text)


_PLAIN_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")


def _field_path(loc: tuple) -> str:
    parts = []
    for item in loc:
        if item == "[key]":  # pydantic's marker for a bad mapping key
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            # A key the user wrote that is not a plain name (empty, spaces, a dot, a
            # line break, thousands of characters) is quoted and shortened as a value is.
            key = str(item)
            if not _PLAIN_KEY_RE.fullmatch(key) or len(key) > 80:
                key = _show(key)
            parts.append(("." if parts else "") + key)
    return "".join(parts)


def _unwrap(annotation: Any) -> Any:
    """The type inside Annotated[...] and Optional[...] (a union of one type and None)."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
            continue
        if origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(members) == 1:
                annotation = members[0]
                continue
        return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _type_at(loc: tuple, root: type[BaseModel] = Spec) -> Any:
    """The annotation of the value at ``loc`` in a spec, walking into models' fields,
    the values of maps (``targets.<target>``) and the items of lists (``by_seq_k[0]``);
    None where ``loc`` leaves the model. ``root``: the model at the top (the spec).
    """
    annotation: Any = root
    for item in loc:
        annotation = _unwrap(annotation)
        origin = typing.get_origin(annotation)
        if origin is dict and item != "[key]":
            annotation = typing.get_args(annotation)[1]
        elif origin is list and isinstance(item, int):
            annotation = typing.get_args(annotation)[0]
        elif _is_model(annotation) and isinstance(item, str) and item in annotation.model_fields:
            annotation = annotation.model_fields[item].annotation
        else:
            return None
    return annotation


def _model_at(loc: tuple, root: type[BaseModel] = Spec) -> Optional[type[BaseModel]]:
    """The model class whose fields live at ``loc`` (for 'allowed keys' messages)."""
    annotation = _unwrap(_type_at(loc, root))
    return annotation if _is_model(annotation) else None


def _field_at(loc: tuple, root: type[BaseModel] = Spec):
    """The pydantic FieldInfo of the field at ``loc``, or None (a list item, a map value)."""
    owner = _model_at(loc[:-1], root) if loc else None
    return owner.model_fields.get(loc[-1]) if owner and isinstance(loc[-1], str) else None


def _bounds_message(loc: tuple, error: dict, root: type[BaseModel] = Spec) -> str:
    """'must be an integer in [1, 128]' for a value out of a field's bounds."""
    field = _field_at(loc, root)
    found = {}
    for meta in getattr(field, "metadata", []):
        for name in ("ge", "gt", "le", "lt"):
            if getattr(meta, name, None) is not None:
                found[name] = getattr(meta, name)
    if not found:  # a bound on a list item or a map value: the one that failed
        found = {k: v for k, v in error.get("ctx", {}).items() if k in ("ge", "gt", "le", "lt")}
    base = _unwrap(field.annotation) if field is not None else type(error.get("input"))
    kind = "an integer" if base is int else "a number"
    low = f"[{found['ge']}" if "ge" in found else f"({found['gt']}" if "gt" in found else None
    high = f"{found['le']}]" if "le" in found else f"{found['lt']})" if "lt" in found else None
    if low and high:
        return f"must be {kind} in {low}, {high}"
    words = {"ge": "at least", "gt": "greater than", "le": "at most", "lt": "less than"}
    return "must be " + " and ".join(f"{words[k]} {v}" for k, v in found.items())


def _problems(error: dict, root: type[BaseModel] = Spec) -> list[tuple[str, str]]:
    """One pydantic error as (field path, message) lines: a cross-field check may
    report several. ``root``: the model validated (the spec, or another file's)."""
    cause = error.get("ctx", {}).get("error") if error["type"] == "value_error" else None
    if isinstance(cause, Problems):
        prefix = _field_path(tuple(error["loc"]))
        return [(f"{prefix}.{path}" if prefix else path, message) for path, message in cause.items]
    return [_problem(error, root)]


# Keys a spec's author may write for a field of another name or for a call argument,
# with what to write instead (top level of a spec only).
KEY_HINTS = {
    "scale": "the softmax scale is an argument of the call: attention(q, k, v, scale=...)",
    "softmax_scale": "the softmax scale is an argument of the call: attention(q, k, v, scale=...)",
    "sliding_window": "did you mean window? It takes {left: sliding_window - 1}",
    "num_heads": "heads come from the tensors; the spec takes gqa_ratio, query heads per KV head",
    "num_kv_heads": "heads come from the tensors; the spec takes gqa_ratio, query heads per KV head",
    "num_key_value_heads": "heads come from the tensors; the spec takes gqa_ratio, query heads "
                           "per KV head",
    "logit_softcap": "did you mean softcap?",
    "attn_logit_softcapping": "did you mean softcap?",
    "is_causal": "did you mean causal?",
    "dropout_p": "the dropout rate is an argument of the call, attention(..., dropout_p=...); "
                 "dropout: true builds it in",
}
# Keys at any depth that name a field of another name.
KEY_ALIASES = {"num_warps": "num_worker_warps", "warps": "num_worker_warps",
               "block_m": "tile_m", "block_n": "tile_n", "BLOCK_M": "tile_m", "BLOCK_N": "tile_n"}


def _key_hint(key: str, allowed: list[str], root: type[BaseModel], depth: int) -> str:
    """' (what to write instead)' for an unknown key, where one is known or a field's
    name is close to it; empty otherwise."""
    import difflib

    if root is Spec and depth == 1 and key in KEY_HINTS:
        return f" ({KEY_HINTS[key]})"
    if KEY_ALIASES.get(key) in allowed:
        return f" (did you mean {KEY_ALIASES[key]}?)"
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def _problem(error: dict, root: type[BaseModel] = Spec) -> tuple[str, str]:
    loc = tuple(error["loc"])
    kind = error["type"]
    value = error.get("input")
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1], root)
        allowed = ", ".join(model.model_fields) if model else "none"
        hint = _key_hint(str(loc[-1]), list(model.model_fields) if model else [], root, len(loc))
        return _field_path(loc), f"unknown key{hint}; allowed keys: {allowed}"
    if kind == "missing":
        return _field_path(loc), "required field is missing"
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        message = f"must be one of {expected}"
    elif kind == "bool_type":
        message = "must be true or false"
    elif kind in ("int_type", "int_from_float"):
        message = "must be an integer"
    elif kind in ("dict_type", "model_type"):
        message = "must be a mapping"
    elif kind == "list_type":
        message = "must be a list"
    elif kind == "string_type":
        message = "must be a string"
    elif kind in ("float_type", "float_parsing", "finite_number"):
        message = "must be a finite number"
    elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        message = _bounds_message(loc, error, root)
    elif kind == "too_short":
        least = error.get("ctx", {}).get("min_length", 1)
        message = "must not be empty" if least == 1 else f"must have at least {least} entries"
    elif kind == "too_long":
        message = f"must have at most {error.get('ctx', {}).get('max_length')} entries"
    elif kind == "value_error":
        message = str(error.get("ctx", {}).get("error", error["msg"]))
    else:
        # Any other pydantic check, in the project's words: "must be ...".
        message = re.sub(r"^Input should be ", "must be ", error["msg"])
    # A mapping as a whole is not worth echoing: the message names the bad key. A
    # message that already says what it got (a hook's "got score // 0", the part of
    # the expression at fault) gets no second "got".
    if not isinstance(value, dict) and ", got " not in message:
        message += f", got {_show(value)}"
    return _field_path(loc), message


def problem_lines(exc: ValidationError, root: type[BaseModel] = Spec) -> list[tuple[str, str]]:
    """Every error of validating ``root`` as (field path, message), in the words a
    spec's errors use ("unknown key; allowed keys: ...", "must be ..., got ...").
    Under a mapping key that is refused itself (an unknown target), its value's
    errors are left out: the key is the one problem there."""
    errors = exc.errors()
    bad_keys = {tuple(e["loc"][:-1]) for e in errors if e["loc"] and e["loc"][-1] == "[key]"}
    kept = [e for e in errors if e["loc"] and e["loc"][-1] == "[key]"
            or not any(tuple(e["loc"][:len(k)]) == k for k in bad_keys)]
    return [line for error in kept for line in _problems(error, root)]


def validate_spec(data: Any, path: str | Path = "<spec>") -> Spec:
    """Validate already-parsed spec data; raise SpecError naming every bad field."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError(path, [("", f"a spec must be a YAML mapping, got {kind}")])
    if "variants" in data and "name" not in data:
        # A variants file (spec: and variants:) given where a spec goes: one line that
        # says what it is, not an unknown-key line for each of its keys.
        raise SpecError(path, [("", "a variants file, not a spec (a spec has name: and the fields "
                                    "of docs/spec-reference.md); time its variants with "
                                    "`specgen bench --variants FILE`")])
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(path, problem_lines(exc)) from None


# YAML 1.1 (PyYAML) breaks lines at these too; YAML 1.2, editors' YAML tooling and
# ruamel.yaml (which `specgen tune` rewrites a spec with) read them as text. PyYAML
# would make the rest of `# softcap: 50 for now<U+2028>softcap: 50` a live key.
_UNICODE_BREAKS = {"\x85": "NEXT LINE", "\u2028": "LINE SEPARATOR", "\u2029": "PARAGRAPH SEPARATOR"}
_UNICODE_BREAK_RE = re.compile("[" + "".join(_UNICODE_BREAKS) + "]")


def _unicode_break(text: str) -> str | None:
    """Where ``text`` holds a character only YAML 1.1 reads as a line break, as an
    error message; None where it holds none."""
    found = _UNICODE_BREAK_RE.search(text)
    if found is None:
        return None
    before = text[:found.start()]
    line = before.count("\n") + before.count("\r") - before.count("\r\n") + 1
    column = found.start() - max(before.rfind("\n"), before.rfind("\r"))
    char = found.group()
    return (f"invalid YAML: line {line}, column {column}: U+{ord(char):04X} "
            f"{_UNICODE_BREAKS[char]} is not allowed in a spec (YAML 1.1 reads it as a line "
            "break, YAML 1.2 as text); use a plain line break")


def parse_spec_text(text: str, path: str | Path = "<spec>") -> Any:
    problem = _unicode_break(text)
    if problem:
        raise SpecError(path, [("", problem)])
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (safe subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = getattr(exc, "context", None)
        detail = f"{context}; {problem}" if context else problem
        raise SpecError(path, [("", f"invalid YAML: {where}{detail}")]) from None
    except RecursionError:
        raise SpecError(path, [("", "invalid YAML: nested too deeply")]) from None
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
        if "digits" not in str(exc):
            raise SpecError(path, [("", f"invalid YAML: {exc}")]) from None
        raise SpecError(path, [("", "invalid YAML: a number too long to read (more than "
                                    f"{sys.get_int_max_str_digits()} digits)")]) from None


def read_spec_text(path: str | Path, limit: int = MAX_SPEC_BYTES) -> str:
    """A spec file's (or generated module's) text: at most ``limit`` bytes of UTF-8;
    SpecError naming the file otherwise."""
    path = Path(path)
    try:
        info = path.stat()
        # A FIFO or a device has no size to check and may never end: a regular file only.
        if not stat.S_ISREG(info.st_mode):
            raise SpecError(path, [("", "not a regular file")])
        if info.st_size > limit:
            raise SpecError(path, [("", f"file is larger than {limit} bytes")])
        with open(path, "rb") as f:
            raw = f.read(limit + 1)  # a file that grew since: still at most limit bytes
        if len(raw) > limit:
            raise SpecError(path, [("", f"file is larger than {limit} bytes")])
    except OSError as exc:
        raise SpecError(path, [("", f"cannot read: {exc.strerror}")]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(path, [("", "file is not UTF-8 text")]) from None


def load_spec(path: str | Path) -> Spec:
    """Read, parse and validate one YAML spec file."""
    return validate_spec(parse_spec_text(read_spec_text(path), path), path)


def compact_config(data: dict) -> dict:
    """A launch config as a spec writes it: null hints, an empty bucket list and
    the default tile order left out."""
    return {k: v for k, v in data.items()
            if v is not None and v != [] and not (k == "tile_order" and v == "per_head")}


def _target_dict(cfg: TargetConfig) -> dict:
    """A target's config without the hints left to the compiler (null), the default
    tile order or an empty bucket list."""
    data = compact_config(cfg.model_dump(mode="json"))
    if "by_seq_k" in data:
        data["by_seq_k"] = [compact_config(b) for b in data["by_seq_k"]]
    return data


def spec_to_dict(spec: Spec) -> dict:
    """The validated spec, defaults filled in, as plain JSON-compatible data.

    Target configs leave out the compiler hints that are null (auto) and empty
    bucket lists; ``autotune`` is left out when empty, and so are the fields of
    the other family (which the spec's own family refuses). The dict validates back to
    an equal spec.
    """
    data = spec.model_dump(mode="json")
    for name in other_family_fields(spec.family):  # refused by the spec's own family
        del data[name]
    data["targets"] = {name: _target_dict(cfg) for name, cfg in spec.targets.items()}
    if not data["autotune"]:
        del data["autotune"]
    for space in data.get("autotune", {}).values():
        for name in ("v_transposed", "persistent"):
            if space[name] == [None]:  # the default: null (auto) only
                del space[name]
    return data


def json_schema() -> dict:
    return Spec.model_json_schema()

"""Loading a spec: strict YAML (no duplicate keys, size-capped), validation with
one line per problem, and the spec as plain data (``spec_to_dict``)."""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ValidationError

from specgen.errors import SpecError
from specgen.spec.fields import MAX_SPEC_BYTES, Problems, TargetConfig
from specgen.spec.model import Spec

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
    loader.flatten_mapping(node)
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first at line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML/JSON terms, shortened."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _field_path(loc: tuple) -> str:
    parts = []
    for item in loc:
        if item == "[key]":  # pydantic's marker for a bad mapping key
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The model class whose fields live at ``loc`` (for 'allowed keys' messages)."""
    model: Any = Spec
    for item in loc:
        if model is Spec and item == "targets":
            model = dict
            continue
        if model is dict:
            model = TargetConfig
            continue
        field = model.model_fields.get(item) if isinstance(item, str) else None
        annotation = getattr(field, "annotation", None)
        # Optional[Model]: the model inside.
        inner = [a for a in typing.get_args(annotation)
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if inner:
            annotation = inner[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _problems(error: dict) -> list[tuple[str, str]]:
    """One pydantic error as (field path, message) lines: a cross-field check may
    report several."""
    cause = error.get("ctx", {}).get("error") if error["type"] == "value_error" else None
    if isinstance(cause, Problems):
        prefix = _field_path(tuple(error["loc"]))
        return [(f"{prefix}.{path}" if prefix else path, message) for path, message in cause.items]
    return [_problem(error)]


def _problem(error: dict) -> tuple[str, str]:
    loc = tuple(error["loc"])
    kind = error["type"]
    value = error.get("input")
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        allowed = ", ".join(model.model_fields) if model else "none"
        return _field_path(loc), f"unknown key; allowed keys: {allowed}"
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
    elif kind in ("greater_than_equal", "less_than_equal", "greater_than"):
        owner = _model_at(loc[:-1])
        ctx = owner.model_fields.get(loc[-1]) if owner and isinstance(loc[-1], str) else None
        bounds = {type(m).__name__: m for m in getattr(ctx, "metadata", [])}
        low, high, above = bounds.get("Ge"), bounds.get("Le"), bounds.get("Gt")
        if low is not None and high is not None:
            message = f"must be an integer in [{low.ge}, {high.le}]"
        elif above is not None and high is not None:
            message = f"must be a number in ({above.gt}, {high.le}]"
        else:
            message = error["msg"]
    elif kind == "too_short":
        message = "must not be empty"
    elif kind == "value_error":
        message = str(error.get("ctx", {}).get("error", error["msg"]))
    else:
        message = error["msg"]
    # A mapping as a whole is not worth echoing: the message names the bad key.
    if not isinstance(value, dict):
        message += f", got {_show(value)}"
    return _field_path(loc), message


def validate_spec(data: Any, path: str | Path = "<spec>") -> Spec:
    """Validate already-parsed spec data; raise SpecError naming every bad field."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError(path, [("", f"a spec must be a YAML mapping, got {kind}")])
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(path, [line for e in exc.errors() for line in _problems(e)]) from None


def parse_spec_text(text: str, path: str | Path = "<spec>") -> Any:
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
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        raise SpecError(path, [("", "invalid YAML: a number too long to read (more than "
                                    f"{sys.get_int_max_str_digits()} digits)")]) from None


def load_spec(path: str | Path) -> Spec:
    """Read, parse and validate one YAML spec file."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError(path, [("", f"file is larger than {MAX_SPEC_BYTES} bytes")])
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError(path, [("", f"cannot read: {exc.strerror}")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(path, [("", "file is not UTF-8 text")]) from None
    return validate_spec(parse_spec_text(text, path), path)


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
    bucket lists; ``autotune`` is left out when empty. The dict validates back to
    an equal spec.
    """
    data = spec.model_dump(mode="json")
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

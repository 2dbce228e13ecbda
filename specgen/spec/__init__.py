"""Spec: the strict Pydantic model a user writes in YAML, its loader, the expression
hooks, and the table of measured launch configs for specs that name no targets."""

from specgen.spec.model import (
    Spec,
    TargetConfig,
    json_schema,
    load_spec,
    parse_spec_text,
    spec_to_dict,
    validate_spec,
)

__all__ = [
    "Spec", "TargetConfig", "json_schema", "load_spec", "parse_spec_text", "spec_to_dict",
    "validate_spec",
]

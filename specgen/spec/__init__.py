"""Spec: the strict Pydantic model a user writes in YAML (:mod:`.model`, its parts in
:mod:`.fields`), loading and error messages (:mod:`.load`), the expression hooks
(:mod:`.hooks`), and the table of measured launch configs for specs that name no
targets (:mod:`.defaults`)."""

from specgen.spec.fields import (
    DEFAULT_TARGET,
    HINT_DEFAULTS,
    HINT_FIELDS,
    TUNABLE_FIELDS,
    AutotuneSpace,
    LaunchConfig,
    TargetConfig,
    decode_rows,
)
from specgen.spec.load import (
    compact_config,
    json_schema,
    load_spec,
    parse_spec_text,
    read_spec_text,
    spec_to_dict,
    validate_spec,
)
from specgen.spec.model import Spec

__all__ = [
    "DEFAULT_TARGET", "HINT_DEFAULTS", "HINT_FIELDS", "TUNABLE_FIELDS",
    "AutotuneSpace", "LaunchConfig", "Spec", "TargetConfig", "compact_config", "decode_rows",
    "json_schema", "load_spec", "parse_spec_text", "read_spec_text", "spec_to_dict",
    "validate_spec",
]

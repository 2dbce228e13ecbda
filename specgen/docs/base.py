"""What the generated pages share: their paths, the command that regenerates them,
and the error both raise."""

REGENERATE = "specgen docs"
SPEC_REFERENCE = "docs/spec-reference.md"
PERFORMANCE = "docs/performance.md"


class DocsError(Exception):
    """The model or the bench results cannot be documented as they stand."""

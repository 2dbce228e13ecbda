"""The generated pages of docs/: the spec reference, walked from the Pydantic model
(``reference``), and the performance tables, read from the JSON that `specgen bench`
committed (``performance``).

    write_docs(root, check=False)   # what `specgen docs [--check]` runs
"""

from __future__ import annotations

from pathlib import Path

from .base import PERFORMANCE, REGENERATE, SPEC_REFERENCE, DocsError
from .performance import DYNAMIC_MARK, performance_markdown
from .reference import (
    DESCRIPTIONS,
    FAMILY_ONLY,
    load_specs,
    check_descriptions,
    spec_reference_markdown,
)


def generated_docs(root: Path) -> dict[str, str]:
    """The generated pages of the repository at ``root``: relative path -> text."""
    root = Path(root)
    specs = load_specs(root / "specs")  # read once, for both pages
    return {
        SPEC_REFERENCE: spec_reference_markdown(root / "specs", specs),
        PERFORMANCE: performance_markdown(root / "bench" / "results", root / "specs", specs),
    }


def write_docs(root: Path, check: bool = False) -> list[str]:
    """Regenerate docs/spec-reference.md and docs/performance.md under ``root``.

    Returns the relative paths of the pages whose content differed from the
    generator's output: written (``check=False``) or left as they are (``check=True``,
    the drift a CI check reports)."""
    root = Path(root)
    # The pages are made from the project's specs/ and bench/results/; a folder
    # without them is not a project, and gets no docs/.
    missing = [f"{rel}/" for rel in ("specs", "bench/results") if not (root / rel).is_dir()]
    if missing:
        raise DocsError(f"{root} is not a specgen project (it has no {' or '.join(missing)})")
    from specgen.compile.export import atomic_write

    # Every page is made before any is written: a bad spec or result leaves all as they were.
    pages = generated_docs(root)
    changed = [rel for rel, text in pages.items()
               if not ((root / rel).is_file() and (root / rel).read_text(encoding="utf-8") == text)]
    if not check:
        for rel in changed:
            atomic_write(root / rel, pages[rel].encode())
    return changed


__all__ = [
    "DESCRIPTIONS", "DYNAMIC_MARK", "DocsError", "FAMILY_ONLY", "PERFORMANCE", "REGENERATE",
    "SPEC_REFERENCE", "check_descriptions", "generated_docs", "performance_markdown",
    "spec_reference_markdown", "write_docs",
]

"""The generated pages of docs/: the spec reference, walked from the Pydantic model
(``reference``), and the performance tables, read from the JSON that `specgen bench`
committed (``performance``).

    write_docs(root, check=False)   # what `specgen docs [--check]` runs
"""

from __future__ import annotations

import os
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
        # Run from docs/ or specs/ of a checkout: name the checkout above.
        above = next((parent for parent in root.resolve().parents
                      if (parent / "specs").is_dir() and (parent / "bench" / "results").is_dir()), None)
        hint = f"; pass --root {os.path.relpath(above)}, the checkout that holds it" if above else ""
        raise DocsError(f"{root} is not a checkout of specgen (it has no {' or '.join(missing)}): "
                        "`specgen docs` regenerates specgen's own docs/ pages, not a page of your specs"
                        + hint)
    from specgen.compile.export import atomic_write

    # Every page is made before any is written: a bad spec or result leaves all as they were.
    pages = generated_docs(root)
    changed = []
    for rel, text in pages.items():
        path = root / rel
        if path.exists() and not path.is_file():
            raise DocsError(f"{path}: exists and is not a regular file; the page cannot be written there")
        try:  # compared as bytes: a page that is not UTF-8 is simply out of date
            same = path.is_file() and path.read_bytes() == text.encode()
        except OSError as exc:
            raise DocsError(f"{path}: cannot read: {exc.strerror or exc}") from None
        if not same:
            changed.append(rel)
    if not check:
        # Each target's folder is checked before the first page is written, so that
        # one that cannot be written leaves the others as they were too.
        for rel in changed:
            folder = (root / rel).parent
            if folder.exists() and not folder.is_dir():
                raise DocsError(f"{folder}: not a folder; {rel} cannot be written")
        for rel in changed:
            atomic_write(root / rel, pages[rel].encode())
    return changed


__all__ = [
    "DESCRIPTIONS", "DYNAMIC_MARK", "DocsError", "FAMILY_ONLY", "PERFORMANCE", "REGENERATE",
    "SPEC_REFERENCE", "check_descriptions", "generated_docs", "performance_markdown",
    "spec_reference_markdown", "write_docs",
]

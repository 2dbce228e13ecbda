import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `import generated.<name>` and `specgen` from a checkout


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _test_caches() -> Path:
    """One cubin cache for the whole run, shared by the xdist workers and the
    subprocesses the tests start, and never the user's: specgen's cubins and cuTile's
    own disk cache under the system temp folder. A cubin's key holds the source, the
    signatures and the toolchain, so entries of an earlier run are reused, never wrong."""
    return Path(tempfile.gettempdir()) / f"specgen-test-caches-{os.getuid()}"


def pytest_configure(config):
    caches = _test_caches()
    os.environ.setdefault("SPECGEN_TEST_CACHE", str(caches / "cubins"))
    os.environ["SPECGEN_CACHE_DIR"] = os.environ["SPECGEN_TEST_CACHE"]
    os.environ.setdefault("CUDA_TILE_CACHE_DIR", str(caches / "cutile"))

import os
import sys
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


@pytest.fixture(autouse=True)
def _isolated_cubin_cache(tmp_path_factory, monkeypatch):
    """Tests compile into one per-session cache, never the user's."""
    if "SPECGEN_TEST_CACHE" not in os.environ:
        os.environ["SPECGEN_TEST_CACHE"] = str(tmp_path_factory.getbasetemp() / "cubins")
    monkeypatch.setenv("SPECGEN_CACHE_DIR", os.environ["SPECGEN_TEST_CACHE"])

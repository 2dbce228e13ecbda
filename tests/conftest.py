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


def _one_core_per_worker() -> None:
    """Under xdist each worker gets its share of the cores, and torch (and the
    processes a test starts: they inherit OMP_NUM_THREADS) one thread per core of it.
    torch's default, a thread per core of the machine in every worker, leaves
    OpenMP's threads spinning at each barrier for a core the other worker holds: on
    2 cores, a 16x128 @ 128x32 matmul of an emulated kernel took 3-15 ms instead of
    5 us, and the emulated tests took most of the suite."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    if "torch" in sys.modules:  # imported before this hook: set its pool directly
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    _one_core_per_worker()
    caches = _test_caches()
    os.environ.setdefault("SPECGEN_TEST_CACHE", str(caches / "cubins"))
    os.environ["SPECGEN_CACHE_DIR"] = os.environ["SPECGEN_TEST_CACHE"]
    os.environ.setdefault("CUDA_TILE_CACHE_DIR", str(caches / "cutile"))

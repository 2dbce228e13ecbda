"""Shared pieces of the GPU commands (`specgen test`, `specgen bench`): making sure
a spec's module is fresh, importing it, and describing the device."""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path
from types import ModuleType

from specgen.compile.jobs import Job, edited_modules, foreign_modules, load_jobs, write_jobs
from specgen.compile.export import package_version
from specgen.errors import InvalidSpecs, UsageError


def require_cuda(command: str):
    """Import torch and fail with exit 2 (bad environment) where CUDA is absent."""
    import torch

    if not torch.cuda.is_available():
        hint = "; --emulate runs the checks on the CPU" if command == "test" else ""
        raise UsageError(
            f"specgen {command}: needs a CUDA GPU, and torch.cuda.is_available() is "
            f"False (torch {torch.__version__}){hint}"
        )
    return torch


def require_do_bench(command: str):
    """triton's do_bench, which the timing commands use; exit 2 where triton is
    missing (CUDA builds of torch bring it, CPU builds do not)."""
    try:
        from triton.testing import do_bench
    except ImportError as exc:
        raise UsageError(
            f"specgen {command}: times kernels with triton.testing.do_bench, and triton does not "
            f"import ({exc}); install a CUDA build of torch, which brings it, or pip install triton"
        ) from None
    return do_bench


def fresh_jobs(paths: list[str], out_dir: Path, log) -> list[Job]:
    """Build stale modules (render only; the JIT compiles at first launch)."""
    jobs = load_jobs(paths, out_dir)
    # Another spec's module of the same name is refused, as build refuses it.
    foreign = foreign_modules(jobs, "replace it with `specgen build --force` first")
    if foreign:
        raise InvalidSpecs("\n".join(foreign))
    # So is a hand-edited module that this run would replace: named before any
    # module is written (exit 2 writes nothing).
    edited = edited_modules(jobs)
    if edited:
        raise InvalidSpecs("\n".join(edited))
    try:  # only stale modules are written: a --gen it may not write serves fresh ones
        refused = write_jobs(jobs, out_dir, force=False, log=log)
    except PermissionError as exc:
        raise UsageError(f"--gen {out_dir}: a stale module must be written there, and it may "
                         f"not be ({exc.strerror}: {exc.filename}); run `specgen build` where "
                         "it can write") from None
    if refused:  # edited between the check above and the write
        raise UsageError("\n".join(refused))
    return jobs


def fresh_modules(paths: list[str], out_dir: Path, log) -> list[tuple[Job, ModuleType]]:
    """fresh_jobs, then import each module from its file."""
    return [(job, import_module_file(job.out_path)) for job in fresh_jobs(paths, out_dir, log)]


def import_module_file(path: Path) -> ModuleType:
    name = f"_specgen_run_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def device_info() -> dict:
    """What a result depends on: the GPU, its driver and the software versions."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    driver = "unknown"
    try:
        import subprocess

        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - the driver version is informative only
        pass
    return {
        "name": props.name,
        "sm": f"sm_{props.major}{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": driver,
        "cuda": torch.version.cuda or "unknown",
        "torch": torch.__version__,
        "cuda_tile": package_version("cuda-tile"),
        "triton": package_version("triton"),
        "python": platform.python_version(),
    }


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; the folder name of bench results."""
    words = [w for w in name.lower().replace("-", " ").split() if w not in ("nvidia", "tesla")]
    slug = "_".join(words) or "gpu"
    return "".join(c for c in slug if c.isalnum() or c == "_")

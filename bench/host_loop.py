"""What the host-time scripts share (launch_host_ab.py, op_host_ab.py, op_overhead.py):
a module loaded from a path, the small calls' inputs, and the timing of host-bound
loops."""

import importlib.util
import statistics
import sys
import time
from types import SimpleNamespace

import torch


def load(path, name):
    """The module at ``path``, imported as ``name`` (kept in sys.modules: torch.compile
    imports the module of a function it traces)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def small_inputs():
    """Inputs whose calls are bound by the host: prefill B1 Hq32/Hkv4 S128 D128 bf16
    (q, k, v contiguous, and qt, kt, vt transposed from [B, S, H, D]); decode B1
    L4096 Hq32/Hkv4 D128 bf16 (qd, kc, vc, lens)."""
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k = torch.randn(1, 32, 128, 128, **bf16), torch.randn(1, 4, 128, 128, **bf16)
    qt = torch.randn(1, 128, 32, 128, **bf16).transpose(1, 2)
    kt = torch.randn(1, 128, 4, 128, **bf16).transpose(1, 2)
    kc = torch.randn(1, 4096, 4, 128, **bf16)
    return SimpleNamespace(
        q=q, k=k, v=torch.randn_like(k), qt=qt, kt=kt, vt=torch.randn_like(kt),
        qd=torch.randn(1, 1, 32, 128, **bf16), kc=kc, vc=torch.randn_like(kc),
        lens=torch.tensor([4096], dtype=torch.int32, device="cuda"),
    )


def host_us(calls, rounds, per_round):
    """Median µs per call of each of ``calls`` (label -> function of no argument):
    ``rounds`` alternating rounds, each a loop of ``per_round`` calls with the GPU
    queue drained before and after it."""
    times = {label: [] for label in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(per_round):
                call()
            torch.cuda.synchronize()
            times[label].append((time.perf_counter() - start) / per_round * 1e6)
    return {label: statistics.median(t) for label, t in times.items()}

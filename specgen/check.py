"""Check: how a kernel's output is compared with the fp64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Relative error allowed per dtype: max |out - ref| / max |ref| (quack's TOLERANCES
# idea: one table, every check reads it).
TOLERANCES = {
    "float16": 1e-2,
    "bfloat16": 1e-2,
}


@dataclass(frozen=True)
class Comparison:
    max_abs_err: float
    rel_err: float
    nonfinite: int  # NaN/inf in the output: unwritten (poisoned) or broken elements
    ok: bool


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> Comparison:
    """Compare ``out`` with the float64 ``ref``; any non-finite output fails."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    out64 = out.to(torch.float64)
    nonfinite = int((~torch.isfinite(out64)).sum())
    if out.numel() == 0:
        return Comparison(0.0, 0.0, 0, True)
    err = (out64 - ref).abs().max().item() if nonfinite == 0 else float("inf")
    scale = max(ref.abs().max().item(), 1e-30)
    rel = err / scale
    return Comparison(err, rel, nonfinite, nonfinite == 0 and rel <= TOLERANCES[dtype])

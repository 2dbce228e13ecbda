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


@dataclass(frozen=True)
class SmokeCase:
    """One ragged chunked-prefill shape (B2, Hkv2, Sq333, Skv1000, q_offset 667
    when causal) and its fp64 reference: the check a config or variant passes
    before it is timed or written anywhere."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_offset: int
    ref: torch.Tensor


def smoke_case(dtype: str, ratio: int, head_dim: int, causal: bool, generator=None) -> SmokeCase:
    from .reference import attention_reference

    def rand(heads: int, seq: int) -> torch.Tensor:
        return torch.randn(2, heads, seq, head_dim, device="cuda", dtype=getattr(torch, dtype),
                           generator=generator)

    q, k, v = rand(2 * ratio, 333), rand(2, 1000), rand(2, 1000)
    q_offset = 667 if causal else 0
    return SmokeCase(q, k, v, q_offset, attention_reference(q, k, v, causal=causal, q_offset=q_offset))

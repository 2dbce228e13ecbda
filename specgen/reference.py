"""The fp64 reference every generated kernel is checked against.

It is written for clarity, not speed: scores are materialised, the mask is built
explicitly with the q_offset semantics of the generated kernels.
"""

from __future__ import annotations

import math

import torch


def causal_mask(seq_q: int, seq_k: int, q_offset: int = 0, device=None) -> torch.Tensor:
    """[seq_q, seq_k] bool, True where query row i may attend key j: j <= q_offset + i."""
    rows = torch.arange(seq_q, device=device)[:, None] + q_offset
    cols = torch.arange(seq_k, device=device)[None, :]
    return cols <= rows


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    q_offset: int = 0,
) -> torch.Tensor:
    """softmax(scale * q k^T + mask) v in float64, for q [B, Hq, Sq, D] and k/v
    [B, Hkv, Skv, D] with Hq a multiple of Hkv (query head h reads KV head h // ratio).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    ratio = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    if ratio > 1:
        k64 = k64.repeat_interleave(ratio, dim=1)
        v64 = v64.repeat_interleave(ratio, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    if causal:
        visible = causal_mask(q.shape[2], k.shape[2], q_offset, device=q.device)
        scores = scores.masked_fill(~visible, -math.inf)
    return torch.matmul(torch.softmax(scores, dim=-1), v64)

"""Merging partial attention results through their log-sum-exp.

Attention over keys split into blocks is exact when each block's output is
weighted by its share of the softmax normaliser: with per-row lse_a, lse_b,

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Everything is computed in float32. A row that sees no key in a block has lse -inf
there and weight 0; a row that sees no key at all keeps out 0 and lse -inf, the
generated kernels' convention.
"""

from __future__ import annotations

import torch


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: fold one block's (block_out [..., rows, Dv], block_lse [..., rows])
    into the float32 accumulators (out, lse) of the same shapes."""
    block_lse = block_lse.float()
    top = torch.maximum(lse, block_lse)
    # Rows where both are -inf: any finite pivot gives weights exp(-inf) = 0.
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w_acc, w_blk = torch.exp(lse - top), torch.exp(block_lse - top)
    total = w_acc + w_blk
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    # Two passes over the rows: scale the accumulator, add the weighted block.
    out.mul_((w_acc * inv).unsqueeze(-1)).addcmul_(block_out, (w_blk * inv).unsqueeze(-1))
    lse.copy_(top + torch.log(total))


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out float32, lse) of attention over the union of the blocks ``parts``, each
    an (out, lse) pair over the same rows."""
    first_out, first_lse = parts[0]
    out = torch.zeros(first_out.shape, dtype=torch.float32, device=first_out.device)
    lse = torch.full(first_lse.shape, float("-inf"), dtype=torch.float32, device=first_out.device)
    for block_out, block_lse in parts:
        merge_into(out, lse, block_out, block_lse)
    return out, lse

"""What attention costs: FLOPs from the query-key pairs a kernel computes.

Every count reads the kernel's Plan (derived once from its spec), never the
module's SPEC dict: the window, the causal rule and the mask_mod come from one
place. ``attention_flops`` and ``visible_pairs`` are the pure formulas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from specgen.plan import Plan


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool,
                    v_head_dim: Optional[int] = None) -> int:
    """2 * B * Hq * Sq * Skv * (D + Dv) (two matmuls, multiply-add = 2; 4 * ... * D
    when Dv = D), halved for causal."""
    flops = 2 * batch * heads * seq_q * seq_k * (head_dim + (v_head_dim or head_dim))
    return flops // 2 if causal else flops


def visible_pairs(seq_q: int, seq_k: int, causal: bool, window: Optional[tuple] = None,
                  q_offset: int = 0) -> int:
    """Query-key pairs a kernel computes: every pair, or those under the causal
    diagonal and inside the window (left, right) (row i at position q_offset + i)."""
    from specgen.check.reference import key_range

    left, right = window or (None, None)
    total = 0
    for i in range(seq_q):
        lo, hi = key_range(q_offset + i, seq_k, causal=causal, left=left, right=right)
        total += max(hi - lo + 1, 0)
    return total


def window_of(plan: Plan) -> Optional[tuple]:
    """The spec's window as (left, right), None without one. The spec's own right
    edge (a causal spec may say 0), which the mask rule treats as the plan's None."""
    window = plan.spec.window
    return (window.left, window.right) if window is not None else None


def forward_flops(plan: Plan, batch: int, heads: int, seq_q: int, seq_k: int) -> int:
    """4 * B * Hq * D * visible pairs; the classic formula (causal: half) where no
    window applies, so dense and causal figures compare with published ones. A
    mask_mod's pairs depend on its tensors: see :func:`mask_mod_flops`."""
    d, dv = plan.head_dim, plan.v_head_dim
    window = window_of(plan)
    if window is None:
        return attention_flops(batch, heads, seq_q, seq_k, d, plan.causal, dv)
    return 2 * batch * heads * visible_pairs(seq_q, seq_k, plan.causal, window) * (d + dv)


def mask_mod_pairs(torch, plan: Plan, extra: dict, batch: int, heads: int, seq_q: int,
                   seq_k: int) -> int:
    """Query-key pairs a mask_mod spec leaves visible (with its causal mask and
    window), summed over batch and heads: evaluated with torch on the GPU, 1024
    rows at a time, on the call's own hook tensors (``extra``)."""
    from specgen.check.reference import visible_mask
    from specgen.spec.hooks import torch_fn

    allowed_fn = torch_fn(plan.spec.mask_mod)
    tensors = {n: extra[n] for n in plan.spec.tensors}
    window = window_of(plan)
    per_head = "h" in plan.mask_mod.uses
    keys = torch.arange(seq_k, device="cuda")[None, :]
    total = 0
    for b in range(batch):
        for h in range(heads) if per_head else (0,):
            for start in range(0, seq_q, 1024):
                rows = torch.arange(start, min(start + 1024, seq_q), device="cuda")[:, None]
                env = {"b": torch.tensor(b, device="cuda"), "h": torch.tensor(h, device="cuda"),
                       "q_idx": rows, "kv_idx": keys}
                allowed = torch.broadcast_to(allowed_fn(env, tensors), (rows.shape[0], seq_k))
                allowed = allowed & visible_mask(rows.shape[0], seq_k, causal=plan.causal,
                                                 q_offset=start, window=window, device="cuda")
                total += int(allowed.sum())
    return total if per_head else total * heads


def mask_mod_flops(torch, plan: Plan, extra: dict, batch: int, heads: int, seq_q: int,
                   seq_k: int) -> int:
    """FLOPs of only the pairs a mask_mod leaves: no phantom FLOPs for hidden pairs."""
    pairs = mask_mod_pairs(torch, plan, extra, batch, heads, seq_q, seq_k)
    return 2 * (plan.head_dim + plan.v_head_dim) * pairs

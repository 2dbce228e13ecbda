"""The fp64 reference every generated kernel is checked against.

It is written for clarity, not speed: scores are materialised, the mask is built
explicitly with the q_offset semantics of the generated kernels.
"""

from __future__ import annotations

import math

import torch


def causal_mask(seq_q: int, seq_k: int, q_offset: int = 0, device=None) -> torch.Tensor:
    """[seq_q, seq_k] bool, True where query row i may attend key j: j <= q_offset + i."""
    return visible_mask(seq_q, seq_k, causal=True, q_offset=q_offset, device=device)


def visible(rows, keys, *, causal: bool, left: int | None = None, right: int | None = None):
    """The mask rule of every generated kernel, elementwise: query position ``rows``
    sees key ``keys`` when j <= p (causal), p - left <= j (window left) and
    j <= p + right (window right). Works on ints and on broadcasting tensors (the
    reference's mask, FlexAttention's mask_mod)."""
    allowed = keys <= rows if causal else keys >= 0
    if left is not None:
        allowed = allowed & (keys >= rows - left)
    if right is not None:
        allowed = allowed & (keys <= rows + right)
    return allowed


def key_range(position: int, seq_k: int, *, causal: bool, left: int | None = None,
              right: int | None = None) -> tuple[int, int]:
    """[lo, hi] of the keys query position ``position`` sees under :func:`visible`
    among keys 0..seq_k-1, in closed form (empty when hi < lo)."""
    hi = seq_k - 1
    if causal:
        hi = min(hi, position)
    if right is not None:
        hi = min(hi, position + right)
    lo = max(position - left, 0) if left is not None else 0
    return lo, hi


def visible_mask(seq_q: int, seq_k: int, *, causal: bool, q_offset: int = 0,
                 window: tuple | None = None, device=None) -> torch.Tensor:
    """[seq_q, seq_k] bool: :func:`visible` for query row i (position q_offset + i)
    and key j."""
    rows = torch.arange(seq_q, device=device)[:, None] + q_offset
    cols = torch.arange(seq_k, device=device)[None, :]
    left, right = window or (None, None)
    allowed = visible(rows, cols, causal=causal, left=left, right=right)
    return torch.broadcast_to(allowed, (seq_q, seq_k)).clone()


_MASK32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 a in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & _MASK32


def dropout_threshold(dropout_p: float) -> int:
    """The kernels' keep threshold, of 2**16: a key is kept where its 16 bits of the
    hash are >= it. ValueError for a dropout_p that rounds to the whole range (at or
    above 1 - 2**-17), which the launchers refuse too: nothing would be kept."""
    threshold = round(dropout_p * 2**16)
    if not 0 <= threshold < 2**16:
        raise ValueError(f"dropout_p must be in [0, 1 - 2**-17), got {dropout_p!r}")
    return threshold


def dropout_keep(batch: int, heads: int, seq_q: int, seq_k: int, *, q_offset: int, seed: int,
                 dropout_p: float, device=None) -> torch.Tensor:
    """[B, H, Sq, Skv] bool: True where the generated kernels keep a probability.

    The kernels hash (seed, b * H + h, q_offset + i, pair) with murmur3's 32-bit
    finaliser, where keys j and j + 8 of each aligned 16 share a pair ((j // 16) * 8
    + j % 8); key j is kept where its half of the hash (the low 16 bits for
    j // 8 even, the high 16 for odd) is >= dropout_threshold(dropout_p)."""
    threshold = dropout_threshold(dropout_p)
    bh = torch.arange(batch * heads, device=device, dtype=torch.int64).view(batch, heads, 1, 1)
    rows = torch.arange(seq_q, device=device, dtype=torch.int64).view(1, 1, -1, 1) + q_offset
    keys = torch.arange(seq_k, device=device, dtype=torch.int64).view(1, 1, 1, -1)
    stream = seed ^ _mul32(bh, 0xC2B2AE3D)
    pairs = (keys >> 4) * 8 + (keys & 7)
    x = _mul32(rows, 0x9E3779B1) ^ _mul32(pairs, 0x85EBCA77) ^ stream
    x = _mul32(x ^ (x >> 16), 0x85EBCA6B)
    x = _mul32(x ^ (x >> 13), 0xC2B2AE35)
    x = x ^ (x >> 16)
    return ((x >> (16 * ((keys >> 3) & 1))) & 0xFFFF) >= threshold


def _visible_pairs(allowed, shape, causal: bool, q_offset: int, window, device) -> torch.Tensor:
    """[B, H, Sq, Skv] bool: the pairs the mask_mod (``allowed``, or None), causal
    and the window leave visible."""
    seen = torch.ones(shape, dtype=torch.bool, device=device) if allowed is None else allowed.clone()
    if causal or window is not None:
        seen &= visible_mask(shape[2], shape[3], causal=causal, q_offset=q_offset, window=window,
                             device=device)
    return seen


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    q_offset: int = 0,
    window: tuple | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    tensors: dict | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    p_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype = torch.float64,
    batch_offset: int = 0,
):
    """softmax(scale * q k^T + mask) v in float64, for q [B, Hq, Sq, D] and k/v
    [B, Hkv, Skv, D] with Hq a multiple of Hkv (query head h reads KV head h // ratio).

    ``window`` is (left, right), None for unbounded; ``softcap`` c maps each
    score to c * tanh(score / c); ``sinks`` [Hq] adds exp(sink[h]) to each row's
    normaliser. ``score_mod`` / ``mask_mod`` are checked hook expressions
    (specgen.spec.hooks) over score, b, h, q_idx, kv_idx and ``tensors``; the score_mod
    sees the scaled, soft-capped score. ``dropout_p`` zeroes the weights the
    kernels' hash drops for ``seed`` (dropout_keep) and scales the rest by the
    inverse of the kernels' keep rate, 2**16 / (2**16 - dropout_threshold); the LSE is the softmax's before dropout. ``p_dtype`` rounds
    the weights exp(score - row max) to that type before the product with v (the
    normaliser stays unrounded), as float8 kernels round P for the P @ V MMA: a
    model of the error that rounding alone causes, not the exact result. A row
    with no visible key gives zeros and an LSE of -inf (or the sink alone).
    ``compute_dtype`` (float64 by default) is the type all of it is computed in:
    the input dtype gives "the same math in the input dtype" of FlashAttention's
    gradient rule. ``batch_offset``: the hooks' b of q's first sequence (a caller
    that passes one sequence of a batch at a time). With
    ``return_lse`` the result is (out, lse [B, Hq, Sq]).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    ratio = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.to(compute_dtype) for t in (q, k, v))
    if ratio > 1:
        k64 = k64.repeat_interleave(ratio, dim=1)
        v64 = v64.repeat_interleave(ratio, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    if softcap is not None:
        if torch.finfo(scores.dtype).max < softcap:
            # A cap past float16's range (65504) would be an infinite constant in the
            # backward; the kernels cap in float32, and so does this reference.
            scores = (softcap * torch.tanh(scores.float() / softcap)).to(scores.dtype)
        else:
            scores = softcap * torch.tanh(scores / softcap)
    if score_mod or mask_mod:
        from specgen.spec.hooks import evaluate

        batch, heads, seq_q, seq_k = scores.shape
        # int32 positions: a hook's integer arithmetic wraps at 32 bits, as in the
        # kernels (and FlexAttention's index tensors).
        i32 = torch.int32
        env = {
            "score": scores,
            "b": (torch.arange(batch, device=q.device, dtype=i32) + batch_offset).view(-1, 1, 1, 1),
            "h": torch.arange(heads, device=q.device, dtype=i32).view(1, -1, 1, 1),
            "q_idx": (torch.arange(seq_q, device=q.device, dtype=i32) + q_offset).view(1, 1, -1, 1),
            "kv_idx": torch.arange(seq_k, device=q.device, dtype=i32).view(1, 1, 1, -1),
        }
        allowed = None
        if mask_mod:
            allowed = torch.broadcast_to(evaluate(mask_mod, env, tensors or {}), scores.shape)
        if score_mod:
            grads = torch.is_grad_enabled() and (scores.requires_grad or any(
                t.requires_grad for t in (tensors or {}).values()))
            if grads and (allowed is not None or causal or window is not None):
                # Differentiated: the hook is evaluated at the visible pairs only. A
                # hidden pair's value is dropped, but autograd would still multiply
                # its zero gradient by the hook's derivative there, which may be
                # infinite (score / (q_idx + 1) at q_idx -1, score / kv_idx at a
                # hidden key 0): NaN gradients where the kernels skip the pair.
                seen = _visible_pairs(allowed, scores.shape, causal, q_offset, window, q.device)
                picked = {n: torch.broadcast_to(t, scores.shape)[seen] for n, t in env.items()}
                values = torch.broadcast_to(evaluate(score_mod, picked, tensors or {}),
                                            picked["score"].shape).to(compute_dtype)
                scores = scores.new_full(scores.shape, -math.inf).masked_scatter(seen, values)
            else:
                scores = torch.broadcast_to(evaluate(score_mod, env, tensors or {}), scores.shape)
                scores = scores.to(compute_dtype)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -math.inf)
    if causal or window is not None:
        visible = visible_mask(q.shape[2], k.shape[2], causal=causal, q_offset=q_offset,
                               window=window, device=q.device)
        scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink = sinks.to(compute_dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    # Row max over visible keys (and the sink); 0 for a row that sees nothing.
    if scores.shape[-1] == 0:  # a sequence without keys (packed batches)
        top = scores.new_zeros((*scores.shape[:-1], 1))
    else:
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(scores - top)
    norm = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        weights = weights[..., :-1]
    if p_dtype is not None:
        weights = weights.to(torch.float32).to(p_dtype).to(compute_dtype)
    if dropout_p:
        keep = dropout_keep(*weights.shape, q_offset=q_offset, seed=seed, dropout_p=dropout_p,
                            device=q.device)
        # The kernels scale kept weights by the inverse of their exact keep rate.
        weights = weights * keep * (2**16 / (2**16 - dropout_threshold(dropout_p)))
    out = torch.matmul(weights, v64) / torch.where(norm == 0, torch.ones_like(norm), norm)
    if not return_lse:
        return out
    return out, (top + torch.log(norm)).squeeze(-1)

"""The attention that context parallelism runs on each block, behind one interface.

``SpecKernel`` wraps a generated module (its forward returns the LSE that merging
needs; a ``backward: true`` spec adds its backward kernels). ``ReferenceKernel``
computes the same in float64 with torch, so the parallel layer can be tested on CPU
(with torch.distributed's gloo backend) and checked against the real kernels.

Both take [B, H, S, D] tensors, a ``q_offset`` (query row i is at position
q_offset + i relative to key 0), and return what the generated kernels return:
out in the input dtype and lse [B, Hq, S] float32, -inf for a row with no key.
"""

from __future__ import annotations

import json
import math

import torch

from specgen.parallel.blocks import Mask

# Spec features whose meaning depends on absolute positions, per-head data or a
# random stream, which a block of the sequence cannot reproduce on its own.
_REFUSED = {
    "score_mod": "a score_mod hook",
    "mask_mod": "a mask_mod hook",
    "sinks": "attention sinks",
    "dropout": "dropout",
    "block_sparse": "a block-sparse map",
}


class SpecKernel:
    """The forward (and backward) kernels of a generated prefill module."""

    def __init__(self, module, mode: str = "ring"):
        spec = getattr(module, "SPEC", None)
        if not isinstance(spec, dict) or "family" not in spec:
            raise ValueError(
                f"module must be a specgen-generated module (with a SPEC dict), got {module!r}"
            )
        name = spec.get("name", "?")
        if spec["family"] != "prefill":
            raise ValueError(
                f"context parallelism runs prefill specs; {name} is a {spec['family']} spec"
            )
        if spec["dtype"] not in ("float16", "bfloat16"):
            raise ValueError(
                f"context parallelism runs float16 and bfloat16 specs; {name} has dtype {spec['dtype']}"
            )
        for field, what in _REFUSED.items():
            if spec.get(field):
                raise ValueError(
                    f"{name}: context parallelism ({mode} mode) cannot split a spec with {what}"
                )
        if mode == "ring" and not (spec.get("return_lse") or spec.get("backward")):
            raise ValueError(
                f"{name}: ring attention merges partial results through their LSE; "
                "the spec needs return_lse: true (forward) or backward: true (training)"
            )
        self.module, self.spec, self.name = module, spec, name
        self.has_backward = bool(spec.get("backward"))
        self.varlen = bool(spec.get("varlen"))
        window = spec.get("window") or {}
        self.mask = Mask(bool(spec["causal"]), window.get("left"), window.get("right"))
        self.dtype = module.DTYPE
        self.head_dim = module.HEAD_DIM
        self.v_head_dim = getattr(module, "V_HEAD_DIM", module.HEAD_DIM)
        self.group_size = module.GROUP_SIZE
        self.needs_cuda = True
        # What every rank must run alike: the whole spec, not only its name (two
        # modules of one name from other specs compute other attentions).
        self.identity = json.dumps(spec, sort_keys=True)
        self.max_grid_y = getattr(module, "MAX_GRID_Y", None)
        # Modules that run a batch past the y limit in slices of it.
        self.grid_y_slices = bool(getattr(module, "GRID_Y_SLICES", False))
        self.pack_gqa = bool(spec.get("pack_gqa"))

    def grid_problem(self, batch: int, q_heads: int, kv_heads: int, q_rows: int = 0,
                     k_rows: int = 0) -> str | None:
        """What this rank's kernel calls would refuse of their grid, found before any
        transfer: batch x heads on its y axis (None where they fit, or where the
        module runs the batch in slices that do: one entry's heads fit), and the
        tiles of at most ``q_rows`` queries and ``k_rows`` keys per call on its x
        axis (the smallest tiles of any config, which every device's fit)."""
        heads = kv_heads if self.pack_gqa else q_heads
        rows = batch * heads
        sliced = self.grid_y_slices and heads <= (self.max_grid_y or 0)
        if self.max_grid_y is not None and rows > self.max_grid_y and not sliced:
            what = "KV heads" if self.pack_gqa else "heads"
            return (f"batch * {what} per call must be at most {self.max_grid_y} (the kernels' grid y "
                    f"limit), got {batch} * {rows // max(batch, 1)}")
        limit = getattr(self.module, "MAX_GRID_X", None)
        for what, n, tile in self._x_tiles(q_rows, k_rows) if limit is not None else ():
            if -(-n // tile) > limit:
                return (f"{what} per call must be at most {limit * tile} ({limit} tiles of {tile}, the "
                        f"kernels' grid x limit), got {n}")
        return None

    def _x_tiles(self, q_rows: int, k_rows: int):
        """(what, rows, rows per tile) of each kernel's x axis: the forward's query
        tiles (the smallest config's; packed GQA: its positions per tile), and the
        backward's query and key tiles."""
        m = self.module
        tiles = [c["tile_m"] for configs in m.CONFIGS.values() for c in configs]
        packed = self.group_size if self.pack_gqa else 1
        yield "query rows", q_rows, max(1, min(tiles) // packed)
        if self.has_backward:
            yield "query rows", q_rows, getattr(m, "BWD_DQ_TILE_P", None) or m.BWD_DQ_TILE_M
            yield "keys", k_rows, m.BWD_TILE_N

    def default_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def forward(self, q, k, v, scale: float, q_offset: int):
        # _forward: the module's eager call (its checks and launch), without the test
        # of whether a tracer needs the custom op (the ring calls it eagerly).
        return self.module._forward(q, k, v, scale=scale, q_offset=q_offset)

    def backward(self, q, k, v, out, lse, dout, scale: float, q_offset: int, *, whole: bool = False):
        """(dq, dk, dv) of one block: q against these keys, with ``out`` and ``lse``
        of the whole attention the block is part of. ``whole``: the block holds every
        key its rows see (only then may the kernels take their exact D)."""
        if not self.has_backward:
            raise ValueError(f"{self.name} has no backward kernels (the spec needs backward: true)")
        return self.module._backward(q, k, v, out, lse, dout, scale, q_offset, exact_delta=whole)

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, q_shift, scale):
        """(out [T, Hq, Dv], lse [Hq, T]) of a packed batch, queries moved by q_shift."""
        return self.module._forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    max_seqlen_q=max_q, max_seqlen_k=max_k, q_shift=q_shift,
                                    scale=scale)

    def backward_varlen(self, q, k, v, out, lse, dout, cu_q, cu_k, max_q, max_k, q_shift, scale, *,
                        whole: bool = False):
        if not self.has_backward:
            raise ValueError(f"{self.name} has no backward kernels (the spec needs backward: true)")
        return self.module._backward(q, k, v, out, lse, dout, scale, cu_q, cu_k, max_q, max_k, q_shift,
                                     exact_delta=whole)

    def attention(self, q, k, v, scale: float, **kwargs):
        """The whole-sequence call (all-to-all mode), differentiable where the spec
        has a backward."""
        return self.module.attention(q, k, v, scale=scale, **kwargs)


class ReferenceKernel:
    """The same interface computed in float64 by torch (any device): a spec's
    position rule, soft-cap and GQA group, without a GPU."""

    def __init__(self, *, causal: bool, window: tuple | None = None, softcap: float | None = None,
                 dtype=torch.bfloat16, head_dim: int = 64, v_head_dim: int | None = None,
                 group_size: int = 1, varlen: bool = False):
        left, right = window or (None, None)
        self.mask = Mask(causal, left, right)
        self.softcap = softcap
        self.dtype, self.head_dim = dtype, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.group_size = group_size
        self.has_backward, self.varlen, self.needs_cuda = True, varlen, False
        self.name = "reference"
        self.identity = repr(("reference", self.mask, softcap, str(dtype), head_dim, self.v_head_dim,
                              group_size, varlen))
        self.calls = 0  # kernel calls made, for tests of the block planner

    def grid_problem(self, batch: int, q_heads: int, kv_heads: int, q_rows: int = 0,
                     k_rows: int = 0) -> str | None:
        return None  # torch has no grid limit

    def default_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def _scores(self, q, k, scale, q_offset):
        q64 = q.double()
        k64 = k.double().repeat_interleave(self.group_size, dim=1)
        raw = torch.matmul(q64, k64.transpose(-1, -2)) * scale
        capped = self.softcap * torch.tanh(raw / self.softcap) if self.softcap else raw
        rows = q_offset + torch.arange(q.shape[2], device=q.device)[:, None]
        keys = torch.arange(k.shape[2], device=q.device)[None, :]
        left, right = self.mask.key_bounds(rows)
        visible = (keys >= left) & (keys <= right)
        return raw, capped, visible

    def forward(self, q, k, v, scale: float, q_offset: int):
        self.calls += 1
        _, scores, visible = self._scores(q, k, scale, q_offset)
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.where(visible, torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None]), 0.0)
        v64 = v.double().repeat_interleave(self.group_size, dim=1)
        return torch.matmul(p, v64).to(self.dtype), lse.float()

    def backward(self, q, k, v, out, lse, dout, scale: float, q_offset: int, *, whole: bool = False):
        """FlashAttention's backward of one block, with the whole row's out and lse."""
        self.calls += 1
        raw, scores, visible = self._scores(q, k, scale, q_offset)
        lse64 = lse.double()[..., None]
        live = visible & torch.isfinite(lse64)
        p = torch.where(live, torch.exp(scores - torch.where(torch.isfinite(lse64), lse64, 0.0)), 0.0)
        g = self.group_size
        v64 = v.double().repeat_interleave(g, dim=1)
        k64 = k.double().repeat_interleave(g, dim=1)
        do64 = dout.double()
        dv = torch.matmul(p.transpose(-1, -2), do64)
        dp = torch.matmul(do64, v64.transpose(-1, -2))
        delta = (do64 * out.double()).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        if self.softcap:
            ds = ds * (1 - torch.tanh(raw / self.softcap) ** 2)
        dq = torch.matmul(ds, k64) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.double()) * scale

        def per_kv_head(t):
            b, h, s, d = t.shape
            return t.view(b, h // g, g, s, d).sum(2)

        return dq.to(self.dtype), per_kv_head(dk).to(self.dtype), per_kv_head(dv).to(self.dtype)

    @staticmethod
    def _sequences(cu_q, cu_k):
        bq, bk = cu_q.tolist(), cu_k.tolist()
        return list(zip(bq[:-1], bq[1:], bk[:-1], bk[1:]))

    @staticmethod
    def _heads_first(x):  # [L, H, D] -> [1, H, L, D]
        return x.transpose(0, 1).unsqueeze(0)

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, q_shift, scale):
        """The varlen kernels' contract: sequence b's query i sees keys
        j <= (seq_k - seq_q + q_shift) + i."""
        out = torch.zeros((q.shape[0], q.shape[1], self.v_head_dim), dtype=self.dtype, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        for qa, qb, ka, kb in self._sequences(cu_q, cu_k):
            if qb == qa:
                continue
            o, l = self.forward(*(self._heads_first(t) for t in (q[qa:qb], k[ka:kb], v[ka:kb])), scale,
                                (kb - ka) - (qb - qa) + q_shift)
            out[qa:qb] = o[0].transpose(0, 1)
            lse[:, qa:qb] = l[0]
        return out, lse

    def backward_varlen(self, q, k, v, out, lse, dout, cu_q, cu_k, max_q, max_k, q_shift, scale, *,
                        whole: bool = False):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qa, qb, ka, kb in self._sequences(cu_q, cu_k):
            if qb == qa or kb == ka:
                continue
            parts = [self._heads_first(t) for t in (q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb])]
            g = self.backward(*parts, lse[:, qa:qb].unsqueeze(0), self._heads_first(dout[qa:qb]), scale,
                              (kb - ka) - (qb - qa) + q_shift)
            dq[qa:qb], dk[ka:kb], dv[ka:kb] = (t[0].transpose(0, 1) for t in g)
        return dq, dk, dv

    def attention(self, q, k, v, scale: float, *, cu_seqlens_q=None, cu_seqlens_k=None, **_):
        """The whole sequence, differentiable; packed [T, H, D] with cu_seqlens
        where the kernel is varlen (sequence by sequence, equal q and k lengths)."""
        if not self.varlen:
            return _ReferenceAttention.apply(q, k, v, self, scale)
        bounds = cu_seqlens_q.tolist()
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            one = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, H, L, D]
            outs.append(_ReferenceAttention.apply(*one, self, scale)[0].transpose(0, 1))
        return torch.cat(outs, dim=0)


class _ReferenceAttention(torch.autograd.Function):
    """The reference over a whole sequence, with its backward (all-to-all tests)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, scale):
        out, lse = kernel.forward(q, k, v, scale, 0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.scale = kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(q, k, v, out, lse, dout, ctx.scale, 0)
        return dq, dk, dv, None, None

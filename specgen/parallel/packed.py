"""Ring attention over packed (varlen) batches.

Every sequence of the batch is sharded on its own (layout per sequence), and rank
r's shard packs its piece of each sequence in order. A ring step pairs the local
queries with the K/V shard in hand sequence by sequence; the pairs of one step
have the same structure in every sequence (the same pieces, the same relation), so
one varlen kernel call per structure serves the whole batch: the pieces are
gathered into packed buffers with their own cu_seqlens, and the kernel's
``q_shift`` moves the queries (0 for the diagonal block, a large shift for a block
that every query sees whole).

The structure comes from the dense planner (specgen.parallel.blocks) on a
representative length and is then checked, exactly, on every sequence of the
batch; a batch it does not fit raises ValueError before any transfer.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from specgen.parallel import layout as layouts
from specgen.parallel.blocks import Mask, _exact, _hidden, plan_step
from specgen.parallel.merge import merge_into
from specgen.parallel.ring import GradCarry, rotate, transfers

# A shift past any sequence length: every query sees every key of its sequence.
FULL = 1 << 29


@dataclasses.dataclass(frozen=True)
class PackedCall:
    """One varlen call: piece ``q_piece`` of each sequence's queries (None: all of
    them) against piece ``k_piece`` of its keys, with ``q_shift``."""

    q_piece: int | None
    k_piece: int | None
    q_shift: int


def _rows(pieces, which, length):
    return (0, length) if which is None else pieces[which]


def _as_piece(rows, pieces, length):
    if rows == (0, length):
        return None
    return pieces.index(rows)


def _step_structure(mask: Mask, layout, world, rank, src, length) -> list[PackedCall]:
    """The calls of a ring step for a sequence of shard length ``length``."""
    q_pos = layouts.positions(layout, world, rank, length)
    k_pos = layouts.positions(layout, world, src, length)
    q_pieces, k_pieces = layouts.pieces(layout, world, rank, length), layouts.pieces(layout, world, src, length)
    calls = []
    for c in plan_step(mask, q_pos, q_pieces, k_pos, k_pieces):
        q_len, k_len = c.q_stop - c.q_start, c.k_stop - c.k_start
        qp, kp = q_pos[c.q_start:c.q_stop], k_pos[c.k_start:c.k_stop]
        # In varlen terms the query offset is k_len - q_len + q_shift; a block every
        # query sees whole gets FULL, so one shift serves every sequence.
        every = _exact(mask, qp, kp, FULL)
        shift = FULL if every else c.q_offset - (k_len - q_len)
        calls.append(PackedCall(_as_piece((c.q_start, c.q_stop), q_pieces, length),
                                _as_piece((c.k_start, c.k_stop), k_pieces, length), shift))
    return calls


def _fits(mask, layout, world, rank, src, length, calls) -> bool:
    """Whether ``calls`` compute exactly the step's pairs for a sequence of shard
    length ``length``: each call exact (or empty), and every pair no call covers hidden."""
    q_pos = layouts.positions(layout, world, rank, length)
    k_pos = layouts.positions(layout, world, src, length)
    q_pieces, k_pieces = layouts.pieces(layout, world, rank, length), layouts.pieces(layout, world, src, length)
    covered = set()
    for call in calls:
        qa, qb = _rows(q_pieces, call.q_piece, length)
        ka, kb = _rows(k_pieces, call.k_piece, length)
        if qb <= qa or kb <= ka:
            continue
        offset = (kb - ka) - (qb - qa) + call.q_shift
        if not _exact(mask, q_pos[qa:qb], k_pos[ka:kb], offset):
            return False
        covered |= {(i, j) for i in range(len(q_pieces)) for j in range(len(k_pieces))
                    if qa <= q_pieces[i][0] and q_pieces[i][1] <= qb and ka <= k_pieces[j][0] and k_pieces[j][1] <= kb}
    for i, (qa, qb) in enumerate(q_pieces):
        for j, (ka, kb) in enumerate(k_pieces):
            if (i, j) not in covered and qb > qa and kb > ka and not _hidden(mask, q_pos[qa:qb], k_pos[ka:kb]):
                return False
    return True


@functools.lru_cache(maxsize=64)
def packed_plans(mask: Mask, layout: str, world: int, rank: int, lengths: tuple) -> tuple:
    """Per ring step, the varlen calls of rank ``rank`` for sequences whose shards
    are ``lengths`` long. ValueError if no common structure fits every sequence."""
    representative = 2 * max(4, max(lengths))
    plans = []
    for step in range(world):
        src = (rank - step) % world
        calls = _step_structure(mask, layout, world, rank, src, representative)
        for length in set(lengths):
            if not _fits(mask, layout, world, rank, src, length, calls):
                raise ValueError(
                    f"ring mode cannot split a packed sequence with {length * world} positions "
                    f"exactly over {world} ranks ({layout} layout); use mode='ulysses'")
        plans.append(tuple(calls))
    return tuple(plans)


class _Selection:
    """The rows of one piece of every sequence in a packed shard, and their cu_seqlens."""

    def __init__(self, layout, world, rank, lengths, local_cu, which, device):
        starts, sizes = [], []
        for length, base in zip(lengths, local_cu):
            a, b = _rows(layouts.pieces(layout, world, rank, length), which, length)
            starts.append(base + a)
            sizes.append(b - a)
        self.all = which is None
        self.rows = sum(sizes)  # none: the call has nothing to compute (a piece empty in every sequence)
        self.cu = torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=torch.int32, device=device)
        self.longest = max(sizes) if sizes else 0
        if not self.all:
            self.index = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, sizes)]).to(device) \
                if sum(sizes) else torch.zeros(0, dtype=torch.int64, device=device)

    def take(self, x):
        return x if self.all else x.index_select(0, self.index)


def _selections(layout, world, rank, lengths, device):
    local_cu = [0] + list(itertools.accumulate(lengths))[:-1]
    cache = {}

    def get(which, owner):
        key = (which, owner)
        if key not in cache:
            cache[key] = _Selection(layout, world, owner, lengths, local_cu, which, device)
        return cache[key]

    return get


def packed_forward(kernel, ring, plans, layout, lengths, q, k, v, scale):
    """(out [T, Hq, Dv] in q's dtype, lse [T, Hq] float32) of every packed sequence's
    queries against its keys on every rank."""
    world, rank = ring.world_size, ring.rank
    total, heads = q.shape[:2]
    out = torch.zeros((total, heads, kernel.v_head_dim), dtype=torch.float32, device=q.device)
    lse = torch.full((total, heads), float("-inf"), dtype=torch.float32, device=q.device)
    select = _selections(layout, world, rank, lengths, q.device)
    steps = rotate(ring, k, v, len(plans))
    with transfers(steps):
        for step, k_cur, v_cur in steps:
            src = (rank - step) % world
            for call in plans[step]:
                qs, ks = select(call.q_piece, rank), select(call.k_piece, src)
                if not (qs.rows and ks.rows):
                    continue
                block_out, block_lse = kernel.forward_varlen(
                    qs.take(q), ks.take(k_cur), ks.take(v_cur), qs.cu, ks.cu, qs.longest, ks.longest,
                    call.q_shift, scale)
                block_lse = block_lse.t()  # [rows, heads], the accumulator's layout
                if qs.all:
                    merge_into(out, lse, block_out, block_lse)
                else:
                    rows_out, rows_lse = out.index_select(0, qs.index), lse.index_select(0, qs.index)
                    merge_into(rows_out, rows_lse, block_out, block_lse)
                    out.index_copy_(0, qs.index, rows_out)
                    lse.index_copy_(0, qs.index, rows_lse)
    return out.to(q.dtype), lse


def packed_backward(kernel, ring, plans, layout, lengths, q, k, v, out, lse, dout, scale):
    """(dq, dk, dv) of a packed shard, as ring_backward computes them."""
    world, rank = ring.world_size, ring.rank
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    select = _selections(layout, world, rank, lengths, q.device)
    lse_rows = lse.t().contiguous()  # [heads, T], the kernels' layout
    carry = GradCarry(ring, k, v)
    steps = rotate(ring, k, v, len(plans))
    with transfers(steps, carry):
        for step, k_cur, v_cur in steps:
            src = (rank - step) % world
            grads, dk_part, dv_part = carry.new()
            for call in plans[step]:
                qs, ks = select(call.q_piece, rank), select(call.k_piece, src)
                if not (qs.rows and ks.rows):
                    continue
                call_lse = lse_rows if qs.all else lse_rows.index_select(1, qs.index)
                dq_c, dk_c, dv_c = kernel.backward_varlen(
                    qs.take(q), ks.take(k_cur), ks.take(v_cur), qs.take(out), call_lse.contiguous(), qs.take(dout),
                    qs.cu, ks.cu, qs.longest, ks.longest, call.q_shift, scale)
                if qs.all:
                    dq += dq_c
                else:
                    dq.index_add_(0, qs.index, dq_c.float())
                if ks.all:
                    dk_part += dk_c
                    dv_part += dv_c
                else:
                    dk_part.index_add_(0, ks.index, dk_c.float())
                    dv_part.index_add_(0, ks.index, dv_c.float())
            carry.pass_on(grads)
    dk, dv = carry.own()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class PackedRingAttention(torch.autograd.Function):
    """Exact attention of this rank's packed shard over the whole packed batch."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, ring, plans, layout, lengths, scale):
        out, lse = packed_forward(kernel, ring, plans, layout, lengths, q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, ring, plans, layout, lengths, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, ring, plans, layout, lengths, scale = ctx.args
        dq, dk, dv = packed_backward(kernel, ring, plans, layout, lengths, q, k, v, out, lse,
                                     dout.contiguous(), scale)
        return dq, dk, dv, None, None, None, None, None, None

"""Ring attention: K/V shards travel around the ranks while each rank attends its
queries to the shard in hand.

Forward: at step s rank r holds the K/V of rank r - s. It posts the transfer of
that shard to rank r + 1 (and the receipt of the next from r - 1) with
``torch.distributed.batch_isend_irecv``, which NCCL runs on its own stream, then
runs the kernel calls of the step (specgen.parallel.blocks) and folds their
(out, lse) into float32 accumulators (specgen.parallel.merge); the transfer is
hidden behind that work. Backward: the K/V go round again and the gradients of
each shard's K and V travel with it (float32, one step behind the K/V), each rank
adding its part, until they reach the shard's owner; dQ stays local.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from specgen.parallel import layout as layouts
from specgen.parallel.blocks import Call, Mask, plan_step
from specgen.parallel.merge import merge_into


class Ring:
    """Point-to-point transfers to the next rank and from the previous one."""

    def __init__(self, group):
        """``group``: a process group, or None for a single process (no transfers)."""
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if self.world_size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world_size)

    def shift(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the
        previous one; returns the works to wait on."""
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ]
        return dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works or ():
        work.wait()


@functools.lru_cache(maxsize=256)
def step_plans(mask: Mask, layout: str, world_size: int, rank: int, shard_len: int) -> tuple[tuple[Call, ...], ...]:
    """The kernel calls of every ring step of rank ``rank`` (step s: the K/V shard
    of rank - s)."""
    q_pos = layouts.positions(layout, world_size, rank, shard_len)
    plans = []
    for step in range(world_size):
        src = (rank - step) % world_size
        k_pos = layouts.positions(layout, world_size, src, shard_len)
        plans.append(tuple(plan_step(mask, q_pos, layouts.pieces(layout, world_size, rank, shard_len),
                                     k_pos, layouts.pieces(layout, world_size, src, shard_len))))
    return tuple(plans)


class _Packed:
    """K and V in one flat buffer, so one transfer moves both."""

    def __init__(self, k_shape, v_shape, dtype, device):
        self.k_shape, self.v_shape = tuple(k_shape), tuple(v_shape)
        self.split = int(torch.Size(k_shape).numel())
        self.total = self.split + int(torch.Size(v_shape).numel())
        self.dtype, self.device = dtype, device

    def empty(self, dtype=None):
        return torch.empty(self.total, dtype=dtype or self.dtype, device=self.device)

    def zeros(self, dtype=None):
        return torch.zeros(self.total, dtype=dtype or self.dtype, device=self.device)

    def pack(self, k, v):
        buf = self.empty()
        self.views(buf)[0].copy_(k)
        self.views(buf)[1].copy_(v)
        return buf

    def views(self, buf):
        return buf[: self.split].view(self.k_shape), buf[self.split:].view(self.v_shape)


def rotate(ring: Ring, k, v, steps: int):
    """The K/V shard in hand at each of ``steps`` ring steps, as (step, k, v): the
    transfer of the next shard starts before a step is handed out and is waited on
    after its work, so the two overlap."""
    packed = _Packed(k.shape, v.shape, k.dtype, k.device)
    current = packed.pack(k, v) if ring.world_size > 1 else None
    k_cur, v_cur = k, v
    for step in range(steps):
        works, incoming = None, None
        if step + 1 < ring.world_size:
            incoming = packed.empty()
            works = ring.shift(current, incoming)
        try:
            yield step, k_cur, v_cur
        except GeneratorExit:
            # The step raised (the caller closes this generator): finish the transfer
            # it posted, which the neighbours posted too, so the next call starts on
            # a clean ring instead of matching this call's leftover transfers.
            _wait(works)
            raise
        if incoming is not None:
            _wait(works)
            current = incoming  # the sent buffer is dropped only after its transfer
            k_cur, v_cur = packed.views(current)


@contextlib.contextmanager
def transfers(steps, carry=None):
    """Run a ring's ``steps`` (a rotate generator); where a step raises, finish the
    transfers it posted (the K/V, and the gradients ``carry`` has in flight) before
    the error leaves, so the next call starts on a clean ring."""
    try:
        yield steps
    except BaseException:
        if carry is not None:
            carry.drain()
        raise
    finally:
        steps.close()


class GradCarry:
    """The float32 dK, dV of the shard in hand, carried around the ring with it:
    each rank adds its part to what the ranks before it summed and passes the total
    on; after the last step the total of this rank's own shard has arrived."""

    def __init__(self, ring: Ring, k, v):
        self.ring = ring
        self.packed = _Packed(k.shape, v.shape, k.dtype, k.device)
        self.works, self.incoming, self.sent = None, None, None

    def new(self):
        """A zeroed (buffer, dk view, dv view) for this rank's part at one step."""
        grads = self.packed.zeros(torch.float32)
        return (grads, *self.packed.views(grads))

    def pass_on(self, grads) -> None:
        """Add what arrived for this shard, and send the sum to the next rank."""
        if self.incoming is not None:
            _wait(self.works)
            grads += self.incoming
        if self.ring.world_size > 1:
            self.incoming = self.packed.empty(torch.float32)
            self.works = self.ring.shift(grads, self.incoming)
            self.sent = grads  # alive until its transfer completes
        else:
            self.incoming = grads

    def drain(self) -> None:
        """Wait for the gradients in flight (a step raised: the ring stops here)."""
        _wait(self.works)
        self.works, self.sent = None, None

    def own(self):
        """(dk, dv) float32 of this rank's shard, summed over every rank."""
        if self.ring.world_size > 1:
            _wait(self.works)
            self.sent = None
        return self.packed.views(self.incoming)


def _single_call(plans):
    """The one call of a ring with one step and one call (world size 1), or None."""
    calls = [c for step in plans for c in step]
    return calls[0] if len(plans) == 1 and len(calls) == 1 else None


def ring_forward(kernel, ring: Ring, plans, q, k, v, scale):
    """(out in q's dtype, lse float32) of q against every rank's K/V."""
    only = _single_call(plans)
    if only is not None and (only.q_start, only.q_stop) == (0, q.shape[2]):
        return kernel.forward(q, k[:, :, only.k_start:only.k_stop], v[:, :, only.k_start:only.k_stop],
                              scale, only.q_offset)
    batch, heads, rows = q.shape[:3]
    out = torch.zeros((batch, heads, rows, kernel.v_head_dim), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, rows), float("-inf"), dtype=torch.float32, device=q.device)
    touched = [False] * rows  # rows that hold a block's result already
    steps = rotate(ring, k, v, len(plans))
    with transfers(steps):
        for step, k_cur, v_cur in steps:
            for c in plans[step]:
                block_out, block_lse = kernel.forward(
                    q[:, :, c.q_start:c.q_stop], k_cur[:, :, c.k_start:c.k_stop],
                    v_cur[:, :, c.k_start:c.k_stop], scale, c.q_offset)
                rows_out, rows_lse = out[:, :, c.q_start:c.q_stop], lse[:, :, c.q_start:c.q_stop]
                if any(touched[c.q_start:c.q_stop]):
                    merge_into(rows_out, rows_lse, block_out, block_lse)
                else:  # the first block these rows see: nothing to merge with
                    rows_out.copy_(block_out)
                    rows_lse.copy_(block_lse)
                    touched[c.q_start:c.q_stop] = [True] * (c.q_stop - c.q_start)
    return out.to(q.dtype), lse


def ring_backward(kernel, ring: Ring, plans, q, k, v, out, lse, dout, scale):
    """(dq, dk, dv) in the inputs' dtypes: dq from this rank's queries against every
    shard; dk, dv of this rank's shard summed over every rank's queries."""
    only = _single_call(plans)
    if only is not None and (only.q_start, only.q_stop, only.k_start, only.k_stop) == (0, q.shape[2], 0, k.shape[2]):
        return kernel.backward(q, k, v, out, lse, dout, scale, only.q_offset, whole=True)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dout = dout.contiguous() if dout.stride(-1) != 1 else dout
    carry = GradCarry(ring, k, v)
    steps = rotate(ring, k, v, len(plans))
    with transfers(steps, carry):
        for step, k_cur, v_cur in steps:
            grads, dk_part, dv_part = carry.new()
            for c in plans[step]:
                rows, keys = slice(c.q_start, c.q_stop), slice(c.k_start, c.k_stop)
                dq_c, dk_c, dv_c = kernel.backward(
                    q[:, :, rows], k_cur[:, :, keys], v_cur[:, :, keys], out[:, :, rows],
                    lse[:, :, rows].contiguous(), dout[:, :, rows], scale, c.q_offset)  # a block: D = dO . O
                dq[:, :, rows] += dq_c
                dk_part[:, :, keys] += dk_c
                dv_part[:, :, keys] += dv_c
            carry.pass_on(grads)
    dk, dv = carry.own()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Exact attention of this rank's query shard over the whole sequence."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, ring, plans, scale):
        out, lse = ring_forward(kernel, ring, plans, q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.ring, ctx.plans, ctx.scale = kernel, ring, plans, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.kernel, ctx.ring, ctx.plans, q, k, v, out, lse, dout, ctx.scale)
        return dq, dk, dv, None, None, None, None

"""All-to-all (Ulysses-style) context parallelism: trade the sequence shard for a
head shard, attend over the whole sequence locally, and trade back.

Rank r sends head group g of its sequence shard to rank g and receives every rank's
shard of its own head group, so it holds H / world heads over the whole sequence.
Any spec then runs unchanged, masks and packed batches included, at the cost of two
all-to-alls of Q, K, V and O per call (and two of their gradients); it needs the
query and KV heads to divide by the world size. Ring attention moves only K and V
and is the better choice when each rank's shard is long.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x [W, ...] contiguous: row w goes to rank w; the result's row w came from it."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group, seq_dim: int) -> torch.Tensor:
    """[..., H, ..., L, ...] sequence shard -> [..., H / W, ..., W * L, ...] head
    shard, the W sequence shards concatenated in rank order. The head axis is
    ``seq_dim - 1`` (4-D [B, H, S, D]) or ``seq_dim + 1`` (3-D packed [T, H, D])."""
    world = dist.get_world_size(group)
    head_dim = 1
    x = x.movedim(head_dim, 0)  # [H, ...]
    heads = x.shape[0]
    seq_axis = seq_dim if seq_dim > head_dim else seq_dim + 1
    parts = x.reshape(world, heads // world, *x.shape[1:]).contiguous()
    got = _all_to_all(parts, group)  # [W(source), H / W, ...]
    got = torch.cat(got.unbind(0), dim=seq_axis)  # sequences side by side
    return got.movedim(0, head_dim)


def heads_to_seq(y: torch.Tensor, group, seq_dim: int) -> torch.Tensor:
    """The inverse of seq_to_heads."""
    world = dist.get_world_size(group)
    head_dim = 1
    y = y.movedim(head_dim, 0)  # [H / W, ...]
    seq_axis = seq_dim if seq_dim > head_dim else seq_dim + 1
    shard = y.shape[seq_axis] // world
    parts = torch.stack(y.split(shard, dim=seq_axis), dim=0).contiguous()  # [W(dest), H / W, ...]
    got = _all_to_all(parts, group)  # [W(source head group), H / W, ...]
    got = got.reshape(-1, *got.shape[2:])  # [H, ...]
    return got.movedim(0, head_dim)


class SeqToHeads(torch.autograd.Function):
    """seq_to_heads, with the inverse as its backward."""

    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return seq_to_heads(x, group, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad.contiguous(), ctx.group, ctx.seq_dim), None, None


class HeadsToSeq(torch.autograd.Function):
    """heads_to_seq, with the inverse as its backward."""

    @staticmethod
    def forward(ctx, y, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return heads_to_seq(y, group, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad.contiguous(), ctx.group, ctx.seq_dim), None, None


def packed_order(cu_seqlens: torch.Tensor, world_size: int, total: int) -> torch.Tensor:
    """For a packed batch of ``total`` rows whose sequences are each split into
    world_size contiguous shards (rank r holds the r-th shard of every sequence,
    packed in sequence order), the row of the rank-ordered concatenation of the
    shards that holds each row of the whole batch."""
    cu = cu_seqlens.to(torch.int64)
    token = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu, token, right=True) - 1
    within = token - cu[seq]
    local_len = (cu[seq + 1] - cu[seq]) // world_size
    source = within // local_len  # the rank whose shard holds the row
    return source * (total // world_size) + cu[seq] // world_size + within % local_len

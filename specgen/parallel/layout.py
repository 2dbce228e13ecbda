"""Where each rank's shard of a sequence sits.

Context parallelism splits one sequence of ``seq_len`` positions into ``world_size``
equal shards, one per rank, along the sequence axis. Two layouts are supported:

- ``contiguous``: rank r holds positions [r * L, (r + 1) * L), with L = seq_len / world.
- ``zigzag``: the sequence is cut into 2 * world chunks and rank r holds chunk r and
  chunk 2 * world - 1 - r. Under a causal mask an early chunk sees few keys and a
  late one many, so pairing them gives every rank the same work (a ring over the
  contiguous layout leaves rank 0 idle for most steps).

A shard of odd length L is cut into chunks of L // 2 and L - L // 2 positions, so
any L works. Everything here is plain torch and runs on any device.
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    """ValueError unless ``layout`` is one of LAYOUTS."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def chunks(layout: str, world_size: int, rank: int, shard_len: int) -> list[tuple[int, int]]:
    """The (global start, length) of each contiguous piece of rank ``rank``'s shard,
    in the order the shard stores them; shards are ``shard_len`` long."""
    check_layout(layout)
    if layout == "contiguous" or world_size == 1:
        return [(rank * shard_len, shard_len)]
    head, tail = shard_len // 2, shard_len - shard_len // 2
    # Chunks 0..W-1 hold `head` positions each and chunks W..2W-1 `tail`, so chunk c
    # starts at c * head for c < W, and at W * head + (c - W) * tail after that.
    late = 2 * world_size - 1 - rank
    return [(rank * head, head), (world_size * head + (late - world_size) * tail, tail)]


def pieces(layout: str, world_size: int, rank: int, shard_len: int) -> list[tuple[int, int]]:
    """The (start, stop) local rows of each contiguous piece of rank ``rank``'s shard."""
    out, start = [], 0
    for _, n in chunks(layout, world_size, rank, shard_len):
        out.append((start, start + n))
        start += n
    return out


def positions(layout: str, world_size: int, rank: int, shard_len: int) -> torch.Tensor:
    """[shard_len] int64: the global position of each row of rank ``rank``'s shard."""
    parts = [torch.arange(start, start + n) for start, n in chunks(layout, world_size, rank, shard_len)]
    return torch.cat(parts)


def order(layout: str, world_size: int, shard_len: int) -> torch.Tensor:
    """[world_size * shard_len] int64: the global position of each row of the
    concatenation of every rank's shard (rank 0's first)."""
    return torch.cat([positions(layout, world_size, r, shard_len) for r in range(world_size)])


def shard(x: torch.Tensor, layout: str, world_size: int, rank: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s shard of the full-sequence tensor ``x`` (sequence axis
    ``dim``), a contiguous copy. The sequence length must divide by world_size."""
    check_layout(layout)
    seq_len = x.shape[dim]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if seq_len % world_size:
        raise ValueError(
            f"the sequence length ({seq_len}) must divide by the world size ({world_size}) "
            "so that every rank holds an equal shard"
        )
    index = positions(layout, world_size, rank, seq_len // world_size).to(x.device)
    return x.index_select(dim, index).contiguous()


def unshard(shards: list[torch.Tensor], layout: str, dim: int = 2) -> torch.Tensor:
    """The full-sequence tensor from every rank's shard (list index = rank)."""
    check_layout(layout)
    world_size, shard_len = len(shards), shards[0].shape[dim]
    stacked = torch.cat(shards, dim=dim)
    # stacked row i holds global position order[i]; invert that permutation.
    inverse = torch.argsort(order(layout, world_size, shard_len)).to(stacked.device)
    return stacked.index_select(dim, inverse)


def gather(x: torch.Tensor, layout: str, group=None, dim: int = 2) -> torch.Tensor:
    """The full-sequence tensor on every rank of ``group`` from each rank's shard
    ``x`` (an all_gather; for tests and examples, not a training step)."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard(parts, layout, dim=dim)

"""The kernel calls of one ring step: which rows of the local queries meet which
rows of the K/V shard in hand, and with which q_offset.

A generated kernel knows only the relative offset of its queries to its keys:
query row i (position q_offset + i) sees key j under the spec's mask (j <= p when
causal, p - left <= j <= p + right with a window). A ring step pairs the local
queries, at global positions ``q_pos``, with a K/V shard at ``k_pos``. This module
finds the fewest calls whose masks, in the kernel's relative terms, give exactly the
global mask, and leaves out the pairs no query sees (the causal blocks above the
diagonal). Every candidate call is checked row by row, so a call is planned only
when it is exact.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Mask:
    """The position rule of a spec: causal, and a window (None: unbounded)."""

    causal: bool
    left: int | None = None
    right: int | None = None

    def key_bounds(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For query positions ``pos``, the closed range [lo, hi] of key positions
        they see (int64; lo > hi where the range is empty of any key >= 0)."""
        big = torch.iinfo(torch.int64).max // 4
        hi = torch.full_like(pos, big)
        if self.causal:
            hi = torch.minimum(hi, pos)
        if self.right is not None:
            hi = torch.minimum(hi, pos + self.right)
        lo = pos - self.left if self.left is not None else torch.full_like(pos, -big)
        return lo, hi


@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call: local query rows [q_start, q_stop) against rows
    [k_start, k_stop) of the K/V shard in hand, at ``q_offset``."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    q_offset: int

    @property
    def pairs(self) -> int:
        return (self.q_stop - self.q_start) * (self.k_stop - self.k_start)


def _index_ranges(mask: Mask, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """Per query row, the [lo, hi) range of key rows (indices into the sorted
    ``k_pos``) it sees, with empty ranges written as (0, 0)."""
    lo_pos, hi_pos = mask.key_bounds(q_pos)
    lo = torch.searchsorted(k_pos, lo_pos, right=False)
    hi = torch.searchsorted(k_pos, hi_pos, right=True)
    empty = hi <= lo
    return torch.where(empty, 0, lo), torch.where(empty, 0, hi)


def _exact(mask: Mask, q_pos, k_pos, offset: int) -> bool:
    """Whether a kernel call over these rows at ``offset`` sees exactly the pairs
    the global mask shows. The key rows of a shard piece are sorted positions, so
    each query sees one contiguous range of them: compare the ranges."""
    want = _index_ranges(mask, q_pos, k_pos)
    local_q = offset + torch.arange(len(q_pos), dtype=torch.int64)
    got = _index_ranges(mask, local_q, torch.arange(len(k_pos), dtype=torch.int64))
    return bool(torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]))


def _hidden(mask: Mask, q_pos, k_pos) -> bool:
    lo, hi = _index_ranges(mask, q_pos, k_pos)
    return bool((hi <= lo).all())


def _groupings(pieces: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The ways to cover a shard's rows: all at once, or piece by piece."""
    whole = [(pieces[0][0], pieces[-1][1])]
    return [whole] if len(pieces) == 1 else [whole, pieces]


def plan_step(mask: Mask, q_pos: torch.Tensor, q_pieces, k_pos: torch.Tensor, k_pieces) -> list[Call]:
    """The calls of one ring step, fewest first: local query rows at global
    positions ``q_pos`` (cut into contiguous ``q_pieces`` of (start, stop) rows)
    against a K/V shard at ``k_pos`` (``k_pieces``). Positions must ascend within
    the K/V shard."""
    q_pos, k_pos = q_pos.to(torch.int64).cpu(), k_pos.to(torch.int64).cpu()
    q_pieces = [p for p in q_pieces if p[1] > p[0]]
    k_pieces = [p for p in k_pieces if p[1] > p[0]]
    if not q_pieces or not k_pieces:
        return []
    best = None
    for q_group in _groupings(q_pieces):
        for k_group in _groupings(k_pieces):
            calls = []
            for qa, qb in q_group:
                for ka, kb in k_group:
                    qp, kp = q_pos[qa:qb], k_pos[ka:kb]
                    if _hidden(mask, qp, kp):
                        continue
                    # Candidates: the true relative offset of the first rows (exact
                    # when both sides are contiguous in position), and "every key
                    # visible" (a block wholly below the causal diagonal).
                    for offset in (int(qp[0] - kp[0]), kb - ka - 1):
                        if _exact(mask, qp, kp, offset):
                            calls.append(Call(qa, qb, ka, kb, offset))
                            break
                    else:
                        calls = None
                        break
                if calls is None:
                    break
            if calls is not None and (best is None or len(calls) < len(best)):
                best = calls
    if best is None:  # cannot happen: single pieces are contiguous in position
        raise RuntimeError("no exact kernel calls for this ring step")
    return best

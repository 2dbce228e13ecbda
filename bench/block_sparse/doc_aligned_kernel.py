"""The document-aligned packed forward's kernel and work list (see doc_aligned.py):
kept in a module of its own so that specgen's emulator can run it on the CPU."""

import math

import cuda.tile as ct
import torch

ConstInt = ct.Constant[int]


def _kernel(occupancy: int):
    @ct.kernel(occupancy=occupancy)
    def doc_aligned(Q, K, V, Out, Items, qk_scale: float, TILE_M: ConstInt, TILE_N: ConstInt):
        item, kv_head = ct.bid(0), ct.bid(1)
        TILE_P = TILE_M // 4
        batch = ct.load(Items, (item, 0), shape=())
        q0 = ct.load(Items, (item, 1), shape=())
        n_rows = ct.load(Items, (item, 2), shape=())
        k0 = ct.load(Items, (item, 3), shape=())
        scale = qk_scale * 1.4426950408889634
        Qs = Q.slice(axis=2, start=q0, stop=q0 + n_rows)
        Outs = Out.slice(axis=2, start=q0, stop=q0 + n_rows)
        Ks = K.slice(axis=2, start=k0, stop=q0 + n_rows)
        Vs = V.slice(axis=2, start=k0, stop=q0 + n_rows)
        # key positions relative to k0; row r's position relative to k0
        rows = (q0 - k0) + (ct.arange(TILE_M, dtype=ct.int32) % TILE_P)[:, None]
        cols = ct.arange(TILE_N, dtype=ct.int32)[None, :]
        m_i = ct.full((TILE_M, 1), -math.inf, dtype=ct.float32)
        l_i = ct.full((TILE_M, 1), 0.0, dtype=ct.float32)
        acc = ct.full((TILE_M, 128), 0.0, dtype=ct.float32)
        q = ct.load(Qs, index=(batch, kv_head, 0, 0), shape=(1, 4, TILE_P, 128),
                    padding_mode=ct.PaddingMode.ZERO).reshape((TILE_M, 128))
        q = (q.astype(ct.float32) * scale).astype(Q.dtype)
        # key tiles wholly at or before the first row: every pair visible
        num_full = (q0 - k0 + 1) // TILE_N
        num_n = ct.cdiv(q0 + n_rows - k0, TILE_N)
        for j in range(0, num_full):
            k_t = ct.load(Ks, index=(batch, kv_head, 0, j), shape=(1, 1, 128, TILE_N),
                          order=(0, 1, 3, 2), latency=2).reshape((128, TILE_N))
            s = ct.mma(q, k_t, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
            m_new = max(m_i, ct.max(s, axis=-1, keepdims=True))
            p = ct.exp2(s - m_new, flush_to_zero=True)
            alpha = ct.exp2(m_i - m_new, flush_to_zero=True)
            l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
            acc = acc * alpha
            m_i = m_new
            v = ct.load(Vs, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, 128),
                        latency=4).reshape((TILE_N, 128))
            acc = ct.mma(p.astype(Q.dtype), v, acc)
        for j in range(num_full, num_n):
            k_t = ct.load(Ks, index=(batch, kv_head, 0, j), shape=(1, 1, 128, TILE_N),
                          order=(0, 1, 3, 2), latency=2,
                          padding_mode=ct.PaddingMode.ZERO).reshape((128, TILE_N))
            s = ct.mma(q, k_t, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
            s = ct.where(j * TILE_N + cols <= rows, s, -math.inf)
            m_new = max(m_i, ct.max(s, axis=-1, keepdims=True))
            p = ct.exp2(s - m_new, flush_to_zero=True)
            alpha = ct.exp2(m_i - m_new, flush_to_zero=True)
            l_i = l_i * alpha + ct.sum(p, axis=-1, keepdims=True)
            acc = acc * alpha
            m_i = m_new
            v = ct.load(Vs, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, 128),
                        latency=4, padding_mode=ct.PaddingMode.ZERO).reshape((TILE_N, 128))
            acc = ct.mma(p.astype(Q.dtype), v, acc)
        out = ct.truediv(acc, l_i, flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX)
        ct.store(Outs, index=(batch, kv_head, 0, 0),
                 tile=out.reshape((1, 4, TILE_P, 128)).astype(Out.dtype))

    return doc_aligned


def work_items(doc: torch.Tensor, tile_p: int, tile_n: int) -> torch.Tensor:
    """[n, 4] int32 (batch, q0, rows, k0): each document cut into runs of tile_p
    positions from its first, heaviest (most key tiles) first."""
    items = []
    for b in range(doc.shape[0]):
        ids = doc[b].cpu()
        starts = [0] + (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
        ends = starts[1:] + [ids.numel()]
        for s, e in zip(starts, ends):
            for q0 in range(s, e, tile_p):
                items.append((b, q0, min(tile_p, e - q0), s))
    items.sort(key=lambda it: -(-(it[1] + it[2] - it[3]) // tile_n))
    return torch.tensor(items, dtype=torch.int32, device=doc.device)

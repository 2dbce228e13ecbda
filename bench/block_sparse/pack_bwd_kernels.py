"""Packed-GQA backward kernels for the packed-document mask (doc[b, q_idx] ==
doc[b, kv_idx], causal, D128, GQA 4), a prototype for bench/block_sparse/pack_bwd.py.

As the packed forward does, a query tile holds TILE_P positions of the GROUP_SIZE
query heads of one KV head (TILE_M = GROUP_SIZE * TILE_P rows), so its key span (dQ)
or the query span a key tile meets (dK/dV) is that of TILE_P positions. Both kernels
follow block maps built at TILE_P-position query tiles by the shipped module's map
kernel; D comes from the shipped module's delta kernel. Written for timing against
the shipped two-kernel backward; not a generated module.
"""

import math

import cuda.tile as ct
import torch

ConstInt = ct.Constant[int]
GROUP_SIZE = 4
HEAD_DIM = 128
INV_LN2 = 1.0 / math.log(2.0)


def _q_rows(X, batch, kv_head, i, TILE_P, WIDTH):
    """The packed rows [GROUP_SIZE * TILE_P, WIDTH] of query tile i of KV head kv_head."""
    tile = ct.load(X, index=(batch, kv_head, i, 0), shape=(1, GROUP_SIZE, TILE_P, WIDTH),
                   padding_mode=ct.PaddingMode.ZERO)
    return tile.reshape((GROUP_SIZE * TILE_P, WIDTH))


def _q_values(X, batch, kv_head, i, TILE_P):
    """[1, GROUP_SIZE * TILE_P] of a [B, H, S] array, in the packed rows' order."""
    tile = ct.load(X, index=(batch, kv_head, i), shape=(1, GROUP_SIZE, TILE_P), padding_mode=ct.PaddingMode.ZERO)
    return tile.reshape((1, GROUP_SIZE * TILE_P))


@ct.kernel(occupancy=2)
def packed_dkdv(Q, K, V, DOut, Lse, Delta, DK, DV, Doc, MapCounts, MapIdx, qk_scale: float, q_offset: int,
                TILE_P: ConstInt, TILE_N: ConstInt):
    """dK and dV of TILE_N keys of one (batch, KV head), over the packed query tiles
    (all GROUP_SIZE heads at once) that see them."""
    TILE_M = GROUP_SIZE * TILE_P
    num_kv_heads = K.shape[1]
    kv_tile = ct.bid(0)
    batch, kv_head = ct.bid(1) // num_kv_heads, ct.bid(1) % num_kv_heads
    seq_q, seq_k = Q.shape[2], K.shape[2]
    k = ct.load(K, index=(batch, kv_head, kv_tile, 0), shape=(1, 1, TILE_N, HEAD_DIM),
                padding_mode=ct.PaddingMode.ZERO).reshape((TILE_N, HEAD_DIM))
    v = ct.load(V, index=(batch, kv_head, kv_tile, 0), shape=(1, 1, TILE_N, HEAD_DIM),
                padding_mode=ct.PaddingMode.ZERO).reshape((TILE_N, HEAD_DIM))
    keys = kv_tile * TILE_N + ct.arange(TILE_N, dtype=ct.int32)[:, None]  # [TILE_N, 1]
    doc_1 = ct.gather(Doc, (batch, keys))
    dk = ct.full((TILE_N, HEAD_DIM), 0.0, dtype=ct.float32)
    dv = ct.full((TILE_N, HEAD_DIM), 0.0, dtype=ct.float32)
    offsets = (ct.arange(TILE_M, dtype=ct.int32) % TILE_P)[None, :]  # [1, TILE_M]
    num_partial = ct.load(MapCounts, (batch, 0, kv_tile, 0), shape=())
    num_full = ct.load(MapCounts, (batch, 0, kv_tile, 1), shape=())
    for e in range(0, num_partial):
        i = ct.load(MapIdx, (batch, 0, kv_tile, e), shape=())
        q = _q_rows(Q, batch, kv_head, i, TILE_P, HEAD_DIM)
        do = _q_rows(DOut, batch, kv_head, i, TILE_P, HEAD_DIM)
        lse = _q_values(Lse, batch, kv_head, i, TILE_P)
        delta = _q_values(Delta, batch, kv_head, i, TILE_P)
        rows = q_offset + i * TILE_P + offsets  # [1, TILE_M]
        s = ct.mma(k, ct.permute(q, (1, 0)), ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32)) * qk_scale
        doc_0 = ct.gather(Doc, (batch, rows))
        visible = (keys < seq_k) & (rows < q_offset + seq_q) & (keys <= rows) & (doc_0 == doc_1)
        p = ct.where(visible, ct.exp2((s - lse) * INV_LN2, flush_to_zero=True), 0.0)
        dv = ct.mma(p.astype(Q.dtype), do, dv)
        dp = ct.mma(v, ct.permute(do, (1, 0)), ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32))
        ds = p * (dp - delta)
        dk = ct.mma(ds.astype(Q.dtype), q, dk)
    for e in range(MapIdx.shape[3] - num_full, MapIdx.shape[3]):
        i = ct.load(MapIdx, (batch, 0, kv_tile, e), shape=())
        q = _q_rows(Q, batch, kv_head, i, TILE_P, HEAD_DIM)
        do = _q_rows(DOut, batch, kv_head, i, TILE_P, HEAD_DIM)
        lse = _q_values(Lse, batch, kv_head, i, TILE_P)
        delta = _q_values(Delta, batch, kv_head, i, TILE_P)
        rows = q_offset + i * TILE_P + offsets
        s = ct.mma(k, ct.permute(q, (1, 0)), ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32)) * qk_scale
        visible = rows < q_offset + seq_q
        p = ct.where(visible, ct.exp2((s - lse) * INV_LN2, flush_to_zero=True), 0.0)
        dv = ct.mma(p.astype(Q.dtype), do, dv)
        dp = ct.mma(v, ct.permute(do, (1, 0)), ct.full((TILE_N, TILE_M), 0.0, dtype=ct.float32))
        ds = p * (dp - delta)
        dk = ct.mma(ds.astype(Q.dtype), q, dk)
    dk = dk * qk_scale
    ct.store(DK, index=(batch, kv_head, kv_tile, 0), tile=dk.reshape((1, 1, TILE_N, HEAD_DIM)).astype(DK.dtype))
    ct.store(DV, index=(batch, kv_head, kv_tile, 0), tile=dv.reshape((1, 1, TILE_N, HEAD_DIM)).astype(DV.dtype))


@ct.kernel(occupancy=2)
def packed_dq(Q, K, V, DOut, Lse, Delta, DQ, Doc, MapCounts, MapIdx, qk_scale: float, q_offset: int,
              TILE_P: ConstInt, TILE_N: ConstInt):
    """dQ of TILE_P positions of the GROUP_SIZE query heads of one (batch, KV head)."""
    TILE_M = GROUP_SIZE * TILE_P
    num_kv_heads = K.shape[1]
    tile = ct.bid(0)
    batch, kv_head = ct.bid(1) // num_kv_heads, ct.bid(1) % num_kv_heads
    seq_q, seq_k = Q.shape[2], K.shape[2]
    q = _q_rows(Q, batch, kv_head, tile, TILE_P, HEAD_DIM)
    do = _q_rows(DOut, batch, kv_head, tile, TILE_P, HEAD_DIM)
    lse = ct.reshape(_q_values(Lse, batch, kv_head, tile, TILE_P), (TILE_M, 1))
    delta = ct.reshape(_q_values(Delta, batch, kv_head, tile, TILE_P), (TILE_M, 1))
    rows = q_offset + tile * TILE_P + (ct.arange(TILE_M, dtype=ct.int32) % TILE_P)[:, None]
    cols = ct.arange(TILE_N, dtype=ct.int32)[None, :]
    doc_0 = ct.gather(Doc, (batch, rows))
    dq = ct.full((TILE_M, HEAD_DIM), 0.0, dtype=ct.float32)
    num_partial = ct.load(MapCounts, (batch, 0, tile, 0), shape=())
    num_full = ct.load(MapCounts, (batch, 0, tile, 1), shape=())
    for e in range(0, num_partial):
        j = ct.load(MapIdx, (batch, 0, tile, e), shape=())
        k = ct.load(K, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, HEAD_DIM),
                    padding_mode=ct.PaddingMode.ZERO).reshape((TILE_N, HEAD_DIM))
        v = ct.load(V, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, HEAD_DIM),
                    padding_mode=ct.PaddingMode.ZERO).reshape((TILE_N, HEAD_DIM))
        keys = j * TILE_N + cols
        s = ct.mma(q, ct.permute(k, (1, 0)), ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)) * qk_scale
        doc_1 = ct.gather(Doc, (batch, keys))
        visible = (keys < seq_k) & (rows < q_offset + seq_q) & (keys <= rows) & (doc_0 == doc_1)
        p = ct.where(visible, ct.exp2((s - lse) * INV_LN2, flush_to_zero=True), 0.0)
        dp = ct.mma(do, ct.permute(v, (1, 0)), ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        ds = p * (dp - delta)
        dq = ct.mma(ds.astype(Q.dtype), k, dq)
    for e in range(MapIdx.shape[3] - num_full, MapIdx.shape[3]):
        j = ct.load(MapIdx, (batch, 0, tile, e), shape=())
        k = ct.load(K, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, HEAD_DIM),
                    padding_mode=ct.PaddingMode.ZERO).reshape((TILE_N, HEAD_DIM))
        v = ct.load(V, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, HEAD_DIM),
                    padding_mode=ct.PaddingMode.ZERO).reshape((TILE_N, HEAD_DIM))
        s = ct.mma(q, ct.permute(k, (1, 0)), ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)) * qk_scale
        visible = rows < q_offset + seq_q
        p = ct.where(visible, ct.exp2((s - lse) * INV_LN2, flush_to_zero=True), 0.0)
        dp = ct.mma(do, ct.permute(v, (1, 0)), ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        ds = p * (dp - delta)
        dq = ct.mma(ds.astype(Q.dtype), k, dq)
    dq = dq * qk_scale
    ct.store(DQ, index=(batch, kv_head, tile, 0),
             tile=dq.reshape((1, GROUP_SIZE, TILE_P, HEAD_DIM)).astype(DQ.dtype))


def packed_backward(m, q, k, v, out, lse, dout, doc, scale, dq_tile=(16, 64), kv_tile=(16, 64), kernels=None,
                    maps=None):
    """(dq, dk, dv) from the shipped module ``m``'s delta kernel and block-map kernel
    and the packed kernels above; ``maps``: (dq map, kv map) built before, else here;
    ``kernels``: (dq, dkdv) kernel objects (with other hints), else the defaults."""
    batch, num_heads, seq_q, _ = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    stream = torch.cuda.current_stream(q.device)
    delta = torch.empty((batch, num_heads, seq_q), dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ct.launch(stream, ((seq_q + m.BWD_TILE_M - 1) // m.BWD_TILE_M, batch * num_heads, 1),
              m.fmha_bwd_delta_causal_gqa4_bf16_d128, (out, dout, delta, m.BWD_TILE_M))
    if maps is None:
        maps = packed_maps(m, doc, batch, seq_q, seq_k, q.device, dq_tile, kv_tile)
    dq_map, kv_map = maps
    dq_kernel, kv_kernel = kernels or (packed_dq, packed_dkdv)
    ct.launch(stream, ((seq_q + dq_tile[0] - 1) // dq_tile[0], batch * num_kv_heads, 1), dq_kernel,
              (q, k, v, dout, lse, delta, dq, doc, *dq_map, float(scale), 0, *dq_tile))
    ct.launch(stream, ((seq_k + kv_tile[1] - 1) // kv_tile[1], batch * num_kv_heads, 1), kv_kernel,
              (q, k, v, dout, lse, delta, dk, dv, doc, *kv_map, float(scale), 0, *kv_tile))
    return dq, dk, dv


def packed_maps(m, doc, batch, seq_q, seq_k, device, dq_tile, kv_tile):
    """The two maps at TILE_P-position query tiles: by query tile (dQ), by key tile (dK/dV)."""
    tensors = {"doc": doc}
    return (m._map_rows(tensors, batch, 1, seq_q, seq_k, 0, device, *dq_tile, False, m.GROUP_SIZE),
            m._map_rows(tensors, batch, 1, seq_q, seq_k, 0, device, *kv_tile, True))

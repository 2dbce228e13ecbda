"""Block-sparse specs on a CUDA GPU (marked `gpu`): the block map against a tile
classification computed from the mask itself, and the kernels against the fp64
reference with maps reused, rebuilt and refused."""

import contextlib

import pytest
import torch

from specgen.check.cases import compare, feature_inputs, random_qkv, reference_for, shape_dims
from specgen.spec.hooks import evaluate

from .helpers import expected_full_run, generated_module
from .test_gpu import _check, _variant_module

pytestmark = pytest.mark.gpu

SPARSE_SPECS = ["fmha_document_mask", "fmha_chunked_local", "fmha_prefix_lm", "fmha_window_document",
                "fmha_block_pattern", "fmha_train_document"]


def _visible(spec, extra, batch, heads, seq_q, seq_k, q_offset):
    """[B, H, Sq, Skv] bool: the pairs the spec's whole mask leaves visible."""
    rows = torch.arange(seq_q, device="cuda")[:, None] + q_offset
    keys = torch.arange(seq_k, device="cuda")[None, :]
    vis = torch.ones(seq_q, seq_k, dtype=torch.bool, device="cuda")
    if spec["causal"]:
        vis = vis & (keys <= rows)
    window = spec.get("window") or {}
    if window.get("left") is not None:
        vis = vis & (keys >= rows - window["left"])
    if window.get("right") is not None and not spec["causal"]:
        vis = vis & (keys <= rows + window["right"])
    b = torch.arange(batch, device="cuda")[:, None, None, None]
    h = torch.arange(heads, device="cuda")[None, :, None, None]
    tensors = {n: extra[n] for n in spec["tensors"]}
    env = {"b": b, "h": h, "q_idx": rows[None, None], "kv_idx": keys[None, None]}
    mask = evaluate(spec["mask_mod"], env, tensors)
    return vis[None, None] & mask.expand(batch, heads, seq_q, seq_k)


def _tile_states(vis, tile_m, tile_n, by_keys=False):
    """[B, H, outer, inner] int: 0 empty, 1 partial, 2 full, from the pairs."""
    batch, heads, seq_q, seq_k = vis.shape
    tq, tk = -(-seq_q // tile_m), -(-seq_k // tile_n)
    padded = torch.zeros(batch, heads, tq * tile_m, tk * tile_n, dtype=torch.int8, device="cuda")
    padded[:, :, seq_q:, :seq_k] = -1  # rows past seq_q: neither visible nor hidden
    padded[:, :, :seq_q, :seq_k] = vis.to(torch.int8)
    tiles = padded.reshape(batch, heads, tq, tile_m, tk, tile_n).permute(0, 1, 2, 4, 3, 5)
    tiles = tiles.reshape(batch, heads, tq, tk, tile_m * tile_n)
    real = tiles >= 0
    any_ = ((tiles == 1) & real).any(-1)
    all_ = ((tiles == 1) | ~real).all(-1)
    states = torch.where(all_, 2, torch.where(any_, 1, 0))
    return states.transpose(2, 3) if by_keys else states


def _map_states(counts, indices, inner):
    """The same [B, H, outer, inner] states, read back from a map's lists."""
    batch, heads, outer, capacity = indices.shape
    states = torch.zeros(batch, heads, outer, inner, dtype=torch.long)
    counts, indices = counts.cpu(), indices.cpu()
    for b in range(batch):
        for h in range(heads):
            for o in range(outer):
                partial, full, run = counts[b, h, o].tolist()
                assert partial + full <= capacity
                listed_full = indices[b, h, o, capacity - full:].tolist()
                listed = indices[b, h, o, :partial].tolist() + listed_full
                assert len(set(listed)) == len(listed), "a tile listed twice"
                assert run == expected_full_run(listed_full), (listed_full, run)
                states[b, h, o, indices[b, h, o, :partial]] = 1
                states[b, h, o, indices[b, h, o, capacity - full:]] = 2
    return states


@pytest.mark.parametrize("name", SPARSE_SPECS)
@pytest.mark.parametrize("shape", [(2, 8, 1000, 1000, 0), (1, 4, 300, 1100, 800), (1, 4, 517, 300, -217)],
                         ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_block_map_lists_exactly_the_visible_tiles(name, shape):
    mod = generated_module(name)
    spec = mod.SPEC
    batch, heads, seq_q, seq_k, q_offset = shape
    gen = torch.Generator(device="cuda").manual_seed(seq_q)
    extra = feature_inputs(spec, {"batch": batch, "heads": heads, "kv_heads": heads // spec["gqa_ratio"],
                                  "seq_q": seq_q, "seq_k": seq_k}, gen)
    tensors = {n: extra[n] for n in spec["tensors"]}
    block_map = mod.make_block_map(batch, heads, seq_q, seq_k, q_offset=q_offset, device="cuda", **tensors)
    vis = _visible(spec, extra, batch, block_map.num_heads, seq_q, seq_k, q_offset)
    tile_m, tile_n = block_map.tile
    want = _tile_states(vis, tile_m, tile_n).cpu()
    assert torch.equal(_map_states(block_map.counts, block_map.indices, want.shape[3]), want)
    args = (tensors, batch, block_map.num_heads, seq_q, seq_k, q_offset, block_map.device)
    # By key tile at the same tiles: the backward's direction, for every mask.
    by_keys = _tile_states(vis, tile_m, tile_n, by_keys=True).cpu()
    counts, indices = mod._map_rows(*args, tile_m, tile_n, True)
    assert torch.equal(_map_states(counts, indices, by_keys.shape[3]), by_keys)
    if hasattr(mod, "BWD_TILE_M"):  # training specs: the maps the backward builds
        # (at the tiles' positions: BWD_*_TILE_P where the backward packs GQA)
        dq_rows, kv_rows = getattr(mod, "BWD_DQ_TILE_P", mod.BWD_DQ_TILE_M), getattr(mod, "BWD_TILE_P", mod.BWD_TILE_M)
        dq_counts, dq_indices, kv_counts, kv_indices = mod._backward_maps(*args)
        dq = _tile_states(vis, dq_rows, mod.BWD_DQ_TILE_N).cpu()
        assert torch.equal(_map_states(dq_counts, dq_indices, dq.shape[3]), dq)
        kv = _tile_states(vis, kv_rows, mod.BWD_TILE_N, by_keys=True).cpu()
        assert torch.equal(_map_states(kv_counts, kv_indices, kv.shape[3]), kv)


@pytest.mark.parametrize("name", SPARSE_SPECS)
@pytest.mark.parametrize("shape", [(1, 2, 3000, 3000, 0), (2, 1, 700, 2100, 1400), (1, 1, 9000, 9000, 0)],
                         ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_sparse_specs_match_reference_long(name, shape):
    """Lengths that cross tiles, documents and the 8192-token chunk. The fp64 reference
    of S 9000 takes GBs: one such case at a time across the xdist workers, its memory
    handed back after it (14 workers at once ran an 80 GB card out of memory)."""
    import tempfile
    from pathlib import Path

    from filelock import FileLock

    long = shape[2] * shape[3] > 2**24
    lock = FileLock(Path(tempfile.gettempdir()) / "specgen-long-reference.lock")
    with lock if long else contextlib.nullcontext():
        try:
            _check(generated_module(name), *shape, seed=shape[2])
        finally:
            if long:  # the worker's cached blocks go back before the next one runs
                torch.cuda.empty_cache()


def test_reused_map_gives_the_same_output_and_mismatches_are_refused():
    mod = generated_module("fmha_document_mask")
    spec = mod.SPEC
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = random_qkv(spec, 2, 2, 1500, 1500, generator=gen)
    extra = feature_inputs(spec, shape_dims(q, k), gen)
    block_map = mod.make_block_map(2, 8, 1500, 1500, doc=extra["doc"])
    once = mod.attention(q, k, v, doc=extra["doc"])
    for _ in range(3):  # one map, several layers
        assert torch.equal(mod.attention(q, k, v, doc=extra["doc"], block_map=block_map), once)
    ref = reference_for(spec, q, k, v, extra)[0]
    assert compare(once, ref, spec["dtype"]).ok
    with pytest.raises(ValueError, match="block_map was built for seq_q 1500, but this call has 1499"):
        mod.attention(q[:, :, :1499], k, v, doc=extra["doc"], block_map=block_map)
    with pytest.raises(ValueError, match="block_map was built for q_offset 0, but this call has 1"):
        mod.attention(q, k, v, doc=extra["doc"], block_map=block_map, q_offset=1)
    with pytest.raises(ValueError, match="block_map must be a BlockMap"):
        mod.attention(q, k, v, doc=extra["doc"], block_map=block_map.indices)
    with pytest.raises(ValueError, match=r"doc must be a torch.int32 tensor of shape \(2, 1500\)"):
        mod.make_block_map(2, 8, 1500, 1500, doc=extra["doc"][:, :100])
    with pytest.raises(ValueError, match="num_heads must be a multiple of 4"):
        mod.make_block_map(2, 6, 1500, 1500, doc=extra["doc"])


def test_training_reuses_a_prebuilt_map_with_the_backward_maps():
    """make_block_map(..., backward=True): the forward and the backward use the
    prebuilt maps, and the gradients equal those of maps built per call, bit for bit."""
    mod = generated_module("fmha_train_document")
    spec = mod.SPEC
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = random_qkv(spec, 2, 2, 1300, 1300, generator=gen)
    extra = feature_inputs(spec, shape_dims(q, k), gen)
    dout = torch.randn_like(q)

    def grads(**kwargs):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mod.attention(*leaves, doc=extra["doc"], **kwargs)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    block_map = mod.make_block_map(2, 8, 1300, 1300, doc=extra["doc"], backward=True)
    assert len(block_map.grads) == 4
    fresh = grads()
    for _ in range(2):  # one map, several layers
        for got, want in zip(grads(block_map=block_map), fresh):
            assert torch.equal(got, want)
    forward_only = mod.make_block_map(2, 8, 1300, 1300, doc=extra["doc"])
    with pytest.raises(ValueError, match=r"no backward maps.*make_block_map\(\.\.\., backward=True\)"):
        grads(block_map=forward_only)
    with torch.no_grad():  # inference takes a forward-only map
        assert torch.equal(mod.attention(q, k, v, doc=extra["doc"], block_map=forward_only), fresh[0])
    with pytest.raises(ValueError, match="block_map was built for seq_q 1300, but this call has 1299"):
        mod.attention(q[:, :, :1299], k, v, doc=extra["doc"], block_map=block_map)


def test_rows_that_see_no_tile_give_zeros():
    mod = generated_module("fmha_block_pattern")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 700, 700)
    blocks = torch.zeros(1, 128, 128, dtype=torch.int32, device="cuda")
    blocks[0, 2, 1] = 1  # only queries 256..383 see keys 128..255
    out = mod.attention(q, k, v, blocks=blocks)
    assert torch.isfinite(out).all()
    assert out[:, :, :256].abs().max() == 0 and out[:, :, 384:].abs().max() == 0
    ref = reference_for(mod.SPEC, q, k, v, {"blocks": blocks})[0]
    assert compare(out, ref, "bfloat16").ok


def test_map_build_and_attention_capture_in_a_cuda_graph():
    mod = generated_module("fmha_document_mask")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = random_qkv(mod.SPEC, 1, 2, 2048, 2048, generator=gen)
    extra = feature_inputs(mod.SPEC, shape_dims(q, k), gen)
    doc = extra["doc"]
    expected = mod.attention(q, k, v, doc=doc)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mod.attention(q, k, v, doc=doc)  # warm: compiled before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block_map = mod.make_block_map(1, 8, 2048, 2048, doc=doc)
        out = mod.attention(q, k, v, doc=doc, block_map=block_map)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_chunk_boundary_variant_matches_reference():
    """Chunked-local attention with a chunk that is not a multiple of any tile."""
    mod = _variant_module("chunk_300", {"mask_mod": "q_idx // 300 == kv_idx // 300", "block_sparse": True,
                                         "dtype": "bfloat16"})
    _check(mod, 1, 2, 1000, 1000)
    _check(mod, 2, 1, 128, 1000, 872)


# --- decode ------------------------------------------------------------------------


def _decode_sparse(name):
    from .test_gpu import DECODE_VARIANTS, _decode_module

    return generated_module(name) if name.startswith("fmha_") else _decode_module(name, DECODE_VARIANTS[name])


@pytest.mark.parametrize("name", ["fmha_decode_chunked_local", "doc_sparse_gqa8",
                                  "per_head_sparse_f16_d64_q4_paged64_window_sinks", "blocks_sparse_gqa8_q2"])
def test_decode_block_map_lists_exactly_the_visible_tiles(name):
    from specgen.check.cases import random_decode

    from .test_block_sparse import _decode_states, _map_states as map_states_np

    mod = _decode_sparse(name)
    spec = mod.SPEC
    q_len = spec["max_q_len"]
    gen = torch.Generator(device="cuda").manual_seed(7)
    batch = random_decode(spec, [q_len, 700, 8191, 8193, 20000], 2, q_len, gen)
    extra = feature_inputs(spec, batch.dims(), gen)
    tensors = {n: extra[n] for n in spec["tensors"]}
    heads = batch.q.shape[2]
    block_map = mod.make_block_map(batch.seq_lens, heads, batch.capacity, q_len=q_len, **tensors)
    want = _decode_states(mod, {n: t.cpu().numpy() for n, t in tensors.items()}, batch.seq_lens.tolist(), heads,
                          q_len, batch.capacity, block_map.tile_n)
    got = map_states_np(block_map.counts.cpu().numpy(), block_map.indices.cpu().numpy(), want.shape[3])
    assert (got == want).all()


def test_decode_map_is_reused_across_layers_and_refused_for_other_sizes():
    from specgen.check.cases import decode_reference, random_decode

    mod = _decode_sparse("doc_sparse_gqa8")
    spec = mod.SPEC
    gen = torch.Generator(device="cuda").manual_seed(11)
    batch = random_decode(spec, [300, 5000, 12345], 2, 1, gen)
    extra = feature_inputs(spec, batch.dims(), gen)
    block_map = mod.make_block_map(batch.seq_lens, 16, batch.capacity, doc=extra["doc"])
    once = mod.attention(*batch.args(), doc=extra["doc"])
    for _ in range(3):  # one map, several layers
        assert torch.equal(mod.attention(*batch.args(), doc=extra["doc"], block_map=block_map), once)
    assert compare(once, decode_reference(spec, batch, extra), spec["dtype"]).ok
    with pytest.raises(ValueError, match="block_map was built for max_len 12345, but this call has 12344"):
        mod.attention(batch.q, batch.k_cache[:, :12344], batch.v_cache[:, :12344], batch.seq_lens,
                      doc=extra["doc"][:, :12344], block_map=block_map)
    with pytest.raises(ValueError, match="block_map must be a BlockMap"):
        mod.attention(*batch.args(), doc=extra["doc"], block_map=block_map.counts)
    with pytest.raises(ValueError, match=r"doc must be a torch.int32 tensor of shape \(3, 12345\)"):
        mod.make_block_map(batch.seq_lens, 16, batch.capacity, doc=extra["doc"][:, :100])


def test_decode_map_and_step_replay_in_a_cuda_graph_as_lengths_advance():
    """A serving loop: one graph holds the map build and the attention; each replay
    follows seq_lens and the caches updated in place."""
    from specgen.check.cases import decode_reference, random_decode

    mod = generated_module("fmha_decode_chunked_local")
    spec = mod.SPEC
    gen = torch.Generator(device="cuda").manual_seed(13)
    batch = random_decode(spec, [8190, 16385, 20000], 1, 1, gen)
    full = random_decode(spec, [20000, 20000, 20000], 1, 1, gen)  # keys for the steps ahead
    k_cache, v_cache = full.k_cache.clone(), full.v_cache.clone()
    seq_lens = batch.seq_lens.clone()
    q = batch.q.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mod.attention(q, k_cache, v_cache, seq_lens)  # warm: compiled before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block_map = mod.make_block_map(seq_lens, q.shape[2], k_cache.shape[1])
        out = mod.attention(q, k_cache, v_cache, seq_lens, block_map=block_map)
    for lens in ([8190, 16385, 19000], [8192, 16386, 19999], [8193, 8192, 1]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        step = type(batch)(q, k_cache, v_cache, seq_lens, None)
        assert compare(out, decode_reference(spec, step, {}), spec["dtype"]).ok, lens

"""Block-sparse specs on the CPU: validation, the map kernel's bound test, rendering."""

import itertools
import random

import numpy as np
import pytest

from specgen.emit.render import render, render_raw
from specgen.errors import SpecError
from specgen.plan.make import make_plan
from specgen.spec import validate_spec
from specgen.spec.hooks import block_quotients, compile_hook, tile_pretest

from .helpers import kernel_source

DOC = {"name": "doc", "causal": True, "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
       "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]", "block_sparse": True}


def _errors(data):
    with pytest.raises(SpecError) as info:
        validate_spec(data, "specs/bad.yaml")
    return info.value.lines()


@pytest.mark.parametrize("overrides,field,words", [
    ({"mask_mod": None, "tensors": {}}, "block_sparse", "needs a mask_mod"),
    ({"skip_masked_tiles": True}, "skip_masked_tiles", "cannot be combined with block_sparse"),
    ({"targets": {"default": {"tile_m": 64, "tile_n": 64, "persistent": True}}},
     "targets.default.persistent", "one CTA per query tile"),
])
def test_bad_block_sparse_specs_name_the_field(overrides, field, words):
    lines = _errors({**DOC, **overrides})
    assert len(lines) == 1 and lines[0].startswith(f"specs/bad.yaml: {field}: ") and words in lines[0]


@pytest.mark.parametrize("overrides,field,words", [
    ({}, "block_sparse", "needs a mask_mod"),
    ({"tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_q"]}},
      "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"}, "tensors.doc.shape[1]", "family decode has no seq_q"),
    ({"mask_mod": "kv_idx > 3", "score_mod": "score * 2.0"}, "score_mod", "a prefill field"),
])
def test_bad_decode_block_sparse_specs_name_the_field(overrides, field, words):
    lines = _errors({"name": "d", "family": "decode", "block_sparse": True, **overrides})
    assert len(lines) == 1 and lines[0].startswith(f"specs/bad.yaml: {field}: ") and words in lines[0], lines


class _Ct:
    """The few cuTile functions the bound test prints, on numpy arrays."""

    min = staticmethod(np.min)
    max = staticmethod(np.max)
    reshape = staticmethod(np.reshape)


MASKS = [
    ("doc[b, q_idx] == doc[b, kv_idx]", {"doc": 2}),
    ("doc[b, q_idx] != doc[b, kv_idx]", {"doc": 2}),
    ("(kv_idx < pre[b]) | (kv_idx <= q_idx)", {"pre": 1}),
    ("q_idx // 37 == kv_idx // 37", {}),
    ("(doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx >= q_idx - 50)", {"doc": 2}),
    ("(q_idx % 64 < 10) and (kv_idx > 300)", {}),
    ("doc[b, kv_idx] >= doc[b, q_idx] - 1", {"doc": 2}),
]


@pytest.mark.parametrize("per_tile", [None, "kv_idx", "q_idx"])
@pytest.mark.parametrize("mask,dims", MASKS, ids=[m for m, _ in MASKS])
def test_bound_test_never_rejects_a_tile_with_a_visible_pair(mask, dims, per_tile):
    """Soundness: on random tiles, wherever a pair is visible the test passes
    (and it does reject some tiles, so it is not trivially true). ``per_tile``: the
    map kernel's form, one entry per tile for 4 tiles of 16 keys (or query rows)."""
    tensors = {n: ("int32", d) for n, d in dims.items()}
    hook = compile_hook(mask, "mask_mod", tensors)
    shape = {"kv_idx": "(CHUNK, TILE_N)", "q_idx": "(CHUNK, TILE_M)"}.get(per_tile)
    test = tile_pretest(mask, tensors, hook.gathers, per_tile=per_tile and (per_tile, shape))
    assert test is not None
    rng = random.Random(7)
    rejected = 0
    for trial in range(300):
        doc = np.cumsum(np.array([rng.random() < 0.05 for _ in range(400)], dtype=np.int32))
        pre = np.array([rng.randrange(0, 400)], dtype=np.int32)
        r0, k0 = rng.randrange(0, 336), rng.randrange(0, 336)
        rows = np.arange(r0, r0 + 64)[:, None]
        keys = np.arange(k0, k0 + 64)[None, :]
        env = {"rows": rows, "keys": keys, "batch": 0, "head": 0, "ct": _Ct, "np": np,
               "CHUNK": 4, "TILE_M": 16, "TILE_N": 16}
        for g in hook.gathers + test.gathers:  # every operand, as the kernel gathers it
            table = {"doc": doc[None, :], "pre": pre}[g.tensor]
            index = tuple(eval(i, {}, env) for i in g.indices)
            env[g.local] = table[index]
        visible = np.broadcast_to(eval(hook.kernel.replace("ct.where", "np.where"), {}, env), (64, 64))
        may = np.broadcast_to(eval(test.expr, {}, env), (4,) if per_tile else ())
        # the pairs of each tile the test answers for: [tile, pairs]
        tiles = {None: visible.reshape(1, -1), "q_idx": visible.reshape(4, -1),
                 "kv_idx": visible.reshape(64, 4, 16).transpose(1, 0, 2).reshape(4, -1)}[per_tile]
        assert (may.reshape(-1) | ~tiles.any(axis=1)).all(), (mask, trial)
        rejected += (~may).sum()
    assert rejected > 0


def test_map_span_renames_the_step_positions_and_their_operands():
    """One tile at a time, the tiles that pass read the plain names: the step's own
    positions and operands are span_* (the rows' side stays as it is)."""
    from specgen.plan.make import _map_span

    tensors = {"doc": ("int32", 2)}
    hook = compile_hook(DOC["mask_mod"], "mask_mod", tensors)
    span = _map_span(DOC["mask_mod"], tensors, hook, "keys", rename=True)
    assert [(g.local, g.indices) for g in span.gathers] == [("span_doc_1", ("batch", "span_keys"))]
    assert "ct.reshape(span_doc_1, (CHUNK, TILE_N))" in span.expr and "ct.min(doc_0)" in span.expr
    assert "doc_1" not in span.expr.replace("span_doc_1", "")
    by_keys = _map_span(DOC["mask_mod"], tensors, hook, "rows", rename=True)
    assert [(g.local, g.indices) for g in by_keys.gathers] == [("span_doc_0", ("batch", "span_rows"))]
    plain = _map_span(DOC["mask_mod"], tensors, hook, "keys", rename=False)
    assert plain.gathers == () and "ct.reshape(doc_1, (CHUNK, TILE_N))" in plain.expr


def test_block_quotients_find_masks_constant_on_blocks():
    assert block_quotients("blocks[b, q_idx // 128, kv_idx // 128] != 0") == (128, 128)
    assert block_quotients("q_idx // 128 + q_idx // 64 > kv_idx // 96") == (64, 96)
    assert block_quotients("(f[b, kv_idx // 64] > 0) & (h > 2)") == (None, 64)
    for mask in ("doc[b, q_idx] == doc[b, kv_idx]", "(q_idx + 1) // 128 == kv_idx // 128",
                 "q_idx // 128 >= kv_idx", "q_idx // 0 == 1"):
        assert block_quotients(mask) is None, mask
    # The map kernel evaluates such masks per block only where no causal or window
    # term reads the positions, and the blocks are powers of two.
    blocks = {"tensors": {"f": {"dtype": "int32", "shape": ["batch", 8, 8]}}, "causal": False,
              "mask_mod": "f[b, q_idx // 128, kv_idx // 256] != 0"}
    assert make_plan(validate_spec({**DOC, **blocks})).map_blocks == (128, 256)
    assert make_plan(validate_spec({**DOC, **blocks, "causal": True})).map_blocks is None
    chunks = {**blocks, "tensors": {}, "mask_mod": "q_idx // 96 == kv_idx // 96"}
    assert make_plan(validate_spec({**DOC, **chunks})).map_blocks is None
    assert make_plan(validate_spec(DOC)).map_blocks is None


def test_dense_and_sparse_renders():
    dense = render(make_plan(validate_spec({**DOC, "block_sparse": False})), "specs/doc.yaml").text
    sparse = render(make_plan(validate_spec(DOC)), "specs/doc.yaml").text
    assert "make_block_map" not in dense and "MapIdx" not in dense
    for text in ("def make_block_map(", "class BlockMap", "def fmha_block_map_causal", "block_map=None",
                 "(ct.max(ct.reshape(doc_1, (CHUNK, TILE_N)), axis=1))",
                 "for j in range(first, last, CHUNK):", "MAP_STEP_PAIRS = 32768"):
        assert text in sparse
    # A mask of positions alone: the steps test CHUNK tiles, then walk those that pass.
    chunks = render(make_plan(validate_spec({**DOC, "tensors": {}, "mask_mod": "q_idx // 300 == kv_idx // 300"})),
                    "specs/doc.yaml").text
    for text in ("MAP_SPAN = 2048", "for j0 in range(first, last, CHUNK):", "while j < last:",
                 "ct.reshape((span_keys // 300), (CHUNK, TILE_N))"):
        assert text in chunks
    # Deterministic: the same spec renders byte-identically.
    assert render(make_plan(validate_spec(DOC)), "specs/doc.yaml").text == sparse


def test_sparse_backward_masks_partial_tiles_only():
    """The dK/dV and dQ kernels walk a map row in two loops: its partial tiles with
    the mask_mod, its full ones with no mask (only rows past seq_q zeroed) and
    without reading the mask_mod's operands."""
    text = render(make_plan(validate_spec({**DOC, "backward": True})), "specs/doc.yaml").text
    for prefix, index in (("fmha_bwd_dkdv_", "kv_tile"), ("fmha_bwd_dq_", "tile")):
        kernel = kernel_source(text, prefix)
        partial, _, full = kernel.partition("for e in range(MapIdx.shape[3] - num_full, MapIdx.shape[3]):")
        assert full, prefix
        assert "for e in range(0, num_partial):" in partial and "doc_0 == doc_1" in partial
        assert "doc_0 == doc_1" not in full and "ct.gather(Doc" not in full
        assert "visible = rows < q_offset + seq_q" in full
        assert f"j = ct.load(MapIdx, (batch, 0, {index}, e), shape=())" in full or \
            f"i = ct.load(MapIdx, (batch, 0, {index}, e), shape=())" in full
    # A score_mod still applies on full tiles, with the operands it reads.
    alibi = render(make_plan(validate_spec({
        **DOC, "backward": True, "score_mod": "score - slope[h] * (q_idx - kv_idx)",
        "tensors": {**DOC["tensors"], "slope": {"dtype": "float32", "shape": ["heads"]}}})),
        "specs/doc.yaml").text
    full = kernel_source(alibi, "fmha_bwd_dq_").partition(
        "for e in range(MapIdx.shape[3] - num_full, MapIdx.shape[3]):")[2]
    assert "slope" in full and "doc_0 == doc_1" not in full


def test_backward_delta_is_the_diagonal_of_the_dp_mma():
    """D = rowsum(dO O) comes from an MMA (dO O^T), as dP = dO V^T does, so a row
    with one visible key gets dP - D = 0 exactly. The dQ kernel forms it (no kernel
    of its own) and stores it before its loops, for the dK/dV kernel."""
    text = render(make_plan(validate_spec({**DOC, "backward": True})), "specs/doc.yaml").text
    assert "fmha_bwd_delta_" not in text
    dq = kernel_source(text, "fmha_bwd_dq_")
    head = dq[: dq.index("    for ")]
    assert "ct.mma(do,ct.permute(o,(1,0))" in "".join(head.split())
    assert "ct.sum(o.astype(ct.float32) * do.astype(ct.float32)" not in dq
    assert head.index("ct.store(Delta,") < head.index("== 1:")


# --- the map kernel run on the CPU, through numpy standing in for cuda.tile ------


class _Tiles:
    """The cuda.tile functions the map kernel calls, on numpy arrays, for one CTA at
    a time (``block``). Enough to check the kernel's logic (which tiles it lists,
    where) without a GPU; compiling it is checked by the AOT build."""

    int32, float32 = np.int32, np.float32

    def __init__(self, grid):
        self.grid, self.block = grid, (0, 0, 0)

    def bid(self, axis):
        return self.block[axis]

    @staticmethod
    def load(array, index, shape):
        """A scalar (shape ()), or the tile at tile index ``index`` (zeros outside)."""
        if shape == ():
            return array[index]
        out = np.zeros(shape, array.dtype)
        part = array[tuple(slice(i * n, (i + 1) * n) for i, n in zip(index, shape))]
        out[tuple(slice(0, n) for n in part.shape)] = part
        return out

    @staticmethod
    def store(array, index, tile):
        """The tile at tile index ``index`` (the part inside the array)."""
        where = tuple(slice(i * n, (i + 1) * n) for i, n in zip(index, tile.shape))
        part = array[where]
        part[...] = tile[tuple(slice(0, n) for n in part.shape)]

    def num_blocks(self, axis):
        return self.grid[axis]

    @staticmethod
    def arange(size, dtype):
        assert size > 0 and size & (size - 1) == 0, f"arange({size}): not a power of two"
        return np.arange(size, dtype=dtype)

    @staticmethod
    def _indices(array, indices, mask):
        indices = indices if isinstance(indices, tuple) else (indices,)
        *indices, mask = np.broadcast_arrays(*indices, True if mask is None else mask)
        inside = mask.copy()
        for index, size in zip(indices, array.shape):
            inside &= (index >= 0) & (index < size)
        return tuple(np.where(inside, i, 0) for i in indices), inside

    def gather(self, array, indices, mask=None, padding_value=0):
        indices, inside = self._indices(array, indices, mask)
        return np.where(inside, array[indices], padding_value)

    def scatter(self, array, indices, value, mask=None):
        indices, inside = self._indices(array, indices, mask)
        array[tuple(i[inside] for i in indices)] = np.broadcast_to(value, inside.shape)[inside]

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    min, max, sum = (staticmethod(f) for f in (np.min, np.max, np.sum))
    minimum, maximum, where, reshape = (staticmethod(f) for f in (np.minimum, np.maximum, np.where, np.reshape))

    @staticmethod
    def cumsum(x, axis=0):
        return np.cumsum(x, axis=axis)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype)

    @staticmethod
    def full(shape, value, dtype):
        return np.full(shape, value, dtype)

    @staticmethod
    def broadcast_to(x, shape):
        return np.broadcast_to(x, shape)

    @staticmethod
    def astype(x, dtype):
        return np.asarray(x).astype(dtype)


def _row_groups(module) -> tuple:
    """The ROW_GROUP values to run a map kernel with: (None,) where it takes none."""
    kernel = next(getattr(module, n) for n in dir(module) if n.startswith("fmha_block_map_"))._pyfunc
    if "ROW_GROUP" not in kernel.__code__.co_varnames[:kernel.__code__.co_argcount]:
        return (None,)
    return (1, module.GROUP_SIZE)


def _run_map(module, tensors, batch, map_heads, seq_q, seq_k, q_offset, tile_m, tile_n, by_keys,
             constants=None, row_group=None):
    """(counts, indices) of module's map kernel run CTA by CTA on the CPU;
    ``constants``: module constants to run it with instead (smaller steps);
    ``row_group``: the kernel's ROW_GROUP (map rows per CTA by query tile), if it has one."""
    import types

    kernel = next(getattr(module, n) for n in dir(module) if n.startswith("fmha_block_map_"))._pyfunc
    outer = -(-seq_k // tile_n) if by_keys else -(-seq_q // tile_m)
    inner = -(-seq_q // tile_m) if by_keys else -(-seq_k // tile_n)
    counts = np.full((batch, map_heads, outer, 3), -2, dtype=np.int32)
    indices = np.full((batch, map_heads, outer, max(inner, 1)), -1, dtype=np.int32)
    ctas = outer if by_keys or row_group is None else -(-outer // row_group)
    tiles = _Tiles((ctas, batch * map_heads, 1))
    run = types.FunctionType(kernel.__code__, {**kernel.__globals__, **(constants or {}), "ct": tiles},
                             kernel.__name__)
    extra = () if row_group is None else (row_group,)
    for block in itertools.product(range(ctas), range(batch * map_heads)):
        tiles.block = (*block, 0)
        run(counts, indices, *tensors, seq_q, seq_k, q_offset, tile_m, tile_n, by_keys, *extra)
    return counts, indices


def _tile_states(mask, tile_m, tile_n, by_keys):
    """[B, H, outer, inner]: 0 empty, 1 partial, 2 full, from [B, H, Sq, Skv] pairs."""
    batch, heads, seq_q, seq_k = mask.shape
    tq, tk = -(-seq_q // tile_m), -(-seq_k // tile_n)
    padded = np.zeros((batch, heads, tq * tile_m, tk * tile_n), dtype=np.int8)
    padded[:, :, seq_q:, :seq_k] = -1  # rows past seq_q: neither visible nor hidden
    padded[:, :, :seq_q, :seq_k] = mask
    tiles = padded.reshape(batch, heads, tq, tile_m, tk, tile_n).transpose(0, 1, 2, 4, 3, 5)
    tiles = tiles.reshape(batch, heads, tq, tk, tile_m * tile_n)
    real = tiles >= 0
    states = np.where(((tiles == 1) | ~real).all(-1), 2, np.where(((tiles == 1) & real).any(-1), 1, 0))
    return states.transpose(0, 1, 3, 2) if by_keys else states


def _map_states(counts, indices, inner):
    """The same states read back from a map's lists, checking their order."""
    from .helpers import expected_full_run

    states = np.zeros(counts.shape[:3] + (inner,), dtype=np.int64)
    capacity = indices.shape[3]
    for b, h, o in itertools.product(*map(range, counts.shape[:3])):
        partial, full, run = counts[b, h, o]
        listed_partial = indices[b, h, o, :partial].tolist()
        listed_full = indices[b, h, o, capacity - full:].tolist()
        assert listed_partial == sorted(listed_partial) and listed_full == sorted(listed_full, reverse=True)
        assert len(set(listed_partial + listed_full)) == partial + full <= capacity
        assert run == expected_full_run(listed_full), (listed_full, run)
        states[b, h, o, listed_partial] = 1
        states[b, h, o, listed_full] = 2
    return states


def _pairs(spec, tensors, batch, heads, seq_q, seq_k, q_offset):
    """[B, H, Sq, Skv] bool: the pairs the whole mask leaves visible (torch, CPU)."""
    import torch

    from specgen.spec.hooks import evaluate

    rows = torch.arange(seq_q)[:, None] + q_offset
    keys = torch.arange(seq_k)[None, :]
    vis = torch.ones(seq_q, seq_k, dtype=torch.bool)
    window = spec.get("window") or {}
    if spec["causal"]:
        vis &= keys <= rows
    if window.get("left") is not None:
        vis &= keys >= rows - window["left"]
    if window.get("right") is not None and not spec["causal"]:
        vis &= keys <= rows + window["right"]
    env = {"b": torch.arange(batch)[:, None, None, None], "h": torch.arange(heads)[None, :, None, None],
           "q_idx": rows[None, None], "kv_idx": keys[None, None]}
    mask = evaluate(spec["mask_mod"], env, {n: torch.from_numpy(t) for n, t in tensors.items()})
    return (vis[None, None] & mask.expand(batch, heads, seq_q, seq_k)).numpy()


def _hook_tensors(spec, batch, heads, seq_k, rng):
    """Document ids (runs of random length), 0/1 block flags, prefix lengths."""
    made = {}
    for name, decl in spec["tensors"].items():
        shape = tuple({"batch": batch, "heads": heads, "seq_k": seq_k, "seq_q": seq_k}.get(d, d)
                      for d in decl["shape"])
        last = decl["shape"][-1]
        if isinstance(last, int):
            made[name] = (rng.random(shape) < 0.3).astype(np.int32)
        elif last in ("seq_q", "seq_k"):
            made[name] = np.cumsum(rng.random(shape) < 1 / 90, axis=-1).astype(np.int32)
        else:
            made[name] = rng.integers(0, seq_k + 1, shape).astype(np.int32)
    return made


MAP_SPECS = ["fmha_document_mask", "fmha_chunked_local", "fmha_prefix_lm", "fmha_window_document",
             "fmha_block_pattern", "fmha_train_document"]
MAP_VARIANTS = {  # masks the shipped specs do not cover: other blocks, windows, heads
    "blocks_64x256": {"causal": False, "tensors": {"f": {"dtype": "int32", "shape": ["batch", 32, 8]}},
                      "mask_mod": "f[b, q_idx // 64, kv_idx // 256] != 0"},
    "key_blocks_only": {"causal": False, "tensors": {"f": {"dtype": "int32", "shape": ["batch", 16]}},
                        "mask_mod": "(f[b, kv_idx // 128] != 0) & (h != 1)"},
    "chunk_300": {"causal": True, "mask_mod": "q_idx // 300 == kv_idx // 300"},
    "window_doc_bwd": {"causal": True, "window": {"left": 200}, "backward": True,
                       "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
                       "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"},
}
# Steps of two to four tiles, so that rows cross many step boundaries.
SMALL_STEPS = {"MAP_SPAN": 256, "MAP_STEP_PAIRS": 16384, "MAP_STEP_BLOCKS": 16, "MAP_GROUP_STEP_PAIRS": 4096}
MAP_SHAPES = [(2, 4, 1000, 1000, 0), (1, 4, 300, 1100, 800), (1, 4, 517, 300, -217), (1, 4, 700, 2100, 1400)]


def _map_module(name):
    if name in MAP_SPECS:
        from .helpers import generated_module

        return generated_module(name)
    from specgen.compile.export import load_module_from_source

    spec = {"name": f"map_{name}", "dtype": "bfloat16", "head_dim": 64, "gqa_ratio": 1,
            "block_sparse": True, **MAP_VARIANTS[name]}
    # Run, not read: the template's output before black (see helpers.render_spec_data).
    return load_module_from_source(f"map_{name}", render_raw(make_plan(validate_spec(spec))), f"<map_{name}>")


@pytest.mark.parametrize("name", MAP_SPECS + list(MAP_VARIANTS))
def test_map_kernel_lists_exactly_the_visible_tiles_on_the_cpu(name):
    """The map kernel run through numpy: every row's lists equal a classification
    of the tiles from the mask's pairs, by query tile and by key tile, at several
    tile sizes, offsets and ragged lengths."""
    module = _map_module(name)
    spec = module.SPEC
    rng = np.random.default_rng(len(name))
    for batch, heads, seq_q, seq_k, q_offset in MAP_SHAPES:
        tensors = _hook_tensors(spec, batch, heads, seq_k, rng)
        map_heads = heads if "h" in compile_hook(spec["mask_mod"], "mask_mod", {
            n: (t["dtype"], len(t["shape"])) for n, t in spec["tensors"].items()}).uses else 1
        pairs = _pairs(spec, tensors, batch, map_heads, seq_q, seq_k, q_offset)
        args = [tensors[n] for n in spec["tensors"]]
        for (tile_m, tile_n), by_keys, constants, row_group in itertools.product(
                [(64, 128), (128, 128), (64, 64), (16, 64)], (False, True), (None, SMALL_STEPS),
                _row_groups(module)):
            want = _tile_states(pairs, tile_m, tile_n, by_keys)
            counts, indices = _run_map(module, args, batch, map_heads, seq_q, seq_k, q_offset,
                                       tile_m, tile_n, by_keys, constants, row_group)
            got = _map_states(counts, indices, want.shape[3])
            assert (got == want).all(), (name, (batch, heads, seq_q, seq_k, q_offset), tile_m, tile_n, by_keys,
                                         constants, row_group)


def test_training_block_map_is_checked_before_the_op():
    """attention(..., block_map=) of a training spec refuses a non-map and, with
    gradients required, a map without the backward's maps, before any launch."""
    import torch

    from tests.helpers import generated_module

    mod = generated_module("fmha_train_document")
    q = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    doc = torch.zeros(1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_map must be a BlockMap"):
        mod.attention(q, k, k, doc=doc, block_map="map")
    forward_only = mod.BlockMap(torch.zeros(1, 1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                                1, 1, 8, 8, 0, (64, 128), torch.device("cuda", 0))
    assert forward_only.grads == ()
    with pytest.raises(ValueError, match="no backward maps, and gradients are required"):
        mod.attention(q, k, k, doc=doc, block_map=forward_only)


def test_block_map_check_refuses_lists_of_other_shapes():
    """BlockMap.check refuses a map whose tensors the kernels would read out of their
    bounds (a map put together by hand, or one of another layout), naming the field."""
    import torch

    from tests.helpers import generated_module

    mod = generated_module("fmha_train_document")
    cpu = torch.device("cpu")
    batch, seq_q, seq_k, tile = 2, 300, 700, (64, 128)

    def ints(*shape):
        return torch.zeros(shape, dtype=torch.int32)

    def rows(n, t):
        return -(-n // t)

    counts, indices = ints(batch, 1, rows(seq_q, 64), 3), ints(batch, 1, rows(seq_q, 64), rows(seq_k, 128))
    # The backward's maps list tiles of positions: BWD_*_TILE_P of packed GQA.
    assert mod.BWD_DQ_TILE_P * mod.GROUP_SIZE == mod.BWD_DQ_TILE_M
    dq_rows, kv_rows = mod.BWD_DQ_TILE_P, mod.BWD_TILE_P
    grads = (ints(batch, 1, rows(seq_q, dq_rows), 3),
             ints(batch, 1, rows(seq_q, dq_rows), rows(seq_k, mod.BWD_DQ_TILE_N)),
             ints(batch, 1, rows(seq_k, mod.BWD_TILE_N), 3),
             ints(batch, 1, rows(seq_k, mod.BWD_TILE_N), rows(seq_q, kv_rows)))

    def made(**changes):
        fields = dict(counts=counts, indices=indices, batch=batch, num_heads=1, seq_q=seq_q, seq_k=seq_k,
                      q_offset=0, tile=tile, device=cpu, grads=grads)
        return mod.BlockMap(**{**fields, **changes})

    made().check(batch, 8, seq_q, seq_k, 0, tile, cpu)  # the shapes make_block_map gives
    made(grads=()).check(batch, 8, seq_q, seq_k, 0, tile, cpu)
    for changes, field in [
        (dict(counts=ints(batch, 1, rows(seq_q, 64), 2)), "block_map.counts"),
        (dict(counts=counts.long()), "block_map.counts"),
        (dict(indices=ints(batch, 1, rows(seq_q, 64), 1)), "block_map.indices"),
        (dict(indices=None), "block_map.indices"),
        (dict(grads=grads[:3]), "block_map.grads must hold 4"),
        (dict(grads=(grads[0], grads[1], grads[3], grads[2])), r"block_map.grads\[2\]"),
        # Lists at the per-head tiles' rows, not the packed tiles' positions.
        (dict(grads=(ints(batch, 1, rows(seq_q, mod.BWD_DQ_TILE_M), 3), *grads[1:])), r"block_map.grads\[0\]"),
    ]:
        with pytest.raises(ValueError, match=field):
            made(**changes).check(batch, 8, seq_q, seq_k, 0, tile, cpu)


@pytest.mark.parametrize("name", ["fmha_train_document", "fmha_block_pattern"])
def test_maps_as_built_pass_their_check(name, monkeypatch):
    """The tensors _block_map allocates (its launches stubbed out on the CPU) have the
    shapes check() demands, at ragged lengths and an offset."""
    import torch

    from tests.helpers import generated_module

    mod = generated_module(name)
    monkeypatch.setattr(mod, "_stream", lambda device: 0)
    monkeypatch.setattr(mod.ct, "launch", lambda *args: None)
    cpu = torch.device("cpu")
    extra = {"backward": True} if mod.SPEC["backward"] else {}
    for batch, heads, seq_q, seq_k, q_offset, tile in [(2, 8, 300, 700, 400, (64, 128)),
                                                      (1, 4, 129, 129, 0, (128, 128))]:
        tensors = dict.fromkeys(mod.SPEC["tensors"])  # read only by the stubbed launches
        block_map = mod._block_map(tensors, batch, heads, seq_q, seq_k, q_offset, cpu, tile, **extra)
        block_map.check(batch, heads, seq_q, seq_k, q_offset, tile, cpu)
        assert len(getattr(block_map, "grads", ())) == (4 if extra else 0)


# --- decode: the map kernel of a decode spec, on the CPU ------------------------

DECODE_MAPS = {  # mask, tensors, other fields
    "doc": {"tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
            "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"},
    "chunk_300_window": {"mask_mod": "q_idx // 300 == kv_idx // 300", "window": {"left": 500}},
    "per_head_limit": {"tensors": {"lim": {"dtype": "int32", "shape": ["heads"]}}, "mask_mod": "kv_idx >= lim[h]"},
    "scattered_blocks": {"tensors": {"f": {"dtype": "int32", "shape": ["batch", 64]}},
                         "mask_mod": "f[b, kv_idx // 64] != 0"},
}


def _decode_map_module(name, gqa, max_q_len, tile_n):
    from specgen.compile.export import load_module_from_source

    spec = {"name": f"dmap_{name}", "family": "decode", "dtype": "bfloat16", "head_dim": 64, "gqa_ratio": gqa,
            "max_q_len": max_q_len, "block_sparse": True, **DECODE_MAPS[name],
            "targets": {"default": {"tile_m": 16, "tile_n": tile_n}}}
    return load_module_from_source(f"dmap_{name}", render_raw(make_plan(validate_spec(spec))), f"<dmap_{name}>")


def _decode_states(module, tensors, seq_lens, heads, q_len, max_len, tile_n):
    """[B, H_map, 1, key tiles]: 0 empty, 1 partial, 2 full, from the mask's pairs
    between each sequence's q_len last positions (and the map head's query heads)
    and its keys."""
    import torch

    from specgen.spec.hooks import evaluate

    spec, group = module.SPEC, module.GROUP_SIZE
    uses = compile_hook(spec["mask_mod"], "mask_mod", {
        n: (t["dtype"], len(t["shape"])) for n, t in spec["tensors"].items()}).uses
    map_heads = heads // group if "h" in uses else 1
    tiles = -(-max_len // tile_n)
    states = np.zeros((len(seq_lens), map_heads, 1, tiles), dtype=np.int64)
    left = (spec.get("window") or {}).get("left")
    keys = torch.arange(tiles * tile_n)[None, :]
    for b, n in enumerate(seq_lens):
        rows = torch.arange(n - q_len, n)[:, None]
        vis = (keys < n) & (keys <= rows)
        if left is not None:
            vis &= keys >= rows - left
        for m in range(map_heads):
            group_heads = torch.arange(m * group, (m + 1) * group) if map_heads > 1 else torch.zeros(1, dtype=torch.long)
            env = {"b": torch.tensor(b), "h": group_heads[:, None, None], "q_idx": rows[None], "kv_idx": keys[None]}
            mask = evaluate(spec["mask_mod"], env, {k: torch.from_numpy(t) for k, t in tensors.items()})
            pairs = (vis[None] & mask).reshape(-1, tiles, tile_n)  # [rows, tiles, tile_n]
            full = pairs.all(dim=2).all(dim=0)
            any_ = pairs.any(dim=2).any(dim=0)
            states[b, m, 0] = torch.where(full, 2, torch.where(any_, 1, 0)).numpy()
    return states


# Small steps: a row's tiles are classified by many CTAs, and listed in several steps.
SMALL_DECODE_STEPS = {"MAP_STEP_PAIRS": 512, "LIST_CHUNK": 16}


def _run_decode_map(module, constants, seq_lens, tensors, map_heads, tiles, q_len, tile_n, max_len):
    """(counts, indices) of a decode module's two map kernels run CTA by CTA on the
    CPU, as _block_map launches them."""
    import types

    def kernel(listing):
        """The map's classifying kernel, or (``listing``) its listing kernel, run on ``ct``."""
        names = [n for n in dir(module) if n.startswith("fmha_decode_map_")]
        fn = getattr(module, next(n for n in names if n.startswith("fmha_decode_map_list_") == listing))._pyfunc
        return lambda ct: types.FunctionType(fn.__code__, {**fn.__globals__, **(constants or {}), "ct": ct},
                                             fn.__name__)

    values = {**vars(module), **(constants or {})}
    rows, list_chunk = values["MAP_ROWS"], values["LIST_CHUNK"]
    chunk = max(values["MAP_STEP_PAIRS"] // (rows * tile_n), 1)
    padded = -(-tiles // list_chunk) * list_chunk
    batch = len(seq_lens)
    state = np.full((batch, map_heads, 1, padded), -7, dtype=np.int32)
    counts = np.full((batch, map_heads, 1, 3), -2, dtype=np.int32)
    indices = np.full((batch, map_heads, 1, tiles), -1, dtype=np.int32)
    ct = _Tiles((padded // chunk, batch * map_heads, 1))
    classify = kernel(False)(ct)
    for block in itertools.product(range(padded // chunk), range(batch * map_heads)):
        ct.block = (*block, 0)
        classify(state, seq_lens, *[tensors[n] for n in module.SPEC["tensors"]], q_len, max_len, tile_n)
    assert (state >= 0).all(), "a state left unwritten"
    ct = _Tiles((batch * map_heads, 1, 1))
    listing = kernel(True)(ct)
    for block in range(batch * map_heads):
        ct.block = (block, 0, 0)
        listing(counts, indices, state)
    return counts, indices


@pytest.mark.parametrize("name", sorted(DECODE_MAPS))
def test_decode_map_kernel_lists_exactly_the_visible_tiles_on_the_cpu(name):
    """A decode spec's map kernel run through numpy: for ragged lengths, several
    query tokens, GQA groups and step sizes, each sequence's lists equal a
    classification of the cache's tiles from the mask's pairs."""
    rng = np.random.default_rng(len(name))
    for gqa, max_q_len, tile_n in [(8, 1, 128), (4, 4, 64), (1, 3, 64)]:
        module = _decode_map_module(name, gqa, max_q_len, tile_n)
        heads, max_len = 2 * gqa, 3000
        for q_len, constants in itertools.product(sorted({1, max_q_len}), (None, SMALL_DECODE_STEPS)):
            # (3100: a length past the cache, which the kernels read as the cache's 3000)
            seq_lens = np.array([q_len, 129, 1000, 2999, 3000, 3100][:5 if q_len > 1 else 6], dtype=np.int32)
            seq_lens = np.maximum(seq_lens, q_len)
            tensors = _hook_tensors(module.SPEC, len(seq_lens), heads, max_len, rng)
            want = _decode_states(module, tensors, np.minimum(seq_lens, max_len).tolist(), heads, q_len, max_len,
                                  tile_n)
            counts, indices = _run_decode_map(module, constants, seq_lens, tensors, want.shape[1], want.shape[3],
                                              q_len, tile_n, max_len)
            got = _map_states(counts, indices, want.shape[3])
            assert (got == want).all(), (name, gqa, max_q_len, tile_n, q_len, constants)


def test_decode_block_map_is_checked_before_any_launch(monkeypatch):
    """A decode map of other sizes, or lists the kernels would read out of bounds,
    is refused with the field named; make_block_map checks its arguments."""
    import torch

    module = _decode_map_module("doc", 8, 1, 128)
    monkeypatch.setattr(module, "_stream", lambda device: 0)
    monkeypatch.setattr(module.ct, "launch", lambda *args: None)
    cpu = torch.device("cpu")
    lens = torch.tensor([5, 300], dtype=torch.int32)
    doc = torch.zeros(2, 1000, dtype=torch.int32)
    built = module._block_map({"doc": doc}, lens, 2, 1, 1000, cpu, 128)  # (launches stubbed)
    assert tuple(built.counts.shape) == (2, 1, 1, 3) and tuple(built.indices.shape) == (2, 1, 1, 8)
    built.check(2, 2, 1, 1000, 128, cpu)
    for args, words in [((3, 2, 1, 1000, 128, cpu), "built for batch 2, but this call has 3"),
                        ((2, 2, 1, 999, 128, cpu), "built for max_len 1000, but this call has 999"),
                        ((2, 2, 1, 1000, 64, cpu), "built for tile_n 128, but this call has 64")]:
        with pytest.raises(ValueError, match=words):
            built.check(*args)
    import dataclasses

    for changes, field in [(dict(counts=built.counts[..., :2]), "block_map.counts"),
                           (dict(indices=built.indices[..., :7]), "block_map.indices"),
                           (dict(indices=built.indices.long()), "block_map.indices")]:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(built, **changes).check(2, 2, 1, 1000, 128, cpu)
    for kwargs, words in [(dict(seq_lens=lens.long()), "seq_lens must be a 1-D int32 CUDA tensor"),
                          (dict(num_heads=12), "num_heads must be a multiple of 8"),
                          (dict(q_len=2), r"q_len must be in \[1, 1\]"),
                          (dict(max_len=0), "max_len must be an int >= 1")]:
        call = {**dict(seq_lens=lens, num_heads=16, max_len=1000, q_len=1, doc=doc), **kwargs}
        with pytest.raises(ValueError, match=words):
            module.make_block_map(call.pop("seq_lens"), call.pop("num_heads"), call.pop("max_len"), **call)


@pytest.mark.parametrize("name", ["chunked_local", "prefix_lm", "window_document", "block_pattern"])
def test_bench_training_copies_of_the_sparse_specs_stay_the_shipped_specs(name):
    """bench/train/fmha_train_<mask>.yaml is specs/fmha_<mask>.yaml with backward: true
    (the backward suite's Flex comparison on every block-sparse mask), and its
    backward packs GQA exactly where the shipped forward does."""
    import yaml

    from specgen.plan.make import make_plan
    from specgen.spec import validate_spec

    from .helpers import ROOT

    shipped = yaml.safe_load((ROOT / "specs" / f"fmha_{name}.yaml").read_text())
    train = yaml.safe_load((ROOT / "bench" / "train" / f"fmha_train_{name}.yaml").read_text())
    assert train.pop("name") == f"fmha_train_{name}" and train.pop("backward") is True
    shipped.pop("name")
    assert train == shipped
    plan = make_plan(validate_spec({**train, "name": f"fmha_train_{name}", "backward": True}))
    assert plan.backward and plan.block_sparse
    assert plan.bwd_pack == bool(shipped.get("pack_gqa"))

"""Block-sparse specs on the CPU: validation, the map kernel's bound test, rendering."""

import itertools
import random

import numpy as np
import pytest

from specgen.emit.render import render
from specgen.errors import SpecError
from specgen.plan.make import make_plan
from specgen.spec import validate_spec
from specgen.spec.hooks import compile_hook, tile_pretest

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


def test_decode_refuses_block_sparse():
    lines = _errors({"name": "d", "family": "decode", "block_sparse": True})
    assert lines == ["specs/bad.yaml: block_sparse: a prefill field, not supported by family decode"]


class _Ct:
    """The few cuTile functions the bound test prints, on numpy arrays."""

    min = staticmethod(np.min)
    max = staticmethod(np.max)


MASKS = [
    ("doc[b, q_idx] == doc[b, kv_idx]", {"doc": 2}),
    ("doc[b, q_idx] != doc[b, kv_idx]", {"doc": 2}),
    ("(kv_idx < pre[b]) | (kv_idx <= q_idx)", {"pre": 1}),
    ("q_idx // 37 == kv_idx // 37", {}),
    ("(doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx >= q_idx - 50)", {"doc": 2}),
    ("(q_idx % 64 < 10) and (kv_idx > 300)", {}),
    ("doc[b, kv_idx] >= doc[b, q_idx] - 1", {"doc": 2}),
]


@pytest.mark.parametrize("mask,dims", MASKS, ids=[m for m, _ in MASKS])
def test_bound_test_never_rejects_a_tile_with_a_visible_pair(mask, dims):
    """Soundness: on random tiles, wherever a pair is visible the test passes
    (and it does reject some tiles, so it is not trivially true)."""
    tensors = {n: ("int32", d) for n, d in dims.items()}
    hook = compile_hook(mask, "mask_mod", tensors)
    test = tile_pretest(mask, tensors, hook.gathers)
    assert test is not None
    rng = random.Random(7)
    rejected = 0
    for trial in range(300):
        doc = np.cumsum(np.array([rng.random() < 0.05 for _ in range(400)], dtype=np.int32))
        pre = np.array([rng.randrange(0, 400)], dtype=np.int32)
        r0, k0 = rng.randrange(0, 336), rng.randrange(0, 336)
        rows = np.arange(r0, r0 + 64)[:, None]
        keys = np.arange(k0, k0 + 64)[None, :]
        env = {"rows": rows, "keys": keys, "batch": 0, "head": 0, "ct": _Ct, "np": np}
        for g in hook.gathers + test.gathers:  # every operand, as the kernel gathers it
            table = {"doc": doc[None, :], "pre": pre}[g.tensor]
            index = tuple(eval(i, {}, env) for i in g.indices)
            env[g.local] = table[index]
        visible = np.broadcast_to(eval(hook.kernel.replace("ct.where", "np.where"), {}, env), (64, 64))
        may = bool(eval(test.expr, {}, env))
        assert may or not visible.any(), (mask, trial)
        rejected += not may
    assert rejected > 0


def test_dense_and_sparse_renders():
    dense = render(make_plan(validate_spec({**DOC, "block_sparse": False})), "specs/doc.yaml").text
    sparse = render(make_plan(validate_spec(DOC)), "specs/doc.yaml").text
    assert "make_block_map" not in dense and "MapIdx" not in dense
    for text in ("def make_block_map(", "class BlockMap", "def fmha_block_map_causal", "block_map=None",
                 "if ((ct.min(doc_0)) <= (ct.max(doc_1)))"):
        assert text in sparse
    # Deterministic: the same spec renders byte-identically.
    assert render(make_plan(validate_spec(DOC)), "specs/doc.yaml").text == sparse

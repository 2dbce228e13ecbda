"""Feature combinations the spec fuzzers (tests/test_fuzz.py's strategies) never draw,
emulated on the CPU against the fp64 reference: several features in one spec
(the fuzzers pick one of sinks/lse/dropout/varlen/hooks/backward, and keep windows,
soft-caps and v_head_dim out of backward specs), GQA ratios that are not powers of
two, learnable hook tensors of every subscript shape, and mask_mods that hide whole
rows of a block-sparse, sink-carrying spec. Small tiles (16) give tiny shapes several
tiles each, so every case runs in a fraction of a second."""

import pytest
import torch

from specgen.check import emulate
from specgen.check.cases import compare, compare_lse, random_qkv, reference_for
from specgen.check.runner import Case, case_verdict, run_case

from .helpers import emulated_spec_module

SMALL_TILES = {"default": {"tile_m": 16, "tile_n": 16}}

# Dense shapes: one key, more queries than keys (rows before the first key), chunked
# prefill, queries past the keys, a strided layout.
DENSE = (Case(1, 1, 1, 1), Case(1, 1, 33, 15, -18), Case(1, 2, 15, 33, 18), Case(1, 1, 10, 20, 30),
         Case(2, 1, 17, 31, 14, "transposed"))
# A packed batch with sequences without queries, without keys, and ragged ones.
PACKED = (Case(4, 2, 0, 0, lengths=((0, 5), (3, 0), (17, 33), (16, 15))),)


def _spec(name: str, **fields) -> dict:
    return {"name": name, "dtype": "bfloat16", "head_dim": 32, "targets": SMALL_TILES, **fields}


def _check(data: dict, cases) -> None:
    module = emulated_spec_module(data, "combo")
    for case in cases:
        with emulate.emulating():
            row = run_case(torch, module, case, torch.Generator().manual_seed(3), device="cpu")
        assert row["ok"], f"{data}\n{case.label(data['gqa_ratio'])}: {case_verdict(row)}"
        if data.get("backward"):
            assert "grad_ratio" in row


LEARNABLE_SLOPE = {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}}
PREFILL_COMBOS = {
    "sinks_window_lse_backward": dict(causal=True, sinks=True, window={"left": 5}, return_lse=True,
                                      backward=True),
    "two_sided_window_sinks_v_head_dim_backward": dict(window={"left": 4, "right": 3}, sinks=True,
                                                       head_dim=48, v_head_dim=16, backward=True),
    "softcap_learnable_score_mod_backward": dict(causal=True, softcap=5.0, tensors=LEARNABLE_SLOPE,
                                                 score_mod="score - slope[h] * abs(q_idx - kv_idx)",
                                                 backward=True),
    "padded_head_dim_dropout_window_backward": dict(causal=True, head_dim=80, dropout=True,
                                                    window={"left": 7}, backward=True),
    "block_sparse_doc_mask_sinks_lse_backward": dict(
        causal=True, sinks=True, return_lse=True, block_sparse=True, backward=True,
        tensors={"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
        mask_mod="doc[b, q_idx] == doc[b, kv_idx]"),
}


@pytest.mark.parametrize("ratio", [2, 3])
@pytest.mark.parametrize("combo", sorted(PREFILL_COMBOS))
def test_prefill_feature_combinations_match_the_reference(combo, ratio):
    _check(_spec(f"combo_{combo}", gqa_ratio=ratio, **PREFILL_COMBOS[combo]), DENSE)


@pytest.mark.parametrize("ratio", [1, 3])
def test_varlen_with_empty_sequences_sinks_window_and_v_head_dim_trains(ratio):
    data = _spec("combo_varlen", gqa_ratio=ratio, varlen=True, causal=True, sinks=True,
                 window={"left": 3}, head_dim=80, v_head_dim=32, return_lse=True, backward=True)
    _check(data, PACKED)


@pytest.mark.parametrize("ratio,q_len", [(3, 3), (5, 2), (6, 1)])
def test_decode_with_a_gqa_ratio_not_a_power_of_two(ratio, q_len):
    """Query tiles of ratio x q_len rows padded to 16: paged, windowed, with sinks and
    several splits; and a float8 cache with V stored keys last."""
    rows = max(16, 1 << (ratio * q_len - 1).bit_length())
    targets = {"default": {"tile_m": rows, "tile_n": 16}}
    lens = (q_len, 17, 100, 33 + q_len)
    cases = [Case(len(lens), 1, q, 0, decode_lens=lens) for q in sorted({1, q_len})]
    for extra in ({"sinks": True, "window": {"left": 6}, "paged": {"page_size": 16}, "splits": 3},
                  {"kv_dtype": "float8_e4m3fn", "v_cache_transposed": True, "splits": 2}):
        _check({"name": f"combo_decode_{ratio}_{q_len}", "family": "decode", "dtype": "bfloat16",
                "head_dim": 32, "gqa_ratio": ratio, "max_q_len": q_len, "targets": targets, **extra},
               cases)


def _learnable(shape) -> dict:
    return {"dtype": "float32", "shape": shape, "learnable": True}


# Each subscript shape sends dL/dtensor down another path of the backward (per head,
# per key, per query row, per element, a fixed table).
LEARNABLE_HOOKS = {
    "per_key": ({"kb": _learnable(["seq_k"])}, "score + kb[kv_idx]"),
    "per_query": ({"qb": _learnable(["seq_q"])}, "score * (1 + qb[q_idx % 15])"),
    "per_batch_head": ({"bh": _learnable(["batch", "heads"])}, "score - bh[b, h] * abs(q_idx - kv_idx)"),
    "per_kv_head": ({"kh": _learnable(["kv_heads"])}, "score - kh[h // 2] * abs(q_idx - kv_idx)"),
    "per_element": ({"full": _learnable(["batch", "heads", "seq_q", "seq_k"])},
                    "score + full[b, h, q_idx % 15, kv_idx]"),
    "fixed_table": ({"two": _learnable([2])}, "score * two[0] + two[1] * kv_idx / 8"),
}


@pytest.mark.parametrize("hook", sorted(LEARNABLE_HOOKS))
def test_learnable_hook_tensors_of_every_subscript_shape_with_sinks_and_a_window(hook):
    tensors, score_mod = LEARNABLE_HOOKS[hook]
    data = _spec(f"combo_learn_{hook}", gqa_ratio=2, window={"left": 4, "right": 3}, sinks=True,
                 tensors=tensors, score_mod=score_mod, backward=True)
    _check(data, (Case(2, 2, 15, 33, 18), Case(1, 2, 33, 40, 3)))


@pytest.mark.parametrize("layout", ["block_sparse", "skip_masked_tiles", "plain"])
def test_a_mask_mod_that_hides_whole_rows_gives_zeros_and_the_sinks_lse(layout):
    """lim [B, Hq] of 0 hides every key of a (batch, head): its rows are zeros, their
    LSE the head's sink, and its gradients zero but for the sink's."""
    data = _spec("combo_hidden_rows", gqa_ratio=2, causal=True, sinks=True, return_lse=True,
                 backward=True, tensors={"lim": {"dtype": "int32", "shape": ["batch", "heads"]}},
                 mask_mod="kv_idx < lim[b, h]",
                 **({layout: True} if layout != "plain" else {}))
    module = emulated_spec_module(data, "combo")
    g = torch.Generator().manual_seed(11)
    q, k, v = (t.requires_grad_() for t in random_qkv(module.SPEC, 2, 1, 19, 35, generator=g,
                                                       device="cpu"))
    sinks = (torch.randn(2, generator=g) * 2).requires_grad_()
    lim = torch.tensor([[0, 7], [40, 0]], dtype=torch.int32)
    dout = torch.randn(2, 2, 19, 32, generator=g).to(torch.bfloat16)
    with emulate.emulating():
        out, lse = module.attention(q, k, v, q_offset=16, sinks=sinks, lim=lim)
        grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref, ref_lse = reference_for(module.SPEC, *leaves[:3], {"sinks": leaves[3], "lim": lim}, q_offset=16)
    assert compare(out, ref, "bfloat16").ok and compare_lse(lse, ref_lse).ok
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    assert torch.allclose(lse[0, 0], sinks[0].detach().expand(19), atol=1e-5)
    want = torch.autograd.grad(ref, leaves, dout.double())
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert torch.isfinite(a).all(), name
        assert (a.double() - b).abs().max() <= 0.02 * b.abs().max() + 1e-4, name

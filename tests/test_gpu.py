"""Generated kernels against the fp64 reference on a CUDA GPU (marked `gpu`)."""

import pytest
import torch

from specgen.check.cases import (
    call_kernel,
    compare,
    compare_lse,
    feature_inputs,
    random_qkv,
    reference_for,
    shape_dims,
)
from specgen.check.runner import Case, learnable_tensors, run_case

from .helpers import (
    DECODE_SPEC_NAMES,
    DENSE_SPEC_NAMES,
    FORWARD_ONLY_PREFILL_SPECS,
    TRAINING_SPEC_NAMES,
    VARLEN_SPEC_NAMES,
    generated_module,
    render_spec_data,
    trained_spec_data,
)

pytestmark = pytest.mark.gpu

# (batch, kv_heads, seq_q, seq_k, q_offset): ragged, tiny, chunked-prefill and long.
SHAPES = [
    (1, 1, 1, 1, 0),
    (3, 2, 17, 17, 0),
    (1, 2, 64, 64, 0),
    (1, 1, 1000, 1000, 0),
    (2, 1, 128, 1000, 872),
    (1, 2, 100, 333, 233),
    (1, 1, 4096, 4096, 0),
]


def _check(mod, batch, kv_heads, seq_q, seq_k, q_offset=0, layout="contiguous", seed=0):
    """One case through the same code path as `specgen test` (poisoned output)."""
    case = Case(batch, kv_heads, seq_q, seq_k, q_offset, layout)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    row = run_case(torch, mod, case, generator)
    print(f"{mod.SPEC['name']} {row['shape']}: max_abs={row['max_abs_err']:.2e} rel={row['rel_err']:.2e}")
    assert row["ok"], row


@pytest.mark.parametrize("name", DENSE_SPEC_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_matches_fp64_reference(name, shape):
    _check(generated_module(name), *shape, seed=hash(shape) & 0xFFFF)


@pytest.mark.parametrize("name", DENSE_SPEC_NAMES)
def test_transposed_views(name):
    """A [B, S, H, D] tensor seen as [B, H, S, D] (a transposed view) works as is."""
    _check(generated_module(name), 2, 2, 300, 300, layout="transposed")
    _check(generated_module(name), 1, 2, 100, 700, q_offset=600, layout="transposed")


@pytest.mark.parametrize("name", DENSE_SPEC_NAMES)
def test_custom_scale(name):
    mod = generated_module(name)
    spec = mod.SPEC
    q, k, v = random_qkv(spec, 1, 1, 200, 200)
    extra = feature_inputs(spec, shape_dims(q, k))
    out, lse = call_kernel(mod, q, k, v, extra, scale=0.05)
    ref, ref_lse = reference_for(spec, q, k, v, extra, scale=0.05)
    assert compare(out, ref, spec["dtype"]).ok
    assert lse is None or compare_lse(lse, ref_lse).ok


@pytest.mark.parametrize("name", DENSE_SPEC_NAMES)
def test_empty_query_returns_empty(name):
    mod = generated_module(name)
    spec = mod.SPEC
    q, k, v = random_qkv(spec, 1, 1, 0, 5)
    out, lse = call_kernel(mod, q, k, v, feature_inputs(spec, shape_dims(q, k)))
    assert out.shape == (*q.shape[:3], v.shape[3]) and (lse is None or lse.shape == q.shape[:3])


# Variants of fmha_gqa_causal rendered at test time: every structural branch of the
# template (and bf16 on the causal GQA kernel) is run against the reference.
VARIANTS = {
    "bf16": {"dtype": "bfloat16"},
    "no_fast_math": {"fast_math": {"exp2": False, "flush_to_zero": False, "approx_div": False}},
    "no_split_no_remap": {"loop_split": False, "block_remap": False},
    "k_permuted_no_hints": {"loads": {"k_transposed": False, "k_latency": None, "v_latency": None}},
    "non_causal_gqa8_d64": {"causal": False, "block_remap": None, "gqa_ratio": 8, "head_dim": 64},
    "d256_tiles_32": {"head_dim": 256, "targets": {"default": {"tile_m": 32, "tile_n": 32, "occupancy": 1}}},
    # Head dims that are not a power of two: tiles zero-padded in D.
    "d80": {"head_dim": 80},
    "d56_gqa8_non_causal": {"head_dim": 56, "gqa_ratio": 8, "causal": False, "block_remap": None},
    "d96_k_permuted_no_prescale": {"head_dim": 96, "prescale_q": False,
                                   "loads": {"k_transposed": False}},
    "d24_bf16_no_split": {"head_dim": 24, "dtype": "bfloat16", "loop_split": False},
    # v_head_dim != head_dim (MLA): one padded, one not; and the other way round.
    "d192_dv128": {"head_dim": 192, "v_head_dim": 128},
    "d64_dv40_window_lse": {"head_dim": 64, "v_head_dim": 40, "window": {"left": 100},
                            "return_lse": True},
    "subtiles_prescale_nobounds": {
        "q_subtiles": 2, "prescale_q": True,
        "loads": {"check_bounds": "masked", "allow_tma": False},
        "targets": {"default": {"tile_m": 128, "tile_n": 64, "occupancy": 1, "num_worker_warps": 8}},
    },
    "non_causal_subtiles": {
        "causal": False, "block_remap": None, "q_subtiles": 2,
        "loads": {"check_bounds": "masked"},
        "targets": {"default": {"tile_m": 64, "tile_n": 32, "occupancy": 2}},
    },
    # V handed to the kernel transposed ([B, Hkv, D, Skv], key rows padded to 16):
    # every length's own config transposes, 77 (a bucket) does not; padded D too.
    "v_transposed_buckets_d80": {
        "head_dim": 80,
        "targets": {"default": {
            "tile_m": 64, "tile_n": 64, "v_transposed": True,
            "by_seq_k": [{"max_seq_k": 100, "tile_m": 32, "tile_n": 32, "v_transposed": False}],
        }},
    },
    "v_transposed_fp8_non_causal": {
        "dtype": "float8_e4m3fn", "out_dtype": "bfloat16", "causal": False, "block_remap": None,
        "prescale_q": False, "targets": {"default": {"tile_m": 64, "tile_n": 64}},
    },
    # Persistent launches: one wave of CTAs looping over the work items, in both
    # tile orders, and a bucket that launches one CTA per item with the same kernel.
    "persistent_buckets": {
        "targets": {"default": {
            "tile_m": 64, "tile_n": 64, "occupancy": 2, "persistent": True,
            "by_seq_k": [{"max_seq_k": 100, "tile_m": 32, "tile_n": 32},
                         {"max_seq_k": 500, "tile_m": 64, "tile_n": 64, "tile_order": "global",
                          "persistent": True}],
        }},
    },
    "persistent_fp8_non_causal": {
        "dtype": "float8_e4m3fn", "out_dtype": "bfloat16", "causal": False, "block_remap": None,
        "prescale_q": False, "targets": {"default": {"tile_m": 64, "tile_n": 64, "persistent": True}},
    },
    "persistent_window_sinks_lse": {
        "window": {"left": 100}, "sinks": True, "return_lse": True,
        "targets": {"default": {"tile_m": 64, "tile_n": 64, "persistent": True}},
    },
    # The next key tile's S formed before this tile's softmax, with Q in shared
    # memory or pre-scaled, with a window's three loops, float8, K permuted in
    # registers and unmasked tiles without bounds checks (the look-ahead checks).
    "qk_ahead_no_prescale_128": {
        "qk_ahead": True, "prescale_q": False,
        "targets": {"default": {"tile_m": 128, "tile_n": 128, "occupancy": 1, "num_worker_warps": 8}},
    },
    "qk_ahead_window_sinks_lse": {"qk_ahead": True, "window": {"left": 100}, "sinks": True,
                                  "return_lse": True},
    "qk_ahead_fp8_non_causal": {
        "qk_ahead": True, "dtype": "float8_e4m3fn", "out_dtype": "bfloat16", "causal": False,
        "block_remap": None, "prescale_q": False, "targets": {"default": {"tile_m": 64, "tile_n": 64}},
    },
    "qk_ahead_k_permuted_nobounds": {"qk_ahead": True, "loads": {"k_transposed": False,
                                                                "check_bounds": "masked"}},
    # Key-length buckets: 77 and 128 run the first config, 1000 the target's own.
    "seq_buckets": {
        "targets": {"default": {
            "tile_m": 128, "tile_n": 64, "occupancy": 1, "num_ctas": 2,
            "by_seq_k": [{"max_seq_k": 100, "tile_m": 32, "tile_n": 32, "occupancy": 2},
                         {"max_seq_k": 500, "tile_m": 64, "tile_n": 128, "occupancy": 1}],
        }},
    },
}


def _variant_module(name, overrides):
    from specgen.compile.export import load_module_from_source

    from .helpers import prefill_variant_data, render_spec_data

    plan, source = render_spec_data(prefill_variant_data(name, overrides))
    return load_module_from_source(plan.module_name, source, f"variant_{name}.py")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("shape", [(1, 1, 1000, 1000, 0), (2, 1, 128, 1000, 872), (1, 2, 77, 77, 0)],
                         ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_template_variants_match_reference(variant, shape):
    _check(_variant_module(variant, VARIANTS[variant]), *shape, seed=shape[2] * 7 + shape[3])


# Issue-6 features on a small kernel each: every combination the template prints
# differently (left/right windows, causal or not, split or not, soft-cap with or
# without pre-scaling, sinks, LSE, exp vs exp2), against the fp64 reference,
# including rows that see no key.
FEATURE_VARIANTS = {
    "window_causal_small": {"window": {"left": 100}, "return_lse": True},
    "window_both_sides_noncausal": {"causal": False, "block_remap": None,
                                    "window": {"left": 70, "right": 33}, "return_lse": True},
    "window_right_only_noncausal": {"causal": False, "block_remap": None, "window": {"right": 5}},
    "window_no_split": {"window": {"left": 64}, "loop_split": False, "return_lse": True},
    "softcap": {"softcap": 5.0, "prescale_q": False},
    "softcap_prescaled_no_exp2": {"softcap": 5.0, "prescale_q": True,
                                  "fast_math": {"exp2": False, "flush_to_zero": False, "approx_div": False}},
    "sinks_lse": {"sinks": True, "return_lse": True},
    "sinks_window_lse_no_exp2": {"sinks": True, "return_lse": True, "window": {"left": 40},
                                 "fast_math": {"exp2": False, "flush_to_zero": False, "approx_div": True}},
    "everything_tiles_128x64": {"sinks": True, "return_lse": True, "window": {"left": 200}, "softcap": 20.0,
                                "targets": {"default": {"tile_m": 128, "tile_n": 64, "occupancy": 1,
                                                        "num_worker_warps": 8}}},
    # Expression hooks: hoisted and per-step gathers, int and float tensors, hooks
    # with soft-cap, window, LSE, no exp2, no pre-scaling, rows left empty.
    "alibi": {"tensors": {"slope": {"dtype": "float32", "shape": ["heads"]}},
              "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
    "doc_mask_non_causal": {"causal": False, "block_remap": None,
                            "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
                            "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"},
    "hooks_softcap_window_lse_no_exp2": {
        "softcap": 20.0, "window": {"left": 150}, "return_lse": True, "prescale_q": False,
        "fast_math": {"exp2": False, "flush_to_zero": False, "approx_div": False},
        "tensors": {"bias": {"dtype": "float32", "shape": ["heads", "seq_k"]}},
        "score_mod": "score + bias[h, kv_idx] if (q_idx - kv_idx) % 3 != 1 else score * 0.5",
        "mask_mod": "kv_idx % 7 != 3"},
    "doc_mask_no_tile_skip": {"skip_masked_tiles": False,
                              "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
                              "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"},
    "mask_mod_empty_rows_lse": {"mask_mod": "kv_idx >= 64", "return_lse": True, "prescale_q": False},
    # float8 q/k/v with descales, 16-bit output.
    "fp8_f16_out": {"dtype": "float8_e4m3fn", "out_dtype": "float16", "prescale_q": False},
    "fp8_window_softcap_lse_non_causal": {
        "dtype": "float8_e4m3fn", "prescale_q": False, "causal": False, "block_remap": None,
        "window": {"left": 100, "right": 20}, "softcap": 15.0, "return_lse": True,
        "targets": {"default": {"tile_m": 128, "tile_n": 64, "occupancy": 1}}},
    # Dropout: the reference regenerates the kernel's mask from the seed.
    "dropout": {"dropout": True},
    "dropout_window_lse_no_split": {"dropout": True, "window": {"left": 90}, "return_lse": True,
                                    "loop_split": False},
    "dropout_alibi_non_causal_no_exp2": {
        "dropout": True, "causal": False, "block_remap": None,
        "fast_math": {"exp2": False, "flush_to_zero": False, "approx_div": False},
        "tensors": {"slope": {"dtype": "float32", "shape": ["heads"]}},
        "score_mod": "score - slope[h] * abs(q_idx - kv_idx)"},
    # Packed GQA: a tile holds tile_m / gqa_ratio positions of each head of a group.
    "pack_gqa_causal_lse": {"pack_gqa": True, "return_lse": True},
    "pack_gqa_window_non_causal_softcap": {
        "pack_gqa": True, "causal": False, "block_remap": None, "window": {"left": 70, "right": 33},
        "softcap": 20.0, "return_lse": True,
        "targets": {"default": {"tile_m": 128, "tile_n": 64, "occupancy": 1, "num_worker_warps": 8}}},
    "pack_gqa_doc_mask_window_global_order": {
        "pack_gqa": True, "window": {"left": 90},
        "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
        "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]",
        "targets": {"default": {"tile_m": 32, "tile_n": 64, "occupancy": 2, "tile_order": "global"}}},
    "pack_gqa_block_sparse_lse": {
        "pack_gqa": True, "block_sparse": True, "return_lse": True,
        "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
        "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"},
}


@pytest.mark.parametrize("variant", sorted(FEATURE_VARIANTS))
@pytest.mark.parametrize("shape", [(1, 1, 1000, 1000, 0), (2, 1, 128, 1000, 872), (1, 2, 77, 77, 0),
                                   (1, 2, 100, 300, 450)],
                         ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_feature_variants_match_reference(variant, shape):
    _check(_variant_module(variant, FEATURE_VARIANTS[variant]), *shape, seed=shape[2] * 11 + shape[3])


def test_empty_rows_are_zero_with_lse_minus_inf():
    """Queries placed past the window of every key: zeros and -inf, never NaN."""
    mod = _variant_module("empty_rows", {"window": {"left": 16}, "return_lse": True})
    q = torch.randn(1, 4, 64, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1, 50, 128, device="cuda", dtype=torch.float16)
    out, lse = mod.attention(q, k, k, q_offset=40)  # rows at 40..103: 40..65 see keys, the rest none
    visible = torch.arange(40, 104, device="cuda") - 16 <= 49
    assert torch.isfinite(out).all()
    assert (out[:, :, ~visible] == 0).all() and torch.isneginf(lse[:, :, ~visible]).all()
    assert torch.isfinite(lse[:, :, visible]).all()


def test_sinks_argument_is_checked_before_launch():
    mod = generated_module("fmha_gptoss_sinks")
    q = torch.randn(1, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"sinks must be a floating-point tensor of shape \[8\]"):
        mod.attention(q, k, k, sinks=torch.zeros(4, device="cuda"))
    with pytest.raises(ValueError, match="sinks must be a \\[8\\] tensor"):
        mod.attention(q, k, k, sinks=None)


def test_v_head_dim_out_buffer_is_checked():
    mod = generated_module("fmha_mla_d192")
    q = torch.randn(1, 2, 8, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must be a torch.bfloat16 tensor of shape \(1, 2, 8, 128\)"):
        mod.attention(q, q, v, out=torch.empty_like(q))


def test_hook_tensors_are_checked_before_launch():
    mod = generated_module("fmha_document_mask")  # doc: int32 [batch, seq_k], GQA 4
    q = torch.randn(2, 4, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"doc must be a torch.int32 tensor of shape \(2, 16\) on cuda:0, "
                                         r"got torch.int64 \(2, 16\)"):
        mod.attention(q, k, k, doc=torch.zeros(2, 16, device="cuda", dtype=torch.int64))
    with pytest.raises(ValueError, match=r"got torch.int32 \(1, 16\)"):
        mod.attention(q, k, k, doc=torch.zeros(1, 16, device="cuda", dtype=torch.int32))
    with pytest.raises(ValueError, match="got NoneType"):
        mod.attention(q, k, k, doc=None)


def test_dropout_is_reproducible_and_matches_reference_mask():
    mod = _variant_module("dropout_repro", {"dropout": True})
    q = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1, 300, 128, device="cuda", dtype=torch.float16)
    a = mod.attention(q, k, k, dropout_p=0.3, seed=11)
    b = mod.attention(q, k, k, dropout_p=0.3, seed=11)
    c = mod.attention(q, k, k, dropout_p=0.3, seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(mod.attention(q, k, k, dropout_p=0.0, seed=5), mod.attention(q, k, k, seed=9))
    ref = reference_for(mod.SPEC, q, k, k, {"dropout_p": 0.3, "seed": 11})[0]
    assert compare(a, ref, "float16").ok
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\), got 1.0"):
        mod.attention(q, k, k, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*31\), got -1"):
        mod.attention(q, k, k, seed=-1)


@pytest.mark.parametrize("name", VARLEN_SPEC_NAMES)
@pytest.mark.parametrize("index", range(8))
def test_varlen_specs_match_reference(name, index):
    from specgen.check.runner import case_matrix

    mod = generated_module(name)
    cases = case_matrix(False, mod.SPEC)
    if index >= len(cases):
        pytest.skip(f"{name} has {len(cases)} packed cases")
    generator = torch.Generator(device="cuda").manual_seed(index)
    row = run_case(torch, mod, cases[index], generator)
    assert row["ok"], row


def test_varlen_arguments_are_checked_before_launch():
    mod = generated_module("fmha_varlen_llama")
    q = torch.randn(10, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(12, 2, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 6, 12], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32 tensor"):
        mod.attention(q, k, k, cu_seqlens_q=cu.long(), cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="must have the same length"):
        mod.attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu_k[:2])
    with pytest.raises(ValueError, match=r"q must be 3-D \[total, heads, head_dim\]"):
        mod.attention(q[None], k, k, cu_seqlens_q=cu, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="max_seqlen_q must be a non-negative int or None"):
        mod.attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=-1)
    out, lse = mod.attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu_k)  # lengths read from cu
    assert out.shape == (10, 8, 128) and lse.shape == (8, 10) and torch.isfinite(out).all()


VARLEN_VARIANTS = {
    "varlen_plain": {"varlen": True},
    "varlen_window_sinks_lse": {"varlen": True, "window": {"left": 50}, "sinks": True, "return_lse": True},
    "varlen_non_causal_d80_dv64_softcap": {"varlen": True, "causal": False, "block_remap": None,
                                           "head_dim": 80, "v_head_dim": 64, "softcap": 10.0,
                                           "return_lse": True},
    "varlen_k_permuted_global_order": {
        "varlen": True, "loads": {"k_transposed": False},
        "targets": {"default": {"tile_m": 64, "tile_n": 64, "tile_order": "global"}}},
    "varlen_qk_ahead_window": {"varlen": True, "qk_ahead": True, "window": {"left": 50}},
}


@pytest.mark.parametrize("variant", sorted(VARLEN_VARIANTS))
@pytest.mark.parametrize("index", [1, 2])
def test_varlen_variants_match_reference(variant, index):
    from specgen.check.runner import case_matrix

    mod = _variant_module(variant, VARLEN_VARIANTS[variant])
    case = case_matrix(False, mod.SPEC)[index]
    row = run_case(torch, mod, case, torch.Generator(device="cuda").manual_seed(index))
    assert row["ok"], row


def test_fp8_descales_are_checked_and_applied():
    mod = generated_module("fmha_fp8_llama")  # GQA 8, D128, bfloat16 output
    q = torch.randn(1, 8, 64, 128, device="cuda").to(torch.float8_e4m3fn)
    k = torch.randn(1, 1, 64, 128, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_descale must be a positive float"):
        mod.attention(q, k, k, k_descale=-1.0)
    with pytest.raises(ValueError, match="v_descale must be a positive float or a one-element float tensor on"):
        mod.attention(q, k, k, v_descale=torch.ones(2, device="cuda"))
    base = mod.attention(q, k, k)
    assert base.dtype == torch.bfloat16
    # v's descale scales the output; a tensor descale (no host sync) equals the float.
    doubled = mod.attention(q, k, k, v_descale=torch.tensor([2.0], device="cuda"))
    assert torch.allclose(doubled.float(), 2 * base.float(), rtol=1e-2, atol=1e-2)



@pytest.mark.parametrize("seq_k", [100, 3000])  # both sm_90 configs (64x128 up to 2k keys, 128x256)
def test_fp8_prefill_takes_a_v_that_transposed_v_made(seq_k):
    """attention(..., v_transposed=True) on transposed_v's V: bit for bit the call
    with V as given (which copies V every call), eagerly and in a CUDA graph."""
    mod = generated_module("fmha_fp8_llama")
    gen = torch.Generator(device="cuda").manual_seed(seq_k)
    q = torch.randn(2, 16, 333, 128, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    k, v = (torch.randn(2, 2, seq_k, 128, device="cuda", generator=gen).to(torch.float8_e4m3fn)
            for _ in range(2))
    want = mod.attention(q, k, v, q_descale=0.5, v_descale=0.25)
    v_t = mod.transposed_v(v)
    got = mod.attention(q, k, v_t, q_descale=0.5, v_descale=0.25, v_transposed=True)
    assert torch.equal(got, want)
    out = torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    mod.attention(q, k, v_t, out=out, q_descale=0.5, v_descale=0.25, v_transposed=True)  # warm
    with torch.cuda.graph(graph):
        mod.attention(q, k, v_t, out=out, q_descale=0.5, v_descale=0.25, v_transposed=True)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mod.attention(q, k, torch.empty(2, 2, 128, seq_k + 1, device="cuda").to(torch.float8_e4m3fn)[..., 1:],
                      v_transposed=True)


# --- decode family -------------------------------------------------------------

DECODE_VARIANTS = {
    "mha_q1": {"gqa_ratio": 1, "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    "gqa4_q4_contiguous": {"gqa_ratio": 4, "max_q_len": 4,
                           "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    "gqa8_paged16_tile16": {"gqa_ratio": 8, "paged": {"page_size": 16},
                            "targets": {"default": {"tile_m": 16, "tile_n": 16}}},
    "window_sinks_no_exp2_splits3": {
        "gqa_ratio": 4, "window": {"left": 300}, "sinks": True, "splits": 3,
        "fast_math": {"exp2": False, "flush_to_zero": False, "approx_div": False},
        "targets": {"default": {"tile_m": 16, "tile_n": 32}}},
    "gqa8_q2_d64_paged128": {"gqa_ratio": 8, "max_q_len": 2, "head_dim": 64, "paged": {"page_size": 128},
                             "targets": {"default": {"tile_m": 16, "tile_n": 128}}},
    # A float8 cache, paged, with several query tokens, a window and sinks.
    "fp8kv_gqa4_q4_paged64_window_sinks": {
        "gqa_ratio": 4, "max_q_len": 4, "kv_dtype": "float8_e4m3fn", "paged": {"page_size": 64},
        "window": {"left": 500}, "sinks": True, "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    "fp8kv_f16_mha_d64": {"dtype": "float16", "kv_dtype": "float8_e4m3fn", "gqa_ratio": 1, "head_dim": 64,
                          "targets": {"default": {"tile_m": 16, "tile_n": 128}}},
    # V stored keys last: paged float8 with the features above, contiguous 16-bit.
    "fp8kv_vt_gqa4_q4_paged64_window_sinks": {
        "gqa_ratio": 4, "max_q_len": 4, "kv_dtype": "float8_e4m3fn", "paged": {"page_size": 64},
        "v_cache_transposed": True, "window": {"left": 500}, "sinks": True,
        "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    "vt_f16_gqa8_q2": {"dtype": "float16", "gqa_ratio": 8, "max_q_len": 2, "v_cache_transposed": True,
                       "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    # mask_mod hooks: evaluated on every tile, or through a block map (block_sparse).
    "doc_sparse_gqa8": {"gqa_ratio": 8, "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
                        "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]", "block_sparse": True,
                        "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    "doc_masked_gqa4_q4_paged64": {
        "gqa_ratio": 4, "max_q_len": 4, "paged": {"page_size": 64},
        "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
        "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]", "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    # A mask per query head (the map is per KV head), paged, a window and sinks.
    "per_head_sparse_f16_d64_q4_paged64_window_sinks": {
        "dtype": "float16", "head_dim": 64, "gqa_ratio": 4, "max_q_len": 4, "paged": {"page_size": 64},
        "window": {"left": 1000}, "sinks": True, "tensors": {"lim": {"dtype": "int32", "shape": ["heads"]}},
        "mask_mod": "kv_idx >= lim[h]", "block_sparse": True, "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    "chunk300_sparse_fp8kv_vt_splits3": {
        "gqa_ratio": 4, "kv_dtype": "float8_e4m3fn", "v_cache_transposed": True, "splits": 3,
        "mask_mod": "q_idx // 300 == kv_idx // 300", "block_sparse": True,
        "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
    # Scattered full tiles: the split kernel reads them from the list, not as a run.
    "blocks_sparse_gqa8_q2": {
        "gqa_ratio": 8, "max_q_len": 2, "tensors": {"f": {"dtype": "int32", "shape": ["batch", 1024]}},
        "mask_mod": "f[b, kv_idx // 64] != 0", "block_sparse": True,
        "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
}


def _decode_module(name, overrides):
    from specgen.compile.export import load_module_from_source

    from .helpers import decode_variant_data, render_spec_data

    plan, source = render_spec_data(decode_variant_data(name, overrides), "specs/v.yaml")
    return load_module_from_source(plan.module_name, source, f"decode_{name}.py")


def _decode_cases(mod):
    from specgen.check.runner import case_matrix

    return case_matrix(False, mod.SPEC)


@pytest.mark.parametrize("name", DECODE_SPEC_NAMES)
@pytest.mark.parametrize("index", range(20))
def test_decode_specs_match_reference(name, index):
    mod = generated_module(name)
    cases = _decode_cases(mod)
    if index >= len(cases):
        pytest.skip(f"{name} has {len(cases)} decode cases")
    row = run_case(torch, mod, cases[index], torch.Generator(device="cuda").manual_seed(index))
    assert row["ok"], row


@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
def test_decode_variants_match_reference(variant):
    mod = _decode_module(variant, DECODE_VARIANTS[variant])
    for i, case in enumerate(_decode_cases(mod)):
        if sum(case.decode_lens) > 40000:
            continue  # the long single sequence runs in the spec tests
        row = run_case(torch, mod, case, torch.Generator(device="cuda").manual_seed(i))
        assert row["ok"], row


def test_decode_replays_in_a_cuda_graph():
    """Captured once, replayed with new tokens and longer sequences written into
    the same buffers: no host sync; the split workspace made during the capture, in
    the graph's memory pool."""
    from specgen.check.cases import decode_reference, random_decode

    mod = generated_module("fmha_decode_paged_mtp")
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = random_decode(mod.SPEC, [700, 1500, 64, 3000], 2, 3, gen)
    out = torch.empty_like(batch.q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mod.attention(*batch.args(), out=out, max_seq_len=3000)  # warm-up: JIT, workspace
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.attention(*batch.args(), out=out, max_seq_len=3000)
    for step in range(3):
        batch.q.copy_(torch.randn(batch.q.shape, generator=gen, device="cuda").to(batch.q.dtype))
        batch.seq_lens.sub_(step)  # the sequences change; the graph stays
        graph.replay()
        torch.cuda.synchronize()
        assert compare(out, decode_reference(mod.SPEC, batch, {}), "bfloat16").ok


@pytest.mark.parametrize("name", ["fmha_decode_gqa8_bf16", "fmha_decode_paged_mtp", "fmha_decode_gqa8_fp8kv"])
def test_decode_pdl_launch_matches_the_plain_launch(name, monkeypatch):
    """Back-to-back calls that share one split workspace, with programmatic dependent
    launch forced on: each split kernel must wait for the combine before it to finish
    reading. A call that read another call's partials would be far off; the PDL
    outputs equal the plain ones to within one bf16 rounding on a few elements (the
    PDL kernels are compiled separately: at 33 splits an H200 rounded 1-2 of 8192
    elements the other way), and eager and graph-replayed PDL outputs are bitwise
    equal. Short and long splits both run, and more splits than one per SM."""
    from specgen.check.cases import random_decode

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    mod = generated_module(name)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q_len = mod.SPEC["max_q_len"]
    for lens in ([8192], [700, 1500, 64, 3000], [30000] * 4):
        batches = [random_decode(mod.SPEC, lens, 2, q_len, gen) for _ in range(6)]
        monkeypatch.setattr(mod, "PDL", False)
        plain = [mod.attention(*b.args(), max_seq_len=max(lens)) for b in batches]
        monkeypatch.setattr(mod, "PDL", True)
        eager = [mod.attention(*b.args(), max_seq_len=max(lens)) for b in batches]
        outs = [torch.full_like(b.q, float("nan")) for b in batches]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for b, out in zip(batches, outs):
                mod.attention(*b.args(), out=out, max_seq_len=max(lens))
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            for i, (want, got, out) in enumerate(zip(plain, eager, outs)):
                torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-24, msg=f"{lens} call {i}")
                assert int((got != want).sum()) <= got.numel() // 1000, (lens, i, "eager")
                assert torch.equal(out, got), (lens, i, "graph")
            for out in outs:
                out.fill_(float("nan"))


def test_decode_float8_descales_are_read_by_the_kernel_and_checked():
    """Descales given as tensors are read at run time: a captured graph replayed
    after the values change matches the reference with the new values. Floats work
    eagerly and under capture. Bad caches and descales are refused before launch."""
    from specgen.check.cases import decode_reference, random_decode

    mod = generated_module("fmha_decode_gqa8_fp8kv")
    gen = torch.Generator(device="cuda").manual_seed(3)
    batch = random_decode(mod.SPEC, [700, 1500, 64, 3000], 2, 1, gen)
    k_descale = torch.tensor([1.25], device="cuda")
    v_descale = torch.tensor(2.0, device="cuda")  # 0-d: one element is enough
    eager = mod.attention(*batch.args(), k_descale=1.25, v_descale=2.0)
    want = decode_reference(mod.SPEC, batch, {"k_descale": 1.25, "v_descale": 2.0})
    assert compare(eager, want, "bfloat16").ok
    assert torch.equal(mod.attention(*batch.args(), k_descale=k_descale, v_descale=v_descale), eager)
    out, out_floats = torch.empty_like(batch.q), torch.empty_like(batch.q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mod.attention(*batch.args(), out=out, k_descale=k_descale, v_descale=v_descale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.attention(*batch.args(), out=out, k_descale=k_descale, v_descale=v_descale)
        # Floats never seen before: their tensors are filled by the graph itself.
        mod.attention(*batch.args(), out=out_floats, k_descale=0.625, v_descale=3.0)
    for k_value, v_value in ((1.25, 2.0), (0.5, 4.0)):
        k_descale.fill_(k_value)
        v_descale.fill_(v_value)
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_reference(mod.SPEC, batch, {"k_descale": k_value, "v_descale": v_value})
        assert compare(out, ref, "bfloat16").ok, (k_value, v_value)
        ref = decode_reference(mod.SPEC, batch, {"k_descale": 0.625, "v_descale": 3.0})
        assert compare(out_floats, ref, "bfloat16").ok

    bf16_cache = batch.k_cache.to(torch.bfloat16)
    bad = [
        ((batch.q, bf16_cache, batch.v_cache, batch.seq_lens), {},
         "k_cache must be a 4-D torch.float8_e4m3fn tensor"),
        (batch.args(), {"k_descale": 0.0}, "k_descale must be a positive float in float32's normal range or a one-element"),
        (batch.args(), {"v_descale": float("inf")}, "v_descale must be a positive float in float32's normal range"),
        (batch.args(), {"k_descale": torch.ones(2, device="cuda")},
         "k_descale must be a positive float or a one-element float32 tensor on cuda"),
        (batch.args(), {"v_descale": torch.ones(1, device="cuda", dtype=torch.float64)},
         "v_descale must be a positive float or a one-element float32 tensor on cuda"),
        (batch.args(), {"k_descale": torch.ones(1)}, "k_descale must be a positive float or a one-element"),
    ]
    for args, kwargs, message in bad:
        with pytest.raises(ValueError) as info:
            mod.attention(*args, **kwargs)
        assert message in str(info.value), (message, str(info.value))


def test_decode_float8_queries_beyond_float16_range():
    """The float8-cache kernel runs its MMAs in float16 with each bfloat16 query row
    scaled into float16's range: rows far above 65504 and far below float16's
    smallest normal give the reference's result."""
    from specgen.check.cases import decode_reference, random_decode

    mod = generated_module("fmha_decode_gqa8_fp8kv")
    gen = torch.Generator(device="cuda").manual_seed(11)
    batch = random_decode(mod.SPEC, [700, 1500, 64, 3000], 2, 1, gen)
    q = batch.q.clone()
    q[0] *= 1e6  # |q| up to ~4e6: far past float16's 65504
    q[1] *= 1e-7  # far below float16's smallest normal (6e-5)
    q[2, :, :3] = 0.0  # all-zero rows
    q[3, :, 5, :64] *= 3e5  # one head with half its dims huge
    scale = 1e-6  # keeps the huge rows' logits finite and varied
    extra = {"k_descale": 0.5, "v_descale": 0.25}
    batch = type(batch)(q, batch.k_cache, batch.v_cache, batch.seq_lens, None, batch.v_transposed)
    for s in (None, scale):
        out = mod.attention(*batch.args(), scale=s, **extra)
        ref = decode_reference(mod.SPEC, batch, extra, scale=s)
        assert compare(out, ref, "bfloat16").ok, s


def test_decode_transposed_v_cache_conversion_and_checks():
    """transposed_v_cache() turns a [B, L, Hkv, D] V cache into the layout the
    module reads (key axis padded to 16); wrong layouts raise ValueError first."""
    from specgen.check.cases import decode_reference, random_decode

    mod = generated_module("fmha_decode_gqa8_fp8kv")
    plain = dict(mod.SPEC, v_cache_transposed=False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    batch = random_decode(plain, [700, 1501, 64, 3001], 2, 1, gen)  # max_len 3001: not a multiple of 16
    v_t = mod.transposed_v_cache(batch.v_cache)
    assert v_t.shape == (4, 2, 128, 3008) and v_t.dtype == torch.float8_e4m3fn
    extra = {"k_descale": 0.75, "v_descale": 1.5}
    out = mod.attention(batch.q, batch.k_cache, v_t, batch.seq_lens, **extra)
    assert compare(out, decode_reference(plain, batch, extra), "bfloat16").ok
    # A new token written keys-last lands where the kernel reads it.
    v_t2 = v_t.clone()
    lens = batch.seq_lens.clone()
    lens[0] += 1
    new = torch.randn(2, 128, device="cuda").to(torch.float8_e4m3fn)
    v_t2[0, :, :, 700] = new
    k2 = batch.k_cache.clone()
    k2[0, 700] = torch.randn(2, 128, device="cuda").to(torch.float8_e4m3fn)
    v_plain = batch.v_cache.clone()
    v_plain[0, 700] = new
    grown = type(batch)(batch.q, k2, v_plain, lens, None, False)
    out = mod.attention(batch.q, k2, v_t2, lens, **extra)
    assert compare(out, decode_reference(plain, grown, extra), "bfloat16").ok
    bad = [
        (batch.v_cache, "v_cache is stored transposed (keys last): it must be a torch.float8_e4m3fn tensor "
                        "[4, 2, 128, L] with L >= 3001, keys contiguous"),
        (v_t[..., :3000], "[4, 2, 128, L] with L >= 3001"),
        (v_t[..., :3001].contiguous(), "rows 16-byte aligned"),
        (v_t.to(torch.bfloat16), "v_cache is stored transposed"),
    ]
    for v_bad, message in bad:
        with pytest.raises(ValueError) as info:
            mod.attention(batch.q, batch.k_cache, v_bad, batch.seq_lens, **extra)
        assert message in str(info.value), (message, str(info.value))
    with pytest.raises(ValueError, match=r"v_cache must be a 4-D torch.float8_e4m3fn \[B, max_len, Hkv, 128\] tensor"):
        mod.transposed_v_cache(v_t[0])


def test_decode_arguments_are_checked_before_launch():
    mod = generated_module("fmha_decode_gqa8_bf16")
    q = torch.randn(2, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, 100, 2, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([50, 100], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"seq_lens must be an int32 \[2\] tensor"):
        mod.attention(q, cache, cache, lens.long())
    with pytest.raises(ValueError, match=r"q_len \(q.shape\[1\]\) must be in \[1, 1\], got 2"):
        mod.attention(torch.cat([q, q], 1), cache, cache, lens)
    with pytest.raises(ValueError, match="this kernel needs q heads == 8 \\* kv heads"):
        mod.attention(q[:, :, :8], cache, cache, lens)
    with pytest.raises(ValueError, match=r"max_seq_len must be an int in \[1, 100\]"):
        mod.attention(q, cache, cache, lens, max_seq_len=101)


# --- backward (issue 8) ------------------------------------------------------------

BACKWARD_VARIANTS = {
    "causal_gqa4_bf16_d128": {"backward": True, "dtype": "bfloat16"},
    "non_causal_mha_f16_d64": {"backward": True, "causal": False, "block_remap": None, "gqa_ratio": 1,
                               "head_dim": 64},
    "causal_gqa8_f16_d64_no_exp2": {"backward": True, "gqa_ratio": 8, "head_dim": 64, "prescale_q": False,
                                    "fast_math": {"exp2": False, "flush_to_zero": False,
                                                  "approx_div": False}},
    # Gemma-2: soft-cap and a sliding window.
    "softcap_window_gqa2": {"backward": True, "gqa_ratio": 2, "softcap": 30.0, "window": {"left": 100},
                            "prescale_q": True},
    "non_causal_window_left_right_f16_d64": {"backward": True, "causal": False, "block_remap": None,
                                             "dtype": "float16", "head_dim": 64,
                                             "window": {"left": 50, "right": 20}},
    # ALiBi: a score_mod whose derivative in the score is 1; slopes read, not learned.
    "alibi_mha": {"backward": True, "gqa_ratio": 1, "tensors": {"slope": {"dtype": "float32", "shape": ["heads"]}},
                  "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
    # A score_mod with a non-trivial derivative (tanh, a position-dependent branch).
    "score_mod_nonlinear": {"backward": True,
                            "score_mod": "tanh(score / 5.0) * 5.0 + where(q_idx > kv_idx + 8, -0.5 * score, 0.0)"},
    "document_mask_mod": {"backward": True, "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
                          "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"},
    # Padded head dims: Phi-2's 80 (tiles of 128), DeepSeek MLA's 192 / 128.
    "phi2_d80_f16_mha": {"backward": True, "dtype": "float16", "head_dim": 80, "gqa_ratio": 1},
    "mla_d192_dv128_mha": {"backward": True, "head_dim": 192, "v_head_dim": 128, "gqa_ratio": 1},
    # Head dim 256: 64 x 64 tiles in every backward kernel, dK/dV with two warp groups.
    "d256_gqa4_bf16_softcap_sinks": {"backward": True, "head_dim": 256, "dtype": "bfloat16",
                                     "softcap": 50.0, "sinks": True},
    # Dropout: the backward regenerates the forward's mask from the seed.
    "dropout_gqa4_bf16": {"backward": True, "dropout": True},
    "dropout_softcap_window_f16_d64": {"backward": True, "dropout": True, "dtype": "float16", "head_dim": 64,
                                       "softcap": 20.0, "window": {"left": 90}, "gqa_ratio": 2},
    # Learnable hook tensors: ALiBi slopes, a relative-position bias table, a
    # per-key bias and a per-row temperature through tanh (every reduction shape).
    "learnable_bias_tables": {
        "backward": True, "gqa_ratio": 2, "head_dim": 64,
        "tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True},
                    "rel": {"dtype": "float32", "shape": ["heads", 1024], "learnable": True},
                    "colb": {"dtype": "float32", "shape": ["seq_k"], "learnable": True},
                    "rowb": {"dtype": "float32", "shape": ["batch", "seq_q"], "learnable": True}},
        # (a per-row term must scale the score: an added one cancels in the softmax)
        "score_mod": "score * (1.0 + 0.5 * tanh(rowb[b, q_idx])) - slope[h] * (q_idx - kv_idx) "
                     "+ rel[h, q_idx - kv_idx] + colb[kv_idx] * 0.5"},
    # A learnable slope beside sinks and a returned LSE: the dQ kernel corrects the
    # slope's D with the sink's share of P and the LSE's gradient.
    "learnable_slope_sinks_lse": {
        "backward": True, "gqa_ratio": 4, "head_dim": 64, "sinks": True, "return_lse": True,
        "tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
        "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
    "learnable_scale_non_causal": {
        "backward": True, "causal": False, "block_remap": None, "gqa_ratio": 1, "dtype": "float16",
        "tensors": {"temp": {"dtype": "float32", "shape": ["heads"], "learnable": True},
                    "rel": {"dtype": "float32", "shape": [2048], "learnable": True}},
        "score_mod": "score * temp[h] + rel[q_idx - kv_idx + 1024]"},
    # Block maps: full tiles skip the mask; a score_mod, a window, dropout and a
    # learnable table still apply on them.
    "document_sparse_alibi_window": {
        "backward": True, "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]},
                                      "slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
        "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]", "block_sparse": True, "window": {"left": 150},
        "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
    "chunk_sparse_dropout_softcap_f16_d64": {
        "backward": True, "dtype": "float16", "head_dim": 64, "gqa_ratio": 2, "dropout": True,
        "softcap": 20.0, "mask_mod": "q_idx // 96 == kv_idx // 96", "block_sparse": True},
    # gpt-oss: sinks (with their gradient) and a window.
    "sinks_window_gqa8_d64": {"backward": True, "gqa_ratio": 8, "head_dim": 64, "sinks": True,
                              "window": {"left": 127}, "return_lse": True},
}


def _grad_check(mod, batch, kv_heads, seq_q, seq_k, q_offset, seed):
    """Output and gradients (q, k, v, and sinks where the spec has them) against
    fp64 autograd of the reference, with the spec's window, soft-cap, hooks."""
    from specgen.check.cases import feature_inputs, shape_dims

    spec = mod.SPEC
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (t.requires_grad_() for t in random_qkv(spec, batch, kv_heads, seq_q, seq_k, generator=gen))
    extra = feature_inputs(spec, shape_dims(q, k), gen)
    learned = (["sinks"] if "sinks" in extra else []) + learnable_tensors(spec)
    for name in learned:
        extra[name].requires_grad_()
    out = mod.attention(q, k, v, q_offset=q_offset, **extra)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(q.dtype)  # v_head_dim wide
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    extra64 = dict(extra)
    for name in learned:
        extra64[name] = extra[name].detach().double().requires_grad_()
    ref, _ = reference_for(spec, q64, k64, v64, extra64, q_offset=q_offset)
    ref.backward(dout.double())
    tol = 2e-2 if spec["dtype"] == "bfloat16" else 1e-2
    checks = [("out", out, ref), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)]
    checks += [("d" + name, extra[name].grad, extra64[name].grad) for name in learned]
    for name, got, want in checks:
        # With one key (and no sink), dq and dk are exactly 0, and the kernel's are the rounding of
        # D = rowsum(dO * O) from the stored output (FlashAttention's too): about
        # eps * sqrt(D) * |dO| * |O| * |K| * scale, which dropout's 1 / (1 - p)
        # enlarges. It is judged against that bound; everything else relatively
        # (a floor of 1e-2).
        if name in ("dq", "dk") and seq_k == 1 and "sinks" not in extra:
            bound = 4 * tol * 2**-6 * dout.abs().max().item() * out.abs().max().item() * k.abs().max().item()
            assert torch.isfinite(got).all() and got.abs().max().item() <= bound, (name, bound)
            continue
        err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-2)
        assert torch.isfinite(got).all() and err <= tol, (name, err)


@pytest.mark.parametrize("variant", sorted(BACKWARD_VARIANTS))
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 0), (2, 2, 77, 77, 0), (1, 1, 300, 300, 0),
                                   (1, 2, 100, 333, 233)],
                         ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_backward_matches_fp64_autograd(variant, shape):
    _grad_check(_variant_module(variant, BACKWARD_VARIANTS[variant]), *shape, seed=sum(shape))


@pytest.mark.parametrize("name", TRAINING_SPEC_NAMES)
@pytest.mark.parametrize("shape", [(2, 2, 1000, 1000, 0), (1, 1, 333, 500, 167)],
                         ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_shipped_training_spec_gradients(name, shape):
    _grad_check(generated_module(name), *shape, seed=1)


VARLEN_BACKWARD_VARIANTS = {
    "varlen_causal_gqa4": {"varlen": True, "backward": True},
    "varlen_sinks_window_softcap_gqa2_d64": {"varlen": True, "backward": True, "sinks": True, "gqa_ratio": 2,
                                             "head_dim": 64, "window": {"left": 60}, "softcap": 30.0,
                                             "dtype": "bfloat16"},
    "varlen_non_causal_mha_d80": {"varlen": True, "backward": True, "causal": False, "block_remap": None,
                                  "gqa_ratio": 1, "head_dim": 80},
}


@pytest.mark.parametrize("name", FORWARD_ONLY_PREFILL_SPECS)
def test_every_shipped_prefill_spec_trains(name):
    """Each shipped forward-only prefill spec (float8 aside) with backward: true:
    outputs and gradients on the quick check matrix (ragged lengths, chunked
    prefill, a transposed layout), by FlashAttention's rule against fp64."""
    from specgen.check.runner import case_matrix
    from specgen.compile.export import load_module_from_source

    plan, source = render_spec_data(trained_spec_data(name), f"specs/{name}.yaml")
    mod = load_module_from_source(plan.module_name, source, f"{plan.module_name}.py")
    for index, case in enumerate(case_matrix(True, mod.SPEC)):
        row = run_case(torch, mod, case, torch.Generator(device="cuda").manual_seed(index))
        if case.lengths == ((1, 1),) or (not case.lengths and case.seq_k == 1):
            # One key: dq and dk are the rounding noise of D (see the varlen test).
            assert row["out_ok"], row
            continue
        assert row["ok"] and row["grad_ok"], (case.label(mod.SPEC["gqa_ratio"]), row)


@pytest.mark.parametrize("variant", sorted(VARLEN_BACKWARD_VARIANTS))
def test_varlen_backward_matches_fp64_autograd(variant):
    """Every packed case of the check matrix (ragged lengths, length-1 sequences,
    seq_q < seq_k): outputs, and gradients by FlashAttention's rule."""
    from specgen.check.runner import case_matrix

    mod = _variant_module(variant, VARLEN_BACKWARD_VARIANTS[variant])
    for index, case in enumerate(case_matrix(False, mod.SPEC)):
        row = run_case(torch, mod, case, torch.Generator(device="cuda").manual_seed(index))
        if case.lengths == ((1, 1),):
            # One query, one key: the exact dq and dk are 0 (with a sink, tiny), and
            # the kernel's are the rounding of D = rowsum(dO * O) from the stored
            # output, as in FlashAttention's backward; FA's rule (a 1e-5 floor) is
            # too tight there. test_backward_matches_fp64_autograd bounds that noise.
            assert row["out_ok"], row
            continue
        assert row["ok"] and row["grad_ok"], row


def test_varlen_backward_checks_before_launch():
    mod = _variant_module("varlen_causal_gqa4", VARLEN_BACKWARD_VARIANTS["varlen_causal_gqa4"])
    q = torch.randn(10, 8, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    k = torch.randn(12, 2, 128, device="cuda", dtype=torch.float16)
    cu_k = torch.tensor([0, 6, 12], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32 tensor"):
        mod.attention(q, k, k, cu_seqlens_q=[0, 4, 10], cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be a non-negative int or None, got -1"):
        mod.attention(q, k, k, cu_seqlens_q=cu_k - cu_k, cu_seqlens_k=cu_k, max_seqlen_q=-1)


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gemma2", "fmha_train_gptoss_sinks"])
def test_backward_is_bitwise_deterministic(name):
    """The kernels own their output tiles (no atomics): two backward passes give
    the same bits."""
    mod = generated_module(name)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = random_qkv(mod.SPEC, 2, 2, 777, 777, generator=gen)
    extra = feature_inputs(mod.SPEC, shape_dims(q, k), gen)
    dout = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    runs = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = mod.attention(*leaves, **extra)
        out = out[0] if isinstance(out, tuple) else out
        runs.append(torch.autograd.grad(out, leaves, dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_backward_refuses_a_wrong_output_gradient():
    mod = generated_module("fmha_train_gqa_causal")
    q, k, v = random_qkv(mod.SPEC, 1, 2, 100, 100)
    out, lse = mod._forward(q, k, v, scale=0.1)
    with pytest.raises(ValueError, match=r"the output gradient must be a torch.bfloat16 tensor of shape "
                                         r"\(1, 8, 100, 128\) on cuda:0, got torch.bfloat16 \(1, 8, 99, 128\)"):
        mod._backward(q, k, v, out, lse, out[:, :, :99], 0.1, 0)
    with pytest.raises(ValueError, match="got torch.float32"):
        mod._backward(q, k, v, out, lse, out.float(), 0.1, 0)


def test_training_step_replays_in_a_cuda_graph():
    """Forward and backward captured together in one CUDA graph, replayed on new
    inputs, match eager autograd."""
    mod = generated_module("fmha_train_gqa_causal")
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (t.requires_grad_() for t in random_qkv(mod.SPEC, 1, 2, 300, 300, generator=gen))
    dout = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (JIT, allocator) off the capture
        for _ in range(2):
            q.grad = k.grad = v.grad = None
            mod.attention(q, k, v).backward(dout)
    torch.cuda.current_stream().wait_stream(stream)
    q.grad = k.grad = v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod.attention(q, k, v)
        out.backward(dout)
    with torch.no_grad():
        for t in (q, k, v, dout):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    got = [out.clone()] + [t.grad.clone() for t in (q, k, v)]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want_out = mod.attention(*leaves)
    want = [want_out] + list(torch.autograd.grad(want_out, leaves, dout))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_gradient_check_catches_a_wrong_gradient():
    """specgen test's gradient check (FlashAttention's rule) passes the kernel and
    fails the same kernel with dq scaled by 1.1."""
    from specgen.check.runner import check_gradients

    mod = generated_module("fmha_train_gqa_causal")

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g * 1.1

    class Wrong:
        SPEC = mod.SPEC

        @staticmethod
        def attention(q, k, v, **kwargs):
            return mod.attention(ScaleGrad.apply(q), k, v, **kwargs)

    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = random_qkv(mod.SPEC, 1, 2, 200, 300, generator=gen)
    good = check_gradients(torch, mod, q, k, v, {}, 100, gen)
    assert good["grad_ok"], good
    bad = check_gradients(torch, Wrong, q, k, v, {}, 100, gen)
    assert not bad["grad_ok"] and bad["grad_ratio"] > 1.0, bad


def test_backward_refuses_learnable_hook_tensors():
    mod = _variant_module("alibi_mha", BACKWARD_VARIANTS["alibi_mha"])
    q = torch.randn(1, 2, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    slope = torch.ones(2, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match=r"slope requires grad, but it is not learnable: pass slope.detach\(\), or declare it learnable: true"):
        mod.attention(q, q, q, slope=slope)
    with pytest.raises(ValueError, match="slope must be a torch.Tensor, got list"):
        mod.attention(q, q, q, slope=[1.0, 1.0])


def test_backward_refuses_out_with_grad():
    mod = generated_module("fmha_train_gqa_causal")
    q = torch.randn(1, 4, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out= cannot be used when q, k or v requires grad"):
        mod.attention(q, k, k, out=torch.empty_like(q))


def test_custom_op_compiles_fullgraph_with_gradients():
    mod = generated_module("fmha_train_gqa_causal")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (t.requires_grad_() for t in random_qkv(mod.SPEC, 2, 2, 256, 256, generator=gen))

    def layer(q, k, v):
        return (mod.attention(q, k, v) * 2.0).sum()

    compiled = torch.compile(layer, fullgraph=True)  # a graph break would raise
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    layer(q, k, v).backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", ["fmha_train_gptoss_sinks", "fmha_train_document"])
def test_compiled_op_and_eager_path_give_the_same_bits(name):
    """torch.compile traces the custom op; an eager call runs _EagerAttention. Both run
    the same kernels on the same inputs: output and every gradient (learnable sinks,
    the document mask's block maps built inside the call) bit for bit."""
    mod = generated_module(name)
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = random_qkv(mod.SPEC, 1, 2, 300, 300, generator=gen)
    extra = feature_inputs(mod.SPEC, shape_dims(q, k), gen)
    dout = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in (q, k, v)]
        tensors = {n: t.detach().clone().requires_grad_(n == "sinks") for n, t in extra.items()}
        out = fn(*leaves, tensors)
        out = out[0] if isinstance(out, tuple) else out
        wrt = leaves + [t for t in tensors.values() if t.requires_grad]
        return [out.detach(), *torch.autograd.grad(out, wrt, dout)], out.grad_fn

    def layer(q, k, v, tensors):
        return mod.attention(q, k, v, **tensors)

    eager, eager_fn = run(layer)
    compiled, _ = run(torch.compile(layer, fullgraph=True))
    assert type(eager_fn).__name__ == "_EagerAttentionBackward"
    assert len(eager) == len(compiled) == (5 if name.endswith("sinks") else 4)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


def test_custom_op_forward_replays_in_a_cuda_graph():
    mod = generated_module("fmha_train_gqa_causal")
    q, k, v = random_qkv(mod.SPEC, 1, 2, 300, 300)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mod.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod.attention(q, k, v)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = reference_for(mod.SPEC, q, k, v, {})
    assert compare(out, ref, "bfloat16").ok


# FlashAttention's convention for more queries than keys: q_offset = Skv - Sq < 0, the
# rows before the first key see none (zeros, LSE -inf).
NEGATIVE_OFFSET_SHAPES = [(1, 2, 333, 200, -133), (2, 1, 1000, 300, -700), (1, 1, 130, 1, -129),
                          (1, 1, 64, 64, -64)]


@pytest.mark.parametrize("name", ["fmha_gqa_causal", "fmha_gqa8_bf16", "fmha_mistral_window",
                                  "fmha_gptoss_sinks", "fmha_document_mask", "fmha_mha_bf16"])
@pytest.mark.parametrize("shape", NEGATIVE_OFFSET_SHAPES, ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_negative_q_offset_matches_reference(name, shape):
    _check(generated_module(name), *shape, seed=shape[2] + shape[3])


def test_negative_q_offset_rows_are_zero_with_lse_minus_inf():
    mod = _variant_module("negative_offset_lse", {"return_lse": True})
    q = torch.randn(1, 4, 300, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1, 100, 128, device="cuda", dtype=torch.float16)
    out, lse = mod.attention(q, k, k, q_offset=-200)  # rows 0..199 see no key
    assert torch.isfinite(out).all() and (out[:, :, :200] == 0).all()
    assert torch.isneginf(lse[:, :, :200]).all() and torch.isfinite(lse[:, :, 200:]).all()


@pytest.mark.parametrize("shape", [(1, 2, 333, 200, -133), (1, 1, 300, 77, -223)],
                         ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_negative_q_offset_gradients(shape):
    _grad_check(generated_module("fmha_train_gqa_causal"), *shape, seed=sum(shape))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_negative_q_offset_template_variants(variant):
    """Every structural variant (subtiles, no loop split, block remap, loads...) with
    the first rows before any key."""
    _check(_variant_module(variant, VARIANTS[variant]), 1, 2, 333, 200, -133, seed=7)


def test_torch_func_gradients_match_eager_backward_on_the_gpu():
    """torch.func on the GPU's kernels: per-sample gradients (vmap over grad, which
    folds the vmap into the kernels' batch), grad over vmap, and torch.compile of
    torch.func.grad give the bits of eager loss.backward() calls on each entry."""
    mod = generated_module("fmha_train_gqa_causal")
    gen = torch.Generator(device="cuda").manual_seed(11)
    entries = [random_qkv(mod.SPEC, 1, 2, 200, 200, generator=gen) for _ in range(3)]
    q, k, v = (torch.stack(ts) for ts in zip(*entries))  # [N, B, H, S, D]

    def loss(q, k, v):
        return mod.attention(q, k, v, q_offset=0).float().square().sum()

    want = []
    for qi, ki, vi in entries:
        leaves = [t.detach().clone().requires_grad_() for t in (qi, ki, vi)]
        loss(*leaves).backward()
        want.append([t.grad for t in leaves])
    want = [torch.stack(ts) for ts in zip(*want)]
    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    summed = torch.func.grad(lambda q, k, v: torch.func.vmap(loss)(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
    compiled = torch.compile(torch.func.grad(loss, argnums=(0, 1, 2)))(q[0], k[0], v[0])
    for got, ref in zip(per_sample, want):
        assert torch.equal(got, ref)
    for got, ref in zip(summed, want):
        assert torch.equal(got, ref)
    for got, ref in zip(compiled, want):
        assert torch.equal(got, ref[0])


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gptoss_sinks"])
def test_batched_output_gradients_match_one_backward_per_entry_on_the_gpu(name):
    """torch.autograd.grad(..., is_grads_batched=True) runs the backward under torch's
    legacy vmap: the eager backward takes the backward op, which torch runs per entry,
    with the bits of each entry's own backward."""
    mod = generated_module(name)
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = random_qkv(mod.SPEC, 1, 2, 200, 200, generator=gen)
    extra = {"sinks": torch.randn(q.shape[1], device="cuda", generator=gen)} if mod.SPEC.get("sinks") else {}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = mod.attention(*leaves, **extra)
    out = out[0] if isinstance(out, tuple) else out
    douts = torch.randn(3, *out.shape, device="cuda", generator=gen).to(out.dtype)
    batched = torch.autograd.grad(out, leaves, douts, is_grads_batched=True, retain_graph=True)
    for i in range(3):
        each = torch.autograd.grad(out, leaves, douts[i], retain_graph=True)
        assert all(torch.equal(a[i], b) for a, b in zip(batched, each, strict=True))

"""Generated kernels against the fp64 reference on a CUDA GPU (marked `gpu`)."""

import pytest
import torch

from specgen.check import compare
from specgen.reference import attention_reference

from .helpers import SPEC_NAMES, generated_module

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


def _inputs(mod, batch, kv_heads, seq_q, seq_k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    spec = mod.SPEC
    heads = kv_heads * spec["gqa_ratio"]
    dtype = getattr(torch, spec["dtype"])
    d = spec["head_dim"]

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    return rand(batch, heads, seq_q, d), rand(batch, kv_heads, seq_k, d), rand(batch, kv_heads, seq_k, d)


@pytest.mark.parametrize("name", SPEC_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_matches_fp64_reference(name, shape):
    mod = generated_module(name)
    batch, kv_heads, seq_q, seq_k, q_offset = shape
    q, k, v = _inputs(mod, batch, kv_heads, seq_q, seq_k, seed=hash(shape) & 0xFFFF)
    out = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails
    mod.attention(q, k, v, q_offset=q_offset, out=out)
    torch.cuda.synchronize()
    ref = attention_reference(q, k, v, causal=mod.SPEC["causal"], q_offset=q_offset)
    result = compare(out, ref, mod.SPEC["dtype"])
    print(f"{name} {shape}: max_abs={result.max_abs_err:.2e} rel={result.rel_err:.2e}")
    assert result.ok, result


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_strided_views_and_scale(name):
    """A [B, S, H, D] tensor seen as [B, H, S, D] (a transposed view) works as is."""
    mod = generated_module(name)
    spec = mod.SPEC
    dtype = getattr(torch, spec["dtype"])
    d, ratio = spec["head_dim"], spec["gqa_ratio"]
    q = torch.randn(2, 300, 2 * ratio, d, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(2, 300, 2, d, device="cuda", dtype=dtype).transpose(1, 2)
    v = torch.randn(2, 300, 2, d, device="cuda", dtype=dtype).transpose(1, 2)
    assert not q.is_contiguous()
    out = mod.attention(q, k, v, scale=0.05)
    ref = attention_reference(q, k, v, causal=spec["causal"], scale=0.05)
    result = compare(out, ref, spec["dtype"])
    assert result.ok, result


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_empty_query_returns_empty(name):
    mod = generated_module(name)
    spec = mod.SPEC
    dtype = getattr(torch, spec["dtype"])
    d, ratio = spec["head_dim"], spec["gqa_ratio"]
    q = torch.randn(1, ratio, 0, d, device="cuda", dtype=dtype)
    k = torch.randn(1, 1, 5, d, device="cuda", dtype=dtype)
    assert mod.attention(q, k, k).shape == q.shape


# Variants of fmha_gqa_causal rendered at test time: every structural branch of the
# template (and bf16 on the causal GQA kernel) is run against the reference.
VARIANTS = {
    "bf16": {"dtype": "bfloat16"},
    "no_fast_math": {"fast_math": {"exp2": False, "flush_to_zero": False, "approx_div": False}},
    "no_split_no_remap": {"loop_split": False, "block_remap": False},
    "k_permuted_no_hints": {"loads": {"k_transposed": False, "k_latency": None, "v_latency": None}},
    "non_causal_gqa8_d64": {"causal": False, "block_remap": None, "gqa_ratio": 8, "head_dim": 64},
    "d256_tiles_32": {"head_dim": 256, "targets": {"default": {"tile_m": 32, "tile_n": 32, "occupancy": 1}}},
}


def _variant_module(name, overrides):
    import yaml

    from specgen.compile import load_module_from_source
    from specgen.plan import make_plan
    from specgen.render import render
    from specgen.spec import validate_spec

    from .helpers import ROOT

    data = yaml.safe_load((ROOT / "specs" / "fmha_gqa_causal.yaml").read_text())
    data.update(overrides, name=f"variant_{name}")
    data["targets"] = overrides.get("targets", {"default": {"tile_m": 64, "tile_n": 64}})
    plan = make_plan(validate_spec(data))
    source = render(plan, "specs/variant.yaml").text
    return load_module_from_source(plan.module_name, source, f"variant_{name}.py")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("shape", [(1, 1, 1000, 1000, 0), (2, 1, 128, 1000, 872), (1, 2, 77, 77, 0)],
                         ids=lambda s: "b{}h{}q{}k{}o{}".format(*s))
def test_template_variants_match_reference(variant, shape):
    mod = _variant_module(variant, VARIANTS[variant])
    batch, kv_heads, seq_q, seq_k, q_offset = shape
    q, k, v = _inputs(mod, batch, kv_heads, seq_q, seq_k, seed=seq_q * 7 + seq_k)
    out = torch.full_like(q, float("nan"))
    mod.attention(q, k, v, q_offset=q_offset, out=out)
    torch.cuda.synchronize()
    ref = attention_reference(q, k, v, causal=mod.SPEC["causal"], q_offset=q_offset)
    result = compare(out, ref, mod.SPEC["dtype"])
    print(f"variant {variant} {shape}: max_abs={result.max_abs_err:.2e} rel={result.rel_err:.2e}")
    assert result.ok, result

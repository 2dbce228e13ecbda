"""Hook semantics shared by the fp64 reference, the CPU emulator and cuTile: int32
wrapping of h and b, min/max of scalars and of NaN, constants folded before they
meet a tile."""

import math

import pytest
import torch

from specgen.check import emulate
from specgen.check.cases import compare, reference_for
from specgen.spec.hooks import ExprError, compile_hook

from .helpers import emulated_spec_module, render_spec_data


def _spec(label, score_mod):
    return {"name": f"hooksem_{label}", "dtype": "float16", "head_dim": 32, "gqa_ratio": 1,
            "causal": False, "score_mod": score_mod,
            "targets": {"default": {"tile_m": 64, "tile_n": 64}}}


def _emulated_vs_reference(label, score_mod, batch=2, heads=4, seq_q=37, seq_k=53):
    data = _spec(label, score_mod)
    module = emulated_spec_module(data, f"test_hooksem_{label}")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq_q, 32, generator=g).half()
    k, v = (torch.randn(batch, heads, seq_k, 32, generator=g).half() for _ in range(2))
    with emulate.emulating():
        out = module.attention(q, k, v)
    ref, _ = reference_for(module.SPEC, q, k, v, {})
    return out, ref


HOOKS = [
    # h * 1500000000 wraps negative at h = 2, 3 in int32 (the GPU's and the reference's)
    ("head_wraps", "score + where(h * 1500000000 < 0, 1.0, -1.0) * (q_idx - kv_idx) * 0.05"),
    ("batch_wraps", "score + where(b * 1500000000 * 2 + h < 0, 1.0, -1.0) * (q_idx - kv_idx) * 0.05"),
    # min/max of two scalars (no tile among them)
    ("min_of_scalars", "score + min(h, 1) * (q_idx - kv_idx) * 0.05"),
    ("max_of_scalars", "score + max(b, h) * 0.1 + 0.0 * q_idx * kv_idx"),
    # max ignores a NaN operand, as cuTile's maximum does: max(NaN, 0.5) is 0.5
    ("max_ignores_nan", "score - max(sqrt((q_idx - kv_idx) * 1.0), 0.5) * 0.1"),
    # a divisor read at run time that is 0 gives 0 (tile divisor, scalar divisor)
    ("zero_tile_divisor", "score + where(q_idx % kv_idx == 0, 1.0, 0.0) + (q_idx // kv_idx) * 0.01"),
    # log(0) on every key of row 0: the row has no weight and stores zeros
    ("hidden_row", "where(q_idx == 0, score + log(0.0 * kv_idx), score)"),
    ("zero_scalar_divisor", "score + (kv_idx // (h - 1)) * 0.01 + ((q_idx - kv_idx) % (b - h)) * 0.1"),
]


@pytest.mark.parametrize("label,score_mod", HOOKS)
def test_emulated_hooks_match_the_reference(label, score_mod):
    out, ref = _emulated_vs_reference(label, score_mod)
    assert not ref.isnan().any()
    result = compare(out, ref, "float16")
    assert result.ok, result


def test_max_ignores_nan_in_the_reference():
    env = {"q_idx": torch.arange(4, dtype=torch.int32).view(-1, 1),
           "kv_idx": torch.arange(4, dtype=torch.int32).view(1, -1)}
    from specgen.spec.hooks import evaluate

    got = evaluate("max(sqrt((q_idx - kv_idx) * 1.0), 0.5) + min(log((q_idx - kv_idx) * 1.0), 9.0)",
                   env, {})
    assert not got.isnan().any()


def test_emulated_reductions_and_minimum_ignore_nan():
    x = torch.tensor([[math.nan, 1.0, 3.0], [math.nan, math.nan, math.nan]])
    assert emulate.max(x, axis=1).tolist()[0] == 3.0 and math.isnan(emulate.max(x, axis=1)[1])
    assert emulate.min(x, axis=1).tolist()[0] == 1.0
    assert emulate.maximum(x, 2.0).tolist()[0] == [2.0, 2.0, 3.0]
    assert math.isnan(emulate.max(x, axis=1, propagate_nan=True)[0])
    assert emulate.minimum(3, 4).item() == 3


def test_block_indices_wrap_at_32_bits(monkeypatch):
    monkeypatch.setattr(emulate._GRID, "bid", (2, 0, 0), raising=False)
    head = emulate.bid(0)
    assert head * 1500000000 == 3000000000 - 2**32
    assert (head * 1500000000) // 65536 == (3000000000 - 2**32) // 65536
    assert isinstance(head + 1, int) and list(range(head)) == [0, 1]
    assert head * 0.5 == 1.0


@pytest.mark.parametrize("text", [
    "score + ((q_idx * kv_idx + 65536 * 65536) % 7) * 0.1",  # cuTile: constant out of int32
    "score + q_idx * (2147483647 + 1) * 0",
    "score + q_idx * -(-2147483648) * 0",
    "score * (1e30 * 1e30)",  # inf in float32
    "score + 1e-30 * 1e-20",  # 0 in float32
])
def test_constant_subexpressions_must_fit_the_kernel_types(text):
    with pytest.raises(ExprError, match="int32|float32"):
        compile_hook(text, "score_mod", {})


@pytest.mark.parametrize("text", [
    "score + q_idx * 65536 * 65536 * 0.0 * kv_idx",  # tile arithmetic: wraps, allowed
    "score - (-2147483648) * 0.0 + 0.0 * q_idx * kv_idx",
    "score * (0.1 + 0.2) + 1 // 2",
])
def test_constant_subexpressions_that_fit_are_accepted(text):
    compile_hook(text, "score_mod", {})


def test_a_zero_divisor_gives_zero_in_the_reference():
    from specgen.spec.hooks import evaluate

    env = {"q_idx": torch.arange(4, dtype=torch.int32).view(-1, 1),
           "kv_idx": torch.arange(4, dtype=torch.int32).view(1, -1)}
    quotient = evaluate("q_idx // kv_idx + 0.0", env, {})
    remainder = evaluate("q_idx % kv_idx + 0.0", env, {})
    assert quotient[:, 0].tolist() == [0.0] * 4 and remainder[:, 0].tolist() == [0.0] * 4
    assert quotient[3, 2] == 1 and remainder[3, 2] == 1


def _gpu_module(label, data):
    """The module of ``data``, rendered into a temporary folder and imported."""
    import importlib.util
    import tempfile
    from pathlib import Path

    plan, source = render_spec_data(data)
    path = Path(tempfile.mkdtemp(prefix="hooksem_")) / f"{plan.module_name}.py"
    path.write_text(source)
    found = importlib.util.spec_from_file_location(f"_gpu_hooksem_{label}", path)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("label,score_mod", HOOKS)
def test_gpu_hooks_match_the_reference(label, score_mod):
    """The same hooks on the GPU: int32 wrapping of b and h, NaN-ignoring min/max,
    zero divisors, as the reference and the emulator compute them."""
    module = _gpu_module(label, _spec(label, score_mod))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 77, 32, generator=g).half()
    k, v = (torch.randn(2, 4, 131, 32, generator=g).half() for _ in range(2))
    out = module.attention(q.cuda(), k.cuda(), v.cuda()).cpu()
    ref, _ = reference_for(module.SPEC, q, k, v, {})
    assert not ref.isnan().any()
    result = compare(out, ref, "float16")
    assert result.ok, result


def _emulated_module(label, data):
    return emulated_spec_module(data, f"test_hooksem_{label}")


@pytest.mark.parametrize("causal", [False, True])
def test_a_score_mod_that_hides_a_whole_row_gives_zeros(causal):
    """log(0) is -inf on every key of row 0 (non-causal: in an unmasked full tile):
    the reference's row has no weight and stores zeros; the kernel took exponents
    against m = -inf there (-inf - -inf: NaN)."""
    data = {**_spec("neginf_row", "where(q_idx == 0, score + log(0.0 * kv_idx), score)"),
            "causal": causal, "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    module = _emulated_module(f"neginf_row_{causal}", data)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 32, generator=g).half() for _ in range(3))
    with emulate.emulating():
        out = module.attention(q, k, v)
    ref, _ = reference_for(module.SPEC, q, k, v, {})
    assert (ref[:, :, 0] == 0).all()
    result = compare(out, ref, "float16")
    assert result.ok, result


HOOK_GRADS = [
    # lse = -inf on row 0: P = exp(s - lse) was NaN in both backward kernels
    "where(q_idx == 0, score + log(0.0 * kv_idx), score)",
    # two choices: the chain rule multiplied 1/sqrt(0) (the score-free branch) by
    # that branch's 0 slope
    "sqrt(abs(where(q_idx > kv_idx, 0.0 * q_idx, score))) + where(kv_idx > 5, score, 2.0 * score)",
    # one choice with a constant branch: refused before ("the derivative is not finite")
    "sqrt(abs(where(q_idx > kv_idx, 0.0, score))) + 0.5 * score",
    # five sets of conditions, more than derive pulls to the top: the outer slope at
    # the all-false pairs (1/sqrt(0)) times the choices' zero slope was NaN
    "sqrt(abs(where(q_idx > kv_idx + 3, score, 0.0) + where(kv_idx % 3 == 0, 0.5 * score, 0.0)"
    " + where(q_idx % 4 == 1, 0.2 * score, 0.0) + where(kv_idx > 12, 0.3 * score, 0.0)"
    " + where(q_idx < 5, 0.1 * score, 0.0)))",
]


def _gradient_row(index, device):
    from specgen.check.runner import Case, run_case

    data = {**_spec("bwd_finite", HOOK_GRADS[index]), "backward": True,
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    if device == "cpu":
        module = _emulated_module(f"bwd_finite_{index}", data)
        with emulate.emulating():
            return run_case(torch, module, Case(1, 2, 20, 20), torch.Generator().manual_seed(1),
                            device="cpu")
    module = _gpu_module(f"bwd_finite_{index}", data)
    return run_case(torch, module, Case(2, 2, 77, 131), torch.Generator(device="cuda").manual_seed(1))


@pytest.mark.parametrize("index", range(len(HOOK_GRADS)))
def test_hook_gradients_are_finite_where_the_reference_is(index):
    row = _gradient_row(index, "cpu")
    assert row["ok"] and row["grad_finite"], row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("index", range(len(HOOK_GRADS)))
def test_gpu_hook_gradients_are_finite_where_the_reference_is(index):
    row = _gradient_row(index, "cuda")
    assert row["ok"] and row["grad_finite"], row


def test_the_block_map_pretest_keeps_a_tile_where_a_float_side_is_nan():
    """NaN != 3.0 holds (rows 16-19 see every key), but the map's bound test for !=
    took the sides' ct.min/ct.max, which skip NaN: rows 16-31 bound to [3, 3] against
    keys [3, 3], the tile was dropped and rows 16-19 stored zeros."""
    from specgen.spec.hooks import tile_pretest

    mask = "where(q_idx < 20, sqrt(-1.0 * q_idx), 3.0) != kv_idx * 0.0 + 3.0"
    assert tile_pretest(mask, {}) is None
    assert tile_pretest("q_idx // 4 != kv_idx // 4", {}) is not None  # integers: bounded
    data = {"name": "hooksem_pretest_nan", "dtype": "float16", "head_dim": 32, "gqa_ratio": 1,
            "causal": False, "mask_mod": mask, "block_sparse": True,
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    module = _emulated_module("pretest_nan", data)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 32, 32, generator=g).half() for _ in range(3))
    with emulate.emulating():
        out = module.attention(q, k, v)
    ref, _ = reference_for(module.SPEC, q, k, v, {})
    assert ref[0, 0, 16:20].abs().sum() > 0
    result = compare(out, ref, "float16")
    assert result.ok, result


def test_nested_run_time_divisors_are_refused_before_their_text_explodes():
    """Each run-time divisor is printed three times (its zero guard): nested ones
    grow the kernel text as 3**depth, gigabytes from a 250-character hook (depth 13
    here: some 45 MB of text without the limit)."""
    from specgen.spec.hooks import MAX_KERNEL_TEXT

    inner = "q_idx"
    for _ in range(13):
        inner = f"(kv_idx // {inner})"
    with pytest.raises(ExprError, match="divisors read at run time too deeply"):
        compile_hook(f"score + {inner}", "score_mod", {})
    shallow = "score + (kv_idx // (kv_idx // (q_idx + 1)))"
    assert len(compile_hook(shallow, "score_mod", {}).kernel) < MAX_KERNEL_TEXT


# A score_mod infinite only on pairs the masks hide: the kernels skip those pairs, and
# the fp64 autograd reference must too (it multiplied their zero gradient by the
# hook's infinite derivative: NaN, and a spurious gradient failure).
HIDDEN_INF = [
    # a row at position -1 (negative q_offset) sees no key under causal
    ({"causal": True, "score_mod": "score / (q_idx + 1)"}, (1, 1, 2, 2, -1)),
    # key 0 hidden by the mask_mod
    ({"causal": False, "score_mod": "score / kv_idx", "mask_mod": "kv_idx > 0"}, (1, 1, 3, 3, 0)),
    # a learnable slope divided by 0 three keys back, which the window (left 2) hides
    ({"causal": True, "window": {"left": 2, "right": None},
      "tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
      "score_mod": "score + slope[h] / (q_idx - kv_idx - 3)"}, (1, 1, 9, 9, 0)),
]


@pytest.mark.parametrize("index", range(len(HIDDEN_INF)))
def test_reference_gradients_ignore_hidden_pairs(index):
    from specgen.check.runner import Case, run_case

    extra, shape = HIDDEN_INF[index]
    data = {"name": f"hidden_inf_{index}", "dtype": "float16", "head_dim": 16, "backward": True,
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}, **extra}
    module = _emulated_module(f"hidden_inf_{index}", data)
    with emulate.emulating():
        row = run_case(torch, module, Case(*shape), torch.Generator().manual_seed(0), device="cpu")
    assert row["ok"] and row["grad_finite"], row


def test_gradient_check_of_an_lse_no_input_reaches():
    """A score_mod that reads score only in a condition makes every score a constant:
    the reference's lse then has no grad_fn. The gradient check of a backward spec with
    return_lse must not crash on it (it did: autograd.grad of an output without one)."""
    from specgen.check.runner import Case, run_case

    data = {"name": "hooksem_const_lse", "dtype": "float16", "head_dim": 16, "gqa_ratio": 1,
            "causal": False, "backward": True, "return_lse": True,
            "score_mod": "where(score > 0.0, 1.0, 0.0)",
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    module = emulated_spec_module(data, "test_hooksem")
    with emulate.emulating():
        row = run_case(torch, module, Case(1, 1, 5, 9, 0), torch.Generator().manual_seed(0),
                       device="cpu")
    assert row["ok"], row


# prescale_q: the kernels multiply Q by the scale (/ soft-cap, x 1/ln2) in float32 and
# round it to bf16 once. A steep hook turns that rounding into gradient errors far
# above a bf16 reference that skips it: the rule's "same math in the input dtype"
# rounds Q the same way.
PRESCALED = [
    ("sqrt", {"score_mod": "sqrt(max(score, 0.0))"}),
    ("softcap", {"softcap": 5.0, "score_mod": "score * score * 0.2"}),
    ("exp2", {"fast_math": {"exp2": True}}),
]


def _prescaled_row(label, fields, device):
    from specgen.check.runner import Case, run_case

    data = {"name": f"hooksem_pre_{label}", "dtype": "bfloat16", "head_dim": 32, "gqa_ratio": 1,
            "causal": False, "backward": True, "prescale_q": True,
            "targets": {"default": {"tile_m": 64, "tile_n": 64}}, **fields}
    if device == "cpu":
        module = _emulated_module(f"pre_{label}", data)
        with emulate.emulating():
            return module, run_case(torch, module, Case(1, 2, 50, 70), torch.Generator().manual_seed(1),
                                    device="cpu")
    module = _gpu_module(f"pre_{label}", data)
    return module, run_case(torch, module, Case(2, 2, 77, 131),
                            torch.Generator(device="cuda").manual_seed(1))


@pytest.mark.parametrize("label,fields", PRESCALED)
def test_prescaled_q_is_rounded_in_the_gradient_rules_low_precision_reference(label, fields):
    module, row = _prescaled_row(label, fields, "cpu")
    assert row["ok"] and row["grad_ok"], row  # sqrt: 291x the allowance without the model


def _lse_against_the_models(label, fields, device):
    """(the kernel's LSE error against the plain fp64 reference, against the one fed
    prescaled_q's rounded Q)."""
    from specgen.check.cases import prescaled_q

    data = {"name": f"hooksem_prem_{label}", "dtype": "bfloat16", "head_dim": 32, "gqa_ratio": 1,
            "causal": False, "prescale_q": True, "return_lse": True,
            "targets": {"default": {"tile_m": 64, "tile_n": 64}}, **fields}
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).bfloat16() for n in (40, 60, 60))
    if device == "cpu":
        module = _emulated_module(f"prem_{label}", data)
        with emulate.emulating():
            _, lse = module.attention(q, k, v)
    else:
        module = _gpu_module(f"prem_{label}", data)
        _, lse = module.attention(q.cuda(), k.cuda(), v.cuda())
        lse = lse.cpu()
    _, plain = reference_for(module.SPEC, q, k, v, {})
    rounded_q, scale = prescaled_q(module.SPEC, q)
    assert rounded_q.dtype == q.dtype and not torch.equal(rounded_q, q)
    _, modelled = reference_for(module.SPEC, rounded_q, k, v, {}, scale=scale)
    return (lse.double() - plain).abs().max().item(), (lse.double() - modelled).abs().max().item()


@pytest.mark.parametrize("label,fields", PRESCALED)
def test_prescaled_q_models_the_kernels_rounding(label, fields):
    """The reference fed prescaled_q's Q gives the kernel's float32 LSE a hundred times
    more closely than the plain reference: the model is the kernel's rounding."""
    far, near = _lse_against_the_models(label, fields, "cpu")
    assert near * 100 < far, (near, far)  # emulated: 4e-7 against 5e-4 to 1.5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("label,fields", PRESCALED)
def test_gpu_prescaled_q_models_the_kernels_rounding(label, fields):
    far, near = _lse_against_the_models(label, fields, "cuda")
    print(f"{label}: LSE error {far:.2e} against the plain reference, {near:.2e} against the model")
    assert near * 20 < far, (near, far)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("label,fields", PRESCALED)
def test_gpu_prescaled_q_gradients_pass_the_rule(label, fields):
    module, row = _prescaled_row(label, fields, "cuda")
    assert row["ok"] and row["grad_ok"], row


@pytest.mark.parametrize("family", ["prefill", "decode"])
def test_a_block_map_gathers_a_pair_subscript_before_the_subscript_it_indexes(family):
    """relb[bucket[q_idx + kv_idx]]: bucket's subscript reads rows and keys (a pair
    gather); relb's reads only bucket's local, so the map kernel took it for a keys
    gather and printed it before bucket's (UnboundLocalError: bucket_0)."""
    from specgen.check.runner import Case, run_case

    data = {"name": f"hooksem_pair_index_{family}", "dtype": "float16", "head_dim": 16,
            "gqa_ratio": 1, "mask_mod": "relb[bucket[q_idx + kv_idx]] > 0.3", "block_sparse": True,
            "tensors": {"relb": {"dtype": "float32", "shape": [10]},
                        "bucket": {"dtype": "int32", "shape": ["seq_k"]}},
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    if family == "decode":
        data["family"] = "decode"
        case = Case(1, 1, 1, 0, decode_lens=(34,))
    else:
        case = Case(1, 1, 20, 37)
    module = _emulated_module(f"pair_index_{family}", data)
    with emulate.emulating():
        row = run_case(torch, module, case, torch.Generator().manual_seed(0), device="cpu")
    assert row["ok"], row

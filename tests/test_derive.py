"""The score_mod derivative (sympy) against torch autograd of the hook itself."""

import pytest
import torch

from specgen.spec.derive import score_derivative, tensor_derivatives
from specgen.spec.hooks import ExprError, compile_hook, evaluate

HOOKS = [
    "score - slope[h] * (q_idx - kv_idx)",
    "score * 2.0 + 1",
    "tanh(score / 30.0) * 30.0",
    "where(q_idx >= kv_idx, score, score * 0.5)",
    "max(score, -0.5)",
    "min(score, bias[h, q_idx % 4])",
    "abs(score) + 0.1 * score",
    "sqrt(score * score + 1.0)",
    "score * score * score / 3.0",
    "log(1.0 + exp(score))",
    "exp(score) / (1.0 + exp(score))",
    "score / (kv_idx - q_idx + 100)",
    "score if score > 0.0 else 0.1 * score",
    "score * slope[h] + bias[h, kv_idx % 4]",
    "where((score > 0.2) & (q_idx > kv_idx), score * score, -score)",
    "-score + 0.0 * (q_idx // 7)",
    # conditions that are themselves chosen, or compared: sympy's Piecewise holds
    # neither, so they are written as and/or/not before it differentiates
    "where(score > 0 if h > 2 else score < 0, score, 0.5 * score)",
    "where((score > 1 if h > 0 else score < 0) & (q_idx >= kv_idx), score, 2.0 * score)",
    "where((score > 0) == (h > 2), score, 3.0 * score)",
    "where((score > 0) != (q_idx > kv_idx), score, 3.0 * score)",
    # integer powers above 8 of a base that may be negative
    "score * score * score * score * score * score * score * score * score * score",
    "score * score * score * score * score * score * score * score * score",
    "sqrt(max(score, 0.0))",
    "where(1 > 0, score, 0.0) + min(score + -1.0, score)",
]
TENSORS = {"slope": ("float32", 1), "bias": ("float32", 2)}


def _env(generator):
    shape = (4, 1, 16, 16)
    score = torch.randn(shape, generator=generator, dtype=torch.float64) * 2
    score = score + torch.sign(score) * 0.01  # away from the kinks at 0
    env = {
        "score": score.requires_grad_(),
        "b": torch.arange(4).view(4, 1, 1, 1),
        "h": torch.arange(1).view(1, 1, 1, 1) + 2,
        "q_idx": torch.arange(16).view(1, 1, 16, 1) + 40,
        "kv_idx": torch.arange(16).view(1, 1, 1, 16) + 32,
    }
    tensors = {"slope": torch.rand(8, generator=generator, dtype=torch.float64),
               "bias": torch.randn(8, 4, generator=generator, dtype=torch.float64)}
    return env, tensors


@pytest.mark.parametrize("hook", HOOKS)
def test_derivative_matches_autograd(hook):
    env, tensors = _env(torch.Generator().manual_seed(0))
    compile_hook(hook, "score_mod", TENSORS)  # the hook itself is valid
    derivative = score_derivative(hook)
    compile_hook(derivative, "score_mod", TENSORS, check_size=False)  # and compiles to cuTile
    value = evaluate(hook, env, tensors)
    (grad,) = torch.autograd.grad(value.sum(), env["score"])
    got = evaluate(derivative, {**env, "score": env["score"].detach()}, tensors)
    got = torch.as_tensor(got, dtype=torch.float64).expand_as(grad)
    # Constants evaluate as float32 (as in the kernel), hence float32-level agreement.
    torch.testing.assert_close(got, grad, rtol=1e-6, atol=1e-6)


def test_min_and_max_take_the_first_arguments_slope_at_a_tie():
    """Both arguments of min(score, score - c) have slope 1, so the derivative is 1
    where they tie (c = 0, the diagonal for a relative bias), not H(c) + H(-c) = 0."""
    assert score_derivative("min(score, score - slope[h] * (q_idx - kv_idx))") == "1.0"
    env, tensors = _env(torch.Generator().manual_seed(0))
    score = env["score"].detach()
    tie = evaluate(score_derivative("max(score, 0.5)"), {**env, "score": torch.full_like(score, 0.5)}, tensors)
    assert torch.equal(torch.as_tensor(tie).expand_as(score), torch.ones_like(score))


def test_derivatives_stay_finite_where_the_hook_is():
    """sqrt(max(score, 0)) is flat below 0 (derivative 0, not inf * 0) and a tenth
    power of a negative score has a finite slope (not exp(9 log(score)))."""
    env, tensors = _env(torch.Generator().manual_seed(0))
    score = -env["score"].detach().abs()  # all negative
    for hook in ("sqrt(max(score, 0.0))", " * ".join(["score"] * 10)):
        got = evaluate(score_derivative(hook), {**env, "score": score}, tensors)
        assert torch.isfinite(torch.as_tensor(got)).all(), hook


def test_sympy_failures_are_one_line_expr_errors(monkeypatch):
    import specgen.spec.derive as derive

    def broken(*args, **kwargs):
        raise TypeError("expecting bool or Boolean, not `Piecewise(...)`\nmore")

    monkeypatch.setattr(derive.sp, "diff", broken)
    with pytest.raises(ExprError, match=r"sympy could not form the derivative \(TypeError: "
                                        r"expecting bool or Boolean, not `Piecewise\(\.\.\.\)`\)$"):
        score_derivative("tanh(score)")


def test_a_bias_has_derivative_one():
    assert score_derivative("score - slope[h] * (q_idx - kv_idx)") == "1.0"
    assert score_derivative("score + 0.5") == "1.0"


@pytest.mark.parametrize("hook,message", [
    ("score // 2", "'//' and '%' of the score or of a learnable tensor have no derivative"),
])
def test_no_derivative_is_an_error(hook, message):
    with pytest.raises(ExprError, match=message):
        score_derivative(hook)


LEARNABLE_HOOKS = [
    "score - slope[h] * (q_idx - kv_idx)",
    "score * slope[h] + bias[h, kv_idx % 4]",
    "min(score, bias[h, q_idx % 4])",
    "tanh(score * slope[h]) + slope[h] * slope[h]",
    "where(q_idx >= kv_idx, score * bias[h, q_idx % 4], bias[h, kv_idx % 4] / 2.0)",
    "score * (1.0 + 0.5 * tanh(bias[b, q_idx % 4]))",
]


@pytest.mark.parametrize("hook", LEARNABLE_HOOKS)
def test_tensor_derivatives_match_autograd(hook):
    """dL/dtensor = sum over the scores of dL/dscore_mod * d(score_mod)/d(subscript),
    scattered to the subscript's element, equals autograd through the hook."""
    env, tensors = _env(torch.Generator().manual_seed(1))
    env["score"] = env["score"].detach()
    leaves = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    upstream = torch.randn(env["score"].shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (evaluate(hook, env, leaves) * upstream).sum().backward()
    ids = {n: torch.arange(t.numel(), dtype=torch.float64).view(t.shape) for n, t in tensors.items()}
    got = {n: torch.zeros_like(t) for n, t in tensors.items()}
    for source, text in tensor_derivatives(hook, {"slope", "bias"}):
        compile_hook(text, "score_mod", TENSORS, check_size=False)  # compiles to cuTile
        name = source.split("[")[0]
        where = evaluate(source, env, ids).long()  # the element each score reads
        value = torch.as_tensor(evaluate(text, env, tensors), dtype=torch.float64)
        contribution = (upstream * value.expand_as(upstream)).flatten()
        got[name].view(-1).index_add_(0, where.expand_as(upstream).flatten(), contribution)
    for name, leaf in leaves.items():
        want = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-6)


def test_tensor_derivatives_list_each_subscript_once():
    assert tensor_derivatives("score * slope[h] + slope[h] + bias[h, kv_idx]", {"slope"}) == [
        ("slope[h]", "(1.0 + score)")]
    assert [s for s, _ in tensor_derivatives("score + bias[h, kv_idx] + bias[h, q_idx]", {"bias"})] == [
        "bias[h, kv_idx]", "bias[h, q_idx]"]
    assert tensor_derivatives("score - slope[h]", set()) == []


def test_abs_of_log_and_sqrt_differentiates_as_a_real_abs():
    """abs() of log(u) or sqrt(u): sympy's Abs took them for complex numbers and
    differentiated through re and im: abs(sqrt(score)) was refused ("cos"), and
    abs(log(u)) had (1 / log u) * log(u / sign u): NaN where u == 1 (a zero table
    entry in 1.0 + score * t[kv_idx]). The derivative is sign(u) du."""
    assert "cos" not in score_derivative("abs(sqrt(score))")
    text = "abs(log(1.0 + 0.1 * score * t[kv_idx]))"
    derivative = score_derivative(text)
    score = torch.tensor([0.5, 1.0, 2.0, -3.0], dtype=torch.float64)
    env = {"score": score, "b": 0, "h": 0, "q_idx": torch.tensor(0),
           "kv_idx": torch.arange(4)}
    tensors = {"t": torch.tensor([0.0, 1.0, 0.0, -2.0])}  # u == 1 at keys 0 and 2
    got = evaluate(derivative, env, tensors)
    s = score.clone().requires_grad_()
    (expected,) = torch.autograd.grad(evaluate(text, {**env, "score": s}, tensors).sum(), s)
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hook,slope", [("min(score, log(score))", 1.0),
                                        ("max(2.0 * score, log(score))", 2.0),
                                        ("score + min(slope[h] * score, log(score))", 2.0)])
def test_min_and_max_take_the_slope_of_the_operand_they_return_past_a_nan(hook, slope):
    """min and max ignore a NaN operand (the kernel's, the reference's): where the second
    is NaN (the log of a negative score) they return the first, and the derivative
    is the first's slope, not the NaN branch's (the comparison is False there)."""
    env, tensors = _env(torch.Generator().manual_seed(0))
    score = -env["score"].detach().abs()  # every score negative: the second operand is NaN
    tensors = dict(tensors, slope=torch.ones(8, dtype=torch.float64))
    compile_hook(score_derivative(hook), "score_mod", TENSORS, check_size=False)
    got = evaluate(score_derivative(hook), {**env, "score": score}, tensors)
    grad = torch.autograd.grad(evaluate(hook, {**env, "score": score.requires_grad_()}, tensors).sum(),
                               score)[0]
    assert torch.equal(torch.as_tensor(got, dtype=torch.float64).expand_as(grad), torch.full_like(grad, slope))
    assert torch.equal(grad, torch.full_like(grad, slope))  # the reference's autograd agrees

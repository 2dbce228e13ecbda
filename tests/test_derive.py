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

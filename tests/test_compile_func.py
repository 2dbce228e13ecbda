"""torch.compile combined with torch.func and forward-mode AD, through the generated
modules, with the kernels emulated on the CPU. The eager calls are the oracle: a
compiled call gives their bits, or is refused with an error that says what to do;
never a zero or missing derivative."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from specgen.check import emulate

from .helpers import emulated_module

REFUSED = "attention cannot be traced inside torch.func.grad"


def _inputs(module, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, module.SPEC["dtype"])
    hq, d = module.SPEC["gqa_ratio"], module.SPEC["head_dim"]
    q = torch.randn(1, hq, seq, d, generator=g).to(dtype)
    k, v = (torch.randn(1, 1, seq, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _compile(fn, fullgraph=False):
    return torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles afresh: no cached frame of another test's module."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_torch_func_grad_and_vjp_give_the_eager_gradients():
    """torch.compile(torch.func.grad(f)), and vjp inside a compiled function, failed
    in torch's words ("it must override the setup_context staticmethod": the op's
    autograd under torch.func, which dynamo traces as plain tensors). The call now
    leaves the trace and runs as an eager one (the same bits as torch.func.grad
    without torch.compile); fullgraph=True refuses it, saying what to do instead."""
    module = emulated_module("fmha_train_gqa_causal", "compile_func")
    q, k, v = _inputs(module)

    def loss(q, k, v):
        return module.attention(q, k, v).float().square().sum()

    def with_vjp(q, k, v):
        out, pullback = torch.func.vjp(module.attention, q, k, v)
        return pullback(2 * out.float().to(out.dtype))

    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    with emulate.emulating():
        want = grad(q, k, v)
        assert all(torch.equal(a, b) for a, b in zip(_compile(grad)(q, k, v), want))
        assert all(torch.equal(a, b) for a, b in zip(_compile(with_vjp)(q, k, v), want))
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match=REFUSED):
            _compile(grad, fullgraph=True)(q, k, v)


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_gqa_causal"])
@pytest.mark.parametrize("where", ["inside", "outside"])
def test_a_dual_tensor_under_torch_compile_is_refused_not_dropped(name, where):
    """Eagerly a dual tensor is a ValueError; under torch.compile dynamo traced it as
    a plain tensor and the output came back without a tangent (a zero one), whether
    the dual level was entered inside the compiled function or outside it."""
    module = emulated_module(name, "compile_dual")
    q, k, v = _inputs(module)
    tangent = torch.ones_like(q)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def inside(q, k, v, tangent):
        with fwAD.dual_level():
            return fwAD.unpack_dual(first(module.attention(fwAD.make_dual(q, tangent), k, v))).tangent

    with emulate.emulating(), pytest.raises(ValueError, match="no forward-mode derivative"):
        if where == "inside":
            _compile(inside)(q, k, v, tangent)
        else:
            with fwAD.dual_level():
                _compile(lambda q, k, v: first(module.attention(q, k, v)))(fwAD.make_dual(q, tangent), k, v)


def test_a_forward_only_module_under_compiled_grad_is_refused_not_a_zero_gradient():
    """A module without a backward, under torch.compile(torch.func.grad(f)): dynamo
    saw the wrapped q as not requiring grad, so the "no backward" check passed and
    the gradient came back as zeros. It is now the eager call's ValueError."""
    module = emulated_module("fmha_gqa_causal", "compile_func_fwd")
    q, k, v = _inputs(module)
    with emulate.emulating(), pytest.raises(ValueError, match="this module has no backward"):
        _compile(torch.func.grad(lambda q: module.attention(q, k, v).float().sum()))(q)


def _sinks_module_and_inputs(tag):
    module = emulated_module("fmha_train_gptoss_sinks", tag)
    q, k, v = _inputs(module)
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(2))
    return module, q, k, v, sinks


def test_compiled_training_steps_through_functional_call_keep_the_eager_gradients(monkeypatch):
    """A training step through torch.func.functional_call compiles whole
    (fullgraph=True, with dynamo's trace_autograd_ops) with torch.autograd.grad or
    backward(), the eager bits either way: the fallback of attention() under
    torch.func transforms leaves these traces alone."""
    module, q, k, v, _ = _sinks_module_and_inputs("compile_steps")

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(q.shape[-1], dtype=q.dtype))
            self.sinks = torch.nn.Parameter(torch.randn(q.shape[1]))

        def forward(self, q, k, v):
            return module.attention(q @ self.w, k, v, sinks=self.sinks)[0]

    layer = Layer()
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}

    def step(params, q, k, v):
        out = torch.func.functional_call(layer, params, (q, k, v))
        return torch.autograd.grad(out.float().square().sum(), list(params.values()))

    def step_backward(params, q, k, v):
        torch.func.functional_call(layer, params, (q, k, v)).float().square().sum().backward()

    monkeypatch.setattr(torch._dynamo.config, "trace_autograd_ops", True)
    with emulate.emulating():
        want = step(params, q, k, v)
        assert all(torch.equal(a, b) for a, b in zip(_compile(step, fullgraph=True)(params, q, k, v), want))
        _compile(step_backward, fullgraph=True)(params, q, k, v)
        assert all(torch.equal(p.grad, b) for p, b in zip(params.values(), want))


def test_compiled_vmap_traces_the_op_and_a_compiled_second_derivative_is_refused():
    """vmap of batched inputs still compiles whole (the op, run once per entry), with
    the eager bits; create_graph through a compiled call is refused in torch's
    words, not a zero second derivative."""
    module, q, k, v, sinks = _sinks_module_and_inputs("compile_vmap")

    def penalty(q, k, v):
        (dq,) = torch.autograd.grad(module.attention(q, k, v, sinks=sinks)[0].float().square().sum(), q,
                                    create_graph=True)
        return dq.float().square().sum()

    batched = [torch.stack([t, t.flip(2)]) for t in (q, k, v)]
    with emulate.emulating():
        vmapped = torch.func.vmap(lambda q, k, v: module.attention(q, k, v, sinks=sinks)[0])
        assert torch.equal(_compile(vmapped, fullgraph=True)(*batched), vmapped(*batched))
        leaf = q.clone().requires_grad_()
        with pytest.raises(RuntimeError, match="does not currently support double backward"):
            torch.autograd.grad(_compile(penalty)(leaf, k, v), leaf)


def test_a_decode_module_under_compiled_grad_or_a_dual_tensor_is_refused():
    """Decode has no derivative: under torch.compile, torch.func.grad gave an all-zero
    gradient and a dual tensor an output without a tangent. Both are now the eager
    call's ValueError."""
    from specgen.check.cases import random_decode

    module = emulated_module("fmha_decode_gqa4_bf16", "compile_decode")
    q, *rest = random_decode(module.SPEC, [17, 5], 1, 1, torch.Generator().manual_seed(0), device="cpu").args()
    with emulate.emulating():
        with pytest.raises(ValueError, match="decode has no backward"):
            _compile(torch.func.grad(lambda q: module.attention(q, *rest).float().sum()))(q)
        torch._dynamo.reset()
        with fwAD.dual_level(), pytest.raises(ValueError, match="no forward-mode derivative"):
            _compile(lambda q: module.attention(q, *rest))(fwAD.make_dual(q, torch.ones_like(q)))


def test_compiled_grad_of_vmap_gives_the_eager_gradients():
    """Per-sample losses summed, torch.compile(torch.func.grad(f)) with a vmap inside
    f: the vmap's batched q made the call look like vmap alone, so it was traced and
    failed in torch's words ("RuntimeError when making fake tensor call"). Any grad or
    jvp under the vmap now sends the call to the eager one, whose bits it gives."""
    module = emulated_module("fmha_train_gqa_causal", "compile_grad_vmap")
    q, k, v = _inputs(module)
    batched = torch.stack([q, q.flip(2)])
    grad = torch.func.grad(lambda qb: torch.func.vmap(lambda q: module.attention(q, k, v))(qb).float().square().sum())
    with emulate.emulating():
        want = grad(batched)
        assert want.abs().sum() > 0
        assert torch.equal(_compile(grad)(batched), want)
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match=REFUSED):
            _compile(grad, fullgraph=True)(batched)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", ["fmha_gqa_causal", "fmha_decode_gqa4_bf16"])
def test_a_module_without_backward_under_grad_of_vmap_is_refused(name, compiled):
    """torch.func.grad of a vmap of a forward-only or decode module: the vmap's
    BatchedTensor says requires_grad False, so the "no backward" check passed and the
    gradient came back as zeros, eagerly and compiled. It is the ValueError of grad
    alone."""
    from specgen.check.cases import random_decode

    module = emulated_module(name, "grad_vmap_no_backward")
    if "decode" in name:
        q, *rest = random_decode(module.SPEC, [17, 5], 1, 1, torch.Generator().manual_seed(0), device="cpu").args()
        message = "decode has no backward"
    else:
        q, *rest = _inputs(module)
        message = "this module has no backward"
    batched = torch.stack([q, q + 1])
    grad = torch.func.grad(lambda qb: torch.func.vmap(lambda q: module.attention(q, *rest))(qb).float().sum())
    with emulate.emulating(), pytest.raises(ValueError, match=message):
        (_compile(grad) if compiled else grad)(batched)
    with emulate.emulating():  # vmap alone runs
        torch.func.vmap(lambda q: module.attention(q, *rest))(batched)

"""Generated modules and the transformers adapter inside torch.autocast, and the
adapter's dropout seed under activation checkpointing. Run on the CPU with the
kernels emulated (CPU autocast stands for CUDA's: the same rule, another device)."""

import random
import types

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from specgen.check import emulate
from specgen.check.cases import random_decode, random_packed, random_qkv

from .helpers import emulated_module, emulated_spec_module, same_tensors, trained_spec_data

GEN = torch.Generator


def _prefill_inputs(module, seed=3):
    spec = module.SPEC
    if spec["varlen"]:
        batch = random_packed(spec, [(37, 70), (5, 40)], 2, GEN().manual_seed(seed), device="cpu")
        return [batch.q, batch.k, batch.v], batch.kwargs()
    q, k, v = random_qkv(spec, 2, 2, 37, 70, generator=GEN().manual_seed(seed), device="cpu")
    return [q, k, v], dict(q_offset=33 if spec["causal"] else 0)


@pytest.mark.parametrize("name", ["fmha_gqa8_bf16", "fmha_gqa_causal", "fmha_varlen_llama"])
def test_prefill_under_autocast_casts_float32_inputs_as_sdpa_does(name):
    """Inside autocast to the spec's dtype, float32 q and k (as float32 rotary
    embeddings leave them) and a half v run the kernel on their cast values, bit for
    bit the call with the casts written out; outside it, or under autocast to another
    dtype, the same call is refused, and float64 stays refused inside it too."""
    module = emulated_module(name, "autocast")
    dtype = module.DTYPE
    (q, k, v), kwargs = _prefill_inputs(module)
    q32, k32 = q.float(), k.float()
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with emulate.emulating():
        expected = module.attention(q, k, v, **kwargs)
        with torch.autocast("cpu", dtype=dtype):
            got = module.attention(q32, k32, v, **kwargs)
            with pytest.raises(ValueError, match="q"):
                module.attention(q.double(), k, v, **kwargs)
        assert same_tensors(got, expected)
        with pytest.raises(ValueError, match="q"):
            module.attention(q32, k32, v, **kwargs)
        with torch.autocast("cpu", dtype=other), pytest.raises(ValueError, match="q"):
            module.attention(q32, k32, v, **kwargs)
        # Traced, the casts are recorded before the op.
        with torch.autocast("cpu", dtype=dtype):
            compiled = torch.compile(lambda *a: module.attention(*a, **kwargs),
                                     fullgraph=True, backend="aot_eager")
            assert same_tensors(compiled(q32, k32, v), expected)


def test_the_float8_prefill_is_not_cast():
    """float8 is no autocast type: the float8 module renders no cast."""
    module = emulated_module("fmha_fp8_llama", "autocast")
    assert not hasattr(module, "_autocast")


@pytest.mark.parametrize("name", ["fmha_decode_gqa8_bf16", "fmha_decode_gqa8_fp8kv"])
def test_decode_under_autocast_casts_q_and_never_the_caches(name):
    module = emulated_module(name, "autocast")
    spec = module.SPEC
    batch = random_decode(spec, [17, 1, 90], 2, 1, GEN().manual_seed(4), device="cpu")
    q, k_cache, v_cache, seq_lens = batch.args()[:4]
    descales = {n: 0.5 for n in ("k_descale", "v_descale") if spec.get("kv_dtype")}
    with emulate.emulating():
        expected = module.attention(q, k_cache, v_cache, seq_lens, **descales)
        with torch.autocast("cpu", dtype=module.DTYPE):
            got = module.attention(q.float(), k_cache, v_cache, seq_lens, **descales)
            if k_cache.dtype == module.DTYPE:  # a float32 cache is refused, not copied
                with pytest.raises(ValueError, match="k_cache"):
                    module.attention(q, k_cache.float(), v_cache, seq_lens)
        assert same_tensors(got, expected)


def test_training_under_autocast_gives_float32_leaves_the_cast_calls_gradients():
    module = emulated_module("fmha_train_gqa_causal", "autocast")
    (q, k, v), kwargs = _prefill_inputs(module)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3],
                       generator=GEN().manual_seed(9)).to(module.DTYPE)
    with emulate.emulating():
        with torch.autocast("cpu", dtype=module.DTYPE):
            out = module.attention(*leaves, **kwargs)
        assert out.dtype == module.DTYPE
        grads = torch.autograd.grad(out, leaves, dout)
        cast = [t.detach().to(module.DTYPE).requires_grad_() for t in leaves]
        expected_out = module.attention(*cast, **kwargs)
        expected = torch.autograd.grad(expected_out, cast, dout)
    assert same_tensors(out.detach(), expected_out.detach())
    for got, want in zip(grads, expected):
        assert got.dtype == torch.float32 and torch.equal(got, want.float())


# The adapter: a function from make_attention_function called as a transformers
# layer calls it, [B, H, S, D] tensors.


def _layer(module):
    return types.SimpleNamespace(is_causal=bool(module.SPEC.get("causal")))


def test_the_adapter_casts_a_mixed_precision_layers_inputs_under_autocast():
    """A float32 model under autocast hands the layer float32 q and k (rotary
    embeddings in float32) and a bfloat16 v: the kernel serves it, as sdpa does;
    outside autocast the float32 layer is refused with the dtypes named."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from specgen.integrations.transformers import make_attention_function

    module = emulated_module("fmha_gqa8_bf16", "autocast_tf")
    function = make_attention_function(module)
    q, k, v = random_qkv(module.SPEC, 1, 1, 33, 33, generator=GEN().manual_seed(2), device="cpu")
    with emulate.emulating(), torch.no_grad():
        expected, _ = function(_layer(module), q, k, v, None)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, _ = function(_layer(module), q.float(), k.float(), v, None)
        with pytest.raises(ValueError, match="float32 with head_dim"):
            function(_layer(module), q.float(), k.float(), v, None)
    assert torch.equal(got, expected)


def _dropout_layer(tag):
    """The adapter's function for the ViT dropout spec with a backward (emulated),
    called as a layer with attention dropout 0.3, and its q, k, v (requiring grad)."""
    pytest.importorskip("transformers")
    from specgen.integrations.transformers import make_attention_function

    module = emulated_spec_module(trained_spec_data("fmha_vit_dropout"), tag)
    function, owner = make_attention_function(module), _layer(module)
    qkv = tuple(t.requires_grad_() for t in random_qkv(
        module.SPEC, 1, 2, 40, 40, generator=GEN().manual_seed(0), device="cpu"))

    def layer(q, k, v):
        return function(owner, q, k, v, None, dropout=0.3)[0]

    return layer, qkv


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_adapters_dropout_survives_activation_checkpointing(reentrant):
    """The adapter draws each call's dropout seed from torch's CPU generator, which
    checkpointing restores before it recomputes the layer: the recomputed forward
    drops the same weights, so the gradients are those of the run without
    checkpointing (with Python's random, the reentrant form's were off by up to 3.3
    against gradients of at most 8.8). torch.manual_seed reproduces a call."""
    layer, (q, k, v) = _dropout_layer("ckpt")

    def run(wrapped):
        random.seed(1)
        torch.manual_seed(1)
        for t in (q, k, v):
            t.grad = None
        out = checkpoint(layer, q, k, v, use_reentrant=reentrant) if wrapped else layer(q, k, v)
        out.float().square().sum().backward()  # the reentrant form takes no inputs=
        return out.detach(), [t.grad.clone() for t in (q, k, v)]

    with emulate.emulating():
        plain_out, plain = run(False)
        again_out, again = run(False)
        out, grads = run(True)
    assert torch.equal(plain_out, again_out) and all(map(torch.equal, plain, again))
    assert torch.equal(out, plain_out)
    assert all(map(torch.equal, grads, plain))


def test_the_adapters_dropout_compiles_whole_with_the_eager_seed():
    """Under torch.compile(fullgraph=True) the seed's draw is part of the graph (it
    broke the graph with Python's random): the compiled call draws what an eager call
    after the same torch.manual_seed draws, and a fresh seed each call."""
    layer, (q, k, v) = _dropout_layer("ckpt_compile")

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with emulate.emulating():
        torch.manual_seed(3)
        eager = layer(q, k, v)
        torch.manual_seed(3)
        first, second = compiled(q, k, v), compiled(q, k, v)
        first.float().sum().backward()
    assert torch.equal(first, eager) and not torch.equal(first, second)
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


@pytest.mark.parametrize("name", ["fmha_gqa8_bf16", "fmha_decode_gqa8_bf16"])
def test_forward_only_modules_refuse_forward_mode_ad(name):
    """torch.func.jvp through a forward-only module gave an all-zero tangent, and a
    dual tensor's tangent was dropped: both are a ValueError before any launch."""
    import torch.autograd.forward_ad as fwAD

    module = emulated_module(name, "fwad")
    if module.SPEC["family"] == "decode":
        batch = random_decode(module.SPEC, [17, 30], 2, 1, GEN().manual_seed(4), device="cpu")
        q, *rest = batch.args()[:4]
    else:
        (q, *rest), _ = _prefill_inputs(module)
    with emulate.emulating():
        with pytest.raises(ValueError, match="no forward-mode derivative"):
            torch.func.jvp(lambda q: module.attention(q, *rest), (q,), (torch.ones_like(q),))
        with fwAD.dual_level(), pytest.raises(ValueError, match="no forward-mode derivative"):
            module.attention(fwAD.make_dual(q, torch.ones_like(q)), *rest)
        with fwAD.dual_level():  # a dual level without dual inputs is an ordinary call
            module.attention(q, *rest)


def test_the_adapters_masked_fallback_stays_float32_under_autocast():
    """A sinks spec's masked call runs masked_attention, float32 torch attention: inside
    autocast its matmuls ran in bfloat16 (7x the error against a float64 reference:
    0.052 against 0.0078), unlike the same call outside autocast."""
    pytest.importorskip("transformers")
    from specgen.integrations.transformers import make_attention_function

    module = emulated_module("fmha_gptoss_sinks", "autocast_masked")
    function = make_attention_function(module)
    q, k, v = random_qkv(module.SPEC, 1, 2, 64, 64, generator=GEN().manual_seed(0), device="cpu")
    q = q * 4
    sinks = torch.randn(q.shape[1], generator=GEN().manual_seed(1))
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
    mask[..., :3] = False
    kwargs = dict(s_aux=sinks, scaling=0.125)
    if module.SPEC.get("window"):
        kwargs["sliding_window"] = module.SPEC["window"]["left"] + 1
    with emulate.emulating(), torch.no_grad(), pytest.warns(UserWarning):
        expected, _ = function(_layer(module), q, k, v, mask, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, _ = function(_layer(module), q.float(), k.float(), v, mask, **kwargs)
    assert torch.equal(got, expected)


def test_the_adapter_on_meta_tensors_reads_no_meta_autocast_state():
    """A model on the meta device: torch.is_autocast_enabled('meta') is a RuntimeError,
    so the adapter asks it nothing there; its own checks and the sdpa fallback run."""
    pytest.importorskip("transformers")
    from specgen.integrations.transformers import make_attention_function

    module = emulated_module("fmha_gqa8_bf16", "autocast_meta")
    function = make_attention_function(module)
    d, ratio = module.SPEC["head_dim"], module.SPEC["gqa_ratio"]
    q = torch.empty(1, ratio, 16, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 1, 16, d, dtype=torch.bfloat16, device="meta")
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool, device="meta")
    with torch.no_grad():
        with pytest.raises(ValueError, match="float32 with head_dim"):
            function(_layer(module), q.float(), k, k, None)
        with pytest.warns(UserWarning):
            out, _ = function(_layer(module), q, k, k, mask)
    assert out.device.type == "meta" and out.shape == (1, 16, ratio, d)


@pytest.mark.parametrize("tracer", ["make_fx", "export"])
def test_the_adapters_dropout_seed_is_a_constant_of_a_non_dynamo_trace(tracer):
    """make_fx and torch.export's non-strict mode trace the adapter's dropout call: the
    seed is drawn from torch's CPU generator at trace time (a traced draw's int() is
    data-dependent, which they refuse), as Python's random draw was."""
    pytest.importorskip("transformers")
    from torch.fx.experimental.proxy_tensor import make_fx

    layer, (q, k, v) = _dropout_layer("seed_trace")

    class Layer(torch.nn.Module):
        def forward(self, q, k, v):
            return layer(q, k, v)

    with emulate.emulating():
        if tracer == "make_fx":
            traced = make_fx(layer, tracing_mode="fake")(q, k, v)
        else:
            traced = torch.export.export(Layer(), (q, k, v), strict=False).module()
        # The seed is the trace's constant: every run drops the same weights.
        first, second = traced(q, k, v), traced(q, k, v)
    assert first.shape == q.transpose(1, 2).shape and torch.equal(first, second)  # [B, S, H, D]


@pytest.mark.parametrize("name", ["fmha_gqa8_bf16", "fmha_train_gqa_causal", "fmha_decode_gqa8_bf16"])
def test_jvp_through_a_function_whose_attention_inputs_are_constants_runs(name):
    """Inside torch.func.jvp (and jacfwd), a call on tensors the function closes over
    (not derived from jvp's primals) has a zero tangent, rightly: the forward-mode
    refusal asked only whether jvp was on the stack, and refused it."""
    module = emulated_module(name, "jvp_const")
    if module.SPEC["family"] == "decode":
        batch = random_decode(module.SPEC, [17, 30], 2, 1, GEN().manual_seed(4), device="cpu")
        args = batch.args()[:4]
    else:
        args, _ = _prefill_inputs(module)
    x = torch.randn(3, generator=GEN().manual_seed(5))

    def f(x):
        out = module.attention(*args)
        out = out[0] if isinstance(out, tuple) else out
        return x * 2 + out.float().mean()

    with emulate.emulating():
        expected = f(x)
        primal, tangent = torch.func.jvp(f, (x,), (torch.ones(3),))
        jacobian = torch.func.jacfwd(f)(x)
        with pytest.raises(ValueError, match="no forward-mode derivative"):
            torch.func.jvp(lambda q: module.attention(q, *args[1:]), (args[0],), (torch.ones_like(args[0]),))
    assert torch.equal(primal, expected) and torch.equal(tangent, torch.full((3,), 2.0))
    assert torch.equal(jacobian, 2 * torch.eye(3))

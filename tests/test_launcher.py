"""Call-time validation of a generated `attention`: a ValueError that says what was
expected, raised before any launch (these run on the CPU, where a launch would fail)."""

import pytest
import torch

from .helpers import ROOT, generated_module

mod = generated_module("fmha_gqa_causal")  # gqa_ratio 4, float16, head_dim 128


def _t(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype)


def good(**overrides):
    args = {"q": _t(1, 8, 16, 128), "k": _t(1, 2, 16, 128), "v": _t(1, 2, 16, 128)}
    args.update(overrides)
    return args


CASES = [
    (good(q=[1, 2]), {}, "q must be a torch.Tensor, got list"),
    (good(k=_t(2, 16, 128)), {}, "k must be 4-D [batch, heads, seq, head_dim], got shape (2, 16, 128)"),
    (good(v=_t(1, 2, 16, 128, dtype=torch.bfloat16)), {}, "v must have dtype torch.float16, got torch.bfloat16"),
    (good(q=_t(1, 8, 16, 64)), {}, "q must have head_dim 128, got 64"),
    (good(q=_t(1, 8, 128, 16).transpose(2, 3)), {}, "q must be contiguous in head_dim (stride 1)"),
    (good(v=_t(1, 2, 17, 128)), {}, "k and v must have the same shape, got (1, 2, 16, 128) and (1, 2, 17, 128)"),
    (good(k=_t(2, 2, 16, 128), v=_t(2, 2, 16, 128)), {}, "q, k and v must have the same batch size, got 1 and 2"),
    (good(q=_t(1, 6, 16, 128)), {}, "q has 6 heads and k/v have 2; this kernel needs q heads == 4 * kv heads (gqa_ratio 4)"),
    (good(k=_t(1, 2, 0, 128), v=_t(1, 2, 0, 128)), {}, "k and v must hold at least one key"),
    (good(), {"scale": -1.0}, "scale must be a positive finite float in float32's normal range, got -1.0"),
    (good(), {"scale": float("nan")}, "scale must be a positive finite float in float32's normal range, got nan"),
    (good(), {"scale": 1e39}, "scale must be a positive finite float in float32's normal range, got 1e+39"),
    (good(), {"scale": 1e-60}, "scale must be a positive finite float in float32's normal range, got 1e-60"),
    (good(), {"scale": "0.1"}, "scale must be a positive float or None, got '0.1'"),
    (good(), {"q_offset": -(2**30) - 1}, "q_offset must be in [-2**30, 2**30 - seq_q] (seq_q 16: at most 1073741808), got -1073741825"),
    (good(), {"q_offset": 2**30 - 15}, "q_offset must be in [-2**30, 2**30 - seq_q] (seq_q 16: at most 1073741808), got 1073741809"),
    (good(), {"q_offset": 1.5}, "q_offset must be an int, got 1.5"),
    (good(), {"q_offset": True}, "q_offset must be an int, got True"),
    (good(), {}, "q, k and v must be CUDA tensors, got q on cpu"),
]


@pytest.mark.parametrize("tensors,kwargs,message", CASES, ids=[c[2][:40] for c in CASES])
def test_bad_arguments_raise_value_error_before_launch(tensors, kwargs, message, monkeypatch):
    def no_launch(*args, **kw):
        raise AssertionError("launched despite bad arguments")

    monkeypatch.setattr(mod.ct, "launch", no_launch)
    with pytest.raises(ValueError) as info:
        mod.attention(tensors["q"], tensors["k"], tensors["v"], **kwargs)
    assert message in str(info.value)


mla = generated_module("fmha_mla_d192")  # head_dim 192, v_head_dim 128, MHA, bfloat16


def _b(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


MLA_CASES = [
    ((_b(1, 2, 8, 192), _b(1, 2, 8, 192), _b(1, 2, 8, 192)), {}, "v must have head_dim 128, got 192"),
    ((_b(1, 2, 8, 128), _b(1, 2, 8, 192), _b(1, 2, 8, 128)), {}, "q must have head_dim 192, got 128"),
    ((_b(1, 2, 8, 192), _b(1, 2, 8, 192), _b(1, 2, 9, 128)), {},
     "k and v must agree in batch, heads and seq, got (1, 2, 8, 192) and (1, 2, 9, 128)"),
]


@pytest.mark.parametrize("tensors,kwargs,message", MLA_CASES, ids=[c[2][:40] for c in MLA_CASES])
def test_v_head_dim_checks(tensors, kwargs, message, monkeypatch):
    monkeypatch.setattr(mla.ct, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError) as info:
        mla.attention(*tensors, **kwargs)
    assert message in str(info.value)


def test_training_module_registers_a_custom_op_with_a_fake_impl():
    """specgen::<name>_<spec hash> traces under fake tensors (what torch.compile does)
    on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    train = generated_module("fmha_train_gqa_causal")
    op = train._OP
    assert train.OP_NAME.startswith("specgen::fmha_train_gqa_causal_")
    assert str(op) == train.OP_NAME.replace("::", ".")
    with FakeTensorMode():
        q = torch.empty(2, 8, 33, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 40, 128, dtype=torch.bfloat16)
        out, lse = op(q, k, k, 0.1, 7)
    assert out.shape == (2, 8, 33, 128) and lse.shape == (2, 8, 33) and lse.dtype == torch.float32


def test_training_module_traces_with_a_symbolic_position():
    """Outside dynamo, a tracer hands a dynamic int input to attention() as a SymInt
    (torch.export's non-strict tracing, make_fx symbolic): q_offset (and seed,
    q_shift, max_seqlen) were refused as "must be an int, got s6", where dynamo
    (strict export, torch.compile) took them."""
    from torch.export import Dim, export
    from torch.fx.experimental.proxy_tensor import make_fx

    train = generated_module("fmha_train_gqa_causal")

    class Layer(torch.nn.Module):
        def forward(self, q, k, v, q_offset):
            return train.attention(q, k, v, q_offset=q_offset)

    q = torch.randn(1, 4, 33, 128).to(torch.bfloat16)
    k = torch.randn(1, 1, 40, 128).to(torch.bfloat16)
    program = export(Layer(), (q, k, k, 7), dynamic_shapes=(None, None, None, Dim.DYNAMIC),
                     strict=False)
    ops = [n for n in program.graph.nodes if n.op == "call_function" and "specgen" in str(n.target)]
    assert len(ops) == 1 and isinstance(ops[0].args[4], torch.fx.Node)  # q_offset stays symbolic
    graph = make_fx(Layer(), tracing_mode="symbolic")(q, k, k, 7)
    assert any(str(n.target).startswith(train.OP_NAME.replace("::", ".")) for n in graph.graph.nodes)


def test_training_op_backward_traces_under_fake_tensors():
    """The backward is its own op (specgen::<name>_backward) with a fake impl, so
    AOTAutograd can trace the gradient graph without launching a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    train = generated_module("fmha_train_gqa_causal")
    op = train._OP
    with FakeTensorMode():
        q = torch.empty(1, 4, 16, 128, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(1, 1, 16, 128, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(1, 1, 16, 128, dtype=torch.bfloat16, requires_grad=True)
        out, _ = op(q, k, v, 0.1, 0)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_decode_launch_plan_uses_pdl_where_the_spec_and_the_device_allow(monkeypatch):
    """Programmatic dependent launch: auto on sm_90 (where it was measured) at every
    size, true on every sm_90+ device, false never, and nothing before sm_90."""
    dec = generated_module("fmha_decode_gqa8_bf16")  # Hkv8 in these shapes, tile_n 128 on sm_90
    config = dec.CONFIGS["sm_90"][-1]
    device = torch.device("cuda", 0)
    monkeypatch.setitem(dec._DEVICE_CONFIGS, 0, (config, 132, 9))  # an H100/H200
    assert dec.PDL == "auto"
    assert dec.launch_plan(1, 8, 8192, device) == (config, 16, True)  # 4 key tiles per split
    assert dec.launch_plan(8, 8, 8192, device)[1:] == (2, True)  # 32 per split
    assert dec.launch_plan(64, 8, 64, device)[1:] == (1, True)  # one split, no combine
    monkeypatch.setattr(dec, "PDL", False)
    assert dec.launch_plan(1, 8, 8192, device)[1:] == (16, False)
    blackwell = (dec.CONFIGS["default"][-1], 148, 10)
    monkeypatch.setitem(dec._DEVICE_CONFIGS, 0, blackwell)
    monkeypatch.setattr(dec, "PDL", "auto")
    assert dec.launch_plan(1, 8, 8192, device)[2] is False  # not measured there
    monkeypatch.setattr(dec, "PDL", True)
    assert dec.launch_plan(1, 8, 8192, device)[2] is True
    monkeypatch.setitem(dec._DEVICE_CONFIGS, 0, (dec.CONFIGS["default"][-1], 108, 8))  # an A100
    assert dec.launch_plan(1, 8, 8192, device)[2] is False



def test_decode_float8_cache_module_checks_q_against_the_query_dtype(monkeypatch):
    """A kv_dtype float8_e4m3fn module keeps bf16 queries; a float8 q is refused
    before any launch (the cache checks need CUDA tensors: tests/test_gpu.py)."""
    dec = generated_module("fmha_decode_gqa8_fp8kv")
    monkeypatch.setattr(dec.ct, "launch", lambda *a, **k: pytest.fail("launched despite bad arguments"))
    assert dec.DTYPE == torch.bfloat16 and dec.KV_DTYPE == torch.float8_e4m3fn
    cache = torch.zeros(1, 64, 1, 128, dtype=torch.float8_e4m3fn)
    q = torch.zeros(1, 1, 8, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^q must be a 4-D torch.bfloat16 tensor with head_dim 128"):
        dec.attention(q, cache, cache, torch.ones(1, dtype=torch.int32))


def test_decode_float8_cache_aims_for_two_split_ctas_per_sm(monkeypatch):
    """auto splits: the float8-cache kernel aims for two CTAs per SM (the 16-bit one
    for one), still at least two key tiles per split and at most MAX_SPLITS."""
    for name, per_sm, want in (("fmha_decode_gqa8_fp8kv", 2, (32, 4, 1, 2)),
                               ("fmha_decode_gqa8_bf16", 1, (16, 2, 1, 2))):
        dec = generated_module(name)
        assert dec.SPLIT_CTAS_PER_SM == per_sm
        config = dec.CONFIGS["sm_90"][-1]
        monkeypatch.setitem(dec._DEVICE_CONFIGS, 0, (config, 132, 9))
        device = torch.device("cuda", 0)
        got = tuple(dec.launch_plan(b, 8, length, device)[1]
                    for b, length in ((1, 8192), (8, 8192), (64, 4096), (1, 512)))
        assert got == want, name


@pytest.mark.parametrize("q_offset", [-1, -100, -(2**30)])
def test_a_negative_q_offset_reaches_the_launch(q_offset, monkeypatch):
    """FlashAttention's bottom-right alignment for Sq > Skv: q_offset = Skv - Sq < 0 is
    accepted and passed to the kernel as is (the CPU stops at the device check, so the
    launch is reached through a CUDA-looking stand-in)."""
    launched = []

    def record(stream, grid, kernel, args, **kw):
        launched.append(args)

    q, k = _t(1, 8, 40, 128), _t(1, 2, 16, 128)
    monkeypatch.setattr(mod.ct, "launch", record)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(mod, "_stream", lambda device: 0)
    monkeypatch.setattr(mod.torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(mod.torch.cuda, "current_device", lambda: 0)
    mod.attention(q, k, k, q_offset=q_offset)
    assert launched, "not launched"
    ints = [a for a in launched[0] if type(a) is int]
    assert q_offset in ints, ints


def test_varlen_under_compile_without_max_seqlen_names_the_argument():
    """torch.compile(fullgraph=True) of a varlen training call (its custom op) without
    max_seqlen_q failed deep in torch ("Could not guard on data-dependent
    expression"); the call now says which argument to pass. With max_seqlen given it
    compiles (the kernels emulated)."""
    from specgen.check import emulate

    from .helpers import render_spec_data

    data = {"name": "launcher_varlen_train", "dtype": "bfloat16", "head_dim": 32, "gqa_ratio": 2,
            "causal": True, "varlen": True, "backward": True,
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    plan, source = render_spec_data(data, formatted=False)
    module = emulate.load_module(ROOT / "generated" / f"{plan.module_name}.py", source=source,
                                 name="_varlen_compile")
    d, ratio = module.SPEC["head_dim"], module.SPEC["gqa_ratio"]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q = torch.randn(12, ratio, d).to(torch.bfloat16)
    k = torch.randn(12, 1, d).to(torch.bfloat16)

    def call(q, k, v, cu):
        return module.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)

    def call_with_max(q, k, v, cu):
        return module.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7,
                                max_seqlen_k=7)

    torch._dynamo.reset()
    with emulate.emulating():
        with pytest.raises(Exception, match="max_seqlen_q must be given under torch.compile"):
            torch.compile(call, fullgraph=True, backend="eager")(q, k, k, cu)
        compiled = torch.compile(call_with_max, fullgraph=True, backend="eager")(q, k, k, cu)
        # Without fullgraph the refusal is a graph break: the call runs (docs/features.md).
        broken = torch.compile(call, backend="eager")(q, k, k, cu)
        eager = call(q, k, k, cu)
    want = eager[0] if isinstance(eager, tuple) else eager
    for result in (compiled, broken):
        assert torch.equal(result[0] if isinstance(result, tuple) else result, want)

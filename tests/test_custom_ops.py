"""The custom ops of the forward-only modules (prefill without a backward, and
decode): what torch.compile, make_fx and torch.export record in their place. Run
on the CPU with the kernels emulated; the GPU tests compile them with inductor."""

import pytest
import torch

from specgen.check import emulate
from specgen.check.cases import (
    feature_inputs,
    random_decode,
    random_packed,
    random_qkv,
    shape_dims,
)
from specgen.check.runner import Case, run_case

from .helpers import ROOT, emulated_module, same_tensors

SPEC_NAMES = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))
INFERENCE_NAMES = [n for n in SPEC_NAMES if not n.startswith("fmha_train")]


def _module(name: str):
    module = emulated_module(name, "ops")
    assert not module.SPEC.get("backward"), name  # the training modules' op is tested elsewhere
    return module


class _Counted:
    """An op that counts its calls."""

    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


def _case(spec: dict) -> Case:
    if spec["family"] == "decode":
        q_len = spec.get("max_q_len", 1)
        return Case(3, 2, q_len, 0, decode_lens=(17, q_len, 300))
    if spec["varlen"]:
        return Case(2, 2, 0, 0, lengths=((5, 300), (130, 200)))
    return Case(2, 2, 150, 257, 107, "transposed")


def _inputs(module, generator):
    """(args, kwargs) of one call of ``module.attention``, with its extra inputs."""
    spec = module.SPEC
    case = _case(spec)
    if case.decode_lens:
        batch = random_decode(spec, list(case.decode_lens), case.kv_heads, case.seq_q, generator,
                              device="cpu")
        return batch.args(), feature_inputs(spec, batch.dims(), generator, device="cpu")
    if case.lengths:
        batch = random_packed(spec, list(case.lengths), case.kv_heads, generator, device="cpu")
        extra = feature_inputs(spec, {"batch": len(case.lengths), "heads": batch.q.shape[1],
                                      "kv_heads": case.kv_heads}, generator, device="cpu")
        return (batch.q, batch.k, batch.v), dict(batch.kwargs(), **extra)
    q, k, v = random_qkv(spec, case.batch, case.kv_heads, case.seq_q, case.seq_k,
                         generator=generator, layout=case.layout, device="cpu")
    extra = feature_inputs(spec, shape_dims(q, k), generator, device="cpu")
    return (q, k, v), dict(q_offset=case.q_offset, **extra)


def _with_map(module, args, kwargs) -> None:
    """A block map for the call, built once as a caller would (a module with maps)."""
    if not hasattr(module, "make_block_map"):
        return
    tensors = {n: kwargs[n] for n in module.SPEC.get("tensors") or {}}
    with emulate.emulating():
        if module.SPEC["family"] == "decode":
            q, k_cache, _, seq_lens = args[:4]
            kwargs["block_map"] = module.make_block_map(seq_lens, q.shape[2], k_cache.shape[1],
                                                        q_len=q.shape[1], **tensors)
        else:
            q, k = args[0], args[1]
            kwargs["block_map"] = module.make_block_map(q.shape[0], q.shape[1], q.shape[2],
                                                        k.shape[2], q_offset=kwargs["q_offset"],
                                                        device="cpu", **tensors)


@pytest.mark.parametrize("name", INFERENCE_NAMES)
def test_every_forward_only_module_runs_through_its_ops(name, monkeypatch):
    """A call that takes the ops (as under a tracer) checks out against the fp64
    reference (the runner writes into out=, the _out op), and a call without out=
    gives the eager path's bits, shape and strides."""
    module = _module(name)
    monkeypatch.setattr(module, "_eager", lambda values: False)
    op, out_op = _Counted(module._OP), _Counted(module._OUT_OP)
    monkeypatch.setattr(module, "_OP", op)
    monkeypatch.setattr(module, "_OUT_OP", out_op)
    with emulate.emulating():
        row = run_case(torch, module, _case(module.SPEC), torch.Generator().manual_seed(5),
                       device="cpu")
        assert row["ok"], row
        assert (op.calls, out_op.calls) == (0, 1)
        args, kwargs = _inputs(module, torch.Generator().manual_seed(6))
        traced = module.attention(*args, **kwargs)
        assert (op.calls, out_op.calls) == (1, 1)
        eager = module._forward(*args, **kwargs)
    assert same_tensors(traced, eager)


# One module of each kind of argument the ops carry: positions, float8 descales
# (numbers and tensors), varlen with its LSE, sinks, hook tensors and block maps,
# dropout, a paged cache.
OPCHECKED = ["fmha_gqa8_bf16", "fmha_fp8_llama", "fmha_varlen_llama", "fmha_gptoss_sinks",
             "fmha_document_mask", "fmha_vit_dropout", "fmha_decode_gqa8_fp8kv",
             "fmha_decode_paged_mtp", "fmha_decode_chunked_local"]


def _op_args(module, args, kwargs):
    """The op's own arguments for attention(*args, **kwargs), as attention() forms
    them (caught on their way to the op)."""
    seen = {}

    def catch(*op_args):
        seen["args"] = op_args
        return module._forward(*args, **kwargs)

    original = module._eager, module._OP
    module._eager, module._OP = (lambda values: False), catch
    try:
        module.attention(*args, **kwargs)
    finally:
        module._eager, module._OP = original
    return seen["args"]


@pytest.mark.parametrize("name", OPCHECKED)
def test_the_ops_pass_torch_library_opcheck(name):
    """torch.library.opcheck: the schema, the fake against the real outputs (shapes,
    strides, dtypes), and AOTAutograd with dynamic shapes, for both ops. float8
    skips test_schema, whose check compares float8 tensors with an op that the CPU
    lacks for them."""
    module = _module(name)
    args, kwargs = _inputs(module, torch.Generator().manual_seed(7))
    _with_map(module, args, kwargs)
    fp8 = "float8_e4m3fn" in (module.SPEC["dtype"], module.SPEC.get("kv_dtype"))
    if fp8:  # one descale as a tensor, the others numbers
        first = "q_descale" if "q_descale" in kwargs else "k_descale"
        kwargs[first] = torch.tensor([kwargs[first]])
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    with emulate.emulating():
        op_args = _op_args(module, args, kwargs)
        want = tests if fp8 else ("test_schema", *tests)
        result = torch.library.opcheck(module._OP, op_args, test_utils=want)
        assert set(result.values()) == {"SUCCESS"}, result
        eager = module._forward(*args, **kwargs)
        out = torch.empty_like(eager[0] if isinstance(eager, tuple) else eager)
        result = torch.library.opcheck(module._OUT_OP, (out, *op_args), test_utils=want)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("name", ["fmha_gqa4_f16_d64", "fmha_fp8_llama", "fmha_varlen_llama",
                                  "fmha_document_mask", "fmha_decode_gqa8_fp8kv",
                                  "fmha_decode_paged_mtp"])
def test_forward_only_modules_compile_without_a_graph_break(name):
    """torch.compile(fullgraph=True) traces attention() whole, with and without out=,
    and the compiled calls give the eager bits."""
    module = _module(name)
    args, kwargs = _inputs(module, torch.Generator().manual_seed(8))
    if name == "fmha_varlen_llama":  # under torch.compile the lengths must be given
        kwargs.update(max_seqlen_q=130, max_seqlen_k=300)
    _with_map(module, args, kwargs)
    if name == "fmha_decode_gqa8_fp8kv":
        kwargs["v_descale"] = torch.tensor([kwargs["v_descale"]])

    def call(*args):
        return module.attention(*args, **kwargs)

    def call_out(out, *args):
        result = module.attention(*args, out=out, **kwargs)
        return result[0] if isinstance(result, tuple) else result

    torch._dynamo.reset()
    with emulate.emulating():
        eager = module._forward(*args, **kwargs)
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(*args)
        first = eager[0] if isinstance(eager, tuple) else eager
        out = torch.full_like(first, float("nan"))
        written = torch.compile(call_out, fullgraph=True, backend="aot_eager")(out, *args)
    assert same_tensors(compiled, eager)
    assert torch.equal(out, first) and written.data_ptr() == out.data_ptr()


def test_a_symbolic_position_goes_into_the_traced_graph():
    """make_fx with symbolic shapes records the op with q_offset as an input of the
    graph; the graph then runs for other offsets."""
    from torch.fx.experimental.proxy_tensor import make_fx

    module = _module("fmha_gqa_causal")
    (q, k, v), _ = _inputs(module, torch.Generator().manual_seed(9))
    with emulate.emulating():
        graph = make_fx(lambda q, k, v, off: module.attention(q, k, v, q_offset=off),
                        tracing_mode="symbolic")(q, k, v, 7)
        targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
        assert any(module.OP_NAME.replace("::", ".") in t for t in targets), targets
        for offset in (7, 100, -20):
            assert torch.equal(graph(q, k, v, offset), module.attention(q, k, v, q_offset=offset))


@pytest.mark.parametrize("name", ["fmha_gqa8_bf16", "fmha_fp8_llama", "fmha_decode_gqa8_fp8kv"])
def test_traced_calls_refuse_what_the_ops_schema_cannot_carry(name):
    """Under a tracer attention() checks the arguments that the op's schema types
    (a float scale, int positions, descales as numbers or tensors, tensors) and
    refuses them with the eager call's ValueError, not the dispatcher's error."""
    from torch.fx.experimental.proxy_tensor import make_fx

    module = _module(name)
    args, kwargs = _inputs(module, torch.Generator().manual_seed(10))
    bad = [({"scale": "0.1"}, "scale must be a positive float"),
           ({"out": [1]}, "out must be a torch.Tensor or None")]
    if module.SPEC["family"] == "prefill":
        bad += [({"q_offset": 1.5}, "q_offset must be an int")]
    else:
        bad += [({"max_seq_len": 0}, "max_seq_len must be a positive int")]
    descale = "q_descale" if "q_descale" in kwargs else "k_descale" if "k_descale" in kwargs else None
    if descale:
        bad += [({descale: -1.0}, f"{descale} must be a positive float")]
    for change, message in bad:
        with emulate.emulating(), pytest.raises(ValueError, match=message):
            make_fx(lambda *a: module.attention(*a, **dict(kwargs, **change)))(*args)
    with emulate.emulating(), pytest.raises(ValueError, match="must be a torch.Tensor"):
        make_fx(lambda q: module.attention(q, [1], *args[2:], **kwargs))(args[0])


@pytest.mark.parametrize("name", ["fmha_fp8_llama", "fmha_decode_gqa8_fp8kv", "fmha_decode_paged_mtp"])
def test_calls_through_the_ops_keep_no_buffers(name, monkeypatch):
    """A call through the ops keeps no tensor past its return (no split workspace, no
    descale made of numbers): torch.compile's reduce-overhead mode runs compiled code
    in a CUDA graph's memory pool, which must hold nothing but the graph's outputs
    (it raised "Detected 2 tensor(s) in the cudagraph pool not tracked as
    outputs"). An eager call keeps them for the next."""
    module = _module(name)
    caches = [getattr(module, n) for n in ("_WORKSPACES", "_WORKSPACE_BUFFERS", "_DESCALES")
              if hasattr(module, n)]
    args, kwargs = _inputs(module, torch.Generator().manual_seed(11))
    with emulate.emulating():
        with monkeypatch.context() as patch:
            patch.setattr(module, "_eager", lambda values: False)
            traced = module.attention(*args, **kwargs)
        assert not any(caches), caches
        eager = module.attention(*args, **kwargs)
    assert any(caches) and same_tensors(traced, eager)


@pytest.mark.parametrize("name", ["fmha_document_mask", "fmha_decode_chunked_local"])
def test_a_compiled_call_refuses_a_map_whose_sources_were_written(name):
    """A block map carries its sources (the tensors it was built from) through the
    ops: a compiled call with a map built before its tensors were written in place
    is refused when the compiled code runs, as an eager call is (the op's arguments
    held only the map's tensors and sizes, so a stale map gave wrong outputs)."""
    module = _module(name)
    args, kwargs = _inputs(module, torch.Generator().manual_seed(12))
    _with_map(module, args, kwargs)
    source = args[3] if module.SPEC["family"] == "decode" else kwargs["doc"]

    def call(*args):
        return module.attention(*args, **kwargs)

    torch._dynamo.reset()
    with emulate.emulating():
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        assert same_tensors(compiled(*args), module._forward(*args, **kwargs))
        source.add_(0)  # written in place: the map may list the wrong tiles
        with pytest.raises(ValueError, match="was written after block_map was built"):
            module.attention(*args, **kwargs)
        with pytest.raises(ValueError, match="was written after block_map was built"):
            compiled(*args)


def test_a_traced_varlen_call_without_max_seqlen_is_refused():
    """make_fx on real tensors read the longest lengths from cu_seqlens and kept them
    in the graph as constants: the graph then ran a batch with a longer sequence on
    too few query tiles (rows left unwritten). Under any tracer the lengths must be
    given."""
    from torch.fx.experimental.proxy_tensor import make_fx

    module = _module("fmha_varlen_llama")
    (q, k, v), kwargs = _inputs(module, torch.Generator().manual_seed(13))
    cu_q, cu_k = kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"]

    def call(q, k, v, cu_q, cu_k):
        return module.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

    for mode in ("real", "fake"):
        with emulate.emulating(), pytest.raises(ValueError, match="max_seqlen_q must be given"):
            make_fx(call, tracing_mode=mode)(q, k, v, cu_q, cu_k)


def test_a_block_map_under_fake_tracers_is_recorded():
    """make_fx (fake, symbolic) and a FakeTensorMode record a call with a block map:
    the traced branch does not read the fake tensors' data pointers (make_fx raised
    "Cannot access data pointer", a FakeTensorMode a false "built from another doc
    tensor"); the graph gives the eager bits."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    module = _module("fmha_document_mask")
    args, kwargs = _inputs(module, torch.Generator().manual_seed(12))
    _with_map(module, args, kwargs)
    with emulate.emulating():
        eager = module.attention(*args, **kwargs)
        for mode in ("fake", "symbolic"):
            graph = make_fx(lambda *a: module.attention(*a, **kwargs), tracing_mode=mode,
                            _allow_non_fake_inputs=True)(*args)
            assert same_tensors(graph(*args), eager)
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            fakes = [fake.from_tensor(t) for t in args]
            doc = fake.from_tensor(kwargs["doc"])
            out = module.attention(*fakes, **dict(kwargs, doc=doc))
        assert out.shape == eager.shape and out.stride() == eager.stride()
    decode = _module("fmha_decode_chunked_local")
    args, kwargs = _inputs(decode, torch.Generator().manual_seed(13))
    _with_map(decode, args, kwargs)
    with emulate.emulating():
        graph = make_fx(lambda *a: decode.attention(*a, **kwargs), tracing_mode="fake",
                        _allow_non_fake_inputs=True)(*args)
        assert same_tensors(graph(*args), decode.attention(*args, **kwargs))


@pytest.mark.parametrize("name", ["fmha_gqa8_bf16", "fmha_decode_gqa8_bf16"])
def test_vmap_takes_the_op(name):
    """torch.func.vmap's tensors hold no memory of their own: the call takes the op,
    which vmap runs once per batch entry (the launcher was handed them and failed)."""
    module = _module(name)
    generator = torch.Generator().manual_seed(16)
    calls = [_inputs(module, generator) for _ in range(2)]
    kwargs = calls[0][1]
    stacked = [torch.stack(ts) for ts in zip(*(args for args, _ in calls), strict=True)]
    with emulate.emulating():
        batched = torch.func.vmap(lambda *a: module.attention(*a, **kwargs))(*stacked)
        for i, (args, _) in enumerate(calls):
            assert torch.equal(batched[i], module.attention(*args, **kwargs))


@pytest.mark.parametrize("name", ["fmha_gqa8_bf16", "fmha_decode_gqa8_bf16"])
def test_a_tensor_subclass_given_only_as_out_takes_the_op(name, monkeypatch):
    """A subclass dispatches the op itself, wherever it is among the call's tensors:
    out= too, not only q, k and v."""
    module = _module(name)
    out_op = _Counted(module._OUT_OP)
    monkeypatch.setattr(module, "_OUT_OP", out_op)
    args, kwargs = _inputs(module, torch.Generator().manual_seed(17))

    class Marked(torch.Tensor):
        pass

    with emulate.emulating():
        want = module.attention(*args, **kwargs)
        assert out_op.calls == 0
        out = torch.empty_like(want).as_subclass(Marked)
        module.attention(*args, out=out, **kwargs)
    assert out_op.calls == 1 and torch.equal(out.as_subclass(torch.Tensor), want)


@pytest.mark.parametrize("name", ["fmha_varlen_llama", "fmha_decode_gqa8_bf16", "fmha_vit_dropout"])
def test_ints_computed_in_the_compiled_code_reach_the_op(name, monkeypatch):
    """An int argument that the compiled code computes from a tensor (.item() with
    capture_scalar_outputs: an unbacked SymInt, whose value a range check cannot
    compare) goes to the op, which checks it when the code runs; the call gave
    "Could not guard on data-dependent expression u0 < 0"."""
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)
    module = _module(name)
    args, kwargs = _inputs(module, torch.Generator().manual_seed(18))
    if name == "fmha_varlen_llama":
        kwargs.pop("max_seqlen_q", None), kwargs.pop("max_seqlen_k", None)

        def call(*args):
            cu = kwargs["cu_seqlens_q"]
            longest = (cu[1:] - cu[:-1]).max().item()
            longest_k = (kwargs["cu_seqlens_k"][1:] - kwargs["cu_seqlens_k"][:-1]).max().item()
            return module.attention(*args, **dict(kwargs, max_seqlen_q=longest, max_seqlen_k=longest_k))
    elif name == "fmha_decode_gqa8_bf16":
        def call(*args):
            return module.attention(*args, max_seq_len=args[3].max().item(), **kwargs)
    else:
        seed = torch.tensor(kwargs.pop("seed"))

        def call(*args):
            return module.attention(*args, seed=seed.item(), **kwargs)

    torch._dynamo.reset()
    with emulate.emulating():
        want = call(*args)
        got = torch.compile(call, fullgraph=True, backend="aot_eager")(*args)
    assert same_tensors(got, want)

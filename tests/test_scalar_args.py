"""The types of the scalar arguments of every public call: an int argument takes what
operator.index takes (Python's ints, NumPy's integers), a float argument any real
number (Python's or NumPy's), and each reaches the launch as a plain int or float,
the same as the Python number's call; a bool, a float for an int, a 0-d tensor or a
string is a ValueError naming the argument. Emulated on the CPU: ct.launch records
each launch's arguments (no kernel runs), and one call under torch.compile runs the
kernels."""

import re
import types

import numpy as np
import pytest
import torch

from specgen.check import emulate
from specgen.check.cases import random_decode, random_packed, random_qkv, shape_dims, hook_tensors

from .helpers import emulated_module

_MODULES = {}


def _module(name):
    if name not in _MODULES:
        _MODULES[name] = emulated_module(name, "scalar_args")
    return _MODULES[name]


def _gen():
    return torch.Generator().manual_seed(0)


def _describe(value):
    """A launch argument as compared between calls: a tensor by its shape and dtype
    (the call's own buffers differ), anything else by its type and value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v) for v in value)
    return (type(value), value)


def _launches(mod, monkeypatch, call):
    """The (kernel, arguments) of every launch ``call`` makes, no kernel run."""
    made = []

    def launch(stream, grid, kernel, args, **kwargs):
        made.append((getattr(kernel, "_pyfunc", kernel).__name__, _describe(grid), _describe(args)))

    with monkeypatch.context() as patch, emulate.emulating():
        patch.setattr(mod.ct, "launch", launch)
        call()
    assert made, "the call launched nothing"
    return made


# name -> (a call taking the scalars as keywords, those scalars as Python numbers)
def _prefill(name, **scalars):
    mod = _module(name)
    q, k, v = random_qkv(mod.SPEC, 1, 1, 40, 48, generator=_gen(), device="cpu")
    extra = hook_tensors(mod.SPEC, shape_dims(q, k), generator=_gen(), device="cpu")
    if mod.SPEC.get("sinks"):
        extra["sinks"] = torch.zeros(q.shape[1])
    grads = bool(mod.SPEC.get("backward"))

    def call(**kw):
        qq, kk, vv = (t.clone().requires_grad_(grads) for t in (q, k, v))
        out = mod.attention(qq, kk, vv, **extra, **kw)
        if grads:
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        return out

    return mod, call, scalars


def _varlen(**scalars):
    mod = _module("fmha_varlen_llama")
    pk = random_packed(mod.SPEC, [(5, 30), (20, 20)], 1, generator=_gen(), device="cpu")
    kwargs = {"cu_seqlens_q": pk.cu_seqlens_q, "cu_seqlens_k": pk.cu_seqlens_k}
    return mod, lambda **kw: mod.attention(pk.q, pk.k, pk.v, **kwargs, **kw), scalars


def _decode(name, **scalars):
    mod = _module(name)
    batch = random_decode(mod.SPEC, [17, 40], 1, mod.SPEC.get("max_q_len", 1), generator=_gen(), device="cpu")
    return mod, lambda **kw: mod.attention(*batch.args(), **kw), scalars


CALLS = {
    "prefill": lambda: _prefill("fmha_gqa_causal", q_offset=8, scale=0.125),
    "training": lambda: _prefill("fmha_train_gqa_causal", q_offset=8, scale=0.125),
    "dropout": lambda: _prefill("fmha_vit_dropout", q_offset=-3, scale=0.125, dropout_p=0.25, seed=7),
    "float8": lambda: _prefill("fmha_fp8_llama", q_offset=8, scale=0.125, q_descale=0.5, k_descale=2,
                               v_descale=1.5),
    "varlen": lambda: _varlen(max_seqlen_q=20, max_seqlen_k=30, q_shift=2, scale=0.125),
    "decode": lambda: _decode("fmha_decode_gqa8_fp8kv", max_seq_len=40, scale=0.125, k_descale=0.5,
                              v_descale=2.0),
    "paged_decode": lambda: _decode("fmha_decode_mha_paged_f16", max_seq_len=40, scale=0.125),
}
INTS = {"q_offset", "q_shift", "max_seqlen_q", "max_seqlen_k", "max_seq_len", "seed"}


def _numpy(name, value):
    """The NumPy scalar a caller would pass: positions read from an int64 array,
    floats from a float32 one."""
    return np.int64(value) if name in INTS else np.float32(value)


@pytest.mark.parametrize("what", sorted(CALLS))
def test_numpy_scalars_launch_as_the_python_numbers(what, monkeypatch):
    """np.int64 positions were refused ("q_offset must be an int, got np.int64(8)",
    max_seqlen, q_shift, max_seq_len, seed alike); now every scalar taken as a NumPy
    scalar launches with the arguments, plain ints and floats, of the Python call."""
    mod, call, scalars = CALLS[what]()
    want = _launches(mod, monkeypatch, lambda: call(**scalars))
    numpy = {n: _numpy(n, v) for n, v in scalars.items()}
    assert _launches(mod, monkeypatch, lambda: call(**numpy)) == want
    for name in scalars:  # one at a time too, and NumPy's other widths
        other = (np.int32 if name in INTS else np.float64)(scalars[name])
        assert _launches(mod, monkeypatch, lambda: call(**dict(scalars, **{name: other}))) == want, name


_BAD_INTS = [True, np.True_, 8.0, np.float64(8.0), torch.tensor(8), "8", None]


@pytest.mark.parametrize("what", sorted(CALLS))
def test_scalars_of_another_kind_are_refused_by_name(what, monkeypatch):
    """A bool (True is no position), a float for an int, a 0-d tensor or a string:
    a ValueError naming the argument and the value, before any launch."""
    mod, call, scalars = CALLS[what]()

    def refused(name, value):
        def launch(*args, **kwargs):
            raise AssertionError(f"{name}={value!r} reached a launch")

        with monkeypatch.context() as patch, emulate.emulating():
            patch.setattr(mod.ct, "launch", launch)
            with pytest.raises(ValueError, match=f"^{name} must be .*, got "):
                call(**dict(scalars, **{name: value}))

    for name in scalars:
        if name in INTS:
            for bad in _BAD_INTS:
                if bad is None and name in ("max_seqlen_q", "max_seqlen_k", "max_seq_len"):
                    continue  # None: read from the tensors
                refused(name, bad)
        else:
            for bad in (True, np.True_, "0.5", float("nan"), np.float32("nan"), torch.zeros(2)):
                refused(name, bad)


def test_block_maps_take_numpy_sizes(monkeypatch):
    """make_block_map's sizes and q_offset as NumPy ints (refused before: "batch must
    be a non-negative int, got np.int64(1)"), the map then used with a NumPy q_offset;
    bools and floats are refused by name."""
    mod = _module("fmha_document_mask")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 40, 48, generator=_gen(), device="cpu")
    doc = hook_tensors(mod.SPEC, shape_dims(q, k), generator=_gen(), device="cpu")["doc"]
    sizes = {"batch": 1, "num_heads": q.shape[1], "seq_q": 40, "seq_k": 48, "q_offset": 8}

    def build(**kw):
        return mod.make_block_map(**kw, device="cpu", doc=doc)

    with emulate.emulating():
        want = build(**sizes)
        got = build(**{n: np.int64(v) for n, v in sizes.items()})
    assert torch.equal(got.counts, want.counts) and torch.equal(got.indices, want.indices)
    assert all(type(getattr(got, n)) is int for n in sizes)
    assert _launches(mod, monkeypatch, lambda: mod.attention(q, k, v, doc=doc, q_offset=np.int64(8), block_map=got)) \
        == _launches(mod, monkeypatch, lambda: mod.attention(q, k, v, doc=doc, q_offset=8, block_map=want))
    for name in sizes:
        for bad in (True, 1.0, torch.tensor(1)):
            with emulate.emulating(), pytest.raises(ValueError, match=f"^{name} must be .*int"):
                build(**dict(sizes, **{name: bad}))


def test_decode_sizes_take_numpy_ints():
    """launch_plan and the decode make_block_map take NumPy ints and return what the
    Python ints give; bools and floats are refused by name."""
    mod = _module("fmha_decode_chunked_local")
    cpu = torch.device("cpu")
    assert mod.launch_plan(np.int64(2), np.int32(1), np.int64(64), cpu) == mod.launch_plan(2, 1, 64, cpu)
    for args in ((True, 1, 64), (2, 1.0, 64), (2, 1, torch.tensor(64))):
        with pytest.raises(ValueError, match="must be an int >= "):
            mod.launch_plan(*args, cpu)
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    heads = batch.q.shape[2]
    with emulate.emulating():
        want = mod.make_block_map(batch.seq_lens, heads, batch.capacity, q_len=1)
        got = mod.make_block_map(batch.seq_lens, np.int64(heads), np.int64(batch.capacity), q_len=np.int64(1))
        assert torch.equal(got.counts, want.counts) and torch.equal(got.indices, want.indices)
        with pytest.raises(ValueError, match="q_len must be an int >= 1, got True"):
            mod.make_block_map(batch.seq_lens, heads, batch.capacity, q_len=True)


def test_numpy_scalars_under_torch_compile():
    """torch.compile(fullgraph=True) of a call with NumPy constants gives the eager
    bits of the Python numbers: Dynamo shows NumPy's scalars as arrays of its own, and
    a np.float64 scale raised Unsupported ("repr() on tensor") in the scale's check.
    (A np.float32 scale still fails there: Dynamo reads it as a value without a hint,
    which the range check cannot compare.)"""
    mod = _module("fmha_gqa_causal")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 40, 48, generator=_gen(), device="cpu")

    # Made outside the compiled code, as a caller's config holds them (an np.int64
    # made inside it is a traced tensor, whose int() Dynamo refuses for any code).
    q_offset, scale = np.int64(8), np.float64(0.125)

    def call(q, k, v):
        return mod.attention(q, k, v, q_offset=q_offset, scale=scale)

    torch._dynamo.reset()
    with emulate.emulating():
        want = mod.attention(q, k, v, q_offset=8, scale=0.125)
        got = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(got, want)


def test_context_parallel_takes_numpy_scalars():
    """ContextParallelAttention's seq_len, max_seqlen and scale as NumPy scalars
    (np.int64 and np.float32 were refused, np.float64 taken); bools, floats for ints,
    tensors and strings are refused."""
    from specgen.parallel import ContextParallelAttention
    from specgen.parallel.kernels import ReferenceKernel

    for varlen in (False, True):
        attn = ContextParallelAttention(ReferenceKernel(causal=True, dtype=torch.float32, head_dim=16,
                                                        varlen=varlen))
        if varlen:
            q = torch.randn(12, 2, 16, generator=_gen())
            base, name = {"cu_seqlens": torch.tensor([0, 5, 12], dtype=torch.int32), "max_seqlen": 7}, "max_seqlen"
        else:
            q = torch.randn(1, 2, 12, 16, generator=_gen())
            base, name = {"seq_len": 12}, "seq_len"
        want = attn(q, q, q, **base, scale=0.25)
        got = attn(q, q, q, **dict(base, **{name: np.int64(base[name])}), scale=np.float32(0.25))
        assert torch.equal(got, want)
        for bad in (True, float(base[name]), torch.tensor(base[name]), str(base[name])):
            with pytest.raises(ValueError, match=f"{name} must be "):
                attn(q, q, q, **dict(base, **{name: bad}))
        for bad in (True, np.True_, "0.25"):
            with pytest.raises(ValueError, match="scale must be a positive float or None"):
                attn(q, q, q, **base, scale=bad)


def test_transformers_backend_checks_scaling_and_dropout():
    """The layer's scaling and dropout: NumPy floats are taken as floats; a bool or a
    string (float() took True as 1.0 and "0.5" as 0.5) is refused, naming the layer's
    argument."""
    pytest.importorskip("transformers")
    from specgen.integrations import transformers as tf_integration

    calls = []
    spec = {"name": "stand_in", "family": "prefill", "dtype": "float32", "head_dim": 32, "gqa_ratio": 2,
            "causal": True, "window": None, "softcap": None, "sinks": False, "dropout": False,
            "varlen": False, "tensors": {}, "return_lse": False, "backward": False}

    def attention(q, k, v, *, scale=None, q_offset=0, out=None, **extra):
        calls.append((scale, q_offset))
        return out

    module = types.ModuleType("stand_in")
    module.SPEC, module.attention = spec, attention
    function = tf_integration.make_attention_function(module)
    layer = types.SimpleNamespace(is_causal=True)
    q, kv = torch.zeros(1, 4, 8, 32), torch.zeros(1, 2, 8, 32)
    function(layer, q, kv, kv, None, scaling=np.float32(0.25), dropout=np.float64(0.0))
    assert calls == [(0.25, 0)] and type(calls[0][0]) is float
    for kwargs, message in (({"scaling": True}, "the layer's scaling must be a float, got True"),
                            ({"scaling": "0.5"}, "the layer's scaling must be a float, got '0.5'"),
                            ({"dropout": "0.1"}, "the layer's dropout must be a float, got '0.1'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            function(layer, q, kv, kv, None, **kwargs)
    assert len(calls) == 1

"""Tensors whose shapes or strides pass int32: the kernels' int64-indexed twins.

cuTile passes an array's shapes and strides as int32 and refuses one past int32 at
launch with an OverflowError ("stride is too big"), before it launches anything. The
generated launcher then launches the kernel's twin whose array parameters are
ct.IndexedWithInt64. These CPU tests check the twin, the fallback, and that the
twins compile; tests/test_gpu_large.py runs them on the GPU.
"""

import io

import cuda.tile as ct
import pytest
import torch
import yaml

from .helpers import ROOT, emulated_module, generated_module, launch_grids, render_spec_data


def _kernel(mod_name, kernel_attr=None):
    mod = generated_module(mod_name)
    if kernel_attr is None:
        kernel_attr = next(n for n, v in vars(mod).items() if isinstance(v, mod.AotKernel))
    return mod, getattr(mod, kernel_attr)


def test_twin_indexes_every_array_in_int64_and_keeps_the_rest():
    mod, kernel = _kernel("fmha_gqa8_bf16", "fmha_prefill_causal_gqa8_bf16_d128")
    twin = kernel.indexed_with_int64()
    assert isinstance(twin, mod.AotKernel) and twin is not kernel
    # Made once, and a twin's twin is itself.
    assert kernel.indexed_with_int64() is twin and twin.indexed_with_int64() is twin
    f, g = kernel._pyfunc, twin._pyfunc
    assert g.__code__ is f.__code__ and g.__name__ == f.__name__
    for name in ("Q", "K", "V", "Out"):
        assert name not in f.__annotations__
        assert g.__annotations__[name] is ct.IndexedWithInt64
    for name, annotation in f.__annotations__.items():
        assert g.__annotations__[name] is annotation  # scalars and constants as they were
    assert twin._compiler_options == kernel._compiler_options
    # cuTile reads the annotations: the twin's array parameters are int64-indexed.
    arrays = [node.array for node in twin._annotated_function.parameter_annotations[:4]]
    assert [a.index_dtype for a in arrays] == [ct.int64] * 4
    plain = [node.array for node in kernel._annotated_function.parameter_annotations[:4]]
    assert plain == [None] * 4
    # A kernel with other hints has a twin of its own, with those hints.
    other = kernel.replace_hints(occupancy=2)
    assert other.indexed_with_int64() is not twin
    assert other.indexed_with_int64()._compiler_options.occupancy == 2


def _launches(monkeypatch, refuse):
    """ct.launch recording (kernel, args), raising ``refuse`` for int32-indexed kernels."""
    calls = []

    def launch(stream, grid, kernel, args, **options):
        calls.append((kernel, args, options))
        int64 = kernel._annotated_function.parameter_annotations[0].array is not None
        if refuse is not None and not int64:
            raise refuse

    monkeypatch.setattr(ct, "launch", launch)
    return calls


def test_launcher_takes_the_twin_where_cutile_refuses_an_int32_stride(monkeypatch):
    mod, kernel = _kernel("fmha_gqa8_bf16", "fmha_prefill_causal_gqa8_bf16_d128")
    calls = _launches(monkeypatch, OverflowError("stride is too big"))
    args = ("q", "k", "v", "out", 0.1, 0, 64, 64, True, False)
    mod._launch(torch.device("cuda"), (1, 1, 1), kernel, args, stream=0, extra=1)
    assert [c[0] for c in calls] == [kernel, kernel.indexed_with_int64()]
    assert calls[1][1] is args and calls[1][2] == {"extra": 1}


@pytest.mark.parametrize("error", [OverflowError("Python int too large to convert to C long"),
                                   ValueError("stride is too big")])
def test_launcher_passes_other_errors_on(monkeypatch, error):
    mod, kernel = _kernel("fmha_gqa8_bf16", "fmha_prefill_causal_gqa8_bf16_d128")
    calls = _launches(monkeypatch, error)
    with pytest.raises(type(error), match=str(error)):
        mod._launch(torch.device("cuda"), (1, 1, 1), kernel, (), stream=0)
    assert len(calls) == 1


def test_launcher_raises_cutiles_error_for_a_kernel_without_a_twin(monkeypatch):
    mod, _ = _kernel("fmha_gqa8_bf16")

    @ct.kernel
    def plain(X):
        pass

    calls = _launches(monkeypatch, OverflowError("shape is too big"))
    with pytest.raises(OverflowError, match="shape is too big"):
        mod._launch(torch.device("cuda"), (1,), plain, (), stream=0)
    assert len(calls) == 1


@pytest.mark.parametrize("spec, kernel_index", [("fmha_varlen_llama", 0), ("fmha_decode_gqa8_bf16", 1)],
                         ids=["varlen-prefill", "decode-combine"])
def test_twins_compile_for_sm_90(spec, kernel_index):
    """The twin is a kernel cuTile compiles: int64 signatures of the module's own."""
    from cuda.tile.compilation import export_kernel

    from specgen.compile.export import (int64_signatures, kernel_builds, load_module_from_source, signatures,
                                        target_configs)

    plan, source = render_spec_data(yaml.safe_load((ROOT / "specs" / f"{spec}.yaml").read_text()),
                                    f"specs/{spec}.yaml")
    mod = load_module_from_source(plan.module_name, source, f"{ROOT}/generated/_twin_{spec}.py")
    config = target_configs(plan, "sm_90")[0]
    name, sigs = kernel_builds(plan, config, "sm_90")[kernel_index]
    sigs = sigs or signatures(plan, "sm_90", config)

    buffer = io.BytesIO()
    export_kernel(getattr(mod, name).indexed_with_int64(), int64_signatures(sigs), buffer, gpu_code="sm_90",
                  output_format="cubin")
    assert buffer.getvalue()[:4] == b"\x7fELF"


def test_axes_of_one_take_a_stride_inside_int32():
    mod = generated_module("fmha_gqa8_bf16")
    big = 2**33
    # [1, S, H, D] seen as [1, H, S, D], batch stride past int32: the span of the
    # head dim (128) is the smallest stride that keeps the elements disjoint.
    q = torch.zeros(7, 4, 128).as_strided((1, 4, 7, 128), (big, 128, 512, 1))
    small = torch.zeros(2, 3)
    (view, same, number) = mod._int32_views((q, small, 1.5))
    assert view.stride() == (128, 128, 512, 1) and view.data_ptr() == q.data_ptr()
    assert same is small and number == 1.5
    # Every axis of one: stride 1 will do.
    (view,) = mod._int32_views((torch.zeros(1).as_strided((1, 1), (big, big)),))
    assert view.stride() == (1, 1)
    # A longer axis past int32, or nothing to change: None (the twin's case).
    wide = torch.empty_strided((2, 1), (big, 1), device="meta")  # metadata only
    assert mod._int32_views((wide,)) is None
    assert mod._int32_views((small, 3)) is None


def test_launcher_tries_views_before_the_twin(monkeypatch):
    mod, kernel = _kernel("fmha_gqa8_bf16", "fmha_prefill_causal_gqa8_bf16_d128")
    calls = []

    def launch(stream, grid, k, args, **options):
        calls.append((k, args))
        if max(args[0].stride()) > 2**31 - 1:
            raise OverflowError("stride is too big")

    monkeypatch.setattr(ct, "launch", launch)
    q = torch.zeros(7, 4, 128).as_strided((1, 4, 7, 128), (2**33, 128, 512, 1))
    mod._launch(torch.device("cuda"), (1,), kernel, (q, 2.0), stream=0)
    assert [c[0] for c in calls] == [kernel, kernel] and calls[1][1][0].stride(0) == 128
    assert calls[1][1][1] == 2.0


def _gapped(t, gap):
    """``t`` ([B, H, S, D] over [B, S, H, D] storage) copied into a view whose batch
    stride is ``gap`` elements past its dense one (a view into a larger buffer)."""
    b, h, s, d = t.shape
    stride0 = s * h * d + gap
    base = torch.full(((b - 1) * stride0 + s * h * d,), float("nan"), dtype=t.dtype)
    view = base.as_strided((b, s, h, d), (stride0, h * d, d, 1)).transpose(1, 2)
    view.copy_(t)
    return view


def _entry_calls(mod, monkeypatch, limit):
    """cuTile's int32 limit lowered to ``limit`` in ``mod``; the launches' grids."""
    monkeypatch.setattr(mod, "_INT32_MAX", limit)
    return launch_grids(mod, monkeypatch)


def test_entries_past_int32_tells_a_batch_stride_from_an_entrys():
    mod = generated_module("fmha_gqa8_bf16")
    big = 2**31
    dense = torch.empty(2, 3, 4, 8)
    assert not mod._entries_past_int32(dense, dense)
    past = torch.empty_strided((2, 3, 4, 8), (big, 32, 8, 1), device="meta")
    assert mod._entries_past_int32(dense, past, dense)
    # One entry: nothing to split (the launcher restrides its axis of one).
    assert not mod._entries_past_int32(torch.empty_strided((1, 3, 4, 8), (big, 32, 8, 1), device="meta"))
    # An entry's own stride past int32 on an axis longer than one: only the twin takes it.
    inner = torch.empty_strided((2, 3, 4, 8), (2 * big, big, 8, 1), device="meta")
    assert not mod._entries_past_int32(past, inner)
    assert mod._entries_past_int32(torch.empty_strided((2, 1, 4, 8), (2 * big, big, 8, 1), device="meta"))


@pytest.mark.parametrize("name", ["fmha_gqa8_bf16", "fmha_gemma_softcap"])
def test_forward_with_a_batch_stride_past_int32_runs_an_entry_per_launch(name, monkeypatch):
    """Emulated with the int32 limit lowered below the batch stride of a view into a
    larger buffer: one launch per entry, the bits of the whole call, no twin."""
    from specgen.check import emulate
    from specgen.check.cases import random_qkv

    mod = emulated_module(name, "entries")
    q, k, v = random_qkv(mod.SPEC, 3, 1, 40, 56, generator=torch.Generator().manual_seed(0), device="cpu")
    with emulate.emulating():
        whole = mod.attention(q, k, v)
        grids = _entry_calls(mod, monkeypatch, q[0].numel())
        mod.attention(q, k, v)  # dense: one launch
        got = mod.attention(_gapped(q, 64), k, v, out=_gapped(torch.zeros_like(whole), 64))
    (one, *entries) = grids
    assert len(entries) == 3 and all(g[0] * g[1] * 3 == one[0] * one[1] for g in entries)
    assert torch.equal(got, whole)
    kernels = [v for v in vars(mod).values() if isinstance(v, mod.AotKernel)]
    assert all(k.__dict__.get("_int64_twin") is None for k in kernels)


def test_training_with_a_batch_stride_past_int32_runs_an_entry_per_call(monkeypatch):
    from specgen.check import emulate
    from specgen.check.cases import random_qkv

    mod = emulated_module("fmha_train_gqa_causal", "entries")
    gen = torch.Generator().manual_seed(1)
    q, k, v = random_qkv(mod.SPEC, 3, 1, 40, 56, generator=gen, device="cpu")
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)

    def run(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = mod.attention(q, k, v)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    with emulate.emulating():
        whole = run(q, k, v)
        grids = _entry_calls(mod, monkeypatch, q[0].numel())
        sliced = run(_gapped(q, 32), _gapped(k, 32), _gapped(v, 32))
    # Forward: a launch per entry; backward: the dQ and dK/dV kernels per entry.
    assert len(grids) == 3 + 2 * 3
    for a, b in zip(sliced, whole, strict=True):
        assert torch.equal(a, b)


def test_dropout_with_drops_keeps_the_batch_whole(monkeypatch):
    """Dropout's mask is drawn per batch index, so a call with drops is not split:
    one launch (the twin takes it on a GPU)."""
    from specgen.check import emulate
    from specgen.check.cases import random_qkv

    mod = emulated_module("fmha_vit_dropout", "entries")
    q, k, v = random_qkv(mod.SPEC, 2, 1, 24, 24, generator=torch.Generator().manual_seed(2), device="cpu")
    with emulate.emulating():
        grids = _entry_calls(mod, monkeypatch, q[0].numel())
        mod.attention(_gapped(q, 16), k, v, dropout_p=0.25, seed=7)
        assert len(grids) == 1
        mod.attention(_gapped(q, 16), k, v, dropout_p=0.0)
        assert len(grids) == 3


def test_a_hook_that_reads_b_keeps_the_batch_whole(monkeypatch):
    """An entry launched on its own is b = 0 to its kernels: a hook that reads b
    (each entry's scores times b + 1) gave every entry the first's scores. Such a
    call is not split: one launch (the twin takes it on a GPU), the whole call's bits."""
    from specgen.check import emulate
    from specgen.check.cases import random_qkv

    from .helpers import emulated_spec_module, prefill_variant_data

    mod = emulated_spec_module(prefill_variant_data("b_hook_entries", {"score_mod": "score * (b + 1)"}),
                               "entries")
    q, k, v = random_qkv(mod.SPEC, 3, 1, 40, 56, generator=torch.Generator().manual_seed(3), device="cpu")
    with emulate.emulating():
        whole = mod.attention(q, k, v)
        grids = _entry_calls(mod, monkeypatch, q[0].numel())
        got = mod.attention(_gapped(q, 64), k, v)
    assert torch.equal(got, whole) and len(grids) == 1

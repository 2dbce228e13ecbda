"""Sizes past int32 and past the grid on the GPU (marked `gpu`): tensors of more
than 2**31 elements, strides past int32 that the kernels' int64-indexed twins take,
and batch × heads past the grid's y limit, run as slices of the batch.

Each test needs several GiB of GPU memory and skips where the device lacks it.
Only chosen entries (the last ones first) are compared with the fp64 reference:
an element offset that wrapped in int32 shows there.
"""

import pytest
import torch

from specgen.check.cases import compare, reference_for

from .helpers import generated_module, render_spec_data, trained_spec_data

pytestmark = pytest.mark.gpu

GIB = 2**30


def _need(gib):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    free = torch.cuda.mem_get_info()[0]
    if free < gib * GIB:
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / GIB:.0f} GiB free")


def _ok(mod, out, q, k, v, **kw):
    ref, _ = reference_for(mod.SPEC, q.double(), k.double(), v.double(), {}, **kw)
    result = compare(out, ref, mod.SPEC["dtype"])
    assert result.ok, result


def _grads_ok(mod, entry, take, q, k, v, out, dout, grads):
    """Output and dq, dk, dv of one entry, ``take(t)`` cutting it from each tensor,
    against fp64 autograd of the reference (FlashAttention's 2e-2 bfloat16 rule)."""
    q64, k64, v64 = (take(t.detach()).double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_for(mod.SPEC, q64, k64, v64, {})
    ref.backward(take(dout).double())
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, q64.grad, k64.grad, v64.grad)):
        got = take(got)
        err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-2)
        assert torch.isfinite(got).all() and err <= 2e-2, (entry, name, err)


def _decode_ok(mod, out, q, k_cache, v_cache, seq_lens, b):
    """Decode entry ``b`` (one query token, its seq_lens[b] keys) against the fp64 reference."""
    n = int(seq_lens[b])
    ref, _ = reference_for(mod.SPEC | {"causal": False}, q[b:b + 1].transpose(1, 2).double(),
                           k_cache[b:b + 1, :n].transpose(1, 2).double(),
                           v_cache[b:b + 1, :n].transpose(1, 2).double(), {})
    result = compare(out[b:b + 1].transpose(1, 2), ref, "bfloat16")
    assert result.ok, (b, result)


def _varlen(total, rows, hq, hkv, gen):
    q = torch.randn(total, hq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.arange(0, total + 1, rows, device="cuda", dtype=torch.int32)
    return q, k, v, cu


def _sequence(t, cu, b):
    return t[int(cu[b]):int(cu[b + 1])].transpose(0, 1)[None]


def test_varlen_prefill_with_more_than_2_31_elements_packed():
    """540,672 packed rows of 32 heads of 128: row 524,288 on starts past int32."""
    _need(14)
    mod = generated_module("fmha_varlen_llama")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = 2048
    q, k, v, cu = _varlen(264 * rows, rows, 32, 8, gen)
    assert q.numel() > 2**31
    out = mod.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=rows, max_seqlen_k=rows)
    out = out[0] if isinstance(out, tuple) else out  # return_lse: (out, lse)
    for b in (263, 262, 255, 0):
        _ok(mod, _sequence(out, cu, b), *(_sequence(t, cu, b) for t in (q, k, v)))


def test_varlen_backward_with_more_than_2_31_elements_packed():
    _need(30)
    from specgen.compile.export import load_module_from_source

    plan, source = render_spec_data(trained_spec_data("fmha_varlen_llama"))
    mod = load_module_from_source(plan.module_name, source, "large_varlen_trained.py")
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = 2048
    q, k, v, cu = _varlen(264 * rows, rows, 32, 8, gen)
    for t in (q, k, v):
        t.requires_grad_()
    out = mod.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=rows, max_seqlen_k=rows)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b in (263, 0):
        _grads_ok(mod, b, lambda t: _sequence(t, cu, b), q, k, v, out, dout, (dq, dk, dv))  # noqa: B023


def _view_past_int32(shape, stride0, dtype, gen):
    """A [B, S, H, D] tensor whose batch stride is ``stride0`` elements, as [B, H, S, D]."""
    b, s, h, d = shape
    base = torch.empty((b - 1) * stride0 + s * h * d, device="cuda", dtype=dtype)
    t = base.as_strided(shape, (stride0, h * d, d, 1))
    for i in range(b):
        t[i].copy_(torch.randn(s, h, d, device="cuda", generator=gen).to(dtype))
    return t


def _twins(mod):
    """How many of the module's kernels (and their configs' hint variants) have made
    their int64 twin."""
    kernels = [k for k in vars(mod).values() if isinstance(k, mod.AotKernel)]
    kernels += list(getattr(mod, "_KERNELS", {}).values())
    return sum(k.__dict__.get("_int64_twin") is not None for k in kernels)


def _take_path(mod, path, monkeypatch):
    """Send a batch stride past int32 down ``path`` ("entries": attention()'s one entry
    per launch; "twin": the int64 twin, as for a call that cannot be split). Returns
    a check, for after the call, that a twin was made on the twin's path only."""
    if path == "twin":
        monkeypatch.setattr(mod, "_entries_past_int32", lambda *tensors: False)
    before = _twins(mod)
    return lambda: (_twins(mod) > 0) if path == "twin" else (_twins(mod) == before)


@pytest.mark.parametrize("path", ["entries", "twin"])
def test_prefill_takes_a_batch_stride_past_int32(path, monkeypatch):
    """q and out views into a larger buffer, batch stride 2**31 + 2**20: an entry per
    launch through the int32 kernel, or (where a call cannot be split) the twin."""
    _need(10)
    mod = generated_module("fmha_gqa8_bf16")
    took_path = _take_path(mod, path, monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(2)
    stride0 = 2**31 + 2**20
    q = _view_past_int32((2, 1000, 32, 128), stride0, torch.bfloat16, gen).transpose(1, 2)
    out = _view_past_int32((2, 1000, 32, 128), stride0, torch.bfloat16, gen).transpose(1, 2)
    k, v = (torch.randn(2, 4, 1000, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in "kv")
    assert max(q.stride()) > 2**31 - 1
    got = mod.attention(q, k, v, out=out)
    assert got is out
    # The launcher took a twin (of the kernel or of the config's hint variant) only
    # where the call could not be split.
    assert took_path()
    for b in (1, 0):
        _ok(mod, out[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1])


def test_prefill_with_a_stride_past_int32_on_an_axis_of_one_keeps_the_int32_kernel():
    """B=1 with a batch stride past int32 (as q [1, 2**19, 32, 128] has): the axis of
    one takes another stride, no twin is made."""
    mod = generated_module("fmha_gqa8_bf16")
    gen = torch.Generator(device="cuda").manual_seed(5)

    def one(heads):
        t = torch.randn(1, 777, heads, 128, device="cuda", generator=gen).to(torch.bfloat16)
        return t.as_strided(t.shape, (2**33, heads * 128, 128, 1)).transpose(1, 2)

    q, k, v = one(32), one(4), one(4)
    twins = _twins(mod)
    out = mod.attention(q, k, v, out=one(32))
    assert _twins(mod) == twins
    _ok(mod, out, q, k, v)


def test_decode_takes_a_cache_batch_stride_past_int32():
    _need(12)
    mod = generated_module("fmha_decode_gqa8_bf16")
    gen = torch.Generator(device="cuda").manual_seed(3)
    stride0 = 2**31 + 2**12
    kc = _view_past_int32((2, 3000, 8, 128), stride0, torch.bfloat16, gen)
    vc = _view_past_int32((2, 3000, 8, 128), stride0, torch.bfloat16, gen)
    q = torch.randn(2, 1, 64, 128, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.tensor([3000, 1777], device="cuda", dtype=torch.int32)
    out = mod.attention(q, kc, vc, lens)
    for b in (1, 0):
        _decode_ok(mod, out, q, kc, vc, lens, b)


@pytest.mark.parametrize("path", ["entries", "twin"])
def test_backward_takes_a_batch_stride_past_int32(path, monkeypatch):
    _need(12)
    mod = generated_module("fmha_train_gqa_causal")
    took_path = _take_path(mod, path, monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(4)
    stride0 = 2**31 + 2**20
    q = _view_past_int32((2, 700, 32, 128), stride0, torch.bfloat16, gen).transpose(1, 2)
    q = q.detach().requires_grad_()
    k, v = (torch.randn(2, 8, 700, 128, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
            for _ in "kv")
    out = mod.attention(q, k, v)
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert took_path()
    for b in (1, 0):
        _grads_ok(mod, b, lambda t: t[b:b + 1], q, k, v, out, dout, (dq, dk, dv))  # noqa: B023


def test_a_global_tile_order_past_the_grid_y_limit_launches_head_by_head():
    """fmha_gqa8_bf16 takes its tile_order: global config (64-row tiles on the grid's
    y axis) up to seq_k 2048 on sm_90: 65,538 query tiles pass y, and launch head by
    head. The first rows (causal) and the last (every key) against fp64."""
    _need(24)
    mod = generated_module("fmha_gqa8_bf16")
    gen = torch.Generator(device="cuda").manual_seed(9)
    seq_q = 65538 * 64 - 20
    q = torch.randn(1, 8, seq_q, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, 1, 2048, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in "kv")
    out = mod.attention(q, k, v)
    for lo in (seq_q - 300, 0):
        rows = slice(lo, lo + 300)
        _ok(mod, out[:, :, rows], q[:, :, rows], k, v, q_offset=lo)


def test_vit_batch_past_the_grid_y_limit_runs_in_slices():
    """B 4096 × 16 heads = 65536 (CTA rows on y, limit 65535): two slices of the batch."""
    _need(8)
    mod = generated_module("fmha_vit_dropout")
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(4096, 197, 16, 64, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
               for _ in "qkv")
    out = mod.attention(q, k, v, dropout_p=0.0)
    for b in (4095, 4094, 0):
        _ok(mod, out[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1])


def test_training_batch_past_the_grid_y_limit_runs_in_slices():
    """B 2049 × 32 heads = 65568: forward and backward in two slices each."""
    _need(8)
    mod = generated_module("fmha_train_gqa_causal")
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2049, 64, 32, 128, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(2049, 64, 8, 128, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
            for _ in "kv")
    for t in (q, k, v):
        t.requires_grad_()
    out = mod.attention(q, k, v)
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b in (2048, 2046, 0):
        _grads_ok(mod, b, lambda t: t[b:b + 1], q, k, v, out, dout, (dq, dk, dv))  # noqa: B023


def test_sinks_training_batch_past_the_grid_y_limit_runs_in_slices():
    """B 1100 × 64 heads = 70400 (gpt-oss's heads): the backward in two slices, the
    sinks' gradient summed over them, against fp64 autograd of the whole batch."""
    _need(8)
    mod = generated_module("fmha_train_gptoss_sinks")
    gen = torch.Generator(device="cuda").manual_seed(12)
    dim = mod.HEAD_DIM
    q = torch.randn(1100, 64, 48, dim, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1100, 8, 48, dim, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
            for _ in "kv")
    sinks = torch.randn(64, device="cuda", generator=gen).requires_grad_()
    out = mod.attention(q, k, v, sinks=sinks)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref, _ = reference_for(mod.SPEC, *leaves[:3], {"sinks": leaves[3]})
    ref.backward(dout.double())
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads),
                               (ref, *(t.grad for t in leaves))):
        err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-2)
        assert torch.isfinite(got).all() and err <= 2e-2, (name, err)


def test_decode_batch_past_the_grid_y_limit_runs_in_slices():
    """B 8200 × 8 KV heads = 65600 (the split kernel's y): slices of 8176 and 24."""
    _need(8)
    mod = generated_module("fmha_decode_gqa8_bf16")
    gen = torch.Generator(device="cuda").manual_seed(8)
    kc, vc = (torch.randn(8200, 300, 8, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in "kv")
    q = torch.randn(8200, 1, 64, 128, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.randint(1, 301, (8200,), device="cuda", generator=gen, dtype=torch.int32)
    out = mod.attention(q, kc, vc, lens)
    for b in (8199, 8176, 8175, 0):
        _decode_ok(mod, out, q, kc, vc, lens, b)


def test_packed_sequences_past_the_grid_y_limit_launch_in_slices():
    """2049 sequences × 32 heads = 65568 CTA rows: launches over slices of cu_seqlens."""
    _need(4)
    mod = generated_module("fmha_varlen_llama")
    gen = torch.Generator(device="cuda").manual_seed(9)
    lengths = torch.randint(1, 97, (2049,), generator=torch.Generator().manual_seed(9))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
    total = int(cu[-1])
    q = torch.randn(total, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(total, 8, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in "kv")
    out, _ = mod.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=96, max_seqlen_k=96)
    for b in (2048, 2047, 2046, 0):
        _ok(mod, _sequence(out, cu, b), *(_sequence(t, cu, b) for t in (q, k, v)))

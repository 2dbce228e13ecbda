"""Tensors past 2**31 elements: are the generated kernels' addresses right?

cuTile passes an array's shape and strides as int32 unless the kernel's parameter is
annotated ct.IndexedWithInt64; a shape or stride past int32 is refused at launch
("stride is too big"). This script asks the two questions that leaves open, on a GPU:

1. Tensors with more than 2**31 elements (every stride inside int32): does each
   kernel still address the last entries right, or does an element offset wrap in
   int32? Each case compares chosen batch entries (the last ones first) with an
   fp32 reference of that entry alone.
2. A stride past int32 (a batch axis of one with a long sequence, or a view into a
   larger buffer): what does a call do?

Usage: python bench/large_tensors.py [--cases a,b,...] > log
"""

import argparse
import contextlib
import functools
import importlib
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F

GIB = 2**30


def module(name):
    return importlib.import_module(f"generated.{name}")


def reference(q, k, v, *, causal, scale=None, q_offset=0):
    """fp32 attention of one entry: q [Hq, Sq, D], k/v [Hkv, Skv, D]."""
    q, k, v = (t.float() for t in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, 0)
    v = v.repeat_interleave(group, 0)
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q.shape[1], device=q.device)[:, None] + q_offset
        cols = torch.arange(k.shape[1], device=q.device)[None, :]
        s = s.masked_fill(cols > rows, -math.inf)
    return torch.softmax(s, -1) @ v


def report(name, got, want):
    """The largest error relative to the reference's largest value."""
    err = (got.float() - want.float()).abs().max().item() / max(want.abs().max().item(), 1e-2)
    ok = err < 2e-2 and torch.isfinite(got).all().item()
    print(f"  {name}: max relative err {err:.3e} {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def elements(*ts):
    return sum(t.numel() for t in ts)


def run_case(name, fn):
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # the point of the probe is to see what is raised
        print(f"  raised {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
        tb = traceback.extract_tb(exc.__traceback__)
        for frame in tb[-3:]:
            print(f"    at {frame.filename.split('/')[-1]}:{frame.lineno} {frame.name}", flush=True)
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)


def prefill_many_entries(unaligned=False):
    """fmha_gqa8_bf16, q/out [1040, 32, 1024, 128]: 4.4e9 elements each. With
    ``unaligned``, q starts one element into its buffer (a base address not 16-byte
    aligned: no TMA for q's loads)."""
    m = module("fmha_gqa8_bf16")
    B, Hq, Hkv, S, D = 1040, 32, 4, 1024, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    if unaligned:
        q = torch.empty(q.numel() + 1, device="cuda", dtype=torch.bfloat16)[1:].view(q.shape).copy_(q)
    q = q.transpose(1, 2)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    print(f"  q elements {q.numel():.3e}, strides {q.stride()}, data_ptr % 16 = {q.data_ptr() % 16}", flush=True)
    out = m.attention(q, k, v)
    torch.cuda.synchronize()
    for b in (B - 1, B - 3, 600, 0):
        report(f"entry {b}", out[b], reference(q[b], k[b], v[b], causal=True))


STRIDE_PAST_INT32 = 2**31 + 2**20


def _dense_and_wide(B, S, H, D):
    """The same random [B, H, S, D] q twice: dense, and as a view over [B, S, H, D]
    storage whose batch stride is STRIDE_PAST_INT32 elements."""
    base = torch.empty((B - 1) * STRIDE_PAST_INT32 + S * H * D, device="cuda", dtype=torch.bfloat16)
    wide = base.as_strided((B, S, H, D), (STRIDE_PAST_INT32, H * D, D, 1))
    wide.normal_()
    return wide.contiguous().transpose(1, 2), wide.transpose(1, 2)


@contextlib.contextmanager
def _split_entries(m, entries):
    """attention()'s path for a batch stride past int32 (an entry per launch), or
    with ``entries`` False the whole batch through the int64 twin (the path of a
    call that cannot be split)."""
    split = m._entries_past_int32
    m._entries_past_int32 = split if entries else (lambda *tensors: False)
    try:
        yield
    finally:
        m._entries_past_int32 = split


def _time_paths(run, cases, flops, warmup):
    """run(q, entries) timed for each (name, q, entries) of ``cases``, twice over."""
    from triton.testing import do_bench

    for name, q, entries in cases + cases:
        ms = do_bench(lambda: run(q, entries), warmup=warmup, rep=300, return_mode="median")  # noqa: B023
        print(f"  {name}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TFLOPS", flush=True)


def twin_cost():
    """fmha_gqa8_bf16 B2 S4096 Hq32: the same q as a dense tensor (the int32
    kernel), and as a view with a batch stride past int32: an entry per launch
    (the int32 kernel, what attention() does) and whole through the int64 twin
    (what it does for a call it cannot split), timed."""
    m = module("fmha_gqa8_bf16")
    B, Hq, Hkv, S, D = 2, 32, 4, 4096, 128
    a, b = _dense_and_wide(B, S, Hq, D)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    def run(q, entries):
        with _split_entries(m, entries):
            return m.attention(q, k, v)

    dense_out = m.attention(a, k, v)
    same = [torch.equal(dense_out, run(b, entries)) for entries in (True, False)]
    _time_paths(run, (("int32 kernel, dense q", a, True), ("int32 kernel, an entry per launch", b, True),
                      ("int64 twin, whole batch", b, False)), 4 * B * Hq * S * S * D / 2, warmup=50)
    print(f"  outputs bit-equal to the dense call's (entries, twin): {same}", flush=True)


def twin_cost_training():
    """fmha_train_gqa_causal B2 S4096 Hq32 Hkv8, forward + backward: q dense, and
    q a view with a batch stride past int32 (an entry per call, and the twin), timed."""
    m = module("fmha_train_gqa_causal")
    B, Hq, Hkv, S, D = 2, 32, 8, 4096, 128
    a, b = (t.requires_grad_() for t in _dense_and_wide(B, S, Hq, D))
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    do = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)

    def step(q, entries):
        with _split_entries(m, entries):
            out = m.attention(q, k, v)
            return (out, *torch.autograd.grad(out, (q, k, v), do))

    dense_res = step(a, True)
    same = [all(torch.equal(x, y) for x, y in zip(dense_res, step(b, entries))) for entries in (True, False)]
    flops = 4 * B * Hq * S * S * D / 2 * 3.5  # forward + backward (2.5 forwards), causal
    _time_paths(step, (("int32 kernels, dense q", a, True), ("int32 kernels, an entry per call", b, True),
                       ("int64 twins, whole batch", b, False)), flops, warmup=20)
    print(f"  out and gradients bit-equal to the dense call's (entries, twins): {same}", flush=True)


def prefill_stride_past_int32():
    """fmha_gqa8_bf16, B=2 views whose batch stride is 2**31 + 2**20 elements."""
    m = module("fmha_gqa8_bf16")
    B, Hq, Hkv, S, D = 2, 32, 4, 1024, 128
    stride_b = 2**31 + 2**20
    base = torch.empty(stride_b + S * Hq * D, device="cuda", dtype=torch.bfloat16)
    q = base.as_strided((B, S, Hq, D), (stride_b, Hq * D, D, 1)).transpose(1, 2)
    q[0].normal_()
    q[1].normal_()
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    print(f"  q strides {q.stride()}", flush=True)
    out = m.attention(q, k, v)
    torch.cuda.synchronize()
    for b in (1, 0):
        report(f"entry {b}", out[b], reference(q[b], k[b], v[b], causal=True))


def prefill_long_single_entry():
    """fmha_gqa8_bf16, B=1 S=2**19 Hq=32: q's batch stride is 2**31 (a size-1 axis)."""
    m = module("fmha_gqa8_bf16")
    B, Hq, Hkv, S, D = 1, 32, 4, 2**19, 128
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    print(f"  q strides {q.stride()}", flush=True)
    out = m.attention(q, k, v)
    torch.cuda.synchronize()
    # The last 64 rows against a reference of those rows alone (q_offset places them).
    rows = slice(S - 64, S)
    want = reference(q[0, :, rows], k[0], v[0], causal=True, q_offset=S - 64)
    report("last 64 rows", out[0, :, rows], want)


def decode_big_cache():
    """fmha_decode_gqa8_bf16, caches [272, 16384, 8, 128]: 4.6e9 elements each."""
    m = module("fmha_decode_gqa8_bf16")
    B, L, Hkv, Hq, D = 272, 16384, 8, 64, 128
    kc = torch.empty(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    check = (B - 1, B - 2, 130, 0)
    lens = torch.full((B,), 4096, device="cuda", dtype=torch.int32)
    lens[B - 1] = L
    for b in check:
        kc[b].normal_()
        vc[b].normal_()
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    print(f"  cache elements {kc.numel():.3e}, strides {kc.stride()}", flush=True)
    out = m.attention(q, kc, vc, lens)
    torch.cuda.synchronize()
    for b in check:
        n = int(lens[b])
        want = reference(
            q[b].transpose(0, 1), kc[b, :n].transpose(0, 1), vc[b, :n].transpose(0, 1), causal=False
        )
        report(f"entry {b} (len {n})", out[b].transpose(0, 1), want)


def twin_cost_decode():
    """fmha_decode_gqa8_bf16 B4 L32768 Hkv8: the caches dense (the int32 kernels) and
    as views with a batch stride past int32 (the int64 twins), timed."""
    from triton.testing import do_bench

    m = module("fmha_decode_gqa8_bf16")
    B, L, Hkv, Hq, D = 4, 32768, 8, 64, 128
    stride0 = 2**31 + 2**20

    def wide_cache():
        base = torch.empty((B - 1) * stride0 + L * Hkv * D, device="cuda", dtype=torch.bfloat16)
        t = base.as_strided((B, L, Hkv, D), (stride0, Hkv * D, D, 1))
        for b in range(B):
            t[b].normal_()
        return t

    kw, vw = wide_cache(), wide_cache()
    kd, vd = kw.contiguous(), vw.contiguous()
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    same = torch.equal(m.attention(q, kd, vd, lens), m.attention(q, kw, vw, lens))
    gbytes = 2 * B * L * Hkv * D * 2 / 1e9
    cases = (("int32 kernels, dense caches", kd, vd), ("int64 twins, caches past int32", kw, vw))
    for name, k, v in cases + cases:
        ms = do_bench(lambda: m.attention(q, k, v, lens), warmup=50, rep=300, return_mode="median")  # noqa: B023
        print(f"  {name}: {ms * 1e3:.1f} us, {gbytes / ms:.2f} TB/s of cache", flush=True)
    print(f"  outputs bit-equal: {same}", flush=True)


def decode_paged_big_pool():
    """fmha_decode_mha_paged_f16, page pool [4200, 128, 32, 128]: 2.2e9 elements;
    the checked sequences live in the last pages."""
    m = module("fmha_decode_mha_paged_f16")
    P, page, H, D = 4200, 128, 32, 128
    kc = torch.empty(P, page, H, D, device="cuda", dtype=torch.float16)
    vc = torch.empty_like(kc)
    B, n_pages = 4, 16
    table = torch.stack([torch.arange(P - (b + 1) * n_pages, P - b * n_pages) for b in range(B)])
    table = table.to(torch.int32).cuda()
    for b in range(B):
        pages = table[b].long()
        kc[pages] = torch.randn(n_pages, page, H, D, device="cuda", dtype=torch.float16)
        vc[pages] = torch.randn(n_pages, page, H, D, device="cuda", dtype=torch.float16)
    lens = torch.full((B,), n_pages * page - 5, device="cuda", dtype=torch.int32)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.float16)
    print(f"  pool elements {kc.numel():.3e}, last page id {int(table.max())}", flush=True)
    out = m.attention(q, kc, vc, lens, table)
    torch.cuda.synchronize()
    for b in range(B):
        n = int(lens[b])
        k = kc[table[b].long()].reshape(-1, H, D)[:n]
        v = vc[table[b].long()].reshape(-1, H, D)[:n]
        want = reference(q[b].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=False)
        report(f"sequence {b}", out[b].transpose(0, 1), want)


def varlen_many_tokens():
    """fmha_varlen_llama, q packed [540000, 32, 128]: 2.2e9 elements."""
    m = module("fmha_varlen_llama")
    Hq, Hkv, D = 32, 8, 128
    lens = [2000] * 270
    total = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(total, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, Hkv, D, device="cuda", dtype=torch.bfloat16)
    print(f"  q elements {q.numel():.3e}, sequences {len(lens)}", flush=True)
    out = m.attention(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens)
    )
    out = out[0] if isinstance(out, tuple) else out  # return_lse: (out, lse)
    torch.cuda.synchronize()
    for b in (len(lens) - 1, len(lens) - 2, 0):
        lo, hi = int(cu[b]), int(cu[b + 1])
        want = reference(
            q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1), causal=True
        )
        report(f"sequence {b}", out[lo:hi].transpose(0, 1), want)


def backward_many_entries():
    """fmha_train_gqa_causal, q [1040, 32, 1024, 128]: 4.4e9 elements; gradients of
    chosen entries against autograd of the fp32 reference."""
    m = module("fmha_train_gqa_causal")
    B, Hq, Hkv, S, D = 1040, 32, 8, 1024, 128
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    for t in (q, k, v):
        t.requires_grad_(True)
    print(f"  q elements {q.numel():.3e}", flush=True)
    out = m.attention(q, k, v)
    do = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    for b in (B - 1, 500, 0):
        qb, kb, vb = (t[b].detach().float().requires_grad_(True) for t in (q, k, v))
        want = reference(qb, kb, vb, causal=True)
        gq, gk, gv = torch.autograd.grad(want, (qb, kb, vb), do[b].float())
        report(f"entry {b} out", out[b], want)
        report(f"entry {b} dq", dq[b], gq)
        report(f"entry {b} dk", dk[b], gk)
        report(f"entry {b} dv", dv[b], gv)


CASES = {
    "prefill_many_entries": prefill_many_entries,
    "prefill_many_entries_unaligned": functools.partial(prefill_many_entries, unaligned=True),
    "twin_cost": twin_cost,
    "twin_cost_training": twin_cost_training,
    "twin_cost_decode": twin_cost_decode,
    "prefill_stride_past_int32": prefill_stride_past_int32,
    "prefill_long_single_entry": prefill_long_single_entry,
    "decode_big_cache": decode_big_cache,
    "decode_paged_big_pool": decode_paged_big_pool,
    "varlen_many_tokens": varlen_many_tokens,
    "backward_many_entries": backward_many_entries,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), f"{torch.cuda.mem_get_info()[1] / GIB:.0f} GiB", flush=True)
    for name in args.cases.split(","):
        run_case(name, CASES[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())

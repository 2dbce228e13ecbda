"""Call-time validation that needs CUDA tensors to reach it (marked `gpu`): the
decode launcher's seq_lens, page table, sinks and caches; the varlen launcher's
cu_seqlens; sinks, fp8 descales, dropout and hook tensors of the prefill
launchers. Each bad call raises a ValueError saying what was expected, and no
kernel is launched (ct.launch is replaced by a failure)."""

import pytest
import torch

from .helpers import generated_module

pytestmark = pytest.mark.gpu


def _no_launch(monkeypatch, module):
    monkeypatch.setattr(module.ct, "launch", lambda *a, **k: pytest.fail("launched despite bad arguments"))


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16, device="cuda")


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


DECODE = "fmha_decode_gqa8_bf16"  # contiguous, gqa 8, D128, q_len 1
PAGED = "fmha_decode_paged_mtp"  # paged (128), gqa 4?, max_q_len 4


def decode_args(**over):
    args = {"q": _bf16(2, 1, 16, 128), "k_cache": _bf16(2, 64, 2, 128), "v_cache": _bf16(2, 64, 2, 128),
            "seq_lens": _i32(5, 64)}
    args.update(over)
    return args


DECODE_CASES = [
    (lambda: {"q": _bf16(2, 1, 16, 64)}, {}, "q must be a 4-D torch.bfloat16 tensor with head_dim 128"),
    (lambda: {"k_cache": torch.zeros(2, 64, 2, 128, dtype=torch.float16, device="cuda")}, {},
     "k_cache must be a 4-D torch.bfloat16 tensor"),
    (lambda: {"v_cache": _bf16(2, 63, 2, 128)}, {}, "k_cache and v_cache must have the same shape"),
    (lambda: {"q": _bf16(2, 1, 12, 128)}, {}, "q has 12 heads and the cache 2; this kernel needs q heads == 8 * kv heads"),
    (lambda: {"q": _bf16(2, 2, 16, 128)}, {}, "q_len (q.shape[1]) must be in [1, 1], got 2"),
    (lambda: {"seq_lens": _i32(5)}, {}, "seq_lens must be an int32 [2] tensor"),
    (lambda: {"seq_lens": torch.tensor([5, 6], device="cuda")}, {}, "seq_lens must be an int32 [2] tensor"),
    (lambda: {"seq_lens": [5, 6]}, {}, "seq_lens must be an int32 [2] tensor on cuda:0, got list"),
    (lambda: {"q": torch.zeros(2, 1, 16, 128, dtype=torch.bfloat16)}, {}, "q must be a CUDA tensor on q's device, got cpu"),
    (dict, {"max_seq_len": 65}, "max_seq_len must be an int in [1, 64] or None, got 65"),
    (dict, {"scale": 0.0}, "scale must be a positive finite float in float32's normal range, got 0.0"),
    (lambda: {"out": _bf16(2, 1, 16, 64)}, {}, "out must be a torch.bfloat16 tensor of shape (2, 1, 16, 128)"),
]


@pytest.mark.parametrize("tensors,kwargs,message", DECODE_CASES, ids=[c[2][:40] for c in DECODE_CASES])
def test_decode_checks(tensors, kwargs, message, monkeypatch):
    mod = generated_module(DECODE)
    _no_launch(monkeypatch, mod)
    over = tensors()
    out = over.pop("out", None)
    with pytest.raises(ValueError) as info:
        mod.attention(*decode_args(**over).values(), out=out, **kwargs)
    assert message in str(info.value)


def test_paged_decode_checks_the_page_table(monkeypatch):
    mod = generated_module(PAGED)
    _no_launch(monkeypatch, mod)
    ratio, size, q_len = mod.GROUP_SIZE, mod.PAGE_SIZE, mod.MAX_Q_LEN
    q = _bf16(2, q_len, 2 * ratio, mod.HEAD_DIM)
    pages = _bf16(5, size, 2, mod.HEAD_DIM)
    lens = _i32(q_len, 2 * size)
    cases = [
        ((q, pages, pages, lens, _i32(0, 1)), "page_table must be an int32 [2, max_pages] tensor"),
        ((q, pages, pages, lens, torch.zeros(2, 2, dtype=torch.int64, device="cuda")),
         "page_table must be an int32 [2, max_pages] tensor"),
        ((q, pages, pages, lens, None), "page_table must be an int32 [2, max_pages] tensor"),
        ((q, _bf16(5, size // 2, 2, mod.HEAD_DIM), _bf16(5, size // 2, 2, mod.HEAD_DIM), lens,
          torch.zeros(2, 2, dtype=torch.int32, device="cuda")),
         f"the caches must be [num_pages, {size}, Hkv, {mod.HEAD_DIM}] pages"),
        ((_bf16(2, q_len + 1, 2 * ratio, mod.HEAD_DIM), pages, pages, lens,
          torch.zeros(2, 2, dtype=torch.int32, device="cuda")), f"q_len (q.shape[1]) must be in [1, {q_len}]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as info:
            mod.attention(*args)
        assert message in str(info.value)


VARLEN = "fmha_varlen_llama"


def test_varlen_checks_cu_seqlens(monkeypatch):
    mod = generated_module(VARLEN)
    _no_launch(monkeypatch, mod)
    ratio, d = mod.GROUP_SIZE, mod.HEAD_DIM
    q, k = _bf16(10, 2 * ratio, d), _bf16(12, 2, d)
    good = {"cu_seqlens_q": _i32(0, 4, 10), "cu_seqlens_k": _i32(0, 5, 12), "max_seqlen_q": 6, "max_seqlen_k": 7}
    cases = [
        ({"cu_seqlens_q": _i32(0)}, "cu_seqlens_q must be a 1-D int32 tensor of B + 1 >= 2 cumulative lengths"),
        ({"cu_seqlens_k": torch.tensor([0, 5, 12], device="cuda")}, "cu_seqlens_k must be a 1-D int32 tensor"),
        ({"cu_seqlens_q": [0, 4, 10]}, "cu_seqlens_q must be a 1-D int32 tensor of B + 1 >= 2 cumulative lengths, got list"),
        ({"cu_seqlens_k": _i32(0, 12)}, "cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), got 3 and 2"),
        ({"cu_seqlens_q": torch.tensor([0, 4, 10], dtype=torch.int32)}, "cu_seqlens_q must be on cuda:0, got cpu"),
        ({"max_seqlen_q": -1}, "max_seqlen_q must be a non-negative int or None, got -1"),
        ({"max_seqlen_k": 2.5}, "max_seqlen_k must be a non-negative int or None, got 2.5"),
    ]
    for over, message in cases:
        with pytest.raises(ValueError) as info:
            mod.attention(q, k, k, **{**good, **over})
        assert message in str(info.value)
    with pytest.raises(ValueError, match="q must be 3-D"):
        mod.attention(_bf16(1, 10, 2 * ratio, d), k, k, **good)


def test_prefill_feature_argument_checks(monkeypatch):
    sinks = generated_module("fmha_gptoss_sinks")
    _no_launch(monkeypatch, sinks)
    r, d = sinks.GROUP_SIZE, sinks.HEAD_DIM
    q, k = _bf16(1, 2 * r, 8, d), _bf16(1, 2, 8, d)
    for value, message in (([0.0] * (2 * r), "sinks must be a [16] tensor of per-head sink logits, got list"),
                           (torch.zeros(2 * r + 1, device="cuda"), "sinks must be a floating-point tensor of shape [16]"),
                           (torch.zeros(2 * r, dtype=torch.int32, device="cuda"), "sinks must be a floating-point tensor")):
        with pytest.raises(ValueError) as info:
            sinks.attention(q, k, k, sinks=value)
        assert message.replace("16", str(2 * r)) in str(info.value)

    fp8 = generated_module("fmha_fp8_llama")
    _no_launch(monkeypatch, fp8)
    r, d = fp8.GROUP_SIZE, fp8.HEAD_DIM
    q8 = torch.zeros(1, r, 8, d, device="cuda").to(torch.float8_e4m3fn)
    k8 = torch.zeros(1, 1, 8, d, device="cuda").to(torch.float8_e4m3fn)
    for kwargs, message in (({"q_descale": -1.0}, "q_descale must be a positive float in float32's normal range or a one-element float tensor, got -1.0"),
                            ({"k_descale": torch.ones(2, device="cuda")}, "k_descale must be a positive float or a one-element float tensor on"),
                            ({"v_descale": "1"}, "v_descale must be a positive float in float32's normal range or a one-element float tensor, got '1'")):
        with pytest.raises(ValueError) as info:
            fp8.attention(q8, k8, k8, **kwargs)
        assert message in str(info.value)

    drop = generated_module("fmha_vit_dropout")
    _no_launch(monkeypatch, drop)
    d = drop.HEAD_DIM
    q = _bf16(1, 2, 8, d)
    for kwargs, message in (({"dropout_p": 1.0}, "dropout_p must be a float in [0, 1), got 1.0"),
                            ({"dropout_p": 0.1, "seed": -3}, "seed must be an int in [0, 2**31), got -3"),
                            ({"dropout_p": 0.1, "seed": 2**31}, "seed must be an int in [0, 2**31)")):
        with pytest.raises(ValueError) as info:
            drop.attention(q, q, q, **kwargs)
        assert message in str(info.value)

    alibi = generated_module("fmha_alibi")
    _no_launch(monkeypatch, alibi)
    r, d = alibi.GROUP_SIZE, alibi.HEAD_DIM
    q, k = _bf16(1, 2 * r, 8, d), _bf16(1, 2, 8, d)
    name = next(iter(alibi.SPEC["tensors"]))
    for value in (torch.zeros(2 * r + 1, device="cuda"), torch.zeros(2 * r, dtype=torch.float64, device="cuda"), None):
        with pytest.raises(ValueError, match=f"{name} must be a torch.float32 tensor of shape"):
            alibi.attention(q, k, k, **{name: value})


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gptoss_sinks", "fmha_train_document"])
def test_calls_without_query_rows_run_on_the_gpu(name):
    """Batch 0 or Sq 0: an empty output and zero key gradients, no zero-sized grid
    (which CUDA would refuse); a decode step of no sequences returns at once."""
    mod = generated_module(name)
    ratio, d = mod.SPEC["gqa_ratio"], mod.SPEC["head_dim"]
    for batch, seq_q in ((0, 16), (1, 0)):
        q = _bf16(batch, ratio, seq_q, d).requires_grad_()
        k, v = (torch.randn(batch, 1, 16, d, device="cuda").to(torch.bfloat16).requires_grad_() for _ in range(2))
        extra = {"sinks": torch.ones(ratio, device="cuda", requires_grad=True)} if mod.SPEC.get("sinks") else {}
        if name == "fmha_train_document":
            extra["doc"] = torch.zeros(batch, 16, dtype=torch.int32, device="cuda")
        out = mod.attention(q, k, v, **extra)
        out = out[0] if isinstance(out, tuple) else out
        leaves = [q, k, v] + [t for t in extra.values() if t.is_floating_point()]
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        torch.cuda.synchronize()
        assert [g.shape for g in grads] == [t.shape for t in leaves] and all(not g.any() for g in grads)
    decode = generated_module(DECODE)
    args = decode_args(q=_bf16(0, 1, 16, 128), k_cache=_bf16(0, 64, 2, 128), v_cache=_bf16(0, 64, 2, 128),
                       seq_lens=torch.zeros(0, dtype=torch.int32, device="cuda"))
    assert decode.attention(**args).shape == (0, 1, 16, 128)


def test_decode_calls_on_two_streams_keep_their_own_workspaces(monkeypatch):
    """Decode calls of one shape on two streams, queued back to back: each stream's
    split kernel writes its own partial results (one workspace shared by every
    stream let calls that run at once mix theirs), and both outputs are right."""
    from specgen.check.cases import decode_reference, random_decode

    mod = generated_module(DECODE)
    streams = [torch.cuda.Stream() for _ in range(2)]
    gen = torch.Generator(device="cuda").manual_seed(5)
    batches = [random_decode(mod.SPEC, [4096, 8192, 3000, 8192], 2, 1, gen) for _ in streams]
    refs = [decode_reference(mod.SPEC, b, {}) for b in batches]
    partials = {}  # stream handle: the split kernel's float32 partial outputs (5-D)
    launch = mod.ct.launch

    def recording(stream, grid, kernel, args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() == 5 and a.dtype == torch.float32:
                partials.setdefault(stream, set()).add(a.data_ptr())
        return launch(stream, grid, kernel, args, **kwargs)

    monkeypatch.setattr(mod.ct, "launch", recording)
    torch.cuda.synchronize()
    for _ in range(3):
        outs = []
        for stream, batch in zip(streams, batches):
            with torch.cuda.stream(stream):
                outs.append(mod.attention(*batch.args()))
        torch.cuda.synchronize()
        for out, ref in zip(outs, refs):
            assert (out.double() - ref).abs().max().item() < 2e-2
    assert len(partials) == 2 and all(len(p) == 1 for p in partials.values()), partials
    first, second = partials.values()
    assert first != second  # a workspace of each stream's own


def test_out_may_be_q_of_a_fused_qkv_buffer_on_the_gpu():
    """q, k, v as interleaved views of one [B, S, 3, H, D] buffer, written in place
    of q: the same output as on separate copies, and k, v untouched."""
    mod = generated_module("fmha_mha_bf16")
    gen = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(2, 300, 3, 4, mod.SPEC["head_dim"], device="cuda", generator=gen).to(torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    expected = mod.attention(q.clone(), k.clone(), v.clone())
    kv = qkv[:, :, 1:].clone()
    out = mod.attention(q, k, v, out=q)
    torch.cuda.synchronize()
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, :, 0].transpose(1, 2), expected) and torch.equal(qkv[:, :, 1:], kv)

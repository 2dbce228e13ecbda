"""Call-time checks that need a CUDA device to be reached: the launchers run on the
CPU with their kernels emulated (specgen.check.emulate), and a launch that a bad
argument should have stopped fails the test. Each bad call is a ValueError before
any launch; each good neighbour reaches the launch."""

import contextlib
import gc
import weakref

import numpy as np
import pytest
import torch

from specgen.check import emulate
from specgen.check.cases import decode_reference, random_decode, random_packed, random_qkv

from .helpers import emulated_module


class Launched(Exception):
    """What the patched ct.launch raises: the call got past its checks."""


_MODULES = {}


def _module(name):
    """The generated module ``name`` with its kernels emulated (loaded once per process)."""
    if name not in _MODULES:
        _MODULES[name] = emulated_module(name, "call_checks")
    return _MODULES[name]


@contextlib.contextmanager
def _no_launch(monkeypatch):
    """Emulated tiles, and every module's ct.launch raising Launched. Patched for the
    call only: a training module's custom op is registered once per process under its
    spec's name, so another test's module of that name may run through this one's."""
    def launch(stream, grid, kernel, args, **kwargs):
        raise Launched(getattr(kernel, "_pyfunc", kernel).__name__)

    with monkeypatch.context() as patch, emulate.emulating():
        for mod in _MODULES.values():
            patch.setattr(mod.ct, "launch", launch)
        yield


@pytest.fixture
def refused(monkeypatch):
    def check(call, message):
        with _no_launch(monkeypatch), pytest.raises(ValueError) as info:
            call()
        assert message in str(info.value)

    return check


@pytest.fixture
def launches(monkeypatch):
    def check(call):
        with _no_launch(monkeypatch), pytest.raises(Launched):
            call()

    return check


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- the output buffer ------------------------------------------------------------


@pytest.mark.parametrize("name", ["fmha_mha_bf16", "fmha_gqa_causal"])
def test_prefill_out_must_not_overlap_k_or_v(name, refused, launches):
    mod = _module(name)
    q, k, v = random_qkv(mod.SPEC, 1, 2, 64, 64, generator=_gen(), device="cpu")
    if q.shape == k.shape:
        refused(lambda: mod.attention(q, k, v, out=k), "out must not overlap k")
        refused(lambda: mod.attention(q, k, v, out=v), "out must not overlap v")
    # Views of one buffer that also holds v (an interleaved fused layout): an out
    # that shares elements with v is refused, one interleaved beside it is not.
    d = q.shape[3]
    fused = torch.zeros(1, q.shape[1], 64, 2 * d, dtype=q.dtype)
    v_in = fused[..., d:][:, : v.shape[1]]
    refused(lambda: mod.attention(q, k, v_in, out=fused[..., d // 2: d // 2 + d]), "out must not overlap v")
    launches(lambda: mod.attention(q, k, v_in, out=fused[..., :d]))
    # In place of q, and a separate buffer, are accepted.
    launches(lambda: mod.attention(q, k, v, out=q))
    launches(lambda: mod.attention(q, k, v, out=torch.empty_like(q)))


def test_out_may_be_q_of_a_fused_qkv_buffer():
    """q, k and v as views of one [B, S, 3, H, D] buffer: their elements interleave
    but never meet, so out=q is in place, as for a q of its own (it used to be
    refused as overlapping k). The emulated kernels give the same output as on copies."""
    mod = _module("fmha_mha_bf16")
    heads, seq, dim = 2, 48, mod.SPEC["head_dim"]
    qkv = torch.randn(1, seq, 3, heads, dim, generator=_gen(3)).to(torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    with emulate.emulating():
        expected = mod.attention(q.clone(), k.clone(), v.clone())
        got = mod.attention(q, k, v, out=q)
    assert got.data_ptr() == qkv.data_ptr()
    assert torch.equal(got, expected)
    assert torch.equal(qkv[:, :, 0].transpose(1, 2), expected)


def test_out_sharing_memory_with_k_through_another_storage_is_refused(refused, launches):
    """Two storages over the same memory (NumPy here; DLPack or CUDA array interface
    views on a GPU): the check compares addresses, not storages."""
    mod = _module("fmha_mha_bf16")
    q, k, v = random_qkv(mod.SPEC, 1, 2, 64, 64, generator=_gen(), device="cpu")
    n = k.numel()
    buf = np.zeros(2 * n + 16, np.int16)
    k_alias = torch.from_numpy(buf).view(torch.bfloat16)[:n].view(k.shape)
    k_alias.copy_(k)
    out = torch.from_numpy(buf[8:]).view(torch.bfloat16)[:n].view(q.shape)
    assert out.untyped_storage().data_ptr() != k_alias.untyped_storage().data_ptr()
    refused(lambda: mod.attention(q, k_alias, v, out=out), "out must not overlap k")
    apart = torch.from_numpy(np.zeros(n, np.int16)).view(torch.bfloat16).view(q.shape)
    launches(lambda: mod.attention(q, k_alias, v, out=apart))


def _byte_sets(t):
    """Every byte address of t's elements, by brute force."""
    size, base = t.element_size(), t.data_ptr()
    index = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        index = index.unsqueeze(-1) + torch.arange(n) * s
    starts = base + index.flatten() * size
    return {int(a) + b for a in starts for b in range(size)}


def test_the_overlap_test_agrees_with_brute_force_on_strided_views():
    """_shares_bytes against the byte sets themselves, on random views (strides of
    any order, stride 0, other element sizes) of one buffer."""
    shares = _module("fmha_mha_bf16")._shares_bytes
    gen = _gen(11)
    buf = torch.zeros(4096, dtype=torch.uint8)
    dtypes = (torch.uint8, torch.int16, torch.bfloat16, torch.int32, torch.float32)
    seen = {True: 0, False: 0}
    for _ in range(400):
        views = []
        for _ in range(2):
            dtype = dtypes[int(torch.randint(len(dtypes), (), generator=gen))]
            size = torch.empty(0, dtype=dtype).element_size()
            dims = int(torch.randint(1, 4, (), generator=gen))
            shape = [int(x) for x in torch.randint(1, 5, (dims,), generator=gen)]
            stride = [int(x) for x in torch.randint(0, 24, (dims,), generator=gen)]
            offset = int(torch.randint(0, 256, (), generator=gen))
            views.append(buf[offset - offset % size:].view(dtype).as_strided(shape, stride))
        a, b = views
        expected = bool(_byte_sets(a) & _byte_sets(b))
        assert shares(a, b) == expected, (a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype,
                                          a.data_ptr() - b.data_ptr())
        seen[expected] += 1
    assert min(seen.values()) > 50, seen


def test_prefill_out_must_not_repeat_elements(refused):
    mod = _module("fmha_mha_bf16")
    q, k, v = random_qkv(mod.SPEC, 2, 2, 64, 64, generator=_gen(), device="cpu")
    out = torch.empty(1, *q.shape[1:], dtype=q.dtype).expand(q.shape)
    refused(lambda: mod.attention(q, k, v, out=out), "out must not repeat elements")
    # Strides that make two indices meet without a zero: head 0's rows are head 1's.
    folded = torch.empty(96 * 64 * 2, dtype=q.dtype).as_strided(q.shape, (96 * 64, 32 * 64, 64, 1))
    refused(lambda: mod.attention(q, k, v, out=folded), "out must not repeat elements")
    # Nor in place of a q whose strides fold the same way.
    refused(lambda: mod.attention(folded, k, v, out=folded), "out must not repeat elements")


def _sharing(shape, dtype, count, other_dtype, at_end=False):
    """An out buffer of ``shape`` and a ``count``-element tensor in the same bytes."""
    size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.zeros(size, dtype=torch.uint8)
    width = count * torch.empty(0, dtype=other_dtype).element_size()
    return raw.view(dtype).view(shape), (raw[-width:] if at_end else raw[:width]).view(other_dtype)


def test_prefill_out_must_not_overlap_the_other_tensors_the_kernel_reads(refused, launches):
    """Hook tensors, sinks, cu_seqlens and a block map are read while out is
    written: an out sharing their memory gave outputs off by up to 4.4 (and, over
    cu_seqlens, a slice at a garbage offset)."""
    mod = _module("fmha_document_mask")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 128, 128, generator=_gen(), device="cpu")
    out, doc = _sharing(q.shape, q.dtype, 128, torch.int32, at_end=True)
    doc = doc.view(1, 128)
    refused(lambda: mod.attention(q, k, v, doc=doc, out=out), "out must not overlap doc")
    launches(lambda: mod.attention(q, k, v, doc=doc.clone(), out=out))
    mod = _module("fmha_gptoss_sinks")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 40, 40, generator=_gen(), device="cpu")
    out, sinks = _sharing(q.shape, q.dtype, q.shape[1], torch.float32)
    refused(lambda: mod.attention(q, k, v, sinks=sinks, out=out), "out must not overlap sinks")
    mod = _module("fmha_varlen_llama")
    packed = random_packed(mod.SPEC, [(40, 60), (40, 60)], 2, generator=_gen(), device="cpu")
    q, k, v, cu_q, cu_k = packed.q, packed.k, packed.v, packed.cu_seqlens_q, packed.cu_seqlens_k
    out, shared_cu = _sharing(q.shape, q.dtype, 3, torch.int32)
    shared_cu.copy_(cu_q)
    refused(lambda: mod.attention(q, k, v, cu_seqlens_q=shared_cu, cu_seqlens_k=cu_k, max_seqlen_q=40,
                                  max_seqlen_k=60, out=out), "out must not overlap cu_seqlens_q")


def test_decode_out_must_not_overlap_the_lengths_or_the_page_table(refused):
    mod = _module("fmha_decode_paged_mtp")
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens, table = batch.args()[:5]
    out, lens = _sharing(q.shape, q.dtype, 2, torch.int32)
    lens.copy_(seq_lens)
    refused(lambda: mod.attention(q, k_cache, v_cache, lens, table, out=out), "out must not overlap seq_lens")
    out, pages = _sharing(q.shape, q.dtype, table.numel(), torch.int32, at_end=True)
    pages = pages.view(table.shape)
    pages.copy_(table)
    refused(lambda: mod.attention(q, k_cache, v_cache, seq_lens, pages, out=out), "out must not overlap page_table")


def test_decode_out_checks(refused, launches):
    mod = _module("fmha_decode_gqa8_bf16")
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens = batch.args()[:4]
    in_cache = k_cache[:, : q.shape[2]].view(q.shape)  # the first keys' rows, seen as an output
    refused(lambda: mod.attention(q, k_cache, v_cache, seq_lens, out=in_cache), "out must not overlap k_cache")
    strided = torch.empty(*q.shape[:3], 2 * q.shape[3], dtype=q.dtype)[..., ::2]
    refused(lambda: mod.attention(q, k_cache, v_cache, seq_lens, out=strided), "out must be contiguous in head_dim")
    launches(lambda: mod.attention(q, k_cache, v_cache, seq_lens, out=torch.empty_like(q)))


def test_decode_caches_without_kv_heads_are_named_as_such(refused):
    """q and caches of no heads used to be refused in launch_plan's words
    ("num_kv_heads must be an int >= 1, got 0"), an argument the caller never passed."""
    mod = _module("fmha_decode_gqa8_bf16")
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens = batch.args()[:4]
    refused(lambda: mod.attention(q[:, :, :0], k_cache[:, :, :0], v_cache[:, :, :0], seq_lens),
            "the caches must hold at least one KV head, got shape (2, 40, 0, 128)")


# --- the softmax scale -------------------------------------------------------------


@pytest.mark.parametrize("name", ["fmha_mha_bf16", "fmha_decode_gqa8_bf16", "fmha_train_gqa_causal"])
@pytest.mark.parametrize("scale", [1e39, 1e-60, 0.0, float("inf"), True, "0.1"])
def test_scale_outside_float32_is_refused(name, scale, refused):
    mod = _module(name)
    if "decode" in name:
        batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
        args = batch.args()
    else:
        args = random_qkv(mod.SPEC, 1, 1, 32, 32, generator=_gen(), device="cpu")
    message = "positive float or None" if isinstance(scale, (bool, str)) else "float32's normal range"
    refused(lambda: mod.attention(*args, scale=scale), message)


# --- decode caches -----------------------------------------------------------------


def test_contiguous_decode_cache_must_hold_the_batch(refused):
    mod = _module("fmha_decode_gqa8_bf16")
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens = batch.args()[:4]
    refused(lambda: mod.attention(q, k_cache[:1], v_cache[:1], seq_lens), "the caches must hold q's batch of 2 sequences")


def test_decode_caches_must_hold_a_page_or_the_query(refused):
    paged = _module("fmha_decode_paged_mtp")
    batch = random_decode(paged.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens, page_table = batch.args()[:5]
    refused(lambda: paged.attention(q, k_cache[:0], v_cache[:0], seq_lens, page_table),
            "the caches must hold at least one page, got 0")
    flat = _module("fmha_decode_gqa8_bf16")
    batch = random_decode(flat.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens = batch.args()[:4]
    refused(lambda: flat.attention(q, k_cache[:, :0], v_cache[:, :0], seq_lens),
            "the caches must hold at least q_len = 1 positions per sequence")


@pytest.mark.parametrize("which", [0, 1])
def test_decode_refuses_inputs_that_require_grad(refused, which):
    """Decode has no backward: a q or cache that requires grad would get an output
    without a gradient (the kernel writes out outside autograd)."""
    mod = _module("fmha_decode_gqa8_bf16")
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    args = list(batch.args()[:4])
    args[which] = args[which].clone().requires_grad_()
    refused(lambda: mod.attention(*args), "an input requires grad, but decode has no backward")


def test_paged_decode_page_table_needs_a_column(refused, launches):
    mod = _module("fmha_decode_paged_mtp")
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens, page_table = batch.args()[:5]
    refused(lambda: mod.attention(q, k_cache, v_cache, seq_lens, page_table[:, :0]),
             "page_table must have at least one column")
    launches(lambda: mod.attention(q, k_cache, v_cache, seq_lens, page_table))


def test_transposed_v_cache_checks_the_dtype(refused):
    mod = _module("fmha_decode_gqa8_fp8kv")
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    k_cache = batch.args()[1]
    v_rows = torch.zeros(k_cache.shape, dtype=torch.bfloat16)
    refused(lambda: mod.transposed_v_cache(v_rows), "v_cache must be a 4-D torch.float8_e4m3fn")


# --- varlen cumulative lengths -----------------------------------------------------


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("cu_q", [[0, 40, 5, 46], [3, 5, 45, 46], [0, 5, 45, 90], [0, 5, 30, 31]],
                         ids=["decreasing", "not-from-0", "past-total", "short-of-total"])
def test_varlen_cu_seqlens_read_on_the_host_are_checked(cu_q, refused, launches):
    mod = _module("fmha_varlen_llama")
    packed = random_packed(mod.SPEC, [(5, 30), (40, 60), (1, 1)], 1, generator=_gen(), device="cpu")
    q, k, v = packed.q, packed.k, packed.v
    refused(lambda: mod.attention(q, k, v, cu_seqlens_q=_i32(cu_q), cu_seqlens_k=packed.cu_seqlens_k),
             "cu_seqlens_q must rise from 0 to 46 (the packed total), never decreasing")
    launches(lambda: mod.attention(q, k, v, cu_seqlens_q=packed.cu_seqlens_q, cu_seqlens_k=packed.cu_seqlens_k))


def test_varlen_without_keys_is_refused(refused):
    mod = _module("fmha_varlen_llama")
    packed = random_packed(mod.SPEC, [(5, 30), (40, 60), (1, 1)], 1, generator=_gen(), device="cpu")
    q, k, v = packed.q, packed.k[:0], packed.v[:0]
    refused(lambda: mod.attention(q, k, v, cu_seqlens_q=packed.cu_seqlens_q, cu_seqlens_k=_i32([0, 0, 0, 0])),
             "k and v must hold at least one key (total_k == 0)")


# --- modules without a backward, and the training path -----------------------------


@pytest.mark.parametrize("name", ["fmha_gqa_causal", "fmha_varlen_llama"])
def test_forward_only_module_refuses_inputs_that_require_grad(name, refused, launches):
    mod = _module(name)
    if name == "fmha_varlen_llama":
        packed = random_packed(mod.SPEC, [(5, 30), (40, 60)], 1, generator=_gen(), device="cpu")
        q, k, v, kwargs = packed.q, packed.k, packed.v, packed.kwargs()
    else:
        q, k, v = random_qkv(mod.SPEC, 1, 1, 32, 32, generator=_gen(), device="cpu")
        kwargs = {}
    q.requires_grad_()
    refused(lambda: mod.attention(q, k, v, **kwargs), "this module has no backward")
    with torch.no_grad():
        launches(lambda: mod.attention(q, k, v, **kwargs))


def test_forward_only_module_refuses_hook_tensors_that_require_grad(refused):
    mod = _module("fmha_alibi")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 32, 32, generator=_gen(), device="cpu")
    slope = torch.ones(q.shape[1], requires_grad=True)
    refused(lambda: mod.attention(q, k, v, slope=slope), "this module has no backward")


@pytest.mark.parametrize("kwargs,message", [
    ({"scale": "0.1"}, "scale must be a positive float or None, got '0.1'"),
    ({"scale": True}, "scale must be a positive float or None, got True"),
    ({"q_offset": 1.5}, "q_offset must be an int, got 1.5"),
    ({"q_offset": True}, "q_offset must be an int, got True"),
    ({"q_offset": np.float64(3.0)}, "q_offset must be an int, got 3.0"),  # np.int64 is taken (test_scalar_args)
])
def test_training_module_checks_scalars_before_its_op(kwargs, message, refused):
    mod = _module("fmha_train_gqa_causal")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 32, 32, generator=_gen(), device="cpu")
    refused(lambda: mod.attention(q, k, v, **kwargs), message)


def test_training_module_checks_tensors_before_its_op(refused):
    mod = _module("fmha_train_gqa_causal")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 32, 32, generator=_gen(), device="cpu")
    refused(lambda: mod.attention([1.0], k, v), "q must be a torch.Tensor, got list")


def test_backward_checks_out_and_lse(refused, launches):
    mod = _module("fmha_train_gqa_causal")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 40, 40, generator=_gen(), device="cpu")
    lse = torch.zeros(q.shape[:3])
    refused(lambda: mod._backward(q, k, v, q, torch.zeros(3), torch.zeros_like(q), 0.1, 0),
             "lse must be a torch.float32 tensor of shape (1, 4, 40)")
    refused(lambda: mod._backward(q, k, v, q[:, :, :5], lse, torch.zeros_like(q[:, :, :5]), 0.1, 0),
             "out must be a torch.bfloat16 tensor of shape (1, 4, 40, 128)")
    launches(lambda: mod._backward(q, k, v, torch.zeros_like(q), lse, torch.zeros_like(q), 0.1, 0))


def test_the_scale_range_written_out_is_float32s():
    float32 = torch.finfo(torch.float32)
    for name in ("fmha_mha_bf16", "fmha_decode_gqa8_bf16"):
        assert _module(name)._FLOAT32_NORMAL == (float32.tiny, float32.max)


# --- block maps and the tensors they were built from --------------------------------


def _built_map(mod, *args, **kwargs):
    """make_block_map with its map kernel emulated (really run, not stubbed)."""
    with emulate.emulating():
        return mod.make_block_map(*args, **kwargs)


@pytest.mark.parametrize("name", ["fmha_document_mask", "fmha_train_document"])
def test_a_block_map_follows_the_tensors_it_was_built_from(name, refused, launches):
    mod = _module(name)
    batch, seq = 1, 200
    q, k, v = random_qkv(mod.SPEC, batch, 4, seq, seq, generator=_gen(), device="cpu")
    doc = torch.zeros(batch, seq, dtype=torch.int32)
    doc[:, 100:] = 1
    block_map = _built_map(mod, batch, q.shape[1], seq, seq, doc=doc)
    launches(lambda: mod.attention(q, k, v, doc=doc, block_map=block_map))
    launches(lambda: mod.attention(q, k, v, doc=doc[:], block_map=block_map))  # a view: the same memory
    # Equal values in other memory: the map cannot tell without reading them (a sync).
    refused(lambda: mod.attention(q, k, v, doc=doc.clone(), block_map=block_map),
            "block_map was built from another doc tensor")
    doc[0, 150] = 0  # one more token in the first document: the map is stale
    refused(lambda: mod.attention(q, k, v, doc=doc, block_map=block_map),
            "doc was written after block_map was built")
    fresh = _built_map(mod, batch, q.shape[1], seq, seq, doc=doc)
    launches(lambda: mod.attention(q, k, v, doc=doc, block_map=fresh))
    # A q_offset of the wrong type is named as such, not as a map built for another.
    for bad in (1.5, True):
        refused(lambda: mod.attention(q, k, v, doc=doc, block_map=fresh, q_offset=bad),
                f"q_offset must be an int, got {bad}")


def test_a_decode_block_map_is_refused_once_seq_lens_advance(refused, launches):
    mod = _module("fmha_decode_chunked_local")
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens = batch.args()[:4]
    heads, capacity = q.shape[1] * q.shape[2], k_cache.shape[1]
    block_map = _built_map(mod, seq_lens, heads, capacity)
    launches(lambda: mod.attention(q, k_cache, v_cache, seq_lens, block_map=block_map))
    seq_lens += 1  # the next step, without a new map
    refused(lambda: mod.attention(q, k_cache, v_cache, seq_lens, block_map=block_map),
            "seq_lens was written after block_map was built")
    refused(lambda: mod.attention(q, k_cache, v_cache, seq_lens.clone(), block_map=block_map),
            "block_map was built from another seq_lens tensor")
    step = _built_map(mod, seq_lens, heads, capacity)
    launches(lambda: mod.attention(q, k_cache, v_cache, seq_lens, block_map=step))


@pytest.mark.parametrize("name", ["fmha_document_mask", "fmha_decode_chunked_local"])
def test_a_block_map_holds_the_memory_of_the_tensors_it_was_built_from(name, refused):
    """A training loop drops each batch's doc (and a decode loop its seq_lens); an
    allocator then hands their memory to the next tensor of that size. The map
    keeps its tensors alive, so a tensor with other values never shows up at the
    address, shape and version the map recorded."""
    mod = _module(name)
    if "decode" in name:
        batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
        q, k_cache, v_cache, seq_lens = batch.args()[:4]
        block_map = _built_map(mod, seq_lens, q.shape[1] * q.shape[2], k_cache.shape[1])
        built, address = weakref.ref(seq_lens), seq_lens.data_ptr()
        del batch, seq_lens
        seq_lens = torch.tensor([9, 30], dtype=torch.int32)

        def call():
            return mod.attention(q, k_cache, v_cache, seq_lens, block_map=block_map)
    else:
        q, k, v = random_qkv(mod.SPEC, 1, 4, 200, 200, generator=_gen(), device="cpu")
        doc = torch.zeros(1, 200, dtype=torch.int32)
        block_map = _built_map(mod, 1, q.shape[1], 200, 200, doc=doc)
        built, address = weakref.ref(doc), doc.data_ptr()
        del doc
        doc = torch.arange(200, dtype=torch.int32)[None] // 50

        def call():
            return mod.attention(q, k, v, doc=doc, block_map=block_map)
    gc.collect()
    assert built() is not None and built().data_ptr() == address
    what = "seq_lens" if "decode" in name else "doc"
    refused(call, f"block_map was built from another {what} tensor")
    del block_map
    gc.collect()
    assert built() is None  # the map held it, nothing else


def test_a_block_map_of_another_module_is_named_so(refused):
    mask, window = _module("fmha_document_mask"), _module("fmha_window_document")
    q, k, v = random_qkv(window.SPEC, 1, 4, 64, 64, generator=_gen(), device="cpu")
    doc = torch.zeros(1, 64, dtype=torch.int32)
    other = _built_map(mask, 1, q.shape[1], 64, 64, doc=doc)
    refused(lambda: window.attention(q, k, v, doc=doc, block_map=other),
            "block_map was built by another module (_call_checks_fmha_document_mask)")
    refused(lambda: window.attention(q, k, v, doc=doc, block_map="map"),
            "block_map must be a BlockMap (make_block_map) or None, got str")


def test_make_block_map_takes_backward_as_a_bool():
    mod = _module("fmha_train_document")
    doc = torch.zeros(1, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="backward must be True or False, got 'no'"):
        _built_map(mod, 1, 4, 64, 64, doc=doc, backward="no")


def test_block_maps_of_inference_tensors(refused, launches):
    """Under torch.inference_mode tensors keep no version counter: the map still
    checks that the call passes the tensor it was built from."""
    mod = _module("fmha_decode_chunked_local")
    with torch.inference_mode():
        batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
        q, k_cache, v_cache, seq_lens = batch.args()[:4]
        heads, capacity = q.shape[1] * q.shape[2], k_cache.shape[1]
        block_map = _built_map(mod, seq_lens, heads, capacity)
        launches(lambda: mod.attention(q, k_cache, v_cache, seq_lens, block_map=block_map))
        refused(lambda: mod.attention(q, k_cache, v_cache, seq_lens.clone(), block_map=block_map),
                "block_map was built from another seq_lens tensor")


@pytest.mark.parametrize("bad", [0.0, 1e-50, 1e39, float("inf"), True, "1"])
def test_float8_decode_descale_numbers_must_be_float32_normal(bad):
    """The float8-cache decode reads its descales in float32: numbers it would turn
    into 0 or inf are refused, as the prefill's are (one check serves both)."""
    mod = _module("fmha_decode_gqa8_fp8kv")
    with pytest.raises(ValueError, match="k_descale must be a positive float in float32's normal range "
                                         "or a one-element float32 tensor"):
        mod._descale("k_descale", bad, torch.device("cpu"), True)
    assert mod._descale("k_descale", 0.5, torch.device("cpu"), True).tolist() == [0.5]
    # NumPy's scalars are numbers too (np.float32 was refused as out of range)
    assert mod._descale("k_descale", np.float32(1.25), torch.device("cpu"), True).tolist() == [1.25]


@pytest.mark.parametrize("name", ["fmha_mha_bf16", "fmha_decode_gqa8_bf16", "fmha_train_gqa_causal",
                                  "fmha_vit_dropout"])
def test_numpy_scalars_are_taken_as_numbers(name, launches):
    """scale (and dropout_p) given as NumPy scalars, as a config read with NumPy
    gives them: np.float32 was refused ("must be a positive float"), np.float64 not."""
    mod = _module(name)
    if "decode" in name:
        args = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu").args()
    else:
        args = random_qkv(mod.SPEC, 1, 1, 32, 32, generator=_gen(), device="cpu")
    extra = {"dropout_p": np.float32(0.25)} if mod.SPEC.get("dropout") else {}
    launches(lambda: mod.attention(*args, scale=np.float32(0.125), **extra))


# --- grid limits, empty calls, descales, max_seqlen bounds ---------------------------


@pytest.mark.parametrize("name", ["fmha_decode_gqa4_bf16", "fmha_decode_paged_mtp", "fmha_decode_chunked_local"])
def test_decode_batch_beyond_the_grid_y_limit(name, refused, launches):
    """The split kernel's grid has batch * KV heads on its y axis (at most 65535): a
    larger batch runs in slices (tests/test_batch_slices.py), except with a block map,
    which is refused."""
    mod = _module(name)
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens = batch.args()[:4]
    rest = batch.args()[4:5]  # a paged cache's page table
    many = 70000
    big_q = q[:1].expand(many, *q.shape[1:])
    big_lens = seq_lens[:1].expand(many).contiguous()
    if rest:
        caches, rest = (k_cache, v_cache), (rest[0][:1].expand(many, -1),)
    else:
        caches = tuple(c[:1].expand(many, *c.shape[1:]) for c in (k_cache, v_cache))
    if mod.SPEC.get("mask_mod"):
        refused(lambda: mod.attention(big_q, *caches, big_lens, *rest),
                "batch * KV heads must be at most 65535 (the grid's y limit), got 70000 * 1")
        refused(lambda: mod.make_block_map(big_lens, q.shape[2], k_cache.shape[1]), "at most 65535")
    else:
        launches(lambda: mod.attention(big_q, *caches, big_lens, *rest))


def test_work_item_grid_limits_follow_the_config(refused, launches, monkeypatch):
    """A one-CTA-per-item config's 1-D grid takes at most MAX_GRID_X blocks (cuTile
    refuses more than 2**24 - 1); a persistent config's wave loops over up to
    MAX_WORK items. Both are ValueErrors before the launch (limits lowered here so
    small calls reach them)."""
    import yaml

    from .helpers import ROOT, emulated_spec_module

    data = yaml.safe_load((ROOT / "specs" / "fmha_gqa_causal.yaml").read_text())
    data.update(name="work_items", targets={"default": {
        "tile_m": 64, "tile_n": 64, "occupancy": 2, "persistent": True,
        "by_seq_k": [{"max_seq_k": 100, "tile_m": 64, "tile_n": 64, "occupancy": 2}]}})
    mod = _MODULES.setdefault("work_items", emulated_spec_module(data, "grid_limits"))  # _no_launch patches it
    assert mod.MAX_GRID_X == 2**24 - 1 and mod.MAX_WORK == 2**31 - 1
    short = random_qkv(mod.SPEC, 2, 1, 64, 64, generator=_gen(), device="cpu")  # one-per-item config
    long = random_qkv(mod.SPEC, 2, 1, 64, 200, generator=_gen(), device="cpu")  # persistent config
    work = 2 * short[0].shape[1]  # one query tile per (batch, head)
    monkeypatch.setattr(mod, "MAX_GRID_X", work - 1)
    refused(lambda: mod.attention(*short), f"query tiles * batch * heads must be at most {work - 1} with this "
            f"config, got {work}")
    launches(lambda: mod.attention(*long))
    monkeypatch.setattr(mod, "MAX_WORK", work - 1)
    refused(lambda: mod.attention(*long), f"must be at most {work - 1} with this config, got {work}")
    monkeypatch.setattr(mod, "MAX_GRID_X", work)
    launches(lambda: mod.attention(*short))


def test_block_map_and_launch_plan_devices_and_sizes_are_value_errors(refused):
    """A device that is not one, or sizes past the kernels' int32 positions, are
    ValueErrors before any memory is asked for (they were RuntimeError, TypeError,
    AttributeError or an allocation of 2**40 rows)."""
    docs = _module("fmha_document_mask")
    doc = torch.zeros(2, 56, dtype=torch.int32)
    for device in ("bogus", [0], True):
        refused(lambda: docs.make_block_map(2, 4, 40, 56, doc=doc, device=device), "device must be a CUDA device")
    chunked = _module("fmha_chunked_local")
    refused(lambda: chunked.make_block_map(2**40, 4, 16, 16), "batch * map heads must be at most")
    refused(lambda: chunked.make_block_map(1, 4, 16, 2**62), "seq_k must be at most 2**30")
    refused(lambda: chunked.make_block_map(1, 4, 2**30 + 1, 16), "seq_q must be at most 2**30")
    decode = _module("fmha_decode_chunked_local")
    lens = torch.tensor([5, 6], dtype=torch.int32)
    refused(lambda: decode.make_block_map(lens, 8, 2**40), "max_len must be at most 2**30")
    plain = _module("fmha_decode_gqa8_bf16")
    refused(lambda: plain.launch_plan(2, 1, 100, "bogus"), "device must be a CUDA device")
    refused(lambda: plain.launch_plan(2, 1, 100, 1.5), "device must be a CUDA device")


def test_decode_lengths_beyond_the_cache_read_as_its_capacity():
    """A seq_len past the cache's capacity is taken as the capacity, a negative one as
    0 (clamped in the kernels, no host sync): it used to read past the cache (NaN rows at capacity + 1,
    a loop of 2**31 keys for 2**31 - 1)."""
    for name in ("fmha_decode_gqa8_bf16", "fmha_decode_chunked_local", "fmha_decode_paged_mtp"):
        mod = _module(name)
        size = mod.SPEC["paged"]["page_size"] if mod.SPEC.get("paged") else 40
        batch = random_decode(mod.SPEC, [17, 2 * size], 1, 1, generator=_gen(), device="cpu")
        extra = {}
        if mod.SPEC.get("tensors"):
            from specgen.check.cases import hook_tensors

            extra = hook_tensors(mod.SPEC, dict(batch=2, heads=8, kv_heads=1, seq_q=1, seq_k=2 * size), _gen(1), "cpu")
        ref = decode_reference(mod.SPEC, batch, extra)
        args = list(batch.args())
        for length in (2 * size + 1, 2**31 - 1):
            args[3] = batch.seq_lens.clone()
            args[3][1] = length
            with emulate.emulating():
                out = mod.attention(*args, **extra)
            assert (out.double() - ref).abs().max().item() < 2e-2, (name, length)
        # A negative length reads as 0 (no key: zeros); -2**31 used to wrap the key
        # positions computed from it (a tile loaded wholly outside the cache, or NaN
        # rows with a block map).
        for length in (-7, -2**31):
            args[3] = batch.seq_lens.clone()
            args[3][1] = length
            with emulate.emulating():
                out = mod.attention(*args, **extra)
            assert (out[1] == 0).all(), (name, length)
            assert (out[0].double() - ref[0]).abs().max().item() < 2e-2, (name, length)


def test_dropout_p_that_rounds_to_dropping_everything_is_refused(refused, launches):
    """The kernels drop in steps of 2**-16: a p at or above 1 - 2**-17 would drop
    every weight (and scale the none kept by 1 / 0). The largest p below it runs."""
    mod = _module("fmha_vit_dropout")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 32, 32, generator=_gen(), device="cpu")
    refused(lambda: mod.attention(q, k, v, dropout_p=1 - 1e-7, seed=1), "dropout_p must be below 1 - 2**-17")
    launches(lambda: mod.attention(q, k, v, dropout_p=1 - 2**-16, seed=1))


def test_the_backward_op_checks_q_k_v_scale_and_positions(refused, launches):
    """The registered backward op (torch.ops.specgen.<spec>_backward runs _op_grads)
    is reached without _forward's checks: k, v, scale and q_offset that do not fit q
    used to launch (a head_dim-64 k, three KV heads, a batch of two, q_offset 2**40,
    a NaN scale), or raise ZeroDivisionError (scale 0)."""
    mod = _module("fmha_train_gqa_causal")
    q, k, v = random_qkv(mod.SPEC, 1, 2, 40, 40, generator=_gen(), device="cpu")
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3], dtype=torch.float32)
    dout = torch.ones_like(out)
    scale = 1 / 128**0.5

    def grads(q=q, k=k, v=v, scale=scale, q_offset=0):
        return lambda: mod._op_grads(q, k, v, out, lse, dout, scale, q_offset)

    refused(grads(k=k[..., :64]), "k must have head_dim 128")
    refused(grads(k=k.float()), "k must be a 4-D torch.bfloat16 tensor")
    refused(grads(k=torch.cat([k, k[:, :1]], 1), v=torch.cat([v, v[:, :1]], 1)), "with q heads == 4 * k/v heads")
    refused(grads(v=v[:, :, :30]), "q, k and v must be [batch, heads, seq, head_dim] of one batch")
    refused(grads(k=torch.cat([k, k]), v=torch.cat([v, v])), "of one batch")
    refused(grads(q_offset=2**40), "q_offset must be in [-2**30, 2**30 - seq_q]")
    for bad in (float("nan"), 0.0):
        refused(grads(scale=bad), "scale must be a positive finite float")
    launches(grads())


def test_decode_launch_plan_takes_ints(refused):
    mod = _module("fmha_decode_paged_mtp")
    cpu = torch.device("cpu")
    refused(lambda: mod.launch_plan("2", 1, 256, cpu), "batch must be an int >= 0, got '2'")
    refused(lambda: mod.launch_plan(1, 0, 256, cpu), "num_kv_heads must be an int >= 1, got 0")
    refused(lambda: mod.launch_plan(1, 1, -5, cpu), "max_seq_len must be an int >= 1, got -5")


def test_a_decode_step_of_no_sequences_launches_nothing(monkeypatch):
    mod = _module("fmha_decode_gqa8_bf16")
    batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
    q, k_cache, v_cache, seq_lens = batch.args()[:4]
    with _no_launch(monkeypatch):
        out = mod.attention(q[:0], k_cache[:0], v_cache[:0], seq_lens[:0])
    assert out.shape == (0, *q.shape[1:])


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gptoss_sinks", "fmha_train_document"])
@pytest.mark.parametrize("batch,seq_q", [(0, 16), (1, 0)])
def test_a_backward_without_query_rows_launches_nothing(name, batch, seq_q, monkeypatch):
    """No query row: the gradients are zeros (keys, sinks) or empty (queries), and no
    grid of zero blocks is launched."""
    mod = _module(name)
    ratio, d = mod.SPEC["gqa_ratio"], mod.SPEC["head_dim"]
    q = torch.randn(batch, ratio, seq_q, d, generator=_gen()).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(batch, 1, 16, d, generator=_gen(i)).to(torch.bfloat16).requires_grad_() for i in (1, 2))
    extra = {}
    if mod.SPEC.get("sinks"):
        extra["sinks"] = torch.randn(ratio, generator=_gen()).requires_grad_()
    if name == "fmha_train_document":
        extra["doc"] = torch.zeros(batch, 16, dtype=torch.int32)
    leaves = [q, k, v] + [t for t in extra.values() if t.is_floating_point()]
    with _no_launch(monkeypatch):
        out = mod.attention(q, k, v, **extra)
        out = out[0] if isinstance(out, tuple) else out
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    assert all(not g.any() for g in grads)


@pytest.mark.parametrize("name,which", [("fmha_fp8_llama", "q_descale"), ("fmha_decode_gqa8_fp8kv", "v_descale")])
def test_forward_only_float8_modules_refuse_descales_that_require_grad(name, which, refused):
    """The kernels read a descale tensor outside autograd: one that requires grad
    would get no gradient."""
    mod = _module(name)
    descale = torch.ones(1, requires_grad=True)
    if "decode" in name:
        batch = random_decode(mod.SPEC, [17, 40], 1, 1, generator=_gen(), device="cpu")
        args = batch.args()[:4]
        refused(lambda: mod.attention(*args, **{which: descale}), "an input requires grad, but decode has no backward")
    else:
        q, k, v = random_qkv(mod.SPEC, 1, 1, 32, 32, generator=_gen(), device="cpu")
        refused(lambda: mod.attention(q, k, v, **{which: descale}), "this module has no backward")


def test_varlen_max_seqlen_is_bounded_by_the_packed_total(refused, monkeypatch):
    """B sequences of total rows: the longest holds at least ceil(total / B) rows (a
    smaller max_seqlen is refused) and at most total (a larger one is taken as total,
    so it sizes no grid beyond the rows)."""
    mod = _module("fmha_varlen_llama")
    packed = random_packed(mod.SPEC, [(5, 30), (40, 60)], 1, generator=_gen(), device="cpu")
    kwargs = packed.kwargs()
    refused(lambda: mod.attention(packed.q, packed.k, packed.v, **{**kwargs, "max_seqlen_q": 0}),
            "max_seqlen_q must be at least 23 (2 sequences hold 45 rows")
    refused(lambda: mod.attention(packed.q, packed.k, packed.v, **{**kwargs, "max_seqlen_k": 44}),
            "max_seqlen_k must be at least 45 (2 sequences hold 90 rows")
    grids = []

    def launch(stream, grid, kernel, args, **kw):
        grids.append(grid)
        raise Launched(kernel)

    with monkeypatch.context() as patch, emulate.emulating():
        patch.setattr(mod.ct, "launch", launch)
        with pytest.raises(Launched):
            mod.attention(packed.q, packed.k, packed.v, **{**kwargs, "max_seqlen_q": 2**40, "max_seqlen_k": 2**40})
    smallest = min(c["tile_m"] for configs in mod.CONFIGS.values() for c in configs)
    rows = -(-45 // smallest)
    heads = packed.q.shape[1]
    assert grids and max(grids[0]) <= max(rows, 2 * heads), grids


def test_an_empty_call_still_checks_its_block_map(refused):
    mod = _module("fmha_chunked_local")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 16, 16, generator=_gen(), device="cpu")
    refused(lambda: mod.attention(q[:, :, :0], k, v, block_map="garbage"),
            "block_map must be a BlockMap (make_block_map) or None, got str")



def test_a_decode_batch_no_slice_of_which_fits_is_refused_as_such(refused, monkeypatch):
    """Slices of a decode batch hold multiples of 16 sequences: past MAX_GRID_Y // 16
    KV heads none fits, and attention() refused the batch saying that it "runs such a
    batch in slices of 0: ask for a slice's plan" (launch_plan's message for a caller
    that asks it about a batch attention() slices). Limit lowered so that a small
    call reaches it."""
    mod = _module("fmha_decode_gqa8_bf16")
    batch = random_decode(mod.SPEC, [30] * 20, 3, 1, generator=_gen(), device="cpu")
    monkeypatch.setattr(mod, "MAX_GRID_Y", 39)  # 39 // 3 KV heads: 13 sequences, under 16
    message = "batch * KV heads must be at most 39 (the grid's y limit), got 20 * 3"
    refused(lambda: mod.attention(*batch.args()), message)
    with pytest.raises(ValueError) as info:
        mod.launch_plan(20, 3, 30, torch.device("cpu"))
    assert str(info.value) == message
    with pytest.raises(ValueError, match="runs such a batch in slices of 32: ask for a slice's plan"):
        mod.launch_plan(40, 1, 30, torch.device("cpu"))  # one KV head: slices of 32 fit


def test_a_packed_batch_past_the_x_limit_names_max_seqlen_q(refused, launches, monkeypatch):
    """The varlen forward's query tiles cover the longest sequence: past the x limit
    its message named seq_q, an argument a packed call has not (the backward's
    named max_seqlen_q already). Limit lowered so that a small call reaches it."""
    mod = _module("fmha_varlen_llama")
    packed = random_packed(mod.SPEC, [(200, 200), (3, 5)], 1, generator=_gen(), device="cpu")
    call = lambda: mod.attention(packed.q, packed.k, packed.v, **packed.kwargs())  # noqa: E731
    monkeypatch.setattr(mod, "MAX_GRID_X", 1)
    refused(call, "max_seqlen_q must be at most ")
    refused(call, "the grid's x limit), got 200")
    monkeypatch.setattr(mod, "MAX_GRID_X", 4)  # 200 rows: at most 4 tiles of 64 or more
    launches(call)


# --- the grid's x limit (2**24 - 1 blocks) --------------------------------------------


@pytest.mark.parametrize("limit", ["x", "y"])
def test_a_global_tile_order_past_the_grid_limits_launches_head_by_head(limit, monkeypatch):
    """A tile_order: global config puts batch * heads on the grid's x axis and the
    query tiles on y. Where either passes its limit (cuTile refused "Grid[0] exceeds
    24-bit limit" for q [2**22, 4, 1, 128]; 65535 tiles of 64 are 4.2M queries), the
    same tiles launch head by head, with the bits of the global order. Limits lowered
    so that a small call reaches them; seq_k 64 takes the spec's global-order config."""
    mod = _module("fmha_gqa_causal")
    seq_q, lowered = (200, ("MAX_GRID_X", 7)) if limit == "x" else (640, ("MAX_GRID_Y", 9))
    q, k, v = random_qkv(mod.SPEC, 2, 1, seq_q, 64, generator=_gen(), device="cpu")  # 8 heads
    tiles = -(-seq_q // 64)
    grids, launch = [], mod._launch

    def spy(device, grid, kernel, args, *rest, **options):
        grids.append((grid, args[-1] if isinstance(args[-1], bool) else None))
        return launch(device, grid, kernel, args, *rest, **options)

    monkeypatch.setattr(mod, "_launch", spy)
    with emulate.emulating():
        whole = mod.attention(q, k, v)
        monkeypatch.setattr(mod, *lowered)
        head_by_head = mod.attention(q, k, v)
    assert grids == [((8, tiles, 1), True), ((tiles, 8, 1), False)]
    assert torch.equal(head_by_head, whole)


@pytest.mark.parametrize("name", ["fmha_mha_f16_d128", "fmha_seed_baseline", "fmha_chunked_local"])
def test_query_tiles_stay_within_the_grid_x_limit(name, refused, launches, monkeypatch):
    """A per-head grid has the query tiles on its x axis: seq_q past MAX_GRID_X tiles
    is a ValueError before any launch, a block map's included (cuTile refused
    seq_q = 2**30 at 64-row tiles)."""
    mod = _module(name)
    q, k, v = random_qkv(mod.SPEC, 1, 1, 200, 64, generator=_gen(), device="cpu")  # 4 tiles of 64
    monkeypatch.setattr(mod, "MAX_GRID_X", 3)
    refused(lambda: mod.attention(q, k, v), "seq_q must be at most 192 with this config (3 query tiles of 64, "
            "the grid's x limit), got 200")
    monkeypatch.setattr(mod, "MAX_GRID_X", 4)
    launches(lambda: mod.attention(q, k, v))


def test_make_block_map_checks_every_direction_before_the_first_launch(refused, launches, monkeypatch):
    """make_block_map launches one kernel per direction: a direction past the grid's
    x limit (here the backward's by-key map) is refused before the forward's map is
    launched (it was launched, then cuTile refused the next)."""
    chunked = _module("fmha_chunked_local")
    monkeypatch.setattr(chunked, "MAX_GRID_X", 3)
    refused(lambda: chunked.make_block_map(1, 4, 200, 16), "seq_q must be at most 192 for the block map's tiles")
    launches(lambda: chunked.make_block_map(1, 4, 192, 16))
    mod = _module("fmha_train_document")
    doc = torch.zeros(1, 200, dtype=torch.int32)
    monkeypatch.setattr(mod, "MAX_GRID_X", 1)
    refused(lambda: mod.make_block_map(1, 4, 16, 200, doc=doc, backward=True),
            f"seq_k must be at most {mod.BWD_TILE_N} for the block map's tiles")
    launches(lambda: mod.make_block_map(1, 4, 16, 200, doc=doc))


# --- the backward's grids -------------------------------------------------------------


def test_the_backward_checks_its_grids_before_the_first_launch(refused, launches, monkeypatch):
    """The backward launches dQ, then dK/dV: key tiles past the grid's x limit were
    refused by cuTile after the dQ kernel had run (seq_k = 2**30 at 64-key tiles),
    and heads past the y limit (the backward op called directly, or sinks' gradients
    that are not sliced) reached the launch. Limits lowered so that small calls reach
    them."""
    mod = _module("fmha_train_gqa_causal")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 64, 200, generator=_gen(), device="cpu")  # 1 dQ tile, 4 key tiles
    lse = torch.zeros(q.shape[:3], dtype=torch.float32)

    def grads(q=q, k=k, v=v, lse=lse):
        return lambda: mod._op_grads(q, k, v, q, lse, q, 0.1, 0)

    monkeypatch.setattr(mod, "MAX_GRID_X", 3)
    refused(grads(), f"seq_k must be at most {3 * mod.BWD_TILE_N} for the backward (3 key tiles of "
            f"{mod.BWD_TILE_N}, the grid's x limit), got 200")
    monkeypatch.setattr(mod, "MAX_GRID_X", 4)
    launches(grads())
    k, v = k[:, :, :64], v[:, :, :64]
    q = torch.cat([q] * 4, 2)  # 256 rows: 256 / BWD_DQ_TILE_M query tiles
    lse = torch.zeros(q.shape[:3], dtype=torch.float32)
    dq_tiles = 256 // mod.BWD_DQ_TILE_M
    monkeypatch.setattr(mod, "MAX_GRID_X", dq_tiles - 1)
    refused(grads(q, k, v, lse), f"seq_q must be at most {(dq_tiles - 1) * mod.BWD_DQ_TILE_M} for the backward")
    monkeypatch.setattr(mod, "MAX_GRID_X", dq_tiles)
    launches(grads(q, k, v, lse))
    monkeypatch.setattr(mod, "MAX_GRID_Y", 3)  # fewer than the 4 heads: no slice of the batch fits
    refused(grads(q, k, v, lse), "batch * heads must be at most 3 (the grid's y limit), got 1 * 4")
    sinks = _module("fmha_train_gptoss_sinks")  # sliced by entries, but not one entry's heads
    q, k, v = random_qkv(sinks.SPEC, 2, 1, 16, 16, generator=_gen(), device="cpu")
    lse = torch.zeros(q.shape[:3], dtype=torch.float32)
    heads = torch.zeros(q.shape[1])
    monkeypatch.setattr(sinks, "MAX_GRID_Y", q.shape[1] - 1)
    refused(lambda: sinks._op_grads(q, k, v, q, lse, q, None, 0.1, 0, heads),
            f"batch * heads must be at most {q.shape[1] - 1} (the grid's y limit), got 2 * {q.shape[1]}")
    monkeypatch.setattr(sinks, "MAX_GRID_Y", 2 * q.shape[1] - 1)
    launches(lambda: sinks._op_grads(q, k, v, q, lse, q, None, 0.1, 0, heads))  # an entry a slice


def test_a_packed_backward_past_the_y_limit_runs_head_by_head(monkeypatch):
    """The document-mask backward launches across heads, its tiles on y: past 65535
    tiles (a million packed query rows at 16 positions a tile) cuTile refused it,
    after the block maps had run. It then runs head by head, tiles on x, with the
    same gradients (MAX_GRID_Y lowered so that a small call reaches it)."""
    mod = _module("fmha_train_document")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 40, 40, generator=_gen(), device="cpu")
    doc = torch.tensor([[0] * 25 + [1] * 15], dtype=torch.int32)
    dout = torch.randn(q.shape, generator=_gen(3)).to(q.dtype)
    grids = []

    def gradients():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with emulate.emulating():
            out = mod.attention(*leaves, doc=doc)
            return torch.autograd.grad(out, leaves, dout)

    def launch(stream, grid, kernel, args, **kw):
        grids.append((getattr(kernel, "_pyfunc", kernel).__name__, grid))
        return emulate.launch(stream, grid, kernel, args, **kw)

    monkeypatch.setattr(mod.ct, "launch", launch)
    across = gradients()
    tiles = -(-40 // mod.BWD_DQ_TILE_P)
    assert ("fmha_bwd_dq_causal_gqa4_bf16_d128", (1, tiles, 1)) in grids
    grids.clear()
    monkeypatch.setattr(mod, "MAX_GRID_Y", tiles - 1)
    by_head = gradients()
    assert ("fmha_bwd_dq_causal_gqa4_bf16_d128", (tiles, 1, 1)) in grids
    assert all(torch.equal(a, b) for a, b in zip(across, by_head))


def test_the_float8_v_transpose_keeps_its_key_blocks_within_the_x_limit(refused, launches, monkeypatch):
    """transposed_v (and attention, which transposes V for a v_transposed config) has
    V's key blocks on the grid's x axis: cuTile refused seq_k = 2**30 (2**24 blocks
    of 64). Limit lowered so that a small call reaches it."""
    mod = _module("fmha_fp8_llama")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 16, 200, generator=_gen(), device="cpu")
    blocks = -(-200 // mod.V_TRANSPOSE_KEYS)
    monkeypatch.setattr(mod, "MAX_GRID_X", blocks - 1)
    message = f"seq_k must be at most {(blocks - 1) * mod.V_TRANSPOSE_KEYS} to transpose v"
    refused(lambda: mod.transposed_v(v), message)
    refused(lambda: mod.attention(q, k, v), message)  # its configs read V transposed
    monkeypatch.setattr(mod, "MAX_GRID_X", blocks)
    launches(lambda: mod.transposed_v(v))
    launches(lambda: mod.attention(q, k, v))


def test_context_parallel_refuses_a_sequence_past_the_kernels_positions_before_any_transfer():
    """Each ring step calls the kernels at its own q_offset: a whole sequence past
    2**30 positions was refused by the kernel call of one rank's step (zigzag: rank
    0's, whose shard holds the last chunk), after the transfers had started, while
    the other ranks went on. It is a problem of the call, found before the ranks
    agree (the shard lengths are the same on every rank)."""
    from specgen.parallel import ContextParallelAttention

    attn = ContextParallelAttention(_module("fmha_train_gqa_causal"))
    attn.world_size = 2  # shards of two ranks, checked on this one
    q = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16).expand(1, 4, 2**29 + 1, 128)
    k = q[:, :1]
    assert attn._shape_problem(q, k, None, None) == ("the sequence must be at most 1073741824 rows long (the "
                                                     "kernels' int32 positions), got 2 shards of 536870913",
                                                     None)
    assert attn._shape_problem(q[:, :, 1:], k[:, :, 1:], None, None) == (None, None)

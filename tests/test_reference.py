"""The fp64 reference agrees with torch's SDPA on the CPU, q_offset semantics included."""

import math

import pytest
import torch
import torch.nn.functional as F

from specgen.check.reference import attention_reference, causal_mask


def _qkv(batch, heads, kv_heads, seq_q, seq_k, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, seq_k, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, seq_k, d, generator=gen, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize(
    "batch,heads,kv_heads,seq_q,seq_k,q_offset,causal",
    [
        (2, 4, 4, 33, 33, 0, False),
        (2, 4, 4, 33, 33, 0, True),
        (1, 8, 2, 17, 50, 33, True),  # chunked prefill: q_offset = Skv - Sq
        (1, 8, 2, 16, 40, 5, True),  # an offset that leaves keys past the diagonal
        (1, 4, 1, 20, 31, 0, False),
    ],
)
def test_reference_matches_sdpa(batch, heads, kv_heads, seq_q, seq_k, q_offset, causal):
    q, k, v = _qkv(batch, heads, kv_heads, seq_q, seq_k, 32)
    ref = attention_reference(q, k, v, causal=causal, q_offset=q_offset)
    ratio = heads // kv_heads
    mask = causal_mask(seq_q, seq_k, q_offset) if causal else None
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1), attn_mask=mask
    )
    torch.testing.assert_close(ref, expected, rtol=1e-10, atol=1e-10)


def test_causal_mask_semantics():
    mask = causal_mask(3, 6, q_offset=2)
    # Row i sees keys j <= 2 + i.
    assert mask.tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, True, True, False],
    ]


def test_reference_scale_and_query_head_to_kv_head_mapping():
    q, k, v = _qkv(1, 4, 2, 5, 7, 8)
    ref = attention_reference(q, k, v, causal=False, scale=0.3)
    # Query head 3 reads KV head 3 // 2 = 1.
    expected = torch.softmax(q[0, 3] @ k[0, 1].T * 0.3, dim=-1) @ v[0, 1]
    torch.testing.assert_close(ref[0, 3], expected)
    assert ref.dtype == torch.float64
    default = attention_reference(q, k, v, causal=False)
    torch.testing.assert_close(
        default, attention_reference(q, k, v, causal=False, scale=1 / math.sqrt(8))
    )


def test_reference_rejects_bad_head_ratio():
    q, k, v = _qkv(1, 3, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention_reference(q, k, v, causal=False)


def _naive(q, k, v, scale, visible, softcap=None, sinks=None):
    """Row by row, straight from the definitions (independent of the reference)."""
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                terms = []
                for j in range(k.shape[2]):
                    if visible[i, j]:
                        s = float(q[b, h, i] @ k[b, h, j]) * scale
                        if softcap is not None:
                            s = softcap * math.tanh(s / softcap)
                        terms.append((s, j))
                norm = sum(math.exp(s) for s, _ in terms)
                if sinks is not None:
                    norm += math.exp(float(sinks[h]))
                if norm:
                    out[b, h, i] = sum(math.exp(s) * v[b, h, j] for s, j in terms) / norm
                    lse[b, h, i] = math.log(norm)
    return out, lse


@pytest.mark.parametrize("causal,window,softcap,with_sinks", [
    (True, (3, None), None, False),
    (True, (1, None), None, False),  # row 10 sees no key: zeros and -inf
    (False, (2, 1), 4.0, False),
    (True, None, 2.0, True),
    (True, (1, None), None, True),
])
def test_window_softcap_sinks_match_a_naive_loop(causal, window, softcap, with_sinks):
    q, k, v = _qkv(1, 2, 2, 6, 9, 4, seed=3)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64) if with_sinks else None
    q_offset = 5  # rows at 5..10; with window left 3 / 1 some see few keys, some none
    out, lse = attention_reference(q, k, v, causal=causal, q_offset=q_offset, window=window,
                                   softcap=softcap, sinks=sinks, return_lse=True)
    rows = torch.arange(6)[:, None] + q_offset
    cols = torch.arange(9)[None, :]
    visible = torch.ones(6, 9, dtype=torch.bool)
    if causal:
        visible &= cols <= rows
    if window and window[0] is not None:
        visible &= cols >= rows - window[0]
    if window and window[1] is not None:
        visible &= cols <= rows + window[1]
    want, want_lse = _naive(q, k, v, 0.5, visible, softcap, sinks)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    if window == (1, None) and causal:
        assert not with_sinks or torch.isfinite(lse).all()  # a sink keeps every row's lse finite
    empty = ~visible.any(dim=1)
    if window == (1, None) and sinks is None:
        assert empty.any()
    if empty.any() and sinks is None:
        assert (out[:, :, empty] == 0).all() and torch.isneginf(lse[:, :, empty]).all()


def test_dropout_reference_mask_rate_seed_and_scaling():
    from specgen.check.reference import dropout_keep

    keep = dropout_keep(2, 4, 128, 256, q_offset=3, seed=1, dropout_p=0.25)
    assert abs(keep.float().mean().item() - 0.75) < 0.01
    assert torch.equal(keep, dropout_keep(2, 4, 128, 256, q_offset=3, seed=1, dropout_p=0.25))
    assert not torch.equal(keep, dropout_keep(2, 4, 128, 256, q_offset=3, seed=2, dropout_p=0.25))
    # q_offset shifts rows: row i at offset 3 is row i + 3 at offset 0.
    assert torch.equal(keep[:, :, :100], dropout_keep(2, 4, 103, 256, q_offset=0, seed=1,
                                                      dropout_p=0.25)[:, :, 3:])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 32, generator=gen) for _ in range(3))
    plain = attention_reference(q, k, v, causal=True)
    assert torch.equal(attention_reference(q, k, v, causal=True, dropout_p=0.0, seed=5), plain)
    dropped, lse = attention_reference(q, k, v, causal=True, dropout_p=0.25, seed=1, return_lse=True)
    weights = torch.softmax((q.double() @ k.double().transpose(-1, -2) / math.sqrt(32)).masked_fill(
        torch.ones(128, 128, dtype=torch.bool).triu(1), -math.inf), -1)
    keep = dropout_keep(2, 4, 128, 128, q_offset=0, seed=1, dropout_p=0.25)
    assert torch.allclose(dropped, (weights * keep / 0.75) @ v.double())
    assert torch.allclose(lse, attention_reference(q, k, v, causal=True, return_lse=True)[1])


def _fmix32_keep(seed: int, bh: int, row: int, key: int, threshold: int) -> bool:
    """One key's keep bit, by plain integer arithmetic: keys k and k + 8 of each
    aligned 16 share one murmur3 hash, the first taking its low 16 bits."""
    m = 0xFFFFFFFF
    pair = (key // 16) * 8 + key % 8
    x = ((row * 0x9E3779B1) & m) ^ ((pair * 0x85EBCA77) & m) ^ seed ^ ((bh * 0xC2B2AE3D) & m)
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & m
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & m
    x ^= x >> 16
    return ((x >> (16 * ((key // 8) % 2))) & 0xFFFF) >= threshold


def test_dropout_keys_share_a_hash_in_pairs_eight_apart():
    from specgen.check.reference import dropout_keep, dropout_threshold

    assert dropout_threshold(0.15) == round(0.15 * 65536) and dropout_threshold(0.0) == 0
    # p just under 1 would round to the whole range (every key dropped, and a keep
    # rate of 0 to scale by): refused, as the launchers refuse it.
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_threshold(1 - 1e-7)
    assert dropout_threshold(1 - 2**-16) == 2**16 - 1
    keep = dropout_keep(2, 3, 5, 70, q_offset=9, seed=11, dropout_p=0.3)
    threshold = dropout_threshold(0.3)
    for b, h, i, j in [(0, 0, 0, 0), (0, 0, 0, 8), (1, 2, 4, 7), (1, 2, 4, 15), (0, 1, 3, 16),
                       (0, 1, 3, 24), (1, 0, 2, 69), (1, 1, 0, 33), (0, 2, 1, 41)]:
        assert keep[b, h, i, j].item() == _fmix32_keep(11, b * 3 + h, 9 + i, j, threshold), (b, h, i, j)
    # The two halves of a hash are independent draws: the keep rate of a key and of
    # its partner k + 8, and how often both are kept, match independent coins.
    keep = dropout_keep(4, 8, 256, 256, q_offset=0, seed=5, dropout_p=0.5).float()
    low, high = keep.view(4, 8, 256, 16, 2, 8)[..., 0, :], keep.view(4, 8, 256, 16, 2, 8)[..., 1, :]
    assert abs(low.mean().item() - 0.5) < 0.01 and abs(high.mean().item() - 0.5) < 0.01
    assert abs((low * high).mean().item() - 0.25) < 0.01
    # Neighbouring keys (other hashes) are not correlated either.
    assert abs((keep[..., :-1] * keep[..., 1:]).mean().item() - 0.25) < 0.01


@pytest.mark.parametrize("p", [0.3, 0.9999])
def test_dropout_scales_kept_weights_by_the_exact_keep_rate(p):
    """The kernels keep a weight where 16 hash bits clear round(p * 2**16), so the
    keep rate is 1 - threshold / 2**16, not 1 - p; the kept weights are scaled by its
    inverse, so a weight's expectation is unchanged (at p = 0.9999, 1 / (1 - p) was
    7% off: the rate is 7 / 65536, not 6.55 / 65536)."""
    from specgen.check.reference import dropout_threshold

    threshold = dropout_threshold(p)
    # One key per (head, query): its weight is 1, kept or dropped by its own hash.
    q = torch.zeros(1, 16, 64, 8, dtype=torch.float64)
    k = torch.zeros(1, 16, 1, 8, dtype=torch.float64)
    v = torch.ones(1, 16, 1, 8, dtype=torch.float64)
    kept = torch.cat([attention_reference(q, k, v, causal=False, dropout_p=p, seed=seed)[..., 0].flatten()
                      for seed in range(64)])
    values = kept[kept != 0]
    assert values.numel() > 0
    assert torch.all(values == 2**16 / (2**16 - threshold))
    # And the kept share is that rate (within sampling noise).
    rate = (2**16 - threshold) / 2**16
    share = values.numel() / kept.numel()
    assert abs(share - rate) < 4 * math.sqrt(rate * (1 - rate) / kept.numel()) + 1e-9


def test_p_dtype_model_rounds_only_the_weights_of_the_pv_product():
    # One query, two keys: scores 0 and ln(0.3), so the weights are 1 and 0.3. In
    # e4m3 (3 mantissa bits) 0.3 lies between 0.28125 and 0.3125 and rounds to the
    # nearer 0.3125; the normaliser stays 1.3.
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[0.0, 0.0], [math.log(0.3), 0.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[2.0, -1.0], [4.0, 8.0]]]], dtype=torch.float64)
    exact = attention_reference(q, k, v, causal=False, scale=1.0)
    model, lse = attention_reference(q, k, v, causal=False, scale=1.0,
                                     p_dtype=torch.float8_e4m3fn, return_lse=True)
    torch.testing.assert_close(exact[0, 0, 0], (v[0, 0, 0] + 0.3 * v[0, 0, 1]) / 1.3)
    torch.testing.assert_close(model[0, 0, 0], (v[0, 0, 0] + 0.3125 * v[0, 0, 1]) / 1.3)
    torch.testing.assert_close(lse[0, 0, 0], torch.tensor(math.log(1.3), dtype=torch.float64))


def test_p_dtype_model_error_is_within_the_e4m3_rounding_bound():
    # Each weight moves by at most 2**-4 of itself (normal range) or 2**-10 (subnormal),
    # so |model - exact| <= (2**-4 + 2**-10 * Skv) * max|v| per output element.
    q, k, v = _qkv(2, 4, 2, 37, 300, 16, seed=5)
    exact = attention_reference(q, k, v, causal=True, q_offset=263)
    model = attention_reference(q, k, v, causal=True, q_offset=263, p_dtype=torch.float8_e4m3fn)
    err = (model - exact).abs().max().item()
    assert 0 < err <= (2**-4 + 2**-10 * 300) * v.abs().max().item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left,right", [(None, None), (3, None), (None, 2), (0, 0), (4, 1), (2, 7)])
@pytest.mark.parametrize("q_offset", [0, 5, 11])
def test_window_rule_closed_form_matches_the_mask(causal, left, right, q_offset):
    """key_range (the bench's pair count) and visible_mask (the reference, Flex)
    are one rule: per row, the visible keys are exactly [lo, hi], checked against
    the definition written out with plain ints."""
    from specgen.bench.flops import visible_pairs
    from specgen.check.reference import key_range, visible, visible_mask

    seq_q, seq_k = 9, 14
    window = None if left is None and right is None else (left, right)
    mask = visible_mask(seq_q, seq_k, causal=causal, q_offset=q_offset, window=window)
    assert mask.shape == (seq_q, seq_k)
    for i in range(seq_q):
        p = q_offset + i
        expected = [j for j in range(seq_k)
                    if (not causal or j <= p) and (left is None or j >= p - left)
                    and (right is None or j <= p + right)]
        assert [j for j in range(seq_k) if mask[i, j]] == expected
        assert [j for j in range(seq_k)
                if visible(p, j, causal=causal, left=left, right=right)] == expected
        lo, hi = key_range(p, seq_k, causal=causal, left=left, right=right)
        assert list(range(lo, hi + 1)) == expected
    pairs = visible_pairs(seq_q, seq_k, causal, window, q_offset=q_offset)
    assert pairs == int(mask.sum())


def test_negative_q_offset_rows_before_the_first_key_are_zero_with_lse_minus_inf():
    """Sq > Skv aligned bottom-right (q_offset = Skv - Sq): the first Sq - Skv rows see
    no key, give zeros and an LSE of -inf, and nothing is NaN; the rest match SDPA's
    bottom-right causal mask."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 12, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    out, lse = attention_reference(q, k, v, causal=True, q_offset=5 - 12, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, :, :7] == 0).all() and torch.isneginf(lse[:, :, :7]).all()
    mask = torch.ones(12, 5, dtype=torch.bool).tril(diagonal=5 - 12)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double()[:, :, 7:], k.double(), v.double(), attn_mask=mask[7:])
    assert torch.allclose(out[:, :, 7:], want, atol=1e-12)
    # Gradients through the empty rows are zero, not NaN.
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    attention_reference(q64, k64, v64, causal=True, q_offset=-7).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q64, k64, v64))
    assert (q64.grad[:, :, :7] == 0).all()


@pytest.mark.parametrize("paged", [None, {"page_size": 16}])
def test_decode_reference_reads_lengths_as_the_kernels_do(paged):
    """A length past the cache's capacity is read as the capacity, a negative one as
    0 (the kernels' documented rule); the reference gave zeros (contiguous) or raised
    IndexError (paged) past the capacity."""
    from specgen.check.cases import DecodeBatch, decode_reference, random_decode

    spec = {"name": "d", "family": "decode", "dtype": "float32", "head_dim": 16, "gqa_ratio": 2,
            "paged": paged, "window": None}
    g = torch.Generator().manual_seed(3)
    batch = random_decode(spec, [40, 7], kv_heads=2, q_len=3, generator=g, device="cpu")
    capacity = batch.capacity
    assert capacity >= 40
    beyond = DecodeBatch(batch.q, batch.k_cache, batch.v_cache,
                         torch.tensor([capacity + 5, -4], dtype=torch.int32), batch.page_table)
    at = DecodeBatch(batch.q, batch.k_cache, batch.v_cache,
                     torch.tensor([capacity, 0], dtype=torch.int32), batch.page_table)
    if paged is None:  # the slots past 40 hold NaN: give them values, as a full cache would
        beyond.k_cache.nan_to_num_(0.5)
        beyond.v_cache.nan_to_num_(0.25)
    else:
        batch.k_cache.nan_to_num_(0.5)
        batch.v_cache.nan_to_num_(0.25)
    ours, want = decode_reference(spec, beyond, {}), decode_reference(spec, at, {})
    assert torch.isfinite(ours).all() and ours.abs().sum() > 0
    torch.testing.assert_close(ours, want, atol=0, rtol=0)
    assert ours[1].abs().max() == 0  # no key: zeros


def test_a_float16_reference_takes_a_softcap_beyond_float16s_range():
    """The input-dtype reference of the FA rule held a soft-cap of 1e5 as float16's inf
    in its backward: NaN gradients, and correct kernels failed as 'nan of FA's allowance'."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g, dtype=torch.float64) for _ in range(3))
    half = [t.half().requires_grad_(True) for t in (q, k, v)]
    out = attention_reference(*half, causal=True, softcap=1e5, compute_dtype=torch.float16)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in half)
    exact = attention_reference(q, k, v, causal=True, softcap=1e5)
    assert (out.double() - exact).abs().max() < 2e-2


@pytest.mark.parametrize("causal, window, q_offset, sinks, dropout_p", [
    (True, None, 2, False, 0.0), (False, (2, 1), -1, True, 0.3), (True, (3, None), 0, True, 0.0)])
def test_visible_pairs_path_gives_the_plain_forward(causal, window, q_offset, sinks, dropout_p):
    """With gradients taken the score_mod is evaluated at the visible pairs only
    (_visible_pairs); the forward must be the one without gradients: GQA heads, hook
    tables gathered per selected pair, softcap, sinks, dropout and a window with
    q_offset included."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    tensors = {"bias": torch.randn(4, 7, generator=g, dtype=torch.float64),
               "doc": torch.randint(0, 2, (2, 12), generator=g)}
    args = dict(causal=causal, window=window, q_offset=q_offset, softcap=5.0, return_lse=True,
                sinks=torch.randn(4, generator=g, dtype=torch.float64) if sinks else None,
                score_mod="where(score > 0, sqrt(score), -score) + bias[h, kv_idx] / (q_idx + 2)",
                mask_mod="doc[b, q_idx] == doc[b, kv_idx]", tensors=tensors,
                dropout_p=dropout_p, seed=3)
    with torch.no_grad():
        plain = attention_reference(q, k, v, **args)
    picked = attention_reference(q.clone().requires_grad_(), k, v, **args)
    for a, b in zip(plain, picked):
        torch.testing.assert_close(b.detach(), a, rtol=0, atol=0)


def test_compare_lse_fails_a_positive_infinite_or_misshapen_lse():
    """+inf is no row's LSE: it must fail like NaN does, not drop out of the error
    as a non-finite value (a kernel's overflowing lse passed). An lse of another
    shape is refused rather than broadcast against the reference's rows."""
    from specgen.check.cases import compare_lse

    ref = torch.tensor([[[0.5, -math.inf, 1.5, 2.0]]], dtype=torch.float64)
    assert compare_lse(ref.float(), ref).ok
    for bad in (math.inf, math.nan, -math.inf):
        lse = ref.clone()
        lse[0, 0, 2] = bad
        result = compare_lse(lse.float(), ref)
        assert not result.ok and result.nonfinite == 1, (bad, result)
    empty = torch.full((2, 3, 4), -math.inf, dtype=torch.float64)
    with pytest.raises(ValueError, match="shape mismatch"):
        compare_lse(torch.full((1,), -math.inf), empty)

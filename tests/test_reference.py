"""The fp64 reference agrees with torch's SDPA on the CPU, q_offset semantics included."""

import math

import pytest
import torch
import torch.nn.functional as F

from specgen.reference import attention_reference, causal_mask


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

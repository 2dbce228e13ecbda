"""Check: how a kernel's output is compared with the fp64 reference."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

# Relative error allowed per dtype: max |out - ref| / max |ref| (quack's TOLERANCES
# idea: one table, every check reads it).
TOLERANCES = {
    "float16": 1e-2,
    "bfloat16": 1e-2,
    # float8 kernels round P to e4m3 (3 mantissa bits) for the P @ V MMA, as
    # FlashAttention-3 does. A float64 reference that differs from the exact one only
    # by that rounding reached 3.4e-2 on the 200 seed-1 fuzz shapes (docs/experiments.md,
    # section 20); the kernel's own worst there was 3.3e-2.
    "float8_e4m3fn": 5e-2,
}
# The descales a float8 test or benchmark passes (values are stored as value / descale).
FP8_DESCALES = {"q_descale": 0.5, "k_descale": 1.25, "v_descale": 2.0}


def p_rounding(spec: dict):
    """The type a spec's kernel rounds P to for the P @ V MMA when that rounding is
    coarser than the output's (float8: e4m3), else None. The check reports the error
    of a reference that rounds only P next to the kernel's, so a float8 tolerance
    can be read against what the format alone costs."""
    return torch.float8_e4m3fn if spec["dtype"] == "float8_e4m3fn" else None


def output_dtype(spec: dict) -> str:
    """The element type of a spec's output."""
    if spec.get("out_dtype"):
        return spec["out_dtype"]
    return "bfloat16" if spec["dtype"] == "float8_e4m3fn" else spec["dtype"]


@dataclass(frozen=True)
class Comparison:
    max_abs_err: float
    rel_err: float
    nonfinite: int  # NaN/inf in the output: unwritten (poisoned) or broken elements
    ok: bool


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> Comparison:
    """Compare ``out`` with the float64 ``ref``; any non-finite output fails."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    out64 = out.to(torch.float64)
    nonfinite = int((~torch.isfinite(out64)).sum())
    if out.numel() == 0:
        return Comparison(0.0, 0.0, 0, True)
    err = (out64 - ref).abs().max().item() if nonfinite == 0 else float("inf")
    scale = max(ref.abs().max().item(), 1e-30)
    rel = err / scale
    return Comparison(err, rel, nonfinite, nonfinite == 0 and rel <= TOLERANCES[dtype])


def random_qkv(spec: dict, batch: int, kv_heads: int, seq_q: int, seq_k: int, *,
               generator=None, layout: str = "contiguous", device="cuda"):
    """Random q [B, Hq, Sq, D], k [B, Hkv, Skv, D] and v [B, Hkv, Skv, Dv] for
    ``spec`` (its SPEC dict), N(0, 1) in the spec's dtype. ``layout`` "transposed"
    makes each a [B, S, H, D] tensor seen as [B, H, S, D] (non-contiguous);
    "sliced" the first S rows of a longer [B, H, S + 37, D] buffer."""
    dtype = getattr(torch, spec["dtype"])
    d = spec["head_dim"]
    dv = spec.get("v_head_dim") or d

    def rand(heads: int, seq: int, dim: int) -> torch.Tensor:
        if layout == "sliced":  # a view of the first seq rows of a longer buffer
            t = torch.randn((batch, heads, seq + 37, dim), generator=generator, device=device,
                            dtype=torch.float32).to(dtype)
            return t[:, :, :seq]
        shape = (batch, seq, heads, dim) if layout == "transposed" else (batch, heads, seq, dim)
        t = torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
        return t.transpose(1, 2) if layout == "transposed" else t

    heads = kv_heads * spec["gqa_ratio"]
    return rand(heads, seq_q, d), rand(kv_heads, seq_k, d), rand(kv_heads, seq_k, dv)


@dataclass(frozen=True)
class Packed:
    """A varlen batch: packed q [total_q, Hq, D], k/v [total_k, Hkv, D*], the
    cumulative lengths (int32, starting at 0) and the same lengths on the host
    (so building a call's arguments never reads the device)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    lengths: tuple[tuple[int, int], ...]  # (seq_q, seq_k) per sequence

    def kwargs(self) -> dict:
        return {"cu_seqlens_q": self.cu_seqlens_q, "cu_seqlens_k": self.cu_seqlens_k,
                "max_seqlen_q": max(q for q, _ in self.lengths),
                "max_seqlen_k": max(k for _, k in self.lengths)}


def random_packed(spec: dict, lengths: list[tuple[int, int]], kv_heads: int, generator=None,
                  device="cuda") -> Packed:
    """A packed varlen batch of (seq_q, seq_k) per sequence, N(0, 1) in the spec's dtype."""
    dtype = getattr(torch, spec["dtype"])
    d, dv = spec["head_dim"], spec.get("v_head_dim") or spec["head_dim"]
    total_q, total_k = sum(q for q, _ in lengths), sum(k for _, k in lengths)

    def rand(*shape):
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    def cumulative(values):
        return torch.tensor([0] + list(itertools.accumulate(values)), dtype=torch.int32, device=device)

    heads = kv_heads * spec["gqa_ratio"]
    return Packed(rand(total_q, heads, d), rand(total_k, kv_heads, d), rand(total_k, kv_heads, dv),
                  cumulative(q for q, _ in lengths), cumulative(k for _, k in lengths),
                  tuple(tuple(pair) for pair in lengths))


def packed_reference(spec: dict, batch: Packed, extra: dict, scale=None, p_dtype=None,
                     compute_dtype=torch.float64):
    """The fp64 reference of a varlen batch, one sequence at a time (its queries
    are its last seq_q positions): out [total_q, Hq, Dv] and lse [Hq, total_q]."""
    outs, lses = [], []
    cq, ck = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    for i, (len_q, len_k) in enumerate(batch.lengths):
        q = batch.q[cq[i]:cq[i + 1]].transpose(0, 1)[None]
        k = batch.k[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        v = batch.v[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        out, lse = reference_for(spec, q, k, v, extra, q_offset=len_k - len_q, scale=scale,
                                 p_dtype=p_dtype, compute_dtype=compute_dtype)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def shape_dims(q: torch.Tensor, k: torch.Tensor) -> dict:
    """The named sizes of a call, for hook tensor shapes: batch, heads, ..."""
    return {"batch": q.shape[0], "heads": q.shape[1], "kv_heads": k.shape[1],
            "seq_q": q.shape[2], "seq_k": k.shape[2]}


def poisoned_out(spec: dict, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An output buffer [B, Hq, Sq, Dv] full of NaN: an element never written fails."""
    return torch.full((*q.shape[:3], v.shape[3]), float("nan"), dtype=getattr(torch, output_dtype(spec)),
                      device=q.device)


DROPOUT_P = 0.15  # what tests and benchmarks of a dropout spec use


def feature_inputs(spec: dict, dims: dict, generator=None, device="cuda") -> dict:
    """The extra keyword tensors a spec's ``attention`` takes (``sinks`` [Hq], hook
    tensors), drawn at random: sinks around the scale of real logits, so they
    matter. ``dims``: batch, heads, kv_heads, seq_q, seq_k (see shape_dims)."""
    extra = {}
    if spec.get("sinks"):
        extra["sinks"] = torch.randn(dims["heads"], device=device, generator=generator) * 2.0
    extra.update(hook_tensors(spec, dims, generator, device))
    if spec["dtype"] == "float8_e4m3fn":
        extra.update(FP8_DESCALES)
    if spec.get("kv_dtype") == "float8_e4m3fn":  # a decode spec's float8 cache
        extra.update({n: FP8_DESCALES[n] for n in ("k_descale", "v_descale")})
    if spec.get("dropout"):
        extra["dropout_p"] = DROPOUT_P
        extra["seed"] = int(torch.randint(0, 2**31 - 1, (1,), device=device, generator=generator))
    return extra


def hook_tensors(spec: dict, dims: dict, generator=None, device="cuda") -> dict:
    """Random values for the spec's hook tensors, shaped by ``dims`` (batch, heads,
    kv_heads, seq_q, seq_k). float32: ALiBi-like slopes in (1/256, 1]. int32, by its
    last axis: along seq_q or seq_k, ids that stay constant over random runs
    (document ids), so a mask built from them keeps blocks of every size; along a
    fixed size, 0/1 flags set with probability 0.1 (a block pattern); along batch
    or heads, positions in [0, seq_k] (a prefix length)."""
    made = {}
    for name, decl in (spec.get("tensors") or {}).items():
        shape = tuple(dims[d] if isinstance(d, str) else d for d in decl["shape"])
        last = decl["shape"][-1]
        if decl["dtype"] == "float32":
            u = torch.rand(shape, device=device, generator=generator)
            made[name] = torch.exp2(-8.0 * u)
        elif isinstance(last, int):
            flags = torch.rand(shape, device=device, generator=generator) < 0.1
            made[name] = flags.to(torch.int32)
        elif last not in ("seq_q", "seq_k"):
            high = dims.get("seq_k", 1) + 1
            made[name] = torch.randint(0, high, shape, device=device, generator=generator,
                                       dtype=torch.int32)
        else:
            starts = torch.rand(shape, device=device, generator=generator) < 1 / 256
            made[name] = torch.cumsum(starts.to(torch.int32), dim=-1, dtype=torch.int32)
    return made


def call_kernel(module, q, k, v, extra: dict, **kwargs):
    """``module.attention`` with the spec's extra inputs; returns (out, lse or None)."""
    result = module.attention(q, k, v, **kwargs, **extra)
    if module.SPEC.get("return_lse"):
        return result
    return result, None


def prescaled_q(spec: dict, q, scale=None):
    """(Q * pre rounded to Q's dtype, the scale that turns its products with K into
    the scores) for a ``prescale_q`` spec, whose kernels multiply Q by pre in float32
    and round it once: pre is the softmax scale, divided by the soft-cap where there
    is one, else times 1/ln2 where the exponentials are exp2 (and no score_mod reads
    the score in natural-log units). Differentiable in q."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    f32 = float(torch.tensor(scale, dtype=torch.float32))
    if spec.get("softcap") is not None:
        pre = f32 / float(torch.tensor(spec["softcap"], dtype=torch.float32))
    elif (spec.get("fast_math") or {}).get("exp2", True) and not spec.get("score_mod"):
        pre = f32 * float(torch.tensor(1.0 / math.log(2.0), dtype=torch.float32))
    else:
        pre = f32
    pre = float(torch.tensor(pre, dtype=torch.float32))
    return (q.to(torch.float32) * pre).to(q.dtype), scale / pre


def reference_for(spec: dict, q, k, v, extra: dict, *, q_offset: int = 0, scale=None,
                  p_dtype=None, compute_dtype=torch.float64, batch_offset: int = 0):
    """The fp64 reference of ``spec`` (window, soft-cap, sinks): (out, lse).
    ``p_dtype``: the P-rounding model of attention_reference (see p_rounding).
    With a ``compute_dtype`` other than float64 (the same math in the input dtype,
    for FlashAttention's gradient rule), a ``prescale_q`` spec's Q is first
    multiplied by the kernels' pre-scale and rounded once, as its kernels do."""
    from specgen.check.reference import attention_reference

    window = spec.get("window")
    tensors = {name: extra[name] for name in spec.get("tensors") or {}}
    if spec.get("prescale_q") and compute_dtype != torch.float64:
        q, scale = prescaled_q(spec, q, scale)
    if spec["dtype"] == "float8_e4m3fn":  # the values the float8 tensors stand for
        q, k, v = (t.to(torch.float32).to(torch.float64) * extra.get(name, 1.0)
                   for t, name in ((q, "q_descale"), (k, "k_descale"), (v, "v_descale")))
    return attention_reference(
        q, k, v, causal=spec["causal"], scale=scale, q_offset=q_offset,
        window=(window["left"], window["right"]) if window else None,
        softcap=spec.get("softcap"), sinks=extra.get("sinks"), return_lse=True,
        score_mod=spec.get("score_mod"), mask_mod=spec.get("mask_mod"), tensors=tensors,
        dropout_p=extra.get("dropout_p", 0.0), seed=extra.get("seed", 0), p_dtype=p_dtype,
        compute_dtype=compute_dtype, batch_offset=batch_offset,
    )


def compare_lse(lse: torch.Tensor, ref: torch.Tensor) -> Comparison:
    """LSE against the fp64 one: -inf exactly where the reference is -inf (rows
    that see no key), finite with absolute error <= 1e-2 elsewhere (natural-log
    units). ``mismatch`` counts the rows where one is -inf and the other is not, and
    every NaN or +inf, which no row's LSE is."""
    if lse.shape != ref.shape:  # broadcasting would compare the wrong rows
        raise ValueError(f"shape mismatch: lse {tuple(lse.shape)} vs ref {tuple(ref.shape)}")
    lse64 = lse.to(torch.float64)
    empty = torch.isneginf(ref)
    wrong = (torch.isneginf(lse64) != empty) | torch.isnan(lse64) | torch.isposinf(lse64)
    mismatch = int(wrong.sum())
    finite = ~empty & torch.isfinite(lse64)
    err = (lse64[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    return Comparison(err, err, mismatch, mismatch == 0 and err <= 1e-2)


@dataclass(frozen=True)
class SmokeCase:
    """One ragged chunked-prefill shape (B2, Hkv2, Sq333, Skv1000, q_offset 667
    when causal or windowed) and its fp64 reference: the check a config or
    variant passes before it is timed or written anywhere."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_offset: int
    extra: dict  # sinks, where the spec has them
    ref: torch.Tensor


def smoke_case(spec: dict, generator=None) -> SmokeCase:
    """The smoke case of a spec (its SPEC dict or spec_to_dict form)."""
    q, k, v = random_qkv(spec, 2, 2, 333, 1000, generator=generator)
    q_offset = 667 if spec["causal"] or spec.get("window") else 0
    extra = feature_inputs(spec, shape_dims(q, k), generator)
    ref, _ = reference_for(spec, q, k, v, extra, q_offset=q_offset)
    return SmokeCase(q, k, v, q_offset, extra, ref)


@dataclass(frozen=True)
class DecodeBatch:
    """A decode call: q [B, q_len, Hq, D], the caches (contiguous [B, max_len, Hkv, D]
    or pages [num_pages, page_size, Hkv, D] with a page table) and seq_lens [B]. A
    spec with v_cache_transposed stores V keys last: [B, Hkv, D, L] or pages
    [num_pages, Hkv, D, page_size]."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor | None
    v_transposed: bool = False

    def args(self) -> tuple:
        return ((self.q, self.k_cache, self.v_cache, self.seq_lens)
                + ((self.page_table,) if self.page_table is not None else ()))

    @property
    def capacity(self) -> int:
        """Key positions of the cache: max_len, or the page table's pages x page_size."""
        if self.page_table is None:
            return self.k_cache.shape[1]
        return self.page_table.shape[1] * self.k_cache.shape[1]

    def dims(self) -> dict:
        """The sizes hook tensors are declared in (seq_k: the cache's positions)."""
        heads, kv_heads = self.q.shape[2], self.k_cache.shape[2]
        return {"batch": self.q.shape[0], "heads": heads, "kv_heads": kv_heads,
                "seq_k": self.capacity}

    def seq_len(self, b: int) -> int:
        """Sequence b's length as the kernels read it: a negative length as 0 and a
        length past the cache's capacity as the capacity."""
        return min(max(int(self.seq_lens[b]), 0), self.capacity)

    def keys(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's cached K and V, [Hkv, seq_len, D] each."""
        n = self.seq_len(b)
        # V in the usual layout ([B, L, Hkv, D] or [num_pages, page_size, Hkv, D]).
        v_cache = self.v_cache.permute(0, 3, 1, 2) if self.v_transposed else self.v_cache
        if self.page_table is None:
            return self.k_cache[b, :n].transpose(0, 1), v_cache[b, :n].transpose(0, 1)
        size = self.k_cache.shape[1]
        pos = torch.arange(n, device=self.q.device)
        pages = self.page_table[b, pos // size].long()
        return (self.k_cache[pages, pos % size].transpose(0, 1),
                v_cache[pages, pos % size].transpose(0, 1))


def random_decode(spec: dict, seq_lens: list[int], kv_heads: int, q_len: int,
                  generator=None, device="cuda") -> DecodeBatch:
    """Random q and caches for ``seq_lens``; every cache slot past a sequence's
    length holds NaN, so a kernel that reads one into its result fails the check.
    A paged cache gets its pages in a shuffled order (and one spare page). A
    float8 cache (``kv_dtype``) holds N(0, 1) values / FP8_DESCALES' k and v descales.
    With ``v_cache_transposed`` V is stored keys last, a contiguous cache's key axis
    padded to a multiple of 16 (with NaN)."""
    dtype = getattr(torch, spec["dtype"])
    kv_dtype = getattr(torch, spec.get("kv_dtype") or spec["dtype"])
    d, batch = spec["head_dim"], len(seq_lens)
    heads = kv_heads * spec["gqa_ratio"]

    fp8 = kv_dtype == torch.float8_e4m3fn
    k_descale, v_descale = (FP8_DESCALES["k_descale"], FP8_DESCALES["v_descale"]) if fp8 else (1.0, 1.0)

    def rand(*shape, descale=1.0, to=dtype):
        return (torch.randn(shape, generator=generator, device=device) / descale).to(to)

    def rand_k(*shape):
        return rand(*shape, descale=k_descale, to=kv_dtype)

    def rand_v(*shape):
        return rand(*shape, descale=v_descale, to=kv_dtype)

    q = rand(batch, q_len, heads, d)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    paged = spec.get("paged")
    transposed = bool(spec.get("v_cache_transposed"))
    if not paged:
        max_len = max(seq_lens)
        k, v = rand_k(batch, max_len, kv_heads, d), rand_v(batch, max_len, kv_heads, d)
        for b, n in enumerate(seq_lens):
            k[b, n:] = float("nan")
            v[b, n:] = float("nan")
        if transposed:
            padded = torch.full((batch, kv_heads, d, -(-max_len // 16) * 16), float("nan"),
                                dtype=kv_dtype, device=device)
            padded[..., :max_len] = v.permute(0, 2, 3, 1)
            v = padded
        return DecodeBatch(q, k, v, lens, None, transposed)
    size = paged["page_size"]
    per_seq = [-(-n // size) for n in seq_lens]
    num_pages = sum(per_seq) + 1
    order = torch.randperm(num_pages, generator=generator, device=device).to(torch.int32)
    table = torch.zeros(batch, max(per_seq), dtype=torch.int32, device=device)
    k = torch.full((num_pages, size, kv_heads, d), float("nan"), dtype=kv_dtype, device=device)
    v = torch.full_like(k, float("nan"))
    used = 0
    for b, (n, count) in enumerate(zip(seq_lens, per_seq)):
        table[b, :count] = order[used:used + count]
        used += count
        pos = torch.arange(n, device=device)
        pages = table[b, pos // size].long()
        k[pages, pos % size] = rand_k(n, kv_heads, d)
        v[pages, pos % size] = rand_v(n, kv_heads, d)
    if transposed:
        v = v.permute(0, 2, 3, 1).contiguous()
    return DecodeBatch(q, k, v, lens, table, transposed)


def decode_reference(spec: dict, batch: DecodeBatch, extra: dict, scale=None) -> torch.Tensor:
    """The fp64 reference of a decode call: each sequence's q_len new tokens are its
    last positions, against its cached keys (window, sinks, mask_mod)."""
    outs = []
    q_len = batch.q.shape[1]
    for b in range(batch.q.shape[0]):
        k, v = batch.keys(b)
        if k.dtype == torch.float8_e4m3fn:  # the values the float8 cache stands for
            k = k.to(torch.float64) * float(extra.get("k_descale", 1.0))
            v = v.to(torch.float64) * float(extra.get("v_descale", 1.0))
        q = batch.q[b].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        n = batch.seq_len(b)
        out, _ = reference_for({**spec, "causal": True}, q, k[None], v[None], extra,
                               q_offset=n - q_len, scale=scale, batch_offset=b)
        outs.append(out[0].transpose(0, 1))
    return torch.stack(outs)

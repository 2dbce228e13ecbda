"""A batch whose batch × heads pass the grid's y limit (65535) runs as slices of the
batch, one launch each, with the bits of the whole call; what cannot be sliced is
refused as before. Emulated on the CPU, with the limit lowered so small calls reach it."""

import pytest
import torch

from specgen.check import emulate
from specgen.check.cases import random_qkv

from .helpers import emulated_module, launch_grids

_MODULES = {}


def _module(name):
    if name not in _MODULES:
        _MODULES[name] = emulated_module(name, "batch_slices")
    return _MODULES[name]


def _qkv(mod, batch, seed=0, requires_grad=False):
    q, k, v = random_qkv(mod.SPEC, batch, 1, 40, 56, generator=torch.Generator().manual_seed(seed), device="cpu")
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _whole_and_sliced(mod, run, heads, monkeypatch):
    """run() as it is, then with the y limit lowered to two entries of ``heads`` CTA
    rows: (whole, sliced, the sliced run's grids)."""
    with emulate.emulating():
        whole = run()
        monkeypatch.setattr(mod, "MAX_GRID_Y", 2 * heads)
        grids = launch_grids(mod, monkeypatch)
        sliced = run()
    return whole, sliced, grids


@pytest.mark.parametrize("name, extra", [("fmha_gemma_softcap", {}), ("fmha_mistral_window", {}),
                                         ("fmha_vit_dropout", {"dropout_p": 0.0}), ("fmha_alibi", "slope"),
                                         ("fmha_gptoss_sinks", "sinks")])
def test_forward_runs_in_batch_slices_with_the_bits_of_one_call(name, extra, monkeypatch):
    mod = _module(name)
    q, k, v = _qkv(mod, 5)
    if isinstance(extra, str):  # a per-head tensor the kernel reads: passed to every slice
        extra = {extra: torch.randn(q.shape[1], generator=torch.Generator().manual_seed(4))}
    heads = q.shape[1]
    whole, sliced, grids = _whole_and_sliced(mod, lambda: mod.attention(q, k, v, **extra), heads, monkeypatch)
    assert [g[1] for g in grids] == [2 * heads, 2 * heads, heads]
    for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (sliced, whole)), strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()  # out, and lse where returned


def test_training_forward_and_backward_run_in_batch_slices(monkeypatch):
    mod = _module("fmha_train_gqa_causal")

    def run():
        q, k, v = _qkv(mod, 5, seed=1, requires_grad=True)
        out = mod.attention(q, k, v)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
        return out.detach(), q.grad, k.grad, v.grad

    heads = mod.SPEC["gqa_ratio"]  # one KV head
    whole, sliced, grids = _whole_and_sliced(mod, run, heads, monkeypatch)
    # Forward: three slices; backward: dQ and dK/dV kernels for each of three slices.
    assert len(grids) == 3 + 2 * 3 and max(g[1] for g in grids) <= 2 * heads
    for a, b in zip(sliced, whole):
        assert torch.equal(a, b) and a.stride() == b.stride()


def test_a_tile_order_with_the_tiles_on_y_needs_no_slices(monkeypatch):
    """fmha_gqa_causal's short-key config launches (batch × heads, tiles): its y axis
    holds query tiles, so a lowered y limit slices nothing."""
    mod = _module("fmha_gqa_causal")
    q, k, v = _qkv(mod, 5)
    monkeypatch.setattr(mod, "MAX_GRID_Y", 2 * q.shape[1])
    grids = launch_grids(mod, monkeypatch)
    with emulate.emulating():
        mod.attention(q, k, v)
    assert grids == [(5 * q.shape[1], 1, 1)]


def test_what_cannot_be_sliced_is_still_refused(monkeypatch):
    dropout = _module("fmha_vit_dropout")
    q, k, v = _qkv(dropout, 5)
    monkeypatch.setattr(dropout, "MAX_GRID_Y", 2 * q.shape[1])
    with emulate.emulating(), pytest.raises(ValueError, match="the grid's y limit"):
        dropout.attention(q, k, v, dropout_p=0.25, seed=3)  # its mask is drawn per batch index
    sparse = _module("fmha_chunked_local")
    q, k, v = _qkv(sparse, 5)
    monkeypatch.setattr(sparse, "MAX_GRID_Y", 2 * q.shape[1])
    with emulate.emulating(), pytest.raises(ValueError, match="at most"):
        sparse.attention(q, k, v)  # its block map has a batch axis


@pytest.mark.parametrize("given_max", [True, False], ids=["max-seqlen-given", "read-on-host"])
def test_packed_sequences_launch_in_slices_of_cu_seqlens(given_max, monkeypatch):
    """Sequences × heads past the y limit: a launch per slice of the sequences, each
    reading its slice of cu_seqlens, with the bits of one launch (out and lse)."""
    from specgen.check.cases import random_packed

    mod = _module("fmha_varlen_llama")
    packed = random_packed(mod.SPEC, [(5, 30), (40, 60), (1, 1), (17, 17), (0, 9)], 1,
                           generator=torch.Generator().manual_seed(5), device="cpu")
    q, k, v, cu_q, cu_k = packed.q, packed.k, packed.v, packed.cu_seqlens_q, packed.cu_seqlens_k
    before = cu_q.clone(), cu_k.clone()
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if given_max:
        kw.update(max_seqlen_q=40, max_seqlen_k=60)
    heads = q.shape[1]
    whole, sliced, grids = _whole_and_sliced(mod, lambda: mod.attention(q, k, v, **kw), heads, monkeypatch)
    assert [g[1] for g in grids] == [2 * heads, 2 * heads, heads]
    for a, b in zip(sliced, whole, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(cu_q, before[0]) and torch.equal(cu_k, before[1])  # the caller's, untouched


def test_packed_training_runs_in_slices_forward_and_backward(monkeypatch):
    """A training varlen module: the forward and both backward kernels launch over
    slices of cu_seqlens, with the bits of one launch each."""
    from specgen.check.cases import random_packed

    from .helpers import emulated_spec_module, trained_spec_data

    data = trained_spec_data("fmha_varlen_llama")
    data.update(return_lse=False, name="varlen_trained_slices")
    mod = emulated_spec_module(data, "batch_slices")
    packed = random_packed(mod.SPEC, [(5, 30), (40, 60), (1, 1), (17, 17), (3, 9)], 1,
                           generator=torch.Generator().manual_seed(7), device="cpu")

    def run():
        q, k, v = (t.clone().requires_grad_() for t in (packed.q, packed.k, packed.v))
        out = mod.attention(q, k, v, cu_seqlens_q=packed.cu_seqlens_q, cu_seqlens_k=packed.cu_seqlens_k)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype))
        return out.detach(), q.grad, k.grad, v.grad

    heads = packed.q.shape[1]
    whole, sliced, grids = _whole_and_sliced(mod, run, heads, monkeypatch)
    assert len(grids) == 3 + 2 * 3 and max(g[1] for g in grids) <= 2 * heads
    for a, b in zip(sliced, whole, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec, varlen", [("fmha_gemma_softcap", False), ("fmha_varlen_llama", True)])
def test_training_with_a_loss_on_the_lse_runs_in_slices(spec, varlen, monkeypatch):
    """return_lse training: the LSE gradient goes to each slice (a packed one is read
    at the rows' offsets as is), with the bits of one call."""
    from specgen.check.cases import random_packed

    from .helpers import emulated_spec_module, trained_spec_data

    data = trained_spec_data(spec)
    data.update(return_lse=True, name=f"{spec}_lse_slices")
    mod = emulated_spec_module(data, "batch_slices")
    if varlen:
        packed = random_packed(mod.SPEC, [(5, 30), (40, 60), (1, 1), (17, 17), (3, 9)], 1,
                               generator=torch.Generator().manual_seed(6), device="cpu")
        inputs = (packed.q, packed.k, packed.v)
        kw = dict(cu_seqlens_q=packed.cu_seqlens_q, cu_seqlens_k=packed.cu_seqlens_k)
    else:
        inputs, kw = _qkv(mod, 5, seed=6), {}

    def run():
        q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
        out, lse = mod.attention(q, k, v, **kw)
        gen = torch.Generator().manual_seed(3)
        loss = (out.float() * torch.randn(out.shape, generator=gen)).sum()
        loss = loss + (lse * torch.randn(lse.shape, generator=gen)).sum()
        loss.backward()
        return out.detach(), lse.detach(), q.grad, k.grad, v.grad

    heads = inputs[0].shape[1]
    whole, sliced, grids = _whole_and_sliced(mod, run, heads, monkeypatch)
    assert len(grids) == 3 + 2 * 3 and max(g[1] for g in grids) <= 2 * heads
    for a, b in zip(sliced, whole, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("longest", [300, 3000], ids=["one-split", "split-kv"])
@pytest.mark.parametrize("name", ["fmha_decode_gqa8_bf16", "fmha_decode_mha_paged_f16"])
def test_decode_batch_runs_in_slices(name, longest, monkeypatch):
    """batch × KV heads past the y limit: slices of 16-entry multiples, a call each.
    Each slice picks its own split count for its batch, so where the whole batch
    would split the keys otherwise the sums round otherwise (within the dtype's
    tolerance); with one split the bits are the whole call's."""
    from specgen.check.cases import TOLERANCES, random_decode

    mod = _module(name)
    lengths = torch.randint(1, longest, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    batch = random_decode(mod.SPEC, lengths, 1, 1, generator=torch.Generator().manual_seed(9), device="cpu")
    args = batch.args()
    with emulate.emulating():
        one = launch_grids(mod, monkeypatch)
        whole = mod.attention(*args)
        one = list(one)
        monkeypatch.setattr(mod, "MAX_GRID_Y", 39)  # slices of 32 (a multiple of 16) and 8
        grids = launch_grids(mod, monkeypatch)
        sliced = mod.attention(*args)
        # launch_plan describes one launch: it points a batch this large to its slices.
        with pytest.raises(ValueError, match="runs such a batch in slices of 32: ask for a slice's plan"):
            mod.launch_plan(40, 1, longest, torch.device("cpu"))  # the emulated GPU
    assert max(g[1] for g in one) == 40 and max(g[1] for g in grids) <= 39
    assert any(g[1] == 32 for g in grids) and any(g[1] == 8 for g in grids)
    if longest == 300:
        assert len(one) == 1 and len(grids) == 2 and torch.equal(sliced, whole)
    else:
        err = (sliced.double() - whole.double()).abs().max() / whole.double().abs().max()
        assert len(one) == 2 and err <= TOLERANCES[mod.SPEC["dtype"]]


def test_a_v_made_by_transposed_v_is_sliced_as_it_is(monkeypatch):
    """A config that reads V transposed, given a V that transposed_v made: each slice
    is told so (it used to read the slice's [b, Hkv, Dv, Skv] as [b, Hkv, Skv, Dv])."""
    from .helpers import emulated_spec_module, prefill_variant_data

    mod = emulated_spec_module(prefill_variant_data("v_pre_slices", {
        "head_dim": 96, "v_head_dim": 80, "prescale_q": False, "gqa_ratio": 2,
        "targets": {"default": {"tile_m": 64, "tile_n": 64, "v_transposed": True}}}), "batch_slices")
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(3, 4, 50, 96, generator=gen).half()
    k = torch.randn(3, 2, 70, 96, generator=gen).half()
    v = torch.randn(3, 2, 70, 80, generator=gen).half()
    with emulate.emulating():
        v_t = mod.transposed_v(v)
    whole, sliced, grids = _whole_and_sliced(mod, lambda: mod.attention(q, k, v_t, v_transposed=True), 2,
                                             monkeypatch)
    assert len([g for g in grids if g[1] <= 4]) >= 2  # the attention ran in slices
    assert torch.equal(sliced, whole)


def test_a_hook_that_reads_b_is_not_sliced(monkeypatch):
    """A slice's kernels count b from the slice's first entry: a hook that reads b
    (here each entry's scores times b + 1) gave every slice after the first the
    first slice's b, silently. Past the y limit such a batch is refused."""
    from .helpers import emulated_spec_module, prefill_variant_data

    mod = emulated_spec_module(prefill_variant_data("b_hook_slices", {"score_mod": "score * (b + 1)"}),
                               "batch_slices")
    q, k, v = _qkv(mod, 5, seed=10)
    monkeypatch.setattr(mod, "MAX_GRID_Y", 2 * q.shape[1])
    grids = launch_grids(mod, monkeypatch)
    with emulate.emulating(), pytest.raises(ValueError, match="the grid's y limit"):
        mod.attention(q, k, v)
    assert grids == [] and not mod.GRID_Y_SLICES


def test_a_decode_mask_that_reads_b_is_not_sliced(monkeypatch):
    """As the prefill's: a decode slice's kernels count b from its first sequence."""
    from specgen.check.cases import random_decode

    from .helpers import decode_variant_data, emulated_spec_module

    mod = emulated_spec_module(decode_variant_data("b_mask_slices", {
        "gqa_ratio": 4, "mask_mod": "kv_idx % (b + 2) != 0"}), "batch_slices")
    lengths = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    batch = random_decode(mod.SPEC, lengths, 1, 1, generator=torch.Generator().manual_seed(12), device="cpu")
    monkeypatch.setattr(mod, "MAX_GRID_Y", 39)
    grids = launch_grids(mod, monkeypatch)
    with emulate.emulating(), pytest.raises(ValueError, match="the grid's y limit"):
        mod.attention(*batch.args())
    assert grids == []


def _hook_choices_module():
    import yaml

    from .helpers import ROOT, emulated_spec_module

    if "hook_choices" not in _MODULES:
        data = yaml.safe_load((ROOT / "bench" / "train" / "fmha_train_hook_choices.yaml").read_text())
        _MODULES["hook_choices"] = emulated_spec_module(data, "batch_slices")
    return _MODULES["hook_choices"]


@pytest.mark.parametrize("name, tensor", [("fmha_train_gptoss_sinks", "sinks"), ("hook_choices", "slope")])
def test_training_with_gradients_summed_over_the_batch_runs_in_slices(name, tensor, monkeypatch):
    """The sinks' and a learnable tensor's gradients are sums over the batch: the
    backward refused a batch × heads past the grid's y limit (gpt-oss's 64 heads at a
    batch of 1,024) after its forward had run in slices. Each slice now returns its
    part in float32 and the call adds them up: dq, dk and dv keep the bits of one call,
    the summed gradient agrees to float32 rounding."""
    mod = _hook_choices_module() if name == "hook_choices" else _module(name)

    def run():
        q, k, v = _qkv(mod, 5, seed=3, requires_grad=True)
        param = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(5)).requires_grad_()
        out = mod.attention(q, k, v, **{tensor: param})
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(out.dtype))
        return out.detach(), q.grad, k.grad, v.grad, param.grad

    heads = mod.SPEC["gqa_ratio"]  # one KV head
    whole, sliced, grids = _whole_and_sliced(mod, run, heads, monkeypatch)
    assert max(g[1] for g in grids) <= 2 * heads and len(grids) >= 2 * 3  # three slices' kernels
    for a, b in zip(sliced[:4], whole[:4]):
        assert torch.equal(a, b) and a.stride() == b.stride()
    assert sliced[4].dtype == whole[4].dtype == torch.float32
    torch.testing.assert_close(sliced[4], whole[4], rtol=1e-5, atol=1e-6)
    assert sliced[4].abs().max() > 0


def test_packed_training_with_sinks_runs_in_slices(monkeypatch):
    """A varlen training module with sinks (gpt-oss on packed sequences): past the y
    limit its forward and backward were refused, even a forward under no_grad, which
    its forward-only twin runs in slices. Both run over slices of cu_seqlens now; each
    slice's dQ kernel stores its sequences' shares of the sinks' gradient, gathered
    in the whole call's buffer and summed once: every gradient, dsinks included, has
    the bits of one launch."""
    from specgen.check.cases import random_packed

    from .helpers import emulated_spec_module, trained_spec_data

    data = trained_spec_data("fmha_varlen_llama")
    data.update(sinks=True, name="varlen_sinks_slices")
    mod = emulated_spec_module(data, "batch_slices")
    packed = random_packed(mod.SPEC, [(5, 30), (40, 60), (1, 1), (17, 17), (0, 9)], 1,
                           generator=torch.Generator().manual_seed(8), device="cpu")
    gen = torch.Generator().manual_seed(9)
    sinks = torch.randn(packed.q.shape[1], generator=gen) * 2.0
    weights = [torch.randn(packed.q.shape[0], packed.q.shape[1], packed.v.shape[2], generator=gen),
               torch.randn(packed.q.shape[1], packed.q.shape[0], generator=gen)]

    def run():
        q, k, v = (t.clone().requires_grad_() for t in (packed.q, packed.k, packed.v))
        param = sinks.clone().requires_grad_()
        out, lse = mod.attention(q, k, v, cu_seqlens_q=packed.cu_seqlens_q, cu_seqlens_k=packed.cu_seqlens_k,
                                 sinks=param)
        ((out.float() * weights[0]).sum() + (lse * weights[1]).sum()).backward()
        return out.detach(), lse.detach(), q.grad, k.grad, v.grad, param.grad

    heads = packed.q.shape[1]
    whole, sliced, grids = _whole_and_sliced(mod, run, heads, monkeypatch)
    assert len(grids) == 3 + 2 * 3 and max(g[1] for g in grids) <= 2 * heads
    for a, b in zip(sliced, whole, strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()
    assert whole[-1].abs().max() > 0 and mod.GRID_Y_SLICES
    with emulate.emulating(), torch.no_grad():  # the limit still lowered: an inference call
        out, lse = mod.attention(packed.q, packed.k, packed.v, cu_seqlens_q=packed.cu_seqlens_q,
                                 cu_seqlens_k=packed.cu_seqlens_k, sinks=sinks)
    assert torch.equal(out, whole[0]) and torch.equal(lse, whole[1])

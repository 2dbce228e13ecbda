"""torch.func.vmap over the training modules' autograd.Functions: the vmapped batch
folded into the kernels' batch (one launch per kernel), or run once per entry where
it cannot be (varlen, dropout, a block map, a batched hook tensor or sinks, a
gradient summed over the batch). Both give the bits of the per-entry loop."""

import pytest
import torch

from specgen.check import emulate

from .helpers import emulated_module, emulated_spec_module, trained_spec_data


def _counted(module, monkeypatch):
    """A list whose length is the number of kernel launches the module makes."""
    launches, launch = [], module.ct.launch

    def spy(*args, **options):
        launches.append(args[1])  # the grid
        return launch(*args, **options)

    monkeypatch.setattr(module.ct, "launch", spy)
    return launches


def _run(module, monkeypatch, launches, fn, *, fold):
    """fn's outputs and launches, with the vmap rules folding or (fold=False) forced
    to the per-entry loop, whose bits are the contract."""
    with monkeypatch.context() as patch:
        if not fold:
            patch.setattr(module, "_folds", lambda *_: False)
        launches.clear()
        with emulate.emulating():
            out = fn()
        return out, len(launches)


def _same(a, b) -> bool:
    a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _gqa_inputs(module, *lead, seed=0):
    g = torch.Generator().manual_seed(seed)
    d, hq = module.SPEC["head_dim"], 2 * module.SPEC["gqa_ratio"]
    q = torch.randn(*lead, 2, hq, 16, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(*lead, 2, 2, 24, d, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("transform", ["per_sample", "per_sample_unbatched_kv", "grad_of_vmap", "jacrev", "nested"])
def test_folded_vmap_gives_the_loops_bits_in_one_launch(transform, monkeypatch):
    """GQA 4:1 with a q_offset: each transform launches each kernel once, as one
    unbatched grad call does (3: the forward, dQ and dK/dV), where the loop launched
    them once per entry, and gives the loop's bits."""
    module = emulated_module("fmha_train_gqa_causal", "vmap_fold")
    launches = _counted(module, monkeypatch)

    def call(q, k, v):
        return module.attention(q, k, v, q_offset=8)

    def loss(q, k, v):
        return call(q, k, v).float().square().sum()

    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    if transform == "per_sample":
        inputs = _gqa_inputs(module, 3)
        fn = lambda: torch.func.vmap(grad)(*inputs)  # noqa: E731
    elif transform == "per_sample_unbatched_kv":  # k and v expanded to the vmap's batch
        q, k, v = _gqa_inputs(module, 3)
        fn = lambda: torch.func.vmap(grad, in_dims=(1, None, None))(q.movedim(0, 1), k[0], v[0])  # noqa: E731
    elif transform == "grad_of_vmap":
        inputs = _gqa_inputs(module, 3)
        fn = lambda: torch.func.grad(lambda *a: torch.func.vmap(loss)(*a).sum(), argnums=(0, 1, 2))(*inputs)  # noqa: E731
    elif transform == "jacrev":  # vmap over vjp: the backward's dout batched, the rest expanded
        q, k, v = _gqa_inputs(module)
        fn = lambda: torch.func.jacrev(lambda q: call(q, k, v)[1, 3, 5, :6].float())(q)  # noqa: E731
    else:
        inputs = _gqa_inputs(module, 2, 2)
        fn = lambda: torch.func.vmap(torch.func.vmap(grad))(*inputs)  # noqa: E731
    folded, folded_launches = _run(module, monkeypatch, launches, fn, fold=True)
    looped, looped_launches = _run(module, monkeypatch, launches, fn, fold=False)
    assert _same(folded, looped)
    assert folded_launches == 3
    assert looped_launches == {"jacrev": 1 + 2 * 6, "nested": 3 * 4}.get(transform, 3 * 3)


def test_sinks_fold_the_forward_and_loop_the_backward(monkeypatch):
    """dsinks is summed over the kernels' batch, so per-sample gradients of sinks need
    the backward per entry; the forward still folds (unbatched sinks are [H]). Batched
    sinks loop both."""
    module = emulated_module("fmha_train_gptoss_sinks", "vmap_fold_sinks")
    launches = _counted(module, monkeypatch)
    q, k, v = _gqa_inputs(module, 3)
    sinks = torch.randn(3, q.shape[2], generator=torch.Generator().manual_seed(1))

    def loss(q, k, v, sinks):
        out, lse = module.attention(q, k, v, sinks=sinks)
        return out.float().square().sum() + lse.sum()

    grad = torch.func.grad(loss, argnums=(0, 1, 2, 3))
    for in_dims, count in (((0, 0, 0, None), 1 + 2 * 3), ((0, 0, 0, 0), 3 * 3)):
        s = sinks if in_dims[3] == 0 else sinks[0]
        fn = lambda: torch.func.vmap(grad, in_dims=in_dims)(q, k, v, s)  # noqa: E731
        folded, folded_launches = _run(module, monkeypatch, launches, fn, fold=True)
        looped, looped_launches = _run(module, monkeypatch, launches, fn, fold=False)
        assert _same(folded, looped)
        assert (folded_launches, looped_launches) == (count, 3 * 3)


def test_a_block_map_or_a_batched_hook_tensor_loops(monkeypatch):
    """A hook tensor with no batch axis, unbatched, folds; batched, or with a block
    map given (built for one batch size), each entry runs on its own."""
    data = trained_spec_data("fmha_train_gqa_causal")
    data.update(name="fmha_fold_map", causal=False, mask_mod="heads_id[h] >= 0", block_sparse=True,
                tensors={"heads_id": {"dtype": "int32", "shape": ["heads"]}})
    module = emulated_spec_module(data, "vmap_fold_map")
    launches = _counted(module, monkeypatch)
    q, k, v = _gqa_inputs(module, 3)
    heads = torch.arange(q.shape[2], dtype=torch.int32)
    block_map = module.make_block_map(2, q.shape[2], 16, 24, heads_id=heads, backward=True)

    def loss(q, k, v, heads_id, block_map=None):
        return module.attention(q, k, v, heads_id=heads_id, block_map=block_map).float().square().sum()

    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    with emulate.emulating():
        grad(q[0], k[0], v[0], heads)  # the first call also launches what later calls reuse
        launches.clear()
        grad(q[0], k[0], v[0], heads)
    per_call = len(launches)
    cases = (
        (lambda: torch.func.vmap(grad, in_dims=(0, 0, 0, None))(q, k, v, heads), per_call),
        (lambda: torch.func.vmap(grad, in_dims=(0, 0, 0, 0))(q, k, v, heads.expand(3, -1)), 3 * per_call),
        (lambda: torch.func.vmap(grad, in_dims=(0, 0, 0, None, None))(q, k, v, heads, block_map), None),
    )
    for fn, count in cases:
        folded, folded_launches = _run(module, monkeypatch, launches, fn, fold=True)
        looped, looped_launches = _run(module, monkeypatch, launches, fn, fold=False)
        assert _same(folded, looped)
        assert folded_launches == (looped_launches if count is None else count)


@pytest.mark.parametrize("name", ["fmha_varlen_llama", "fmha_vit_dropout"])
def test_varlen_and_dropout_modules_loop(name, monkeypatch):
    """Packed varlen inputs have no batch axis to fold into, and dropout's mask is
    drawn per batch index (a folded entry would get another's): these modules have
    no folding rule, and per-sample gradients are a loop's, launch for launch."""
    module = emulated_spec_module(trained_spec_data(name), f"vmap_fold_{name}")
    assert not hasattr(module, "_fold_batch")
    launches = _counted(module, monkeypatch)
    g = torch.Generator().manual_seed(2)
    d, hq = module.SPEC["head_dim"], module.SPEC.get("gqa_ratio", 1)
    if module.SPEC.get("varlen"):
        q = torch.randn(3, 24, hq, d, generator=g).to(torch.bfloat16)
        k, v = (torch.randn(3, 24, 1, d, generator=g).to(torch.bfloat16) for _ in range(2))
        cu = torch.tensor([0, 10, 24], dtype=torch.int32)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=14, max_seqlen_k=14)
    else:
        q, k, v = (torch.randn(3, 2, hq, 16, d, generator=g).to(torch.bfloat16) for _ in range(3))
        kwargs = dict(dropout_p=0.25, seed=7)

    def loss(q, k, v):
        out = module.attention(q, k, v, **kwargs)
        return (out[0] if isinstance(out, tuple) else out).float().square().sum()

    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    with emulate.emulating():
        loop = [grad(q[i], k[i], v[i]) for i in range(3)]
        per_entry = len(launches) // 3
        launches.clear()
        per_sample = torch.func.vmap(grad)(q, k, v)
    assert len(launches) == 3 * per_entry
    assert all(torch.equal(got, torch.stack(want)) for got, want in zip(per_sample, zip(*loop)))


@pytest.mark.parametrize("sinks_dtype", [torch.float32, torch.bfloat16])
def test_grad_over_vmap_with_sinks_loops_the_forward(sinks_dtype, monkeypatch):
    """grad over vmap differentiates the vmap rule's call itself: a folded forward's
    backward summed dsinks over every entry in one kernel, where the loop sums each
    entry's and autograd adds them (other bits). The forward runs per entry there."""
    module = emulated_module("fmha_train_gptoss_sinks", "vmap_fold_sinks")
    launches = _counted(module, monkeypatch)
    q, k, v = (x[:, :1] for x in _gqa_inputs(module, 4))
    sinks = torch.randn(q.shape[2], generator=torch.Generator().manual_seed(3)).to(sinks_dtype)

    def loss(q, k, v, sinks):
        out, lse = module.attention(q, k, v, sinks=sinks)
        return out.float().square().sum() + lse.sum()

    batched = lambda *a: torch.func.vmap(loss, in_dims=(0, 0, 0, None))(*a).sum()  # noqa: E731
    fn = lambda: torch.func.grad(batched, argnums=(0, 1, 2, 3))(q, k, v, sinks)  # noqa: E731
    folded, folded_launches = _run(module, monkeypatch, launches, fn, fold=True)
    looped, looped_launches = _run(module, monkeypatch, launches, fn, fold=False)
    assert _same(folded, looped)
    assert folded_launches == looped_launches == 4 * 3


def test_a_fold_past_the_grid_limit_splits(monkeypatch):
    """Each entry of the loop meets the grid's y limit (batch * heads <= MAX_GRID_Y)
    on its own; the folded batch need not (per-sample gradients of 16385 entries of
    B1 Hq4 raised ValueError). The fold takes as many entries per call as fit: here
    the limit is lowered to two entries' worth."""
    module = emulated_module("fmha_train_gqa_causal", "vmap_fold")
    launches = _counted(module, monkeypatch)
    inputs = _gqa_inputs(module, 3)
    monkeypatch.setattr(module, "MAX_GRID_Y", 2 * inputs[0].shape[1] * inputs[0].shape[2])

    def loss(q, k, v):
        return module.attention(q, k, v).float().square().sum()

    fn = lambda: torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(*inputs)  # noqa: E731
    folded, folded_launches = _run(module, monkeypatch, launches, fn, fold=True)
    looped, looped_launches = _run(module, monkeypatch, launches, fn, fold=False)
    assert _same(folded, looped)
    assert (folded_launches, looped_launches) == (2 * 3, 3 * 3)


def test_a_hook_that_reads_b_loops(monkeypatch):
    """A folded vmap entry is b = entry * B + b to the kernels: a hook that reads b
    (each entry's scores times b + 1) gave per-sample gradients other values than
    the loop's. Such a module has no folding rule."""
    from .helpers import prefill_variant_data

    module = emulated_spec_module(prefill_variant_data("vmap_b_hook", {
        "score_mod": "score * (b + 1)", "backward": True}), "vmap_fold_b_hook")
    launches = _counted(module, monkeypatch)
    g = torch.Generator().manual_seed(4)
    d, hq = module.SPEC["head_dim"], 2 * module.SPEC["gqa_ratio"]
    q = torch.randn(3, 2, hq, 16, d, generator=g).half()
    k, v = (torch.randn(3, 2, 2, 24, d, generator=g).half() for _ in range(2))

    def loss(q, k, v):
        return module.attention(q, k, v).float().square().sum()

    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    with emulate.emulating():
        loop = [grad(q[i], k[i], v[i]) for i in range(3)]
        launches.clear()
        per_sample = torch.func.vmap(grad)(q, k, v)
    assert all(torch.equal(got, torch.stack(want)) for got, want in zip(per_sample, zip(*loop)))
    assert len(launches) == 3 * 3 and not hasattr(module, "_fold_batch")

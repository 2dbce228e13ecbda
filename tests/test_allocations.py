"""The memory a call allocates around its kernels (emulated on the CPU): a prefill
output lies in memory in q's order of axes, so a caller with transformers' layout
([B, Sq, Hq, D] seen transposed) reads it back as [B, Sq, Hq * D] without a copy;
the training op's fake output has the real one's strides; and the launchers copy no
input of the layouts users pass (transposed, fused QKV, cache slices)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specgen.check import emulate
from specgen.check.cases import compare, reference_for

from .helpers import emulated_module, emulated_spec_module

B, HKV, S = 1, 2, 40


def _module(name):
    return emulated_module(name, "layout")


def _qkv(module, layout, requires_grad=False):
    """q, k, v of ``module``'s spec in ``layout``, N(0, 1)."""
    spec = module.SPEC
    dtype, d, hq = getattr(torch, spec["dtype"]), spec["head_dim"], HKV * spec["gqa_ratio"]
    dv = spec.get("v_head_dim") or d
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=g).to(dtype).requires_grad_(requires_grad)

    if layout == "contiguous":
        return rand(B, hq, S, d), rand(B, HKV, S, d), rand(B, HKV, S, dv)
    if layout == "transposed":  # [B, S, H, D] projections seen as [B, H, S, D]
        return tuple(rand(B, S, h, w).transpose(1, 2) for h, w in ((hq, d), (HKV, d), (HKV, dv)))
    # fused: one [B, S, Hq + 2 Hkv, D] projection split into q, k and v (MLA: q and
    # k, v on its own)
    fused = [hq, HKV, HKV] if dv == d else [hq, HKV]
    parts = rand(B, S, sum(fused), d).split(fused, dim=2)
    if dv != d:
        parts += (rand(B, S, HKV, dv),)
    return tuple(t.transpose(1, 2) for t in parts)


class _Allocations(TorchDispatchMode):
    """The tensors the launcher makes (not the emulated kernels' tiles): the ops
    outside ct.launch whose output shares no storage with their inputs."""

    VIEWS = {"view", "transpose", "permute", "slice", "select", "as_strided", "alias",
             "detach", "unsqueeze", "squeeze", "expand", "split", "split_with_sizes",
             "unbind", "narrow", "_unsafe_view"}

    def __init__(self, module):
        super().__init__()
        self.made, self.in_kernel = [], False
        launch = module.ct.launch

        def quiet_launch(*args, **kwargs):
            self.in_kernel = True
            try:
                return launch(*args, **kwargs)
            finally:
                self.in_kernel = False

        module.ct.launch = quiet_launch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.in_kernel or name in self.VIEWS or name.endswith("_"):
            return out
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.made.append((name, tuple(o.shape)))
        return out


@pytest.mark.parametrize("name", ["fmha_gqa8_bf16", "fmha_train_gqa_causal", "fmha_mla_d192"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused"])
def test_the_output_lies_in_qs_order_of_axes_and_is_right(name, layout):
    module = _module(name)
    q, k, v = _qkv(module, layout)
    with emulate.emulating(), torch.no_grad():
        result = module.attention(q, k, v)
    out = result[0] if isinstance(result, tuple) else result
    if layout == "contiguous":
        assert out.is_contiguous()
    else:
        # transformers' layout, read back without a copy (was: a contiguous
        # [B, Hq, Sq, D] out, and the caller's reshape copied it whole)
        assert out.transpose(1, 2).is_contiguous(), out.stride()
        flat = out.transpose(1, 2).reshape(B, S, -1)
        assert flat.data_ptr() == out.data_ptr()
    ref, _ = reference_for(module.SPEC, q, k, v, {})
    assert compare(out, ref, module.SPEC["dtype"]).ok


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused"])
def test_the_training_ops_fake_output_has_the_real_strides(layout):
    module = _module("fmha_train_gqa_causal")
    q, k, v = _qkv(module, layout)
    with emulate.emulating(), torch.no_grad():
        real = module._op_forward(q, k, v, 0.125, 0)
    fake = module._op_fake(q, k, v, 0.125, 0)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def _transposed(shapes, batch_stride=None):
    """bfloat16 [B, S, H, D] tensors of ``shapes`` ([B, H, S, D] each) seen as
    [B, H, S, D]; ``batch_stride``: B's stride (B = 1: any), as a permute leaves it."""
    g = torch.Generator().manual_seed(0)
    made = []
    for b, h, s, d in shapes:
        t = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16).transpose(1, 2)
        made.append(t if batch_stride is None else t.as_strided(t.shape, (batch_stride, *t.stride()[1:])))
    return made


def _real_and_fake(run, fake_run, args):
    """``run(*args)`` and ``fake_run`` of the same arguments as FakeTensors (their
    strides kept) under FakeTensorMode, as torch.compile runs an op's fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with emulate.emulating(), torch.no_grad():
        real = run(*args)
    mode = FakeTensorMode()
    with mode:
        fake = fake_run(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    return [(r.shape, r.dtype, r.stride()) for r in real], [(f.shape, f.dtype, f.stride()) for f in fake]


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused", "one_row", "odd_batch_stride",
                                    "empty_batch"])
def test_the_training_ops_fakes_under_fake_tensors_give_the_real_strides(layout):
    """The forward and backward ops' fakes, run under FakeTensorMode as torch.compile
    runs them, give the real outputs' shapes, dtypes and strides. The backward's made
    dq, dk and dv with torch.empty_like, as the real backward did, but FakeTensorMode's
    empty_like renumbers strides that eager mode keeps: a size-1 axis's (Sq = 1 in
    transformers' layout, an odd batch stride at B = 1) and every axis's of an empty
    tensor (B = 0). Was: dq (1024, 128, 1024, 1) real, (1024, 128, 128, 1) fake at Sq = 1."""
    module = _module("fmha_train_gqa_causal")
    d, hq = module.SPEC["head_dim"], HKV * module.SPEC["gqa_ratio"]
    if layout in ("contiguous", "transposed", "fused"):
        q, k, v = _qkv(module, layout)
    else:
        batch, seq = {"one_row": (2, 1), "odd_batch_stride": (1, S), "empty_batch": (0, 10)}[layout]
        q, k, v = _transposed([(batch, hq, seq, d), (batch, HKV, seq, d), (batch, HKV, seq, d)],
                              7 if layout == "odd_batch_stride" else None)
    real, fake = _real_and_fake(module._op_forward, module._op_fake, (q, k, v, 0.125, 0))
    assert real == fake
    with emulate.emulating(), torch.no_grad():
        out, lse = module._op_forward(q, k, v, 0.125, 0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    real, fake = _real_and_fake(module._op_grads, module._op_grads_fake, (q, k, v, out, lse, dout, 0.125, 0))
    assert real == fake


def test_the_backward_fake_gives_a_learnable_tables_gradient_its_real_strides():
    """A learnable [heads, 256] table at one head, its head axis of an odd stride: its
    gradient was torch.zeros_like of it (that stride kept), the fake's new_empty
    row-major (FakeTensorMode: (256, 1), real: (3, 1))."""
    data = {"name": "fake_strides_one_head", "dtype": "bfloat16", "head_dim": 64, "gqa_ratio": 1,
            "causal": True, "backward": True,
            "tensors": {"rel": {"dtype": "float32", "shape": ["heads", 256], "learnable": True}},
            "score_mod": "score + rel[h, q_idx - kv_idx]"}
    module = emulated_spec_module(data, "layout")
    q, k, v = _transposed([(1, 1, S, 64)] * 3)
    rel = torch.randn(256).as_strided((1, 256), (3, 1))
    with emulate.emulating(), torch.no_grad():
        out, lse = module._op_forward(q, k, v, 0.125, 0, rel)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    real, fake = _real_and_fake(module._op_grads, module._op_grads_fake,
                                (q, k, v, out, lse, dout, 0.125, 0, rel))
    assert real == fake


@pytest.mark.parametrize("layout", ["transposed", "fused"])
def test_training_in_transformers_layout_copies_no_output(layout):
    """Forward and backward of the eager training path with q, k and v from
    [B, S, H, D] projections, the output reshaped for o_proj as transformers does:
    the launchers make only the output, its LSE, D, the gradients and the scaled Q;
    no copy of q, k, v, out or dout."""
    module = _module("fmha_train_gqa_causal")
    q, k, v = _qkv(module, layout, requires_grad=True)
    log = _Allocations(module)
    # The eager path (the dispatch mode would otherwise send the call through the op).
    module.torch._C._len_torch_dispatch_stack = lambda: 0
    with emulate.emulating(), log:
        out = module.attention(q, k, v)
        forward = list(log.made)
        merged = out.transpose(1, 2).reshape(B, S, -1)  # the layer's input to o_proj
        assert merged.data_ptr() == out.data_ptr()  # a view: no copy of the output
        merged.backward(torch.ones_like(merged))
    hq, d = q.shape[1], q.shape[3]
    assert forward == [("empty_permuted", (B, hq, S, d)), ("empty", (B, hq, S))], forward
    made = ("empty", "empty_permuted", "empty_like", "clone", "contiguous")
    launcher = [m for m in log.made[len(forward):] if m[0] in made]
    # delta, then dq, dk and dv in q, k and v's order of axes, then the scaled Q
    assert launcher == [("empty", (B, hq, S)), ("empty_permuted", (B, hq, S, d)),
                        ("empty_permuted", (B, HKV, S, d)), ("empty_permuted", (B, HKV, S, d)),
                        ("empty_like", (B, hq, S, d))], launcher


def test_decode_workspaces_of_many_batch_sizes_share_their_buffers():
    """A server that decodes batches of every size from 1 to 24 keeps, for each split
    count, workspaces of under twice the largest one it used (one buffer of 32 rows,
    the smaller ones dropped as it grew; was: one per batch size, 12.5 times the
    largest), and every call
    stays right with more than one split (a single split writes no partials), the
    shared buffers NaN-poisoned before each call (a call reads only rows it wrote)."""
    from specgen.check.runner import Case, run_case

    module = _module("fmha_decode_gqa8_bf16")
    generator = torch.Generator().manual_seed(0)
    with emulate.emulating():
        for batch in list(range(1, 25)) + [3, 17]:
            lens = tuple(range(600, 600 + 7 * batch, 7))
            assert module.launch_plan(batch, 1, max(lens), torch.device("cpu"))[1] > 1
            for buffers in module._WORKSPACE_BUFFERS.values():
                for t in buffers:
                    t.fill_(float("nan"))
            row = run_case(torch, module, Case(batch, 1, 1, 0, decode_lens=lens), generator, device="cpu")
            assert row["ok"], row
    largest, held = {}, {}
    for (_, _, _, _, splits), (o_part, lse_part) in module._WORKSPACES.items():
        used = (o_part.numel() + lse_part.numel()) * 4
        largest[splits] = max(largest.get(splits, 0), used)
        for t in (o_part, lse_part):
            held.setdefault(splits, {})[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for splits, storages in held.items():
        assert sum(storages.values()) < 2 * largest[splits], (splits, storages, largest[splits])


def test_a_decode_capture_takes_a_workspace_of_its_own(monkeypatch):
    """Under CUDA graph capture a decode call makes its split workspace afresh (a
    temporary of the graph's memory pool) and keeps none of it, nor touches the eager
    calls' cached buffers: graphs of two batch sizes captured on one stream must not
    share a workspace kept by the module."""
    import gc
    import weakref

    from specgen.check.runner import Case, run_case

    module = _module("fmha_decode_gqa8_bf16")
    generator = torch.Generator().manual_seed(1)
    made = []
    new_workspace = module._new_workspace

    def recorded(*args):
        workspace = new_workspace(*args)
        made.append([weakref.ref(t) for t in workspace])
        return workspace

    monkeypatch.setattr(module, "_new_workspace", recorded)
    with emulate.emulating():
        eager = run_case(torch, module, Case(3, 1, 1, 0, decode_lens=(700, 650, 900)), generator, device="cpu")
        assert eager["ok"] and len(made) == 1  # the eager calls' shared buffer
        cached, buffers = dict(module._WORKSPACES), dict(module._WORKSPACE_BUFFERS)
        monkeypatch.setattr(module.torch.cuda, "is_current_stream_capturing", lambda: True, raising=False)
        for lens in ((700, 650, 900), (800, 620), (700, 650, 900)):
            row = run_case(torch, module, Case(len(lens), 1, 1, 0, decode_lens=lens), generator, device="cpu")
            assert row["ok"], row
    gc.collect()
    assert len(made) == 4  # one workspace made per captured call
    assert all(ref() is not None for ref in made[0])  # the eager buffer, kept
    assert all(ref() is None for refs in made[1:] for ref in refs)  # the captures', not kept
    assert module._WORKSPACES == cached and all(
        module._WORKSPACE_BUFFERS[key] is value for key, value in buffers.items())

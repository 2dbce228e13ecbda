"""Context parallelism on CPU: the shard layouts, the LSE merge, the ring step
planner, and ring / all-to-all attention over torch.distributed's gloo backend with
the float64 reference in place of the GPU kernels."""

import itertools

import pytest
import torch

from specgen.check.reference import attention_reference
from specgen.parallel import ContextParallelAttention, ReferenceKernel, SpecKernel, shard, unshard
from specgen.parallel import layout as layouts
from specgen.parallel.blocks import Mask, plan_step
from specgen.parallel.merge import merge
from specgen.parallel.ring import step_plans
from tests import parallel_worker
from tests.helpers import generated_module, launch_grids


@pytest.mark.parametrize("world,shard_len", [(1, 5), (2, 8), (2, 7), (3, 9), (4, 1), (8, 6)])
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_layout_round_trip(layout, world, shard_len):
    x = torch.randn(2, 3, world * shard_len, 4)
    shards = [shard(x, layout, world, r) for r in range(world)]
    assert all(s.shape[2] == shard_len for s in shards)
    assert torch.equal(unshard(shards, layout), x)
    assert sorted(layouts.order(layout, world, shard_len).tolist()) == list(range(world * shard_len))


def test_zigzag_layout_pairs_early_and_late_chunks():
    assert layouts.chunks("zigzag", 4, 0, 8) == [(0, 4), (28, 4)]
    assert layouts.chunks("zigzag", 4, 3, 8) == [(12, 4), (16, 4)]
    assert layouts.chunks("zigzag", 2, 1, 7) == [(3, 3), (6, 4)]  # odd shards: 3 + 4


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(world):
    """Every rank sees the same number of visible causal pairs under zigzag; the
    contiguous layout's last rank does 2W-1 times the first's."""
    shard_len = 16
    def work(layout, rank):
        q = layouts.positions(layout, world, rank, shard_len)
        return int((q + 1).sum())  # causal: position p sees p + 1 keys
    zig = [work("zigzag", r) for r in range(world)]
    assert len(set(zig)) == 1
    flat = [work("contiguous", r) for r in range(world)]
    assert flat[-1] > flat[0] * (world - 1)


def test_bad_layout_and_shard_arguments():
    with pytest.raises(ValueError, match="layout must be one of contiguous, zigzag, got 'ring'"):
        shard(torch.zeros(1, 1, 4, 1), "ring", 2, 0)
    with pytest.raises(ValueError, match=r"sequence length \(5\) must divide by the world size \(2\)"):
        shard(torch.zeros(1, 1, 5, 1), "zigzag", 2, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        shard(torch.zeros(1, 1, 4, 1), "zigzag", 2, 2)


def test_lse_merge_matches_attention_over_all_keys():
    """Attention over keys cut into blocks, merged through the LSE, equals attention
    over all keys; rows that see no key in a block, or in any, come out right."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for n in (20, 30, 30))
    full, full_lse = attention_reference(q, k, v, causal=True, q_offset=-5, return_lse=True)
    parts = []
    for a, b in ((0, 7), (7, 8), (8, 30)):
        out, lse = attention_reference(q, k[:, :, a:b], v[:, :, a:b], causal=True, q_offset=-5 - a,
                                       return_lse=True)
        parts.append((out, lse))
    out, lse = merge(parts)
    assert torch.isneginf(lse[:, :, :5]).all() and (out[:, :, :5] == 0).all()  # rows before key 0
    torch.testing.assert_close(out.double(), full, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse[:, :, 5:].double(), full_lse[:, :, 5:], rtol=0, atol=1e-5)


MASKS = [Mask(True), Mask(False), Mask(True, 5, None), Mask(False, 4, 3), Mask(True, 0, None)]


@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("layout,world,shard_len", [("zigzag", 2, 8), ("zigzag", 3, 7), ("contiguous", 4, 6),
                                                    ("zigzag", 4, 5)])
def test_ring_plans_cover_the_mask_exactly(mask, layout, world, shard_len):
    """Over all ring steps, a rank's kernel calls (each with its q_offset, in the
    kernel's relative terms) show every visible pair once and no other."""
    seq = world * shard_len
    for rank in range(world):
        q_pos = layouts.positions(layout, world, rank, shard_len)
        seen = torch.zeros(shard_len, seq, dtype=torch.int64)
        for step, calls in enumerate(step_plans(mask, layout, world, rank, shard_len)):
            k_pos = layouts.positions(layout, world, (rank - step) % world, shard_len)
            for c in calls:
                rows = c.q_offset + torch.arange(c.q_stop - c.q_start)[:, None]
                keys = torch.arange(c.k_stop - c.k_start)[None, :]
                lo, hi = mask.key_bounds(rows)
                vis = (keys >= lo) & (keys <= hi)
                for i, j in vis.nonzero().tolist():
                    seen[c.q_start + i, k_pos[c.k_start + j]] += 1
        lo, hi = mask.key_bounds(q_pos[:, None])
        want = (torch.arange(seq)[None, :] >= lo) & (torch.arange(seq)[None, :] <= hi)
        assert torch.equal(seen, want.long()), (rank, seen, want.long())


def test_zigzag_causal_ring_makes_one_call_per_step_and_skips_hidden_blocks():
    for world, rank in itertools.product((2, 4), range(4)):
        if rank >= world:
            continue
        plans = step_plans(Mask(True), "zigzag", world, rank, 16)
        assert [len(p) for p in plans] == [1] * world
        # Every step does the same work: 2 chunks x 2 chunks of causal pairs, or
        # one chunk-pair's worth of full pairs on each side.
        assert {sum(c.pairs for c in p) for p in plans[1:]} == {16 * 8}
    # Contiguous causal: the blocks above the diagonal are skipped.
    plans = step_plans(Mask(True), "contiguous", 4, 1, 16)
    assert [len(p) for p in plans] == [1, 1, 0, 0]


def test_plan_step_rejects_nothing_it_cannot_do_exactly():
    q = torch.tensor([0, 1, 2, 10, 11])
    k = torch.tensor([3, 4, 5, 6])
    calls = plan_step(Mask(True), q, [(0, 3), (3, 5)], k, [(0, 4)])
    assert [(c.q_start, c.q_stop, c.k_start, c.k_stop) for c in calls] == [(3, 5, 0, 4)]


def test_spec_kernel_refuses_what_a_shard_cannot_compute():
    with pytest.raises(ValueError, match="mask_mod hook"):
        SpecKernel(generated_module("fmha_document_mask"))
    with pytest.raises(ValueError, match="needs return_lse: true .* or backward: true"):
        SpecKernel(generated_module("fmha_gqa8_bf16"))
    with pytest.raises(ValueError, match="runs prefill specs; fmha_decode_gqa8_bf16 is a decode spec"):
        SpecKernel(generated_module("fmha_decode_gqa8_bf16"))
    with pytest.raises(ValueError, match="float16 and bfloat16 specs; fmha_fp8_llama has dtype float8_e4m3fn"):
        SpecKernel(generated_module("fmha_fp8_llama"))
    with pytest.raises(ValueError, match="attention sinks"):
        SpecKernel(generated_module("fmha_train_gptoss_sinks"))
    assert SpecKernel(generated_module("fmha_varlen_llama")).varlen  # ring over packed batches
    with pytest.raises(ValueError, match="layout='contiguous'"):
        ContextParallelAttention(generated_module("fmha_varlen_llama"), mode="ulysses")
    with pytest.raises(ValueError, match="mode must be one of ring, ulysses, got 'a2a'"):
        ContextParallelAttention(generated_module("fmha_train_gqa_causal"), mode="a2a")
    with pytest.raises(ValueError, match="must be a specgen-generated module"):
        SpecKernel(torch)
    kernel = SpecKernel(generated_module("fmha_train_gemma2"))
    assert kernel.mask == Mask(True, 4095, None) and kernel.group_size == 2


def test_single_process_checks_inputs_before_any_launch():
    attn = ContextParallelAttention(generated_module("fmha_train_gqa_causal"))
    q = torch.zeros(1, 8, 16, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 16, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        attn(q, k, k)
    with pytest.raises(ValueError, match="q must have dtype torch.bfloat16, got torch.float16"):
        attn(q.half(), k, k)
    with pytest.raises(ValueError, match=r"q has 8 heads and k/v have 4; the kernel needs q heads == 4 \* kv heads"):
        attn(q, torch.zeros(1, 4, 16, 128, dtype=torch.bfloat16), torch.zeros(1, 4, 16, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="same positions"):
        attn(q, k[:, :, :8], k[:, :, :8])


def test_the_kernels_grid_limit_is_checked_before_any_transfer():
    """batch x heads beyond the kernels' grid y limit, in a module that cannot run
    such a batch in slices, is a ValueError of the call (on every rank, through the
    agreement), not a kernel error after the ring has posted its first transfer;
    packed GQA specs count KV heads."""
    kernel = SpecKernel(generated_module("fmha_train_gqa_causal"))
    assert kernel.grid_y_slices  # the shipped module slices such a batch: nothing to refuse
    assert kernel.grid_problem(16385, 4, 1) is None
    kernel.grid_y_slices = False
    assert kernel.grid_problem(16383, 4, 1) is None
    assert kernel.grid_problem(16385, 4, 1) == ("batch * heads per call must be at most 65535 (the kernels' "
                                                "grid y limit), got 16385 * 4")
    kernel.pack_gqa = True  # a packed-GQA spec's grid holds batch x KV heads
    assert kernel.grid_problem(16385, 4, 1) is None
    assert "got 65536 * 1" in kernel.grid_problem(65536, 4, 1)
    attn = ContextParallelAttention(generated_module("fmha_train_gqa_causal"))
    attn.kernel.grid_y_slices = False
    q = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16).expand(16385, 4, 2, 128)
    k = torch.zeros(1, 1, 2, 128, dtype=torch.bfloat16).expand(16385, 1, 2, 128)
    attn.kernel.needs_cuda = False  # reach the shape checks on the CPU
    with pytest.raises(ValueError, match="the kernels' grid y limit"):
        attn(q, k, k)
    # One entry's heads past the limit cannot be sliced either.
    sliced = SpecKernel(generated_module("fmha_train_gqa_causal"))
    assert "got 1 * 70000" in sliced.grid_problem(1, 70000, 17500)


def test_a_batch_past_the_grid_y_limit_runs_through_the_ring_in_slices(monkeypatch):
    """The module runs such a batch in slices of it; the ring's forward and backward
    (its calls with q_offset and the merged out and lse) give the bits of the whole."""
    from specgen.check import emulate
    from tests.helpers import ROOT

    module = emulate.load_module(ROOT / "generated" / "fmha_train_gqa_causal.py", name="_test_cp_slices")
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(3, 4, 40, 128, generator=gen).bfloat16()
    k, v = (torch.randn(3, 1, 40, 128, generator=gen).bfloat16() for _ in range(2))
    dout = torch.randn(3, 4, 40, 128, generator=gen).bfloat16()

    def run():
        attn = ContextParallelAttention(module)
        attn.kernel.needs_cuda = False
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn(*leaves)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    grids = launch_grids(module, monkeypatch)
    with emulate.emulating():
        whole = run()
        calls = len(grids)
        monkeypatch.setattr(module, "MAX_GRID_Y", 8)  # two entries of 4 heads per launch
        sliced = run()
    assert len(grids) - calls == 2 * calls and all(g[1] <= 8 for g in grids[calls:])
    for a, b in zip(sliced, whole, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ring_and_all_to_all_match_the_whole_sequence(world, tmp_path):
    """gloo, float64 reference kernels: outputs and gradients of every layout and
    mode equal attention over the whole sequence in one process."""
    results = parallel_worker.spawn(world, "gloo", "reference", tmp_path)
    for rank, result in enumerate(results):
        for row in result["rows"]:
            assert max(row["errors"]) < 1e-5, (rank, row)
    rows = results[0]["rows"]
    assert ("ring", "packed-zigzag-one-row") in {(r["mode"], r["layout"]) for r in rows}
    assert {(r["mode"], r["layout"]) for r in rows} >= {("ring", "zigzag"), ("ring", "contiguous"),
                                                        ("ulysses", "zigzag"), ("ring", "packed-zigzag"),
                                                        ("ring", "packed-contiguous"), ("ulysses", "packed-contiguous")}


def test_bad_input_raises_on_every_rank(tmp_path):
    results = parallel_worker.spawn(2, "gloo", "errors", tmp_path)
    for rank, seen in enumerate(results):
        assert "every rank must hold an equal shard" in seen["unequal"], (rank, seen)
        assert ("must have dtype torch.float64" in seen["dtype"]) if rank == 0 else \
            ("rank 0's inputs are invalid" in seen["dtype"]), (rank, seen)
        assert "seq_len 18 needs shards of 9 rows on 2 ranks, got 8" in seen["seq_len"], seen
        assert "the query heads (1) must divide by the world size (2)" in seen["heads"], seen
        alone = {  # a problem of rank 0's own: named there, pointed at elsewhere
            "scale_type": "scale must be a positive float or None, got 'abc'",
            "scale_range": "scale must be a positive finite float in float32's normal range",
            "unknown_kwarg": "unexpected keyword argument(s): q_offset",
            "strided": "q must be contiguous in head_dim (stride 1)",
            "max_seqlen": "max_seqlen must be None or an int from the longest sequence (8)",
        }
        for key, words in alone.items():
            assert (words in seen[key]) if rank == 0 else ("rank 0's inputs are invalid" in seen[key]), \
                (rank, key, seen[key])
        differ = {  # each rank fine alone, the ranks not alike: the same message everywhere
            "scale_differs": "every rank must use the same scale: rank 0 has 0.5, rank 1 has 0.353553",
            "mode_differs": "every rank must agree on the mode: rank 1 differs from rank 0",
            "layout_differs": "every rank must agree on the layout: rank 1 differs from rank 0",
            "grads_differ": "every rank must agree on whether gradients are needed",
            "cu_differs": "every rank must agree on cu_seqlens: rank 1 differs from rank 0",
        }
        for key, words in differ.items():
            assert words in seen[key], (rank, key, seen[key])
        assert f"rank {rank}: cu_seqlens must start at 0, got 4" in seen["cu_start"], seen
        assert "every rank must agree on the spec: rank 1 differs from rank 0" in seen["spec_differs"], seen
        assert ("rank 1: q is a meta tensor" in seen["device_differs"]) if rank == 1 else \
            ("rank 1's inputs are invalid" in seen["device_differs"]), seen
        assert f"rank {rank}: q is a meta tensor" in seen["meta_everywhere"], seen
        for key, words in (("seq_len_type", "seq_len must be an int or None, got '8'"),
                           ("positional", "takes q, k and v as its only positional arguments, got 1 more"),
                           ("cu_meta", "cu_seqlens is a meta tensor")):
            assert (words in seen[key]) if rank == 0 else ("rank 0's inputs are invalid" in seen[key]), \
                (rank, key, seen[key])
        assert ("max_seqlen is for varlen specs" in seen["dense_max_seqlen"]) if rank == 0 else \
            ("rank 0's inputs are invalid" in seen["dense_max_seqlen"]), seen
        assert ("seq_len is for [B, H, S, D] shards" in seen["packed_seq_len"]) if rank == 0 else \
            ("rank 0's inputs are invalid" in seen["packed_seq_len"]), seen
        assert seen["empty"] == [[1, 4, 0, 8], [1, 4, 0, 8]], seen
        assert seen["step_raised"] == "the kernel failed in a ring step", seen
        assert seen["after"] < 1e-6


def test_packed_ring_plans_one_varlen_call_per_step():
    """A packed batch's ring step is one varlen call for every sequence at once:
    the diagonal block with q_shift 0, the blocks seen whole with FULL."""
    from specgen.parallel.packed import FULL, PackedCall, packed_plans

    assert packed_plans(Mask(True), "zigzag", 2, 0, (4, 7, 1)) == (
        (PackedCall(None, None, 0),), (PackedCall(1, None, FULL),))
    assert packed_plans(Mask(True), "zigzag", 2, 1, (4, 7, 1)) == (
        (PackedCall(None, None, 0),), (PackedCall(None, 0, FULL),))
    assert packed_plans(Mask(True), "contiguous", 3, 1, (4, 7)) == (
        (PackedCall(None, None, 0),), (PackedCall(None, None, FULL),), ())
    with pytest.raises(ValueError, match="ring mode splits packed batches without windows"):
        ContextParallelAttention(ReferenceKernel(causal=True, window=(8, None), varlen=True))


def test_spec_field_picks_the_mode_and_refuses_what_a_shard_cannot_compute(tmp_path):
    import importlib.util

    from tests.helpers import ROOT
    from tests.test_cli import specgen

    spec = tmp_path / "cp_pick.yaml"
    spec.write_text("name: cp_pick\ngqa_ratio: 2\ncontext_parallel: ulysses\n")
    built = specgen("build", spec, "--no-compile", "--out", tmp_path, cwd=ROOT)
    assert built.returncode == 0, built.stderr
    found = importlib.util.spec_from_file_location("cp_pick", tmp_path / "cp_pick.py")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    assert module.SPEC["context_parallel"] == "ulysses"
    assert ContextParallelAttention(module).mode == "ulysses"
    with pytest.raises(ValueError, match="needs return_lse: true"):  # the call overrides the spec
        ContextParallelAttention(module, mode="ring")
    bad = tmp_path / "cp_bad.yaml"
    bad.write_text("name: cp_bad\ncontext_parallel: ring\n")
    done = specgen("build", bad, "--no-compile", "--out", tmp_path, cwd=ROOT)
    assert done.returncode == 2
    assert "cp_bad.yaml: context_parallel: 'ring' merges partial results through their LSE: it needs " \
           "return_lse: true or backward: true" in done.stderr
    assert not (tmp_path / "cp_bad.py").exists()


def _emulated_blocks_ratio(exact_in_blocks: bool) -> float:
    """FlashAttention's rule (check.runner) over dq, dk, dv of fmha_train_gqa_causal's
    kernels (emulated on the CPU) over two blocks of keys, as the ring computes them:
    each block's backward gets the merged out and lse of both, and the gradients are
    summed. The worst error over its allowance (<= 1 passes)."""
    from specgen.check import emulate
    from specgen.check.runner import _fa_rule
    from specgen.parallel import ring
    from specgen.parallel.blocks import Call
    from tests.helpers import ROOT

    module = emulate.load_module(ROOT / "generated" / "fmha_train_gqa_causal.py", name="_test_cp_blocks")
    kernel = SpecKernel(module)
    gen = torch.Generator().manual_seed(7)
    seq_q, seq_k, offset = 80, 164, 120  # first block: one key tile, seen whole by every row
    q = torch.randn(1, 4, seq_q, 128, generator=gen).bfloat16()
    k, v = (torch.randn(1, 1, seq_k, 128, generator=gen).bfloat16() for _ in range(2))
    dout = torch.randn(1, 4, seq_q, 128, generator=gen).bfloat16()
    plans = ((Call(0, seq_q, 0, 64, offset), Call(0, seq_q, 64, seq_k, offset - 64)),)
    scale = kernel.default_scale()
    if exact_in_blocks:  # the mutation: each block takes D as if it held every key
        plain = kernel.backward
        kernel.backward = lambda *args, whole=False: plain(*args, whole=True)
    with emulate.emulating():
        out, lse = ring.ring_forward(kernel, ring.Ring(None), plans, q, k, v, scale)
        grads = ring.ring_backward(kernel, ring.Ring(None), plans, q, k, v, out, lse, dout, scale)

    def reference_grads(dtype):
        leaves = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        attention_reference(*leaves, causal=True, q_offset=offset, compute_dtype=dtype).backward(dout.to(dtype))
        return [t.grad for t in leaves]

    return _fa_rule(torch, grads, reference_grads(torch.float64), reference_grads(torch.bfloat16))["grad_ratio"]


def test_ring_blocks_of_generated_kernels_sum_to_the_whole_gradient():
    """A ring block's backward sees the merged out and lse of keys it does not hold:
    its D must be dO . O, not the exact rowsum(P dP) a call over every key may take
    (which left dq and dk of short rows wrong on two GPUs)."""
    assert _emulated_blocks_ratio(exact_in_blocks=False) <= 1.0
    assert _emulated_blocks_ratio(exact_in_blocks=True) > 4.0  # the exact D of one block is wrong here


# A packed-batch training spec (the ring's varlen path with backward kernels).
_VARLEN_TRAIN = dict(name="cp_varlen_train", dtype="bfloat16", head_dim=128, gqa_ratio=4, causal=True,
                     varlen=True, backward=True)


def test_ring_of_two_ranks_over_the_emulated_generated_kernels(tmp_path):
    """Two gloo ranks, the generated kernels emulated on the CPU: a zigzag ring of
    one long sequence, and a packed batch whose short sequences give each query tile
    of a block one key tile, against the one-process kernels and fp64 (the checks
    tests/test_parallel_gpu.py makes on two GPUs)."""
    from tests.helpers import ROOT, render_spec_data

    plan, source = render_spec_data(_VARLEN_TRAIN, "specs/cp_varlen_train.yaml")
    varlen = tmp_path / f"{plan.module_name}.py"
    varlen.write_text(source)
    cases = [
        dict(file=str(ROOT / "generated" / "fmha_train_gqa_causal.py"), mode="ring", layout="zigzag",
             shape=(1, 4, 1, 70)),
        dict(file=str(varlen), mode="ring", layout="zigzag", heads=(4, 1), lengths=[3, 40, 1, 70]),
    ]
    results = parallel_worker.spawn(2, "gloo", "emulated", tmp_path, {"cases": cases})
    parallel_worker.assert_rows_agree(results)


def test_a_ring_step_that_raises_finishes_the_transfers_it_posted():
    """The K/V transfer posted before a step (and the gradients in flight) are waited
    for before the step's error leaves `transfers`, even while the caller keeps the
    error and its traceback (which would keep an unclosed generator alive)."""
    from specgen.parallel import ring as rings

    class Work:
        def __init__(self, log):
            self.log = log

        def wait(self):
            self.log.append("waited")

    class FakeRing:
        world_size, rank = 2, 0

        def __init__(self):
            self.log = []

        def shift(self, send, recv):
            self.log.append("posted")
            return [Work(self.log)]

    ring = FakeRing()
    k = v = torch.zeros(1, 1, 4, 8)
    carry = rings.GradCarry(ring, k, v)
    carry.pass_on(carry.new()[0])  # gradients in flight, as after a backward step
    kept = []
    try:
        with rings.transfers(rings.rotate(ring, k, v, 2), carry) as steps:
            for step, _, _ in steps:
                raise ValueError("a kernel refused the call")
    except ValueError as error:
        kept.append(error)
    assert kept and ring.log == ["posted", "posted", "waited", "waited"], ring.log


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_query_and_key_tiles_are_checked_before_any_transfer(mode, monkeypatch):
    """The tiles of a call's rows on the kernels' grid x axis (the forward's query
    tiles, the backward's query and key tiles) are checked with the shapes, before
    the ranks agree: a ring call takes its shard's rows, an all-to-all call every
    row. Limit lowered so that a small call reaches it."""
    module = generated_module("fmha_train_gqa_causal")
    kernel = SpecKernel(module)
    smallest = min(c["tile_m"] for configs in module.CONFIGS.values() for c in configs)
    # A sequence of 2**30 rows (the positions' bound) in one call passes the real limit.
    assert kernel.grid_problem(1, 4, 1, (2**24 - 1) * smallest, (2**24 - 1) * smallest) is None
    assert "got 1073741824" in kernel.grid_problem(1, 4, 1, 2**30, 0)
    monkeypatch.setattr(module, "MAX_GRID_X", 3)
    assert kernel.grid_problem(1, 4, 1, 3 * smallest, 3 * smallest) is None
    assert kernel.grid_problem(1, 4, 1, 3 * smallest + 1, 0) == (
        f"query rows per call must be at most {3 * smallest} (3 tiles of {smallest}, the kernels' grid x "
        f"limit), got {3 * smallest + 1}")
    keys = 3 * module.BWD_TILE_N
    assert "keys per call must be at most" in kernel.grid_problem(1, 4, 1, 0, keys + 1)
    kernel.pack_gqa = True  # a packed-GQA forward holds tile_m // GROUP_SIZE positions per tile
    packed = smallest // module.GROUP_SIZE
    assert f"at most {3 * packed} (3 tiles of {packed}," in kernel.grid_problem(1, 4, 1, 3 * packed + 1, 0)
    # Through the call: 3 tiles of the smallest fit a ring shard, not the whole sequence.
    attn = ContextParallelAttention(module, mode=mode)
    attn.kernel.needs_cuda = False
    attn.world_size = 2  # each rank holds half the rows (the shapes are checked, no transfer made)
    heads = 2 if mode == "ulysses" else 1  # all-to-all scatters the heads over the ranks
    q = torch.zeros(1, 4 * heads, 2 * smallest, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, heads, 2 * smallest, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(attn, "_shape_problem", lambda *args: (None, None))
    agreed = []

    class Agreed(Exception):
        pass

    def agree(group, problem, signature):  # what this rank brings to the agreement; stop there
        agreed.append(problem)
        raise Agreed

    monkeypatch.setattr("specgen.parallel.attention.agree", agree)
    with pytest.raises(Agreed):
        attn(q, k, k)
    if mode == "ring":
        assert agreed == [None]  # a shard of 2 tiles per call
    else:
        assert "query rows per call must be at most" in agreed[0]  # 4 tiles in one call


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_a_packed_call_reads_cu_seqlens_to_the_host_once(monkeypatch, mode):
    """The checks, the grid limits, the ranks' signature and the call itself share one
    read of cu_seqlens: each read is a device sync. The kernels' own launch is stubbed,
    so the count is context parallelism's alone."""
    from specgen.parallel import attention as cp

    class Counted(torch.Tensor):
        reads = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("tolist", "item", "__int__", "__index__", "__bool__", "__float__", "numpy", "cpu"):
                cls.reads.append(name)
            return super().__torch_function__(func, types, args, kwargs or {})

    attn = ContextParallelAttention(generated_module("fmha_varlen_llama"), mode=mode, layout="contiguous")
    attn.kernel.needs_cuda = False
    heads_q, heads_k = attn.kernel.module.GROUP_SIZE, 1
    q = torch.zeros(12, heads_q, 128, dtype=torch.bfloat16)
    k = torch.zeros(12, heads_k, 128, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 5, 5, 12], dtype=torch.int32).as_subclass(Counted)
    seen = {}

    def call(*args, **kwargs):
        seen.update(kwargs, args=args)
        return torch.zeros(12, heads_q, 128, dtype=torch.bfloat16)

    monkeypatch.setattr(attn.kernel, "attention", call)
    monkeypatch.setattr(cp.packed.PackedRingAttention, "apply", lambda *args: (call(*args), None))
    attn(q, k, k, cu_seqlens=cu_seqlens)
    assert Counted.reads == ["tolist"] and seen
    if mode == "ulysses":
        assert seen["max_seqlen_q"] == seen["max_seqlen_k"] == 7
    else:
        assert seen["args"][7] == (5, 0, 7)  # the packed ring's lengths

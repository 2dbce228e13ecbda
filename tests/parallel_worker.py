"""Processes of the context-parallel tests: one per rank, started by
torch.multiprocessing.spawn (gloo on CPU, NCCL on GPUs). Each rank writes what it
saw to <out_dir>/rank<r>.json; the test reads every rank's file.

Every check compares the sharded computation, gathered back, with the same
attention computed on the whole sequence in one process.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from specgen.parallel import ContextParallelAttention, ReferenceKernel, gather, shard  # noqa: E402
from specgen.parallel import layout as layouts  # noqa: E402


def main(rank: int, world: int, store: str, backend: str, scenario: str, out_dir: str, options: dict):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # A file store of this spawn's own: a TCP port picked free and then bound by the
    # ranks could be taken meanwhile by another test's ranks (seen as a SIGABRT under
    # the parallel test runner).
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = SCENARIOS[scenario](rank, world, options)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        result = {"crash": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    # A scenario that keeps an error (its traceback a reference cycle through the
    # frames that held the ring) keeps the process group alive past
    # destroy_process_group; gloo then destroys it during interpreter finalization and
    # aborts ("terminate called without an active exception", about 1 run in 10).
    # Collected here, the group goes while the interpreter is whole.
    gc.collect()
    dist.destroy_process_group()


def _inputs(batch, q_heads, kv_heads, seq, dim, dtype, device, seed, v_dim=None):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shapes = ((batch, q_heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, v_dim or dim),
              (batch, q_heads, seq, v_dim or dim))
    return [torch.randn(s, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype) for s in shapes]


def sharded_run(attn, q, k, v, dout, layout, rank, world, **kwargs):
    """Output and gradients of q, k, v, each gathered to the whole sequence."""
    shards = [shard(t, layout, world, rank).requires_grad_() for t in (q, k, v)]
    out = attn(*shards, **kwargs)
    out.backward(shard(dout, layout, world, rank))
    gathered = [gather(out.detach(), layout)] + [gather(s.grad, layout) for s in shards]
    return gathered


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _ulp(x) -> float:
    """One unit in the last place of x's dtype at x's largest magnitude: the step
    at which two roundings of nearly equal values can differ."""
    top = x.detach().abs().max().double().item()
    return torch.finfo(x.dtype).eps * 2.0 ** math.floor(math.log2(top)) if top > 0 else 0.0


def reference_cases(rank, world, options):
    """Ring and all-to-all over float64 reference kernels against the whole-sequence
    reference: every layout, causal, non-causal and windowed, GQA, odd shards."""
    rows = []
    for mode in ("ring", "ulysses"):
        for layout in ("zigzag", "contiguous"):
            for causal, window, softcap in ((True, None, None), (False, None, None), (True, (5, None), None),
                                            (False, (4, 3), 2.0)):
                for shard_len in (9, 16):
                    heads = (2 * world, world) if mode == "ulysses" else (4, 2)
                    kern = ReferenceKernel(causal=causal, window=window, softcap=softcap, dtype=torch.float64,
                                           head_dim=8, group_size=heads[0] // heads[1])
                    q, k, v, dout = _inputs(2, *heads, shard_len * world, 8, torch.float64, "cpu", 7)
                    whole = ReferenceKernel(causal=causal, window=window, softcap=softcap, dtype=torch.float64,
                                            head_dim=8, group_size=heads[0] // heads[1])
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    ref = whole.attention(*leaves, whole.default_scale())
                    ref.backward(dout)
                    attn = ContextParallelAttention(kern, mode=mode, layout=layout)
                    got = sharded_run(attn, q, k, v, dout, layout, rank, world)
                    errs = [_max_err(g, r) for g, r in zip(got, [ref.detach()] + [t.grad for t in leaves])]
                    rows.append(dict(mode=mode, layout=layout, causal=causal, window=window, softcap=softcap,
                                     shard_len=shard_len, errors=errs, calls=kern.calls))
    # Packed batches: sequences of different lengths (odd shards among them), each
    # split over the ranks on its own; ring (both layouts) and all-to-all.
    lengths = [3 * world, 8 * world, 1 * world, 5 * world]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = sum(lengths)
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(total, 2 * world, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, world, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    for mode, layout, causal in (("ring", "zigzag", True), ("ring", "contiguous", True), ("ring", "zigzag", False),
                                 ("ulysses", "contiguous", True)):
        kern = ReferenceKernel(causal=causal, dtype=torch.float64, head_dim=8, group_size=2, varlen=True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = kern.attention(*leaves, kern.default_scale(), cu_seqlens_q=cu, cu_seqlens_k=cu)
        ref.backward(dout)
        index = torch.cat([a + layouts.positions(layout, world, rank, (b - a) // world)
                           for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
        shards = [t.index_select(0, index).requires_grad_() for t in (q, k, v)]
        attn = ContextParallelAttention(kern, mode=mode, layout=layout)
        out = attn(*shards, cu_seqlens=cu)
        out.backward(dout.index_select(0, index))
        errs = [_max_err(out, ref.detach().index_select(0, index))]
        errs += [_max_err(s.grad, t.grad.index_select(0, index)) for s, t in zip(shards, leaves)]
        rows.append(dict(mode=mode, layout="packed-" + layout, causal=causal, errors=errs))
    # Sequences whose shards are one row long: a zigzag shard's two halves are then
    # one row and none, so some ring steps pair the queries with no keys at all (a
    # kernel refuses such a call: it is skipped, as it adds nothing).
    class NoEmptyCalls(ReferenceKernel):
        def forward_varlen(self, q, k, v, *args):
            assert q.shape[0] and k.shape[0], "a call without rows or keys"
            return super().forward_varlen(q, k, v, *args)

        def backward_varlen(self, q, k, v, *args, **kwargs):
            assert q.shape[0] and k.shape[0], "a call without rows or keys"
            return super().backward_varlen(q, k, v, *args, **kwargs)

    cu = torch.tensor([0, world, 2 * world], dtype=torch.int32)
    q, dout = (torch.randn(2 * world, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2 * world, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    kern = NoEmptyCalls(causal=True, dtype=torch.float64, head_dim=8, group_size=2, varlen=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = kern.attention(*leaves, kern.default_scale(), cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref.backward(dout)
    index = torch.cat([a + layouts.positions("zigzag", world, rank, 1) for a in (0, world)])
    shards = [t.index_select(0, index).requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(kern, mode="ring", layout="zigzag")(*shards, cu_seqlens=cu)
    out.backward(dout.index_select(0, index))
    errs = [_max_err(out, ref.detach().index_select(0, index))]
    errs += [_max_err(s.grad, t.grad.index_select(0, index)) for s, t in zip(shards, leaves)]
    rows.append(dict(mode="ring", layout="packed-zigzag-one-row", causal=True, errors=errs))
    return {"rows": rows}


def _expect_error(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return ""


def error_cases(rank, world, options):
    """Bad input raises the same kind of ValueError on every rank, before any
    transfer; a good call right after still works (nothing was left in flight)."""
    kern = ReferenceKernel(causal=True, dtype=torch.float64, head_dim=8, group_size=2)
    attn = ContextParallelAttention(kern, mode="ring", layout="zigzag")
    q, k, v, _ = _inputs(1, 4, 2, 8 * world, 8, torch.float64, "cpu", 1)
    parts = [shard(t, "zigzag", world, rank) for t in (q, k, v)]
    seen = {}
    # One rank holds a shorter shard than the others.
    short = [t[:, :, :-1] if rank == world - 1 else t for t in parts]
    seen["unequal"] = _expect_error(lambda: attn(*short))
    # One rank's q has the wrong dtype.
    typed = [parts[0].float() if rank == 0 else parts[0], parts[1], parts[2]]
    seen["dtype"] = _expect_error(lambda: attn(*typed))
    # The shards do not add up to the stated length.
    seen["seq_len"] = _expect_error(lambda: attn(*parts, seq_len=8 * world + 2))
    # All-to-all needs heads that divide by the world size.
    kern1 = ReferenceKernel(causal=True, dtype=torch.float64, head_dim=8, group_size=1)
    odd = [t[:, :1] for t in parts]
    seen["heads"] = _expect_error(lambda: ContextParallelAttention(kern1, mode="ulysses")(*odd)) if world > 1 else "n/a"
    # What one rank alone gets wrong or does differently: each would have left the
    # others waiting in a transfer, or computed a wrong result without an error.
    first = rank == 0
    seen["scale_type"] = _expect_error(lambda: attn(*parts, scale="abc" if first else None))
    seen["scale_range"] = _expect_error(lambda: attn(*parts, scale=-1.0 if first else None))
    seen["scale_differs"] = _expect_error(lambda: attn(*parts, scale=0.5 if first else None))
    seen["unknown_kwarg"] = _expect_error(lambda: attn(*parts, **({"q_offset": 4} if first else {})))
    strided = parts[0].transpose(2, 3).contiguous().transpose(2, 3)
    seen["strided"] = _expect_error(lambda: attn(strided if first else parts[0], parts[1], parts[2]))
    other = ContextParallelAttention(kern, mode="ulysses" if first else "ring", layout="zigzag")
    seen["mode_differs"] = _expect_error(lambda: other(*parts))
    relaid = ContextParallelAttention(kern, mode="ring", layout="contiguous" if first else "zigzag")
    seen["layout_differs"] = _expect_error(lambda: relaid(*parts))
    wants = [t.clone().requires_grad_(first) for t in parts]
    seen["grads_differ"] = _expect_error(lambda: attn(*wants))
    # A packed batch: cu_seqlens must be the same everywhere, from 0.
    packed_kern = ReferenceKernel(causal=True, dtype=torch.float64, head_dim=8, group_size=2, varlen=True)
    packed_attn = ContextParallelAttention(packed_kern, mode="ring", layout="zigzag")
    rows = 8 * world
    pq, pk, pv = (torch.zeros(rows // world, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 4 * world, rows], dtype=torch.int32)
    moved = torch.tensor([0, 2 * world, rows], dtype=torch.int32)
    seen["cu_differs"] = _expect_error(lambda: packed_attn(pq, pk, pv, cu_seqlens=moved if first else cu))
    seen["cu_start"] = _expect_error(lambda: packed_attn(pq, pk, pv, cu_seqlens=cu + 2 * world))
    seen["max_seqlen"] = _expect_error(lambda: packed_attn(pq, pk, pv, cu_seqlens=cu,
                                                            max_seqlen=1 if first else None))
    # Two kernels of one name that compute other attentions (a causal and a
    # non-causal spec both named so): the ranks compare the whole spec, not its name.
    unlike = ReferenceKernel(causal=first, dtype=torch.float64, head_dim=8, group_size=2)
    seen["spec_differs"] = _expect_error(lambda: ContextParallelAttention(unlike, mode="ring")(*parts))
    # One rank's shards on the meta device (no data: nothing a transfer could carry).
    elsewhere = [t.to("meta") if not first else t for t in parts]
    seen["device_differs"] = _expect_error(lambda: attn(*elsewhere))
    seen["meta_everywhere"] = _expect_error(lambda: attn(*[t.to("meta") for t in parts]))
    # What a rank's own checks would have raised as another error (a TypeError, a
    # read of a meta tensor) is its problem too, named on every rank.
    seen["seq_len_type"] = _expect_error(lambda: attn(*parts, seq_len="8" if first else None))
    seen["positional"] = _expect_error(lambda: attn(*parts, *((0.5,) if first else ())))
    seen["cu_meta"] = _expect_error(lambda: packed_attn(pq, pk, pv, cu_seqlens=cu.to("meta") if first else cu))
    # Arguments of the other kind of spec, on one rank only.
    seen["dense_max_seqlen"] = _expect_error(lambda: attn(*parts, max_seqlen=3 if first else None))
    seen["packed_seq_len"] = _expect_error(lambda: packed_attn(pq, pk, pv, cu_seqlens=cu,
                                                                seq_len=99 if first else None))
    # Empty shards on every rank: an empty output, in both modes (nothing to exchange).
    empty = [t[:, :, :0] for t in parts]
    seen["empty"] = [tuple(ContextParallelAttention(kern, mode=m)(*empty).shape) for m in ("ring", "ulysses")]
    # A kernel that raises in the ring's first step, after the next K/V shard's
    # transfer was posted: the transfer is finished before the error leaves, so the
    # good call below does not meet it.
    class FailsOnce(ReferenceKernel):
        failed = False

        def forward(self, *args):
            if not self.failed:
                self.failed = True
                raise ValueError("the kernel failed in a ring step")
            return super().forward(*args)

    failing = FailsOnce(causal=False, dtype=torch.float64, head_dim=8, group_size=2)
    kept = []  # the error kept, traceback and all (as a caller that logs it later would)
    try:
        ContextParallelAttention(failing, mode="ring")(*parts)
    except ValueError as error:
        kept.append(error)
    seen["step_raised"] = str(kept[0]) if kept else ""
    # After all that, a good call.
    whole = ReferenceKernel(causal=True, dtype=torch.float64, head_dim=8, group_size=2)
    ref = whole.forward(q, k, v, whole.default_scale(), 0)[0]
    out = gather(attn(*parts), "zigzag")
    seen["after"] = _max_err(out, ref)
    return seen


def spec_cases(rank, world, options):
    """The generated kernels on GPUs against the same spec's kernel on the whole
    sequence in one process, and against the float64 reference."""
    import importlib

    rows = []
    device = torch.device("cuda", torch.cuda.current_device())
    for case in options["cases"]:
        if case.get("path"):
            sys.path.insert(0, case["path"])
        module = importlib.import_module(case["module"])
        run = _packed_spec_case if module.SPEC["varlen"] else _dense_spec_case
        rows.append(run(module, case, rank, world, device))
    return {"rows": rows}


def emulated_cases(rank, world, options):
    """spec_cases on the CPU: the generated modules at ``case["file"]`` with their
    kernels emulated (specgen.check.emulate), over gloo."""
    from specgen.check import emulate

    rows = []
    with emulate.emulating():
        for case in options["cases"]:
            path = Path(case["file"])
            module = emulate.load_module(path, name=f"_cp_emulated_{path.stem}")
            run = _packed_spec_case if module.SPEC["varlen"] else _dense_spec_case
            rows.append(run(module, case, rank, world, torch.device("cpu")))
    return {"rows": rows}


def assert_rows_agree(results: list[dict]) -> None:
    """Every rank's rows of spec_cases / emulated_cases: outputs and gradients within
    FlashAttention's rule against fp64, and within rounding of the one-process
    kernels. A shard's dK/dV come from the kernel rounded to the input dtype, are
    summed over the ranks in float32 and rounded again, so they may sit up to two
    units in the last place from the one-process result."""
    for rank, result in enumerate(results):
        for row in result["rows"]:
            print(f"rank {rank} {row['case']}: " + ", ".join(
                f"{name} {row['vs_fp64'][name]:.3g}/{row['allowed'][name]:.3g} of fp64, "
                f"{row['vs_single'][name]:.3g} from one process" for name in row["vs_fp64"]))
            for name in row["vs_fp64"]:
                assert row["vs_fp64"][name] <= row["allowed"][name], (rank, name, row)
                bound = max(2 * row["single_vs_fp64"][name], 1e-2, 2 * row["ulp"][name])
                assert row["vs_single"][name] <= bound, (rank, name, row)


def _attention(module, case, device):
    attn = ContextParallelAttention(module, mode=case["mode"], layout=case["layout"])
    attn.kernel.needs_cuda = device.type == "cuda"  # emulated kernels take CPU tensors
    return attn


def _dense_spec_case(module, case, rank, world, device) -> dict:
    """[B, H, S, D] shards of one sequence on the generated kernels, against the
    whole sequence in one process and fp64."""
    from specgen.check.reference import attention_reference

    spec = module.SPEC
    batch, q_heads, kv_heads, shard_len = case["shape"]
    seq = shard_len * world
    dim, v_dim = module.HEAD_DIM, getattr(module, "V_HEAD_DIM", module.HEAD_DIM)
    q, k, v, dout = _inputs(batch, q_heads, kv_heads, seq, dim, module.DTYPE, device, 11 + seq, v_dim)
    attn = _attention(module, case, device)
    got = sharded_run(attn, q, k, v, dout, case["layout"], rank, world)
    # The same kernels on the whole sequence, one process.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    single = module.attention(*leaves)
    single = single[0] if isinstance(single, tuple) else single
    single.backward(dout)
    singles = [single.detach()] + [t.grad for t in leaves]
    # fp64 and same-dtype references (FlashAttention's rule: the error against
    # fp64 at most twice that of the same math in the input dtype).
    window = spec["window"] or {}
    ref_args = dict(causal=spec["causal"], softcap=spec["softcap"],
                    window=(window.get("left"), window.get("right")) if window else None)
    exact_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    exact = attention_reference(*exact_leaves, **ref_args)
    exact.backward(dout.double())
    rough_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rough = attention_reference(*rough_leaves, compute_dtype=module.DTYPE, **ref_args)
    rough.backward(dout)
    exacts = [exact.detach()] + [t.grad for t in exact_leaves]
    roughs = [rough.detach()] + [t.grad for t in rough_leaves]
    row = dict(case=case, vs_single={}, vs_fp64={}, allowed={}, single_vs_fp64={}, ulp={})
    for name, g, s, e, r in zip(("out", "dq", "dk", "dv"), got, singles, exacts, roughs):
        row["vs_single"][name] = _max_err(g, s)
        row["ulp"][name] = _ulp(s)
        row["vs_fp64"][name] = _max_err(g, e)
        row["allowed"][name] = 2 * _max_err(r, e) + 1e-5
        row["single_vs_fp64"][name] = _max_err(s, e)
    return row


def _packed_spec_case(module, case, rank, world, device) -> dict:
    """A packed batch on the generated varlen kernels: each sequence sharded over
    the ranks on its own, against the whole batch in one process and fp64."""
    from specgen.check.reference import attention_reference

    lengths = [n * world for n in case["lengths"]]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    total, (q_heads, kv_heads) = sum(lengths), case["heads"]
    dim, dtype = module.HEAD_DIM, module.DTYPE
    gen = torch.Generator(device="cpu").manual_seed(5 + total)
    q, dout = (torch.randn(total, q_heads, dim, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(total, kv_heads, dim, generator=gen).to(device, dtype) for _ in range(2))
    index = torch.cat([a + layouts.positions(case["layout"], world, rank, (b - a) // world)
                       for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]).to(device)
    grads = not case.get("forward_only")
    shards = [t.index_select(0, index).requires_grad_(grads) for t in (q, k, v)]
    attn = _attention(module, case, device)
    out = attn(*shards, cu_seqlens=cu, max_seqlen=max(lengths))
    leaves = [t.clone().requires_grad_(grads) for t in (q, k, v)]
    single = module.attention(*leaves, cu_seqlens_q=cu, cu_seqlens_k=cu)
    single = single[0] if isinstance(single, tuple) else single
    got, singles = [out.detach()], [single.detach()]
    if grads:
        out.backward(dout.index_select(0, index))
        single.backward(dout)
        got += [s.grad for s in shards]
        singles += [t.grad for t in leaves]

    def reference(compute):
        ls = [t.to(compute).requires_grad_(grads) for t in (q, k, v)]
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            one = [t[a:b].transpose(0, 1).unsqueeze(0) for t in ls]
            outs.append(attention_reference(*one, causal=module.SPEC["causal"], compute_dtype=compute)[0]
                        .transpose(0, 1))
        whole = torch.cat(outs).to(compute)
        if not grads:
            return [whole.detach()]
        whole.backward(dout.to(compute))
        return [whole.detach()] + [t.grad for t in ls]

    exact, rough = reference(torch.float64), reference(dtype)
    row = dict(case=case, vs_single={}, vs_fp64={}, allowed={}, single_vs_fp64={}, ulp={})
    for name, g, s1, e, r in zip(("out", "dq", "dk", "dv"), got, singles, exact, rough):
        picked = [t.index_select(0, index) for t in (s1, e, r)]
        row["vs_single"][name] = _max_err(g, picked[0])
        row["ulp"][name] = _ulp(picked[0])
        row["vs_fp64"][name] = _max_err(g, picked[1])
        row["allowed"][name] = 2 * _max_err(picked[2], picked[1]) + 1e-5
        row["single_vs_fp64"][name] = _max_err(picked[0], picked[1])
    return row


SCENARIOS = {"reference": reference_cases, "errors": error_cases, "spec": spec_cases,
             "emulated": emulated_cases}


def spawn(world: int, backend: str, scenario: str, out_dir, options: dict | None = None) -> list[dict]:
    """Run ``scenario`` on ``world`` processes; every rank's result, rank order."""
    import uuid

    import torch.multiprocessing as mp

    store = str(Path(out_dir) / f"rendezvous-{uuid.uuid4().hex}")  # a fresh name; the ranks create it
    mp.spawn(main, args=(world, store, backend, scenario, str(out_dir), options or {}), nprocs=world)
    results = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    for r, result in enumerate(results):
        if "crash" in result:
            raise AssertionError(f"rank {r} crashed:\n{result['crash']}")
    return results

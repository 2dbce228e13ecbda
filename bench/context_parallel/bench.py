"""Context-parallel attention, timed against torch's own context parallel.

    torchrun --nproc-per-node 2 bench/context_parallel/bench.py --out DIR

For each S: specgen's ring attention (zigzag layout) over the generated kernels of
SPEC, forward and forward + backward; torch.distributed.tensor.experimental's
context_parallel around SDPA on the same inputs (its default load balancer, both
its all-gather and all-to-all rotations, SDPA's backends as torch picks them and
cuDNN forced: the fastest counts); the same generated kernel on one GPU over the
whole sequence and over one rank's length (the scaling efficiency); and the ring's
communication alone and its kernels alone (how much of the transfer is hidden).
Every figure is a median of CUDA-event timings after a warm-up, with a barrier
before each repetition. Rank 0 writes DIR/context_parallel.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specgen.parallel import ContextParallelAttention, shard  # noqa: E402
from specgen.parallel import ring as rings  # noqa: E402


def timed(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() across ranks' barriers."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def causal_flops(batch, heads, seq, dim, backward: bool) -> float:
    forward = 4 * batch * heads * seq * seq * dim / 2
    return forward * (3.5 if backward else 1.0)  # FlashAttention's count: bwd = 2.5 fwd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default="generated.fmha_train_gqa_causal")
    parser.add_argument("--seq", default="32768,65536,131072")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if not torch.cuda.is_available():  # on every rank, before any group is formed
        print(f"{sys.argv[0]}: needs CUDA GPUs; torch {torch.__version__} sees none", file=sys.stderr)
        return 2

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    module = importlib.import_module(args.spec)
    dim, group_size, dtype = module.HEAD_DIM, module.GROUP_SIZE, module.DTYPE
    heads, kv_heads = args.heads, args.heads // group_size
    device = torch.device("cuda", local)
    attn = ContextParallelAttention(module, mode="ring", layout="zigzag")
    rows = []
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    log(f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, spec {module.SPEC['name']}")
    for seq in [int(s) for s in args.seq.split(",")]:
        gen = torch.Generator(device=device).manual_seed(seq)
        q = torch.randn(args.batch, heads, seq, dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(args.batch, kv_heads, seq, dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(args.batch, kv_heads, seq, dim, device=device, dtype=dtype, generator=gen)
        dout = torch.randn_like(q)
        row = dict(seq=seq, batch=args.batch, heads=heads, kv_heads=kv_heads, head_dim=dim, world=world,
                   device=torch.cuda.get_device_name())
        shard_len = seq // world
        qs, ks, vs, dos = (shard(t, "zigzag", world, rank) for t in (q, k, v, dout))
        leaves = [t.clone().requires_grad_() for t in (qs, ks, vs)]

        def cp_fwd():
            with torch.no_grad():
                attn(qs, ks, vs)

        def cp_fwd_bwd():
            for t in leaves:
                t.grad = None
            attn(*leaves).backward(dos)

        row["specgen_fwd_ms"] = timed(cp_fwd, args.reps)
        row["specgen_fwdbwd_ms"] = timed(cp_fwd_bwd, args.reps)
        # Its parts: the kernels of every step without transfers, and the transfers alone.
        plans = rings.step_plans(attn.kernel.mask, "zigzag", world, rank, shard_len)
        alone = rings.Ring(None)
        scale = attn.kernel.default_scale()
        row["kernels_only_fwd_ms"] = timed(lambda: rings.ring_forward(attn.kernel, alone, plans, qs, ks, vs, scale),
                                           args.reps)
        out, lse = rings.ring_forward(attn.kernel, attn.ring, plans, qs, ks, vs, scale)
        row["kernels_only_fwdbwd_ms"] = row["kernels_only_fwd_ms"] + timed(
            lambda: rings.ring_backward(attn.kernel, alone, plans, qs, ks, vs, out, lse, dos, scale), args.reps)
        if world > 1:
            packed = rings._Packed(ks.shape, vs.shape, ks.dtype, device)
            kv, into = packed.pack(ks, vs), packed.empty()
            grads, grads_into = packed.zeros(torch.float32), packed.empty(torch.float32)

            def transfers(backward):
                for step in range(world):
                    works = attn.ring.shift(kv, into) if step + 1 < world else []
                    if backward:
                        works += attn.ring.shift(grads, grads_into)
                    rings._wait(works)

            row["comm_only_fwd_ms"] = timed(lambda: transfers(False), args.reps)
            row["comm_only_fwdbwd_ms"] = row["comm_only_fwd_ms"] + timed(lambda: transfers(True), args.reps)
            for phase in ("fwd", "fwdbwd"):
                exposed = max(0.0, row[f"specgen_{phase}_ms"] - row[f"kernels_only_{phase}_ms"])
                row[f"comm_hidden_{phase}"] = max(0.0, 1 - exposed / row[f"comm_only_{phase}_ms"])
        del leaves
        # One GPU, the same kernel: the whole sequence, and one rank's length.
        for label, length in (("single_full", seq), ("single_shard", shard_len)):
            q1, k1, v1, do1 = (t[:, :, :length] for t in (q, k, v, dout))
            lv = [t.clone().requires_grad_() for t in (q1, k1, v1)]
            try:
                def one_fwd():
                    with torch.no_grad():
                        module.attention(q1, k1, v1)

                def one_fwd_bwd():
                    for t in lv:
                        t.grad = None
                    module.attention(*lv).backward(do1)

                row[f"{label}_fwd_ms"] = timed(one_fwd, args.reps)
                row[f"{label}_fwdbwd_ms"] = timed(one_fwd_bwd, args.reps)
            except torch.OutOfMemoryError as error:
                row[f"{label}_error"] = str(error).splitlines()[0]
            del lv
            torch.cuda.empty_cache()
        # torch's context parallel around SDPA, KV heads expanded for its kernels.
        row.update(torch_context_parallel(q, k, v, dout, group_size, world, args.reps))
        # Figures.
        for phase, backward in (("fwd", False), ("fwdbwd", True)):
            total = causal_flops(args.batch, heads, seq, dim, backward)
            row[f"specgen_{phase}_tflops_per_gpu"] = total / world / row[f"specgen_{phase}_ms"] / 1e9
            if f"single_full_{phase}_ms" in row:
                row[f"single_full_{phase}_tflops"] = total / row[f"single_full_{phase}_ms"] / 1e9
                row[f"efficiency_vs_full_{phase}"] = row[f"specgen_{phase}_tflops_per_gpu"] / row[f"single_full_{phase}_tflops"]
            if f"single_shard_{phase}_ms" in row:
                shard_flops = causal_flops(args.batch, heads, shard_len, dim, backward)
                row[f"single_shard_{phase}_tflops"] = shard_flops / row[f"single_shard_{phase}_ms"] / 1e9
                row[f"efficiency_vs_shard_{phase}"] = row[f"specgen_{phase}_tflops_per_gpu"] / row[f"single_shard_{phase}_tflops"]
            best = row.get(f"torch_cp_{phase}_ms")
            if best:
                row[f"torch_cp_{phase}_tflops_per_gpu"] = total / world / best / 1e9
                row[f"speedup_vs_torch_cp_{phase}"] = best / row[f"specgen_{phase}_ms"]
        rows.append(row)
        log(json.dumps(row))
        del q, k, v, dout, qs, ks, vs, dos
        torch.cuda.empty_cache()
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "context_parallel.json").write_text(json.dumps(
            {"spec": module.SPEC["name"], "torch": torch.__version__, "rows": rows}, indent=1))
        print(f"{'S':>7} {'phase':>7} {'specgen TF/GPU':>14} {'torch CP TF/GPU':>15} {'x torch':>8} "
              f"{'eff(full)':>9} {'eff(shard)':>10} {'hidden':>7}")
        for r in rows:
            for phase in ("fwd", "fwdbwd"):
                print(f"{r['seq']:>7} {phase:>7} {r[f'specgen_{phase}_tflops_per_gpu']:>14.0f} "
                      f"{r.get(f'torch_cp_{phase}_tflops_per_gpu', float('nan')):>15.0f} "
                      f"{r.get(f'speedup_vs_torch_cp_{phase}', float('nan')):>8.2f} "
                      f"{r.get(f'efficiency_vs_full_{phase}', float('nan')):>9.3f} "
                      f"{r.get(f'efficiency_vs_shard_{phase}', float('nan')):>10.3f} "
                      f"{r.get(f'comm_hidden_{phase}', float('nan')):>7.2f}")
    dist.barrier()
    dist.destroy_process_group()


def torch_context_parallel(q, k, v, dout, group_size, world, reps) -> dict:
    """torch's context parallel (SDPA inside context_parallel) on the same inputs:
    the fastest of its rotations and SDPA backends, with each one's time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world,))
    k_full = k.repeat_interleave(group_size, dim=1)
    v_full = v.repeat_interleave(group_size, dim=1)
    found = {}
    for rotate in ("allgather", "alltoall"):
        for backend in ("default", "cudnn"):
            label = f"{rotate}/{backend}"
            try:
                set_rotate_method(rotate)
                bufs = [t.clone() for t in (q, k_full, v_full)]
                grad = dout.clone()
                ctx = sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if backend == "cudnn" else _null()
                # context_parallel shards the buffers in place (a resize), which a
                # tensor that requires grad refuses: ask for gradients inside.
                with ctx, context_parallel(mesh, buffers=bufs + [grad], buffer_seq_dims=[2, 2, 2, 2],
                                           no_restore_buffers=set(bufs + [grad])):
                    for t in bufs:
                        t.requires_grad_()

                    def fwd():
                        with torch.no_grad():
                            F.scaled_dot_product_attention(*bufs, is_causal=True)

                    def fwd_bwd():
                        for t in bufs:
                            t.grad = None
                        F.scaled_dot_product_attention(*bufs, is_causal=True).backward(grad)

                    found[f"torch_cp_{label}_fwd_ms"] = timed(fwd, reps)
                    found[f"torch_cp_{label}_fwdbwd_ms"] = timed(fwd_bwd, reps)
                del bufs, grad
            except Exception as error:  # noqa: BLE001 - recorded in the row
                found[f"torch_cp_{label}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            torch.cuda.empty_cache()
    for phase in ("fwd", "fwdbwd"):
        times = {key: ms for key, ms in found.items() if key.endswith(f"_{phase}_ms")}
        if times:
            key = min(times, key=times.get)
            found[f"torch_cp_{phase}_ms"] = times[key]
            found[f"torch_cp_{phase}_best"] = key[len("torch_cp_"):-len(f"_{phase}_ms")]
    return found


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    raise SystemExit(main())

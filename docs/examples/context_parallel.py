"""Context-parallel training step over every GPU of a machine.

    torchrun --nproc-per-node 2 docs/examples/context_parallel.py [--seq 65536]

Each rank holds one zigzag shard of a long causal sequence (B1, 32 query heads,
8 KV heads, D128, bf16); ring attention over the generated kernels of
specs/fmha_train_gqa_causal.yaml computes exact attention over the whole sequence,
forward and backward. Rank 0 prints the output error against the same kernel run
on the whole sequence on one GPU (skip that with --no-check for lengths that do not
fit one GPU).
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a checkout: generated/ and specgen/

import torch
import torch.distributed as dist

import generated.fmha_train_gqa_causal as kernels
from specgen.parallel import ContextParallelAttention, gather, shard


def _refuse(message):
    print(f"context_parallel.py: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--mode", choices=("ring", "ulysses"), default="ring")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    # One line and exit 2, as specgen's commands do, rather than a traceback from deep
    # inside torch.cuda or init_process_group.
    if not torch.cuda.is_available():
        _refuse("needs CUDA GPUs (NCCL), and torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); without GPUs, tests/test_parallel.py runs the "
                "ring over gloo on the CPU")
    if "RANK" not in os.environ:
        _refuse("run it under torchrun, one process per GPU: "
                "torchrun --nproc-per-node 2 docs/examples/context_parallel.py")

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()

    # The whole batch, made the same on every rank (a data loader would hand each
    # rank its shard directly).
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 8, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, 8, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)

    attn = ContextParallelAttention(kernels, dist.group.WORLD, mode=args.mode, layout="zigzag")
    q_s, k_s, v_s = (shard(t, "zigzag", world, rank).requires_grad_() for t in (q, k, v))
    out = attn(q_s, k_s, v_s, seq_len=args.seq)  # [1, 32, seq / world, 128]
    out.float().square().sum().backward()  # gradients reach q_s, k_s, v_s
    print(f"rank {rank}: out {tuple(out.shape)}, |dq| {q_s.grad.float().norm():.4g}, "
          f"|dk| {k_s.grad.float().norm():.4g}", flush=True)

    if not args.no_check:
        whole = gather(out.detach(), "zigzag")
        if rank == 0:
            single = kernels.attention(q, k, v)
            print(f"max |out - one-GPU out| = {(whole - single).abs().max().item():.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

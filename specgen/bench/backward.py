"""`specgen bench --suite backward`: the backward kernels of a `backward: true`
spec next to the SDPA cuDNN and FA2 backward passes (and FlexAttention's), timed
in one process on the same inputs and the same upstream gradient.

What is timed is the backward alone: ``torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True)`` on a forward graph made once, so the forward is not in the
figure. FLOPs are 2.5 times the forward's (the five matmuls of the FA2 backward
against the forward's two), the usual convention. SDPA's cuDNN and FA2 backends
need K/V expanded to the query heads: the expansion is made once, outside the
timing, and their gradients are those of the expanded K/V (the sum over the
group, which a GQA model would add, is not timed).
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Callable

from specgen.bench.prefill import (
    BACKWARD_SUITE,
    SUITES,
    BenchResult,
    Row,
    Timing,
    device_and_matmul_rate,
    failed_timing,
    format_markdown,
    spec_flops,
    speedups,
    timed,
    write_result,
)
from specgen.errors import UsageError

# Backward FLOPs over forward FLOPs: 5 matmuls (S, dP, dV, dQ, dK) against 2.
BACKWARD_FLOP_FACTOR = 2.5


def backward_flops(spec: dict, batch: int, heads: int, seq_q: int, seq_k: int) -> int:
    return int(BACKWARD_FLOP_FACTOR * spec_flops(spec, batch, heads, seq_q, seq_k))


def _baselines(torch, names, causal: bool, ratio: int) -> dict:
    """Forward callables (q, k_full, v_full, k, v) -> out whose autograd graphs
    are timed, or the reason a baseline is missing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    made: dict = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        if name in names:
            def run(q, k_full, v_full, _k, _v, backend=backend):
                with sdpa_kernel([backend]):
                    return sdpa(q, k_full, v_full, is_causal=causal)

            made[name] = run
    if "flex" in names:
        try:
            import torch._functorch.config as functorch_config
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            # The timing replays one backward graph (retain_graph=True), which a
            # compiled backward with donated buffers refuses.
            functorch_config.donated_buffer = False
            compiled = torch.compile(flex_attention)
            masks: dict = {}

            def run_flex(q, _kf, _vf, k, v):
                key = (q.shape[2], k.shape[2])
                if causal and key not in masks:
                    masks[key] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None,
                                                   key[0], key[1], device="cuda")
                return compiled(q, k, v, block_mask=masks.get(key), enable_gqa=ratio > 1)

            made["flex"] = run_flex
        except Exception as exc:  # noqa: BLE001 - reported, not dropped
            made["flex"] = f"{type(exc).__name__}: {exc}"
    return made


def _grad_timer(torch, do_bench, forward, leaves, dout):
    """(median ms of the backward, the gradients) for one forward callable."""
    out = forward()
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.cuda.synchronize()
    ms = do_bench(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                  warmup=10, rep=200, return_mode="median")
    return ms, grads


def run_backward_bench(paths: list[str], out_dir: Path, gen_dir: Path, baselines: tuple[str, ...],
                       log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> list[Path]:
    from specgen.check.cases import random_qkv
    from specgen.check.gpu import fresh_modules, require_cuda

    jobs = fresh_modules(paths, gen_dir, log)
    without = [job.plan.module_name for job, module in jobs if not module.SPEC.get("backward")]
    if without:
        raise UsageError(
            f"--suite backward: {', '.join(without)} has backward: false; the suite times "
            "backward kernels (set backward: true in the spec)"
        )
    torch = require_cuda("bench")
    from triton.testing import do_bench

    batch, heads, seqs = SUITES["prefill"]  # the forward suite's shapes
    device, matmul = device_and_matmul_rate(torch, do_bench, log)

    written = []
    for job, module in jobs:
        spec = module.SPEC
        ratio, causal = spec["gqa_ratio"], spec["causal"]
        if heads % ratio:
            log(f"{job.plan.module_name}: skipped, {heads} query heads not divisible by gqa_ratio {ratio}")
            continue
        kv_heads = heads // ratio
        fns = _baselines(torch, baselines, causal, ratio)
        rows = []
        for seq in seqs:
            log(f"[{job.plan.module_name}] backward S={seq}")
            gen = torch.Generator(device="cuda").manual_seed(seq)
            q, k, v = (t.requires_grad_() for t in random_qkv(spec, batch, kv_heads, seq, seq, generator=gen))
            dout = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
            flops = backward_flops(spec, batch, heads, seq, seq)
            timings: dict[str, Timing] = {}
            ms, ours = _grad_timer(torch, do_bench, lambda: module.attention(q, k, v), (q, k, v), dout)
            timings["specgen"] = timed(ms, flops, matmul)
            if not all(torch.isfinite(g).all() for g in ours):
                timings["specgen"].error = "non-finite gradient"
            # Expanded K/V leaves for SDPA, made outside the timing.
            k_full, v_full = (t.detach().repeat_interleave(ratio, 1).requires_grad_() if ratio > 1
                              else t.detach().clone().requires_grad_() for t in (k, v))
            for name in baselines:
                fn = fns.get(name)
                if not callable(fn):
                    timings[name] = Timing(error=str(fn or "not available"))
                    continue
                qb = q.detach().clone().requires_grad_()
                kb, vb = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
                expanded = name in ("cudnn", "flash")
                leaves = (qb, k_full, v_full) if expanded else (qb, kb, vb)
                try:
                    ms, grads = _grad_timer(torch, do_bench, lambda: fn(qb, k_full, v_full, kb, vb),
                                            leaves, dout)
                    dq, dk, dv = grads
                    if expanded and ratio > 1:  # the group's sum, for the comparison only
                        dk, dv = (g.unflatten(1, (kv_heads, ratio)).sum(2) for g in (dk, dv))
                    diff = max((x.float() - y.float()).abs().max().item()
                               for x, y in zip((dq, dk, dv), ours))
                    timings[name] = timed(ms, flops, matmul, max_abs_diff_vs_specgen=diff)
                except Exception as exc:  # noqa: BLE001 - a missing baseline is reported
                    timings[name] = failed_timing(exc)
                del qb, kb, vb
            rows.append(Row(batch=batch, heads_q=heads, heads_kv=kv_heads, seq_q=seq, seq_k=seq,
                            head_dim=spec["head_dim"], dtype=spec["dtype"], causal=causal, flops=flops,
                            timings=timings, speedup=speedups(timings)))
            summary = "  ".join(f"{n} {t.tflops:.0f}" if t.tflops else f"{n} n/a"
                                for n, t in timings.items())
            log(f"[{job.plan.module_name}] backward S={seq}: TFLOPS {summary}")
            del q, k, v, dout, ours, k_full, v_full
            torch.cuda.empty_cache()
        result = BenchResult(
            spec=job.plan.module_name, kernel=job.plan.kernel_name, suite=BACKWARD_SUITE,
            created=datetime.date.today().isoformat(), device=device, matmul_tflops=matmul,
            baselines=list(baselines), rows=rows,
            layout=("Sq=Skv; backward only (torch.autograd.grad of a saved forward graph), "
                    f"TFLOPS = {BACKWARD_FLOP_FACTOR} x forward FLOPs / time; SDPA gets K/V "
                    "expanded to the query heads outside the timing"),
        )
        stem = write_result(result, out_dir, log)
        print(format_markdown(result))
        written.append(stem)
    return written

"""`specgen bench --suite backward`: the backward kernels of a `backward: true`
spec next to the baselines' backward passes, timed in one process on the same
inputs and the same upstream gradient, on the prefill suite's shapes (B4 Hq32,
S 1024..16384; a spec whose gqa_ratio does not divide 32 is skipped).

What is timed is the backward alone: ``torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True)`` on a forward graph made once, so the forward is not in the
figure (a block-sparse spec's map, forward and backward, is built once per batch
and timed apart, as the prefill suite does). Each backward is also timed as a CUDA
graph of one call (``ms_one_call``, a second table): without the host's launch
path, which bounds short backward calls. What it counts: 2.5 times the forward's
FLOPs (the five matmuls of the FA2 backward against the forward's two), the usual
convention. Baselines that expand K/V (SDPA's cuDNN and FA2) get K/V leaves
repeated to the query heads, made outside the timing; their gradients are those
of the expanded K/V (the sum over the group, which a GQA model would add, is not
timed).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from specgen.bench.baselines import Inputs
from specgen.bench.core import Case, Context, Suite, Timing, graph_time_ms, matmul_rate, median_ms, timed
from specgen.bench.flops import forward_flops, mask_mod_flops
from specgen.bench.prefill import BATCH, HEADS, REPORT, SEQS, checked_shapes, varlen_lengths
from specgen.errors import UsageError

# Backward FLOPs over forward FLOPs: 5 matmuls (S, dP, dV, dQ, dK) against 2.
BACKWARD_FLOP_FACTOR = 2.5


def backward_flops(plan, batch: int, heads: int, seq_q: int, seq_k: int) -> int:
    return int(BACKWARD_FLOP_FACTOR * forward_flops(plan, batch, heads, seq_q, seq_k))


def grad_timer(torch, do_bench, forward, leaves, dout):
    """(median ms of the backward, the gradients, the median ms of a CUDA graph of
    one backward or None) for ``forward(*leaves)``."""
    out = _first(forward(*leaves))
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.cuda.synchronize()
    ms = do_bench(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                  warmup=10, rep=200, return_mode="median")
    del out  # the eager graph, before the captured one is made
    return ms, grads, grad_graph_ms(torch, do_bench, forward, leaves, dout)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def grad_graph_ms(torch, do_bench, forward, leaves, dout) -> Optional[float]:
    """The backward's time without the host's launch path: a CUDA graph of one
    ``torch.autograd.grad`` replayed. The graph's forward, ``forward(*fresh)``, runs
    on the capture stream on fresh copies of ``leaves`` made there. Autograd runs
    each backward op on its forward op's stream, and a leaf's gradient node on the
    stream of the leaf's first use: with leaves first used on the default stream the
    capture fails (the legacy stream would wait on the capturing one). None where
    the backward cannot be captured (the eager time stands alone)."""
    made = []

    def prepare():
        fresh = tuple(t.detach().clone().requires_grad_() for t in leaves)
        made.append((fresh, _first(forward(*fresh))))

    def backward():
        fresh, out = made[-1]
        return torch.autograd.grad(out, fresh, dout, retain_graph=True)

    try:
        return graph_time_ms(torch, backward, do_bench, prepare=prepare)
    except Exception:  # noqa: BLE001 - a backward that cannot be captured keeps its eager time
        torch.cuda.synchronize()
        return None


def baseline_backward(baseline, fn, q, k, v, k_full, v_full, extra=None, packed=None):
    """(forward(*leaves), leaves) of one baseline: fresh leaves of q, k, v (each
    baseline builds its own graph on the same values), with ``k_full``/``v_full``
    (K/V repeated to the query heads, already leaves) in place of k, v for a baseline
    that expands K/V. ``forward`` reads the leaves it is given (the timed ones, or a
    CUDA graph's fresh copies) where the baseline reads them; for a varlen spec, as
    the packed batch ``packed`` with those leaves as its q, k and v."""
    qb = q.detach().clone().requires_grad_()
    kb, vb = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    expands = baseline.expands_kv
    leaves = (qb, k_full, v_full) if expands else (qb, kb, vb)
    cache: dict = {}  # one per baseline and case, as the prefill suite's Inputs

    def forward(q_, k_, v_):
        if packed is not None:
            return fn(Inputs(packed=dataclasses.replace(packed, q=q_, k=k_, v=v_),
                             extra=extra or {}, cache=cache))
        return fn(Inputs(q=q_, k=kb if expands else k_, v=vb if expands else v_,
                         k_full=k_ if expands else k_full, v_full=v_ if expands else v_full,
                         extra=extra or {}, cache=cache))

    return forward, leaves


class Backward(Suite):
    name = "backward"
    report = REPORT

    def check(self, plans: list) -> None:
        without = [plan.module_name for plan in plans if not plan.backward]
        if without:
            raise UsageError(
                f"--suite backward: {', '.join(without)} has backward: false; the suite times "
                "backward kernels (set backward: true in the spec)"
            )

    def yardstick(self, torch, do_bench, log) -> dict:
        return {"matmul_tflops": matmul_rate(torch, do_bench, log)}

    def skip(self, plan) -> Optional[str]:
        if HEADS % plan.group_size:
            return f"{HEADS} query heads not divisible by gqa_ratio {plan.group_size}"
        return None

    def shapes(self, plan, override=None) -> list:
        if override:
            return checked_shapes(plan, override)
        return [(BATCH, HEADS, seq) for seq in SEQS]

    def case(self, ctx: Context, module, plan, shape) -> Case:
        from specgen.check.cases import feature_inputs, random_packed, random_qkv, shape_dims

        torch = ctx.torch
        batch, heads, seq = shape
        ratio = plan.group_size
        kv_heads = heads // ratio
        gen = torch.Generator(device="cuda").manual_seed(seq)
        row = dict(batch=batch, heads_q=heads, heads_kv=kv_heads, seq_q=seq, seq_k=seq,
                   head_dim=plan.head_dim, dtype=plan.dtype, causal=plan.causal)
        if plan.varlen:
            # The prefill suite's ragged packed batch (S/2, S, 3S/2, S, ... tokens): q, k
            # and v are the packed [T, H, D] leaves, the call takes the cumulative lengths.
            lengths = varlen_lengths(batch, seq)
            packed = random_packed(plan.spec_dict, [(n, n) for n in lengths], kv_heads, generator=gen)
            q, k, v = (t.requires_grad_() for t in (packed.q, packed.k, packed.v))
            dout = torch.randn((*q.shape[:2], v.shape[2]), generator=gen, device="cuda").to(q.dtype)
            extra = feature_inputs(plan.spec_dict, {"heads": heads}, gen)
            row["flops"] = sum(backward_flops(plan, 1, heads, n, n) for n in lengths)
            return Case(f"backward S={seq}", row, inputs=(None, None, ratio, extra, packed),
                        kernel=(q, k, v, dout, extra, packed.kwargs()))
        q, k, v = (t.requires_grad_() for t in random_qkv(plan.spec_dict, batch, kv_heads, seq, seq,
                                                           generator=gen))
        # out's shape, not q's: v_head_dim may differ from head_dim (MLA's 192/128)
        dout = torch.randn((*q.shape[:3], v.shape[3]), generator=gen, device="cuda").to(q.dtype)
        # The spec's sinks and hook tensors (document ids, slopes), as the prefill suite draws them.
        extra = feature_inputs(plan.spec_dict, shape_dims(q, k), gen)
        # Expanded K/V leaves for the baselines that expand, made outside the timing.
        k_full, v_full = (t.detach().repeat_interleave(ratio, 1).requires_grad_() if ratio > 1
                          else t.detach().clone().requires_grad_() for t in (k, v))
        row["flops"] = backward_flops(plan, batch, heads, seq, seq)
        if plan.mask_mod:  # only the pairs the mask leaves, as the prefill suite counts
            row["flops"] = int(BACKWARD_FLOP_FACTOR * mask_mod_flops(torch, plan, extra, batch, heads,
                                                                      seq, seq))
        return Case(f"backward S={seq}", row, inputs=(k_full, v_full, ratio, extra, None),
                    kernel=(q, k, v, dout, extra, {}))

    def time_kernel(self, ctx: Context, module, case: Case) -> Timing:
        torch = ctx.torch
        q, k, v, dout, extra, call_kwargs = case.kernel
        kwargs, map_fields = dict(extra, **call_kwargs), {}
        if hasattr(module, "make_block_map"):
            # Built once per batch with the backward's maps and reused by every layer,
            # as Flex's block mask is: its build is timed apart, not in the backward.
            tensors = {n: extra[n] for n in module.SPEC["tensors"]}

            def build():
                return module.make_block_map(q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                                             device=q.device, backward=True, **tensors)

            kwargs["block_map"] = build()
            partial, full, capacity = kwargs["block_map"].tile_counts()
            map_fields = dict(block_map_ms=median_ms(ctx.do_bench, build),
                              tiles_visited=(partial + full) / max(capacity, 1))
        ms, case.ours, ms_graph = grad_timer(torch, ctx.do_bench,
                                              lambda *qkv: module.attention(*qkv, **kwargs), (q, k, v), dout)
        timing = timed(ms, case.row["flops"], ctx.yardstick["matmul_tflops"], ms_one_call=ms_graph,
                       **map_fields)
        if not all(torch.isfinite(g).all() for g in case.ours):
            timing.error = "non-finite gradient"
        return timing

    def time_baseline(self, ctx: Context, case: Case, baseline, fn) -> Timing:
        q, k, v, dout, _, _ = case.kernel
        k_full, v_full, ratio, extra, packed = case.inputs
        forward, leaves = baseline_backward(baseline, fn, q, k, v, k_full, v_full, extra, packed)
        ms, (dq, dk, dv), ms_graph = grad_timer(ctx.torch, ctx.do_bench, forward, leaves, dout)
        if baseline.expands_kv and ratio > 1:  # the group's sum, for the comparison only
            dk, dv = (g.unflatten(1, (k.shape[1], ratio)).sum(2) for g in (dk, dv))
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip((dq, dk, dv), case.ours))
        return timed(ms, case.row["flops"], ctx.yardstick["matmul_tflops"], max_abs_diff_vs_specgen=diff,
                     note=baseline.note, ms_one_call=ms_graph)

    def layout(self, plan) -> str:
        return (("packed varlen batch of B sequences of S/2, S, 3S/2, S, ... (mean S) tokens, "
                 "Sq=Skv per sequence" if plan.varlen else "Sq=Skv")
                + "; backward only (torch.autograd.grad of a saved forward graph), "
                f"TFLOPS = {BACKWARD_FLOP_FACTOR} x forward FLOPs / time; SDPA gets K/V "
                "expanded to the query heads outside the timing")


SUITE = Backward()

"""Packed GQA in the packed-document backward: the prototype kernels of
pack_bwd_kernels.py beside the shipped backward of `fmha_train_document` and Flex's
backward, one process, the same inputs (B4 Hq32 Hkv8 bf16 D128 causal, the suites'
documents).

The shipped dK/dV kernel loops over the four query heads of its KV head, each
against 64-position query tiles; its dQ kernel takes 128 positions of one head. The
packed kernels take 16 or 32 positions of all four heads at once (64 or 128 rows),
so a key tile meets, and a query tile visits, the span of fewer positions. Maps are
built once per length (at each variant's tiles) and are not timed; D comes from the
shipped delta kernel in every variant.

Timed: the backward alone (do_bench medians). `shipped` and the packed variants are
called directly (no autograd); `shipped (autograd)` and Flex go through
torch.autograd.grad, as `specgen bench --suite backward` times them. Each variant's
gradients are compared with the shipped ones. TFLOPS: 2.5 x the forward FLOPs of the
visible pairs.

    python3 bench/block_sparse/pack_bwd.py OUT_DIR [SEQS]
"""

import json
import math
import sys
from pathlib import Path

import torch

sys.path[:0] = [".", str(Path(__file__).parent)]
from ceiling import BATCH, HEADS, document_inputs  # noqa: E402  (this folder's forward script)
from pack_bwd_kernels import packed_backward, packed_dkdv, packed_dq, packed_maps  # noqa: E402
from specgen.bench.baselines import Inputs, _flex  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402

NAME = "fmha_train_document"
SEQS = (1024, 4096, 16384)
WIDE = {"occupancy": 1, "num_worker_warps": 8}
# label -> (dQ tile (positions, keys), its hints, dK/dV tile, its hints)
VARIANTS = {
    "dq 16x64 / kv 16x64": ((16, 64), {}, (16, 64), {}),
    "dq 32x64 w8 / kv 16x64": ((32, 64), WIDE, (16, 64), {}),
    "dq 16x64 / kv 32x64 w8": ((16, 64), {}, (32, 64), WIDE),
    "dq 32x64 w8 / kv 32x64 w8": ((32, 64), WIDE, (32, 64), WIDE),
}


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def main(out_dir: str, seqs=SEQS) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    m = load_module_from_source(f"packbwd_{NAME}", Path(f"generated/{NAME}.py").read_text(), f"<{NAME}>")
    plan = make_plan(load_spec(f"specs/{NAME}.yaml"))
    flex = _flex(torch, "backward", plan)
    kernels = {label: (packed_dq.replace_hints(**dq_hints) if dq_hints else packed_dq,
                       packed_dkdv.replace_hints(**kv_hints) if kv_hints else packed_dkdv)
               for label, (_, dq_hints, _, kv_hints) in VARIANTS.items()}
    scale = 1.0 / math.sqrt(128)
    rows = []
    for seq in seqs:
        q, k, v, extra, tensors, gen, flops = document_inputs(m.SPEC, plan, seq)
        dout = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
        doc = tensors["doc"].contiguous()
        flops = 2.5 * flops
        row = {"seq": seq, "flops": flops, "ms": {}, "max_diff": {}}
        block_map = m.make_block_map(BATCH, HEADS, seq, seq, device=q.device, backward=True, **tensors)
        out, lse = m._forward(q, k, v, doc=doc, block_map=block_map)

        def shipped():
            return m._backward(q, k, v, out, lse, dout, scale, 0, doc, *block_map.grads)

        reference = shipped()
        row["ms"]["shipped"] = median_ms(shipped)
        for label, (dq_tile, _, kv_tile, _) in VARIANTS.items():
            maps = packed_maps(m, doc, BATCH, seq, seq, q.device, dq_tile, kv_tile)

            def call(dq_tile=dq_tile, kv_tile=kv_tile, maps=maps, pair=kernels[label]):
                return packed_backward(m, q, k, v, out, lse, dout, doc, scale, dq_tile, kv_tile, pair, maps)

            try:
                grads = call()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                row["max_diff"][label] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"S={seq} {label}: {row['max_diff'][label]}", flush=True)
                continue
            row["max_diff"][label] = [(a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference)]
            row["ms"][label] = median_ms(call)
        # The suite's way: autograd over a saved forward, for shipped and Flex alike.
        for label, fn in (("shipped (autograd)", lambda leaves: m.attention(*leaves, block_map=block_map,
                                                                              **extra)),
                          ("flex", lambda leaves: flex(Inputs(q=leaves[0], k=leaves[1], v=leaves[2],
                                                              extra=extra)))):
            leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
            result = fn(leaves)
            result = result[0] if isinstance(result, tuple) else result
            torch.autograd.grad(result, leaves, dout, retain_graph=True)
            row["ms"][label] = median_ms(lambda: torch.autograd.grad(result, leaves, dout, retain_graph=True))
        row["tflops"] = {label: flops / ms / 1e9 for label, ms in row["ms"].items()}
        base = row["ms"]["shipped"]
        print(f"S={seq:6d} " + "  ".join(f"{label}: {row['tflops'][label]:4.0f}T {base / ms:.2f}x"
                                          for label, ms in row["ms"].items())
              + f"  flex/shipped(autograd) {row['ms']['flex'] / row['ms']['shipped (autograd)']:.2f}", flush=True)
        print("   max diff (dq, dk, dv): " + "  ".join(
            f"{label} " + (",".join(f"{d:.1e}" for d in diff) if isinstance(diff, list) else "ERR")
            for label, diff in row["max_diff"].items()), flush=True)
        rows.append(row)
        Path(out_dir, "pack_bwd.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "spec": NAME, "batch": BATCH, "heads": HEADS, "rows": rows},
            indent=1))


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(s) for s in sys.argv[2].split(",")) if len(sys.argv) > 2 else SEQS)

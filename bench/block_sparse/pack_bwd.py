"""The packed-document backward with packed GQA tiles against the same spec's per-head
backward and Flex's, one process, the same inputs (B4 Hq32 Hkv8 bf16 D128 causal,
the suites' documents).

`packed` is generated/fmha_train_document.py (pack_gqa: dK/dV and dQ tiles of 16
positions of the four query heads of a KV head, 64 x 64, two CTAs per SM). `per-head`
is the same spec rendered before the backward packed GQA (dK/dV looping over the four
heads with 64-position tiles; dQ 128 positions of one head at one CTA of two warp
groups), a module file given on the command line (for example `git show
4ab8a91:generated/fmha_train_document.py`). Each module builds its own maps once per
length (make_block_map(..., backward=True), not timed).

Timed: the backward alone (do_bench medians): each module's _backward called directly
(no autograd), then the packed module and Flex through torch.autograd.grad, as
`specgen bench --suite backward` times them. The two modules' gradients are compared
(max abs difference). TFLOPS: 2.5 x the forward FLOPs of the visible pairs.

    python3 bench/block_sparse/pack_bwd.py PER_HEAD_MODULE OUT_DIR [SEQS]
"""

import json
import math
import sys
from pathlib import Path

import torch

sys.path[:0] = [".", str(Path(__file__).parent)]
from ceiling import BATCH, HEADS, document_inputs  # noqa: E402  (this folder's forward script)
from specgen.bench.baselines import Inputs, _flex  # noqa: E402
from specgen.compile.export import load_module_from_source, rename_op  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402

NAME = "fmha_train_document"
SEQS = (1024, 2048, 4096, 8192, 16384)


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def main(per_head_path: str, out_dir: str, seqs=SEQS) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    # The per-head module registers its custom op under a name of its own: an op is
    # registered once per process and name, and the second module would reuse the first's.
    per_head = rename_op(Path(per_head_path).read_text(), "per_head", per_head_path)
    modules = {"per-head": load_module_from_source(f"perhead_{NAME}", per_head, "<per-head>"),
               "packed": load_module_from_source(f"packed_{NAME}", Path(f"generated/{NAME}.py").read_text(),
                                                 "<packed>")}
    assert modules["packed"].BWD_DQ_TILE_P and not hasattr(modules["per-head"], "BWD_DQ_TILE_P")
    plan = make_plan(load_spec(f"specs/{NAME}.yaml"))
    flex = _flex(torch, "backward", plan)
    scale = 1.0 / math.sqrt(128)
    rows = []
    for seq in seqs:
        q, k, v, extra, tensors, gen, flops = document_inputs(modules["packed"].SPEC, plan, seq)
        dout = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
        doc = tensors["doc"].contiguous()
        flops = 2.5 * flops
        row = {"seq": seq, "flops": flops, "ms": {}}
        grads = {}
        for label, m in modules.items():
            block_map = m.make_block_map(BATCH, HEADS, seq, seq, device=q.device, backward=True, **tensors)
            out, lse = m._forward(q, k, v, doc=doc, block_map=block_map)

            def call(m=m, out=out, lse=lse, block_map=block_map):
                return m._backward(q, k, v, out, lse, dout, scale, 0, doc, *block_map.grads)

            grads[label] = call()
            row["ms"][label] = median_ms(call)
            if label == "packed":
                packed_map = block_map
        row["max_diff"] = [(a.float() - b.float()).abs().max().item()
                           for a, b in zip(grads["packed"], grads["per-head"])]
        # The suite's way: autograd over a saved forward, for the packed module and Flex.
        m = modules["packed"]
        for label, fn in (("packed (autograd)", lambda leaves: m.attention(*leaves, block_map=packed_map, **extra)),
                          ("flex", lambda leaves: flex(Inputs(q=leaves[0], k=leaves[1], v=leaves[2], extra=extra)))):
            leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
            result = fn(leaves)
            result = result[0] if isinstance(result, tuple) else result
            torch.autograd.grad(result, leaves, dout, retain_graph=True)
            row["ms"][label] = median_ms(lambda: torch.autograd.grad(result, leaves, dout, retain_graph=True))
        row["tflops"] = {label: flops / ms / 1e9 for label, ms in row["ms"].items()}
        ms = row["ms"]
        print(f"S={seq:6d} " + "  ".join(f"{label}: {row['tflops'][label]:4.0f}T" for label in ms)
              + f"  packed/per-head {ms['per-head'] / ms['packed']:.3f}x"
              + f"  flex/packed(autograd) {ms['flex'] / ms['packed (autograd)']:.2f}x"
              + "  max diff (dq, dk, dv) " + ",".join(f"{d:.1e}" for d in row["max_diff"]), flush=True)
        rows.append(row)
        Path(out_dir, "pack_bwd.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "spec": NAME, "batch": BATCH, "heads": HEADS, "rows": rows},
            indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], tuple(int(s) for s in sys.argv[3].split(",")) if len(sys.argv) > 3 else SEQS)

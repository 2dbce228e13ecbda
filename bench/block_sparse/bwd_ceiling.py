"""The packed-document backward's ceiling: the shipped backward kernels of
`fmha_train_document` and the smallest kernels that walk the same maps, timed
beside Flex's backward in one process (B4 Hq32 Hkv8 bf16 D128 causal, documents
of about 256 tokens, the suites' inputs).

Variants, each the shipped module with its dK/dV and dQ kernels edited (same
launchers, grids, tiles, maps and compiler hints):

  shipped   the generated kernels (full tiles unmasked, partial tiles masked; packed
            GQA tiles where the spec packs them);
  no_mask   the document ids are not read on partial tiles either: what evaluating
            the mask_mod costs (wrong gradients, timing only);
  all_full  every visited tile is treated as full: the exponentials and dS, no mask
            at all (wrong gradients on partial tiles, timing only): the smallest
            kernels that compute the backward of these tiles;
  mma_only  per visited tile the loads and the MMAs only (S, dP, dV, dK in the
            dK/dV kernel; S, dP, dQ in the dQ kernel): no exponentials, no mask, no
            delta (wrong gradients, timing only). Whatever a backward that visits
            these tiles with these kernels does beyond its matrix products comes on
            top of this time.

What is timed is the backward alone (torch.autograd.grad of a saved forward graph,
the maps built once), as `specgen bench --suite backward` does. TFLOPS: 2.5 x the
forward FLOPs of the visible pairs. Flex: the Triton backend compiled for one
shape, the same mask as a block mask.

    python3 bench/block_sparse/bwd_ceiling.py OUT_DIR [SEQS]

The edits are patterns over the kernels' text, written against the kernels of
commit e0b9bee (experiments, section 44); the backward kernels have changed since
(runs of full tiles walked by index, section 46; the preprocessing folded into the
dQ kernel, section 48), and `all_full` no longer finds its mask there. Run it from a checkout of that commit, or rewrite the
edits for the kernels of the day.
"""

import json
import re
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path[:0] = [".", str(Path(__file__).parent)]
from ceiling import BATCH, HEADS, KV_HEADS, document_inputs, edit_kernel  # noqa: E402  (this folder's forward script)
from specgen.bench.baselines import Inputs, _flex  # noqa: E402
from specgen.compile.export import load_module_from_source, rename_op  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402
SEQS = (1024, 4096, 16384)
NAME = "fmha_train_document"
DOCS = re.compile(r"\n +doc_0 = ct\.gather\(Doc, \(batch, rows\)\).*\n +doc_1 = ct\.gather\(Doc, \(batch, keys\)\).*")
DOC_TERM = re.compile(r"\n +& \(doc_0 == doc_1\)")
EXP2 = r"ct\.exp2\(\(s - lse\) \* INV_LN2(?:, flush_to_zero=True)?\)"
SOFTMAX = re.compile(r"\n( +)doc_0 = ct\.gather\(Doc, \(batch, rows\)\).*?"
                     r"p = ct\.where\(visible, " + EXP2 + r", 0\.0\)", re.S)


def edit_kernels(text: str, edit) -> str:
    """``text`` with ``edit`` applied to the body of each backward dK/dV and dQ kernel."""
    for prefix in ("fmha_bwd_dkdv_", "fmha_bwd_dq_"):
        text = edit_kernel(text, prefix, edit)
    return text


def no_mask(body: str) -> str:
    body, n = DOCS.subn("", body)
    assert n >= 1, n
    body, n = DOC_TERM.subn("", body)
    assert n >= 1, n
    return body


VISIBLE = re.compile(r"\n +visible = \(\n(?: +.*\n)*? +\)\n")
WHERE = re.compile(r"p = ct\.where\(visible, (" + EXP2 + r"), 0\.0\)")


FULL_VISIBLE = re.compile(r"\n +visible = rows < q_offset \+ seq_q")


def all_full(body: str) -> str:
    """Both loops (the partial tiles' and, where the kernels split them, the full
    tiles') without any mask."""
    body, n = DOCS.subn("", body)
    assert n >= 1, n
    body, n = VISIBLE.subn("\n", body)
    assert n >= 1, n
    body, n = FULL_VISIBLE.subn("", body)
    assert n <= 1, n
    body, n = WHERE.subn(lambda m: f"p = {m[1]}", body)
    assert n >= 1, n
    return body


def mma_only(body: str) -> str:
    body, n = SOFTMAX.subn(lambda m: f"\n{m[1]}p = s", body)
    assert n >= 1, n
    body, n = FULL_VISIBLE.subn("", body)
    assert n <= 1, n
    body, n = WHERE.subn("p = s", body)  # the full tiles' loop
    assert n <= 1, n
    body, n = re.subn(r"ds = p \* \(dp - delta\)", "ds = dp", body)
    assert n in (1, 2), n
    return body


def grad_ms(forward, leaves, dout):
    out = forward()
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    ms = do_bench(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                  warmup=25, rep=200, return_mode="median")
    return ms, grads


def main(out_dir: str, seqs=SEQS) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    source = Path(f"generated/{NAME}.py").read_text()
    texts = {"shipped": source, "no_mask": edit_kernels(source, no_mask),
             "all_full": edit_kernels(source, all_full), "mma_only": edit_kernels(source, mma_only)}
    # Each variant registers its own custom op: a module loaded twice reuses the op
    # registered first, which would run the first variant's kernels.
    modules = {label: load_module_from_source(
        f"bwdceil_{label}", rename_op(t, label, f"<{label}>"),
        f"<{label}>") for label, t in texts.items()}
    plan = make_plan(load_spec(f"specs/{NAME}.yaml"))
    flex = _flex(torch, "backward", plan)
    rows = []
    for seq in seqs:
        q, k, v, extra, tensors, gen, flops = document_inputs(modules["shipped"].SPEC, plan, seq)
        dout = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
        flops = 2.5 * flops
        row = {"seq": seq, "flops": flops, "ms": {}}
        reference = None
        for label, m in modules.items():
            leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
            block_map = m.make_block_map(BATCH, HEADS, seq, seq, device=q.device, backward=True,
                                         **tensors)
            ms, grads = grad_ms(lambda m=m, leaves=leaves, block_map=block_map: m.attention(
                *leaves, block_map=block_map, **extra), leaves, dout)
            row["ms"][label] = ms
            if label == "shipped":
                reference = grads
        leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
        inputs = Inputs(q=leaves[0], k=leaves[1], v=leaves[2], extra=extra)
        ms, grads = grad_ms(lambda: flex(inputs), leaves, dout)
        row["ms"]["flex"] = ms
        row["flex_max_diff"] = max((a.float() - b.float()).abs().max().item()
                                   for a, b in zip(grads, reference))
        row["tflops"] = {label: flops / ms / 1e9 for label, ms in row["ms"].items()}
        row["over_flex"] = {label: row["ms"]["flex"] / ms for label, ms in row["ms"].items()}
        print(f"S={seq:6d} " + "  ".join(f"{label} {tf:5.0f} TFLOPS ({row['over_flex'][label]:.2f}x Flex)"
                                          for label, tf in row["tflops"].items())
              + f"  flex diff {row['flex_max_diff']:.3g}", flush=True)
        rows.append(row)
        Path(out_dir, "document_bwd_ceiling.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "spec": NAME, "batch": BATCH, "heads": HEADS,
             "kv_heads": KV_HEADS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(s) for s in sys.argv[2].split(",")) if len(sys.argv) > 2 else SEQS)

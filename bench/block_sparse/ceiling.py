"""The packed-document forward's ceiling: the smallest kernels that walk the same
block map, timed beside the shipped kernel and Flex in one process.

`fmha_document_mask` (B4 Hq32 Hkv8 bf16 D128 causal, documents of about 256 tokens,
the bench suite's inputs). Kernels, each the shipped module with its attention kernel
replaced (same launcher, grid, tiles, block map and compiler hints):

  shipped      the generated kernel;
  no_mask      the partial tiles are not masked (the document ids are not read):
               what evaluating the mask_mod costs (wrong output, timing only);
  all_full     every visited tile runs the unmasked step (the online softmax, no
               mask at all; wrong output on partial tiles, timing only): the smallest
               kernel that computes attention over these tiles;
  mma_only     per visited key tile only the two MMAs, S = Q K^T and acc += S V, and
               the Q load and the store: no softmax, no mask (wrong output, timing
               only). Whatever a kernel that visits these tiles at this tile shape
               does beyond its matrix products comes on top of this time;
  fma_exp      the shipped kernel with P's exponentials computed on the FMA pipe
               (_exp2_fma, a polynomial) instead of MUFU.EX2 (a correct kernel; its
               output is compared with the shipped one's);
  all_full_fma_exp  all_full with the same exponentials.

TFLOPS count the visible pairs only (the suite's count). Flex: the Triton backend
compiled for one shape (`dynamic=False`) with the same mask as a block mask.

    python3 bench/block_sparse/ceiling.py OUT_DIR [SEQS]
"""

import json
import re
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from specgen.bench.baselines import Inputs, _flex  # noqa: E402
from specgen.bench.core import graph_time_ms  # noqa: E402
from specgen.bench.flops import mask_mod_flops  # noqa: E402
from specgen.check.cases import feature_inputs, random_qkv, shape_dims  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.spec.load import load_spec  # noqa: E402

BATCH, HEADS, KV_HEADS = 4, 32, 8
SEQS = (1024, 2048, 4096, 8192, 16384)
NAME = "fmha_document_mask"

# A query tile's map row: its partial and full tile counts and the first tile of the
# full tiles' run (-1: no run).
MAP_COUNTS = """\
    map_head = 0
    num_partial = ct.load(MapCounts, (batch, map_head, tile_idx, 0), shape=())
    num_full = ct.load(MapCounts, (batch, map_head, tile_idx, 1), shape=())
    full_run = ct.load(MapCounts, (batch, map_head, tile_idx, 2), shape=())
"""

# The body of the generated kernel: from the Q load to the store.
STEP_HEAD = """\
    tile_bid, num_tiles, batch_head = ct.bid(0), ct.num_blocks(0), ct.bid(1)
    tile_idx = num_tiles - 1 - tile_bid
    batch = batch_head // num_heads
    head = batch_head % num_heads
    kv_head = head // GROUP_SIZE
    acc = ct.full((TILE_M, HEAD_DIM), 0.0, dtype=ct.float32)
    q = ct.load(
        Q, index=(batch, head, tile_idx, 0), shape=(1, 1, TILE_M, HEAD_DIM)
    ).reshape((TILE_M, HEAD_DIM))
{counts}    first = ct.where(full_run >= 0, full_run, 0)
    for j in range(first, first + num_full):
{step}
    for i in range(0, num_partial):
        j = ct.load(MapIdx, (batch, map_head, tile_idx, i), shape=())
{step}
    out = acc.reshape((1, 1, TILE_M, HEAD_DIM)).astype(Out.dtype)
    ct.store(Out, index=(batch, head, tile_idx, 0), tile=out)
"""

# The same for a packed-GQA kernel (pack_gqa): TILE_P positions of the GROUP_SIZE heads
# of one KV head, the full tiles' run first, then the listed tiles.
PACKED_STEP_HEAD = """\
    tile_bid, num_tiles, batch_head = ct.bid(0), ct.num_blocks(0), ct.bid(1)
    tile_idx = num_tiles - 1 - tile_bid
    TILE_P = TILE_M // GROUP_SIZE
    num_kv_heads = num_heads // GROUP_SIZE
    batch = batch_head // num_kv_heads
    kv_head = batch_head % num_kv_heads
    acc = ct.full((TILE_M, HEAD_DIM), 0.0, dtype=ct.float32)
    q = ct.load(
        Q, index=(batch, kv_head, tile_idx, 0), shape=(1, GROUP_SIZE, TILE_P, HEAD_DIM)
    ).reshape((TILE_M, HEAD_DIM))
{counts}    num_run = ct.where(full_run >= 0, num_full, 0)
    for j in range(full_run, full_run + num_run):
{step}
    first_full = MapIdx.shape[3] - num_full
    for t in range(0, num_partial + num_full - num_run):
        i = ct.where(t < num_partial, t, first_full + t - num_partial)
        j = ct.load(MapIdx, (batch, map_head, tile_idx, i), shape=())
{step}
    out = acc.reshape((1, GROUP_SIZE, TILE_P, HEAD_DIM)).astype(Out.dtype)
    ct.store(Out, index=(batch, kv_head, tile_idx, 0), tile=out)
"""

MMA_STEP = """\
        k_t = ct.load(
            K, index=(batch, kv_head, 0, j), shape=(1, 1, HEAD_DIM, TILE_N),
            order=(0, 1, 3, 2), latency=2,
        ).reshape((HEAD_DIM, TILE_N))
        s = ct.mma(q, k_t, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))
        v = ct.load(
            V, index=(batch, kv_head, j, 0), shape=(1, 1, TILE_N, HEAD_DIM), latency=4,
            padding_mode=ct.PaddingMode.ZERO,
        ).reshape((TILE_N, HEAD_DIM))
        acc = ct.mma(s.astype(Q.dtype), v, acc)"""


def replace_body(text: str, kernel: str, body: str) -> str:
    """``text`` with the body of ``kernel`` (after its docstring) replaced by ``body``."""
    start = text.index(f"def {kernel}(")
    doc = text.index('"""', text.index('"""', start) + 3) + 4  # past the docstring's line
    end = text.index("\n\n\n", doc)
    head = "    num_heads = Q.shape[1]\n"
    return text[:doc] + head + body + text[end:]


def mma_only(text: str, kernel: str) -> str:
    packed = "TILE_P = TILE_M // GROUP_SIZE" in text
    return replace_body(text, kernel, (PACKED_STEP_HEAD if packed else STEP_HEAD).format(counts=MAP_COUNTS,
                                                                                 step=MMA_STEP))


def edit_kernel(text: str, name: str, edit) -> str:
    """``text`` with ``edit`` applied to the source of the function whose name starts
    with ``name`` (from its def to the blank lines after it)."""
    start = text.index(f"def {name}")
    end = text.index("\n\n\n", start)
    return text[:start] + edit(text[start:end]) + text[end:]


def _unmasked_documents(body: str) -> str:
    body, n = re.subn(r"\n +doc_1 = ct\.gather\(Doc, \(batch, keys\)\).*", "", body)
    assert n == 1, n
    body, n = re.subn(r"\n +visible = visible & \(\n +doc_0 == doc_1\n +\).*", "", body)
    assert n == 1, n
    return body


def no_mask(text: str, kernel: str) -> str:
    """Partial tiles of ``kernel`` run unmasked: the doc gathers and the where removed
    (the map kernels after it keep theirs)."""
    return edit_kernel(text, f"{kernel}(", _unmasked_documents)


PARTIAL_MASK = re.compile(
    r"\n +keys = j \* TILE_N \+ cols.*"
    r"|\n +doc_1 = ct\.gather\(Doc, \(batch, keys\)\).*"
    r"|\n +visible = keys <= rows.*"
    r"|\n +visible = visible & \(keys < seq_k\).*"
    r"|\n +visible = visible & \(\n +doc_0 == doc_1\n +\).*"
    r"|\n +s = ct\.where\(visible, s, -math\.inf\).*")


def _no_partial_mask(body: str) -> str:
    body, n = PARTIAL_MASK.subn("", body)
    assert n == 6, n
    return body


def all_full(text: str, kernel: str) -> str:
    """The partial tiles of ``kernel`` run with no mask at all."""
    return edit_kernel(text, f"{kernel}(", _no_partial_mask)


def document_inputs(spec: dict, plan, seq: int):
    """One length's inputs, as both ceiling scripts draw them from a generator seeded
    by ``seq``: (q, k, v, the hook tensors, the map's tensors, the generator for any
    further draws, the forward FLOPs of the visible pairs)."""
    gen = torch.Generator(device="cuda").manual_seed(seq)
    q, k, v = random_qkv(spec, BATCH, KV_HEADS, seq, seq, generator=gen)
    extra = feature_inputs(spec, shape_dims(q, k), gen)
    tensors = {n: extra[n] for n in spec["tensors"]}
    return q, k, v, extra, tensors, gen, mask_mod_flops(torch, plan, extra, BATCH, HEADS, seq, seq)


# 2**x for x <= 0 on the FMA and integer pipes instead of MUFU.EX2 (the trick of
# FlashAttention-4): x = n + f with n = round(x) from the float's own rounding at
# 1.5 * 2**23, 2**f on [-0.5, 0.5] by a degree-4 polynomial (relative error about
# 4e-6), and n added to the exponent bits. x below -127 (and -inf) gives 0.
FMA_EXP2 = """

def _exp2_fma(x):
    x = max(x, -127.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = 1.0 + f * (0.69314718 + f * (0.24022652 + f * (0.05550411 + f * 0.00961813)))
    bits = ct.bitcast(p, ct.int32) + ct.bitwise_lshift(ct.bitcast(t, ct.int32), 23)
    return ct.bitcast(bits, ct.float32)
"""
P_EXP2 = re.compile(r"p = ct\.exp2\((s - m_(?:new|exp)), flush_to_zero=True\)")


def fma_exp(text: str, kernel: str) -> str:
    """``kernel`` with P's exponentials (not the rescale factors') computed by _exp2_fma."""
    def edit(body):
        body, n = P_EXP2.subn(r"p = _exp2_fma(\1)", body)
        assert n == 2, n
        return body

    text = edit_kernel(text, f"{kernel}(", edit)
    at = text.index("\n\n\n", text.index("\nINV_LN2")) if "\nINV_LN2" in text else text.index("\n\n\n")
    return text[:at] + "\n" + FMA_EXP2 + text[at:]


def main(out_dir: str, seqs=SEQS) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    source = Path(f"generated/{NAME}.py").read_text()  # packed GQA or not: both are edited
    kernel = re.search(r"^def (fmha_prefill_\w+)\(", source, re.M)[1]
    texts = {"shipped": source, "no_mask": no_mask(source, kernel), "all_full": all_full(source, kernel),
             "mma_only": mma_only(source, kernel), "fma_exp": fma_exp(source, kernel),
             "all_full_fma_exp": fma_exp(all_full(source, kernel), kernel)}
    modules = {label: load_module_from_source(f"ceil_{label}", t, f"<{label}>") for label, t in texts.items()}
    plan = make_plan(load_spec(f"specs/{NAME}.yaml"))
    flex = _flex(torch, "prefill", plan)
    rows = []
    for seq in seqs:
        q, k, v, extra, tensors, _, flops = document_inputs(modules["shipped"].SPEC, plan, seq)
        row = {"seq": seq, "flops": flops, "ms": {}, "graph_ms": {}}
        for label, m in modules.items():
            out = torch.full_like(q, float("nan"))
            block_map = m.make_block_map(BATCH, HEADS, seq, seq, device=q.device, **tensors)

            def call(m=m, out=out, block_map=block_map):
                return m.attention(q, k, v, out=out, block_map=block_map, **extra)

            call()
            torch.cuda.synchronize()
            if label == "shipped":
                counts = block_map.counts[..., :2].sum(-1).double()
                row["tiles_visited"] = counts.sum().item() * HEADS
                row["shipped_out"] = out.clone()
            if label == "fma_exp":  # a correct kernel: its output against the shipped one's
                row["fma_exp_max_diff"] = (out.float() - row["shipped_out"].float()).abs().max().item()
            row["ms"][label] = do_bench(call, warmup=25, rep=200, return_mode="median")
            row["graph_ms"][label] = graph_time_ms(torch, call, do_bench, calls=20)
        ref = row.pop("shipped_out")
        inputs = Inputs(q=q, k=k, v=v, extra=extra)
        try:  # Flex against the shipped kernel: both compute the same mask
            row["flex_max_diff"] = (flex(inputs).float() - ref.float()).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - reported in the row
            row["flex_max_diff"] = f"{type(exc).__name__}: {exc}"[:200]
        row["ms"]["flex"] = do_bench(lambda: flex(inputs), warmup=25, rep=200, return_mode="median")
        row["graph_ms"]["flex"] = graph_time_ms(torch, lambda: flex(inputs), do_bench, calls=20)
        row["tflops"] = {label: flops / ms / 1e9 for label, ms in row["ms"].items()}
        row["over_flex"] = {label: row["ms"]["flex"] / ms for label, ms in row["ms"].items()}
        print(f"S={seq:6d} " + "  ".join(f"{label} {tf:5.0f} TFLOPS ({row['over_flex'][label]:.2f}x Flex)"
                                          for label, tf in row["tflops"].items()), flush=True)
        rows.append(row)
        Path(out_dir, "document_ceiling.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "spec": NAME, "batch": BATCH, "heads": HEADS,
             "kv_heads": KV_HEADS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(s) for s in sys.argv[2].split(",")) if len(sys.argv) > 2 else SEQS)

"""The ceiling of a cuTile decode over a float8 KV cache against a bf16 one.

The smallest kernel with the decode's data movement: per (batch, KV head) and split
of the cache, a loop over key tiles of TILE_N that loads K^T [D, TILE_N] and V
[TILE_N, D] exactly as ``fmha_decode_gqa8_fp8kv`` does (K as [B, L, Hkv, D], V keys
last as [B, Hkv, D, L]; float8 tiles cast to float16), with the two MMAs of a
16-row query tile and no softmax: S = Q K^T, acc += S V. Whatever the softmax, the
masks and the split combine cost comes on top. The stream is timed at several split
counts around two CTAs per SM and the fastest is kept per cache, so the fastest
float8 stream bounds what any float8 decode of this shape reaches in cuTile; its
speed over the shipped bf16-cache decode bounds the float8 / bf16 ratio.
A split decode also has to merge its splits: the stream is timed a second time
followed by the float8 module's own combine kernel, launched as the module launches
it (programmatic dependent launch on sm_90, the stream waiting for the previous
combine as the split kernel does). The fastest of these is the bound of a split
decode with its combine; with one split no combine runs.
Beside them, in the same process and timed the same way: the shipped decode
modules (float8 and bf16 caches) and a torch copy of the float8 cache's bytes.

Timing: CUDA graphs of 20 launches over 4 copies of the inputs (more than L2
holds), steady state, median of do_bench over graph replays, per launch.

Usage:  python bench/decode_ceiling.py [--json out.json]
"""

from __future__ import annotations

import cuda_device  # noqa: F401 (first: one line and exit 2 without a CUDA GPU)
import argparse
import json
import math

import cuda.tile as ct
import torch
from results_json import write_rows
from triton.testing import do_bench

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
SHAPES = ((1, 8192), (1, 32768), (8, 8192), (64, 4096))  # (batch, cache length)
HQ, HKV, D, TILE_M, TILE_N = 64, 8, 128, 16, 128
COPIES, CALLS = 4, 20
# (name, FP8 mode, query rows): 16-bit cache; float8 cast to float16 (the shipped
# design); float8 MMAs with the query tile padded to a warpgroup MMA's 64 rows, the
# only row count at which cuTile 1.7 emits float8 MMAs (QGMMA) on sm_90 (at 16 rows it
# casts both operands to float16 for HMMA); the shipped cast at 64 rows.
VARIANTS = (("bf16", 0, 16), ("fp8", 1, 16), ("fp8mma", 2, 64), ("fp8w64", 1, 64))


def stream_kernel(
    Q, K, V, Out, Lse, CHUNK, D: ConstInt, TILE_N: ConstInt, FP8: ConstInt, PDL: ConstBool,
    ROWS: ConstInt = 16,
):
    split, bh = ct.bid(0), ct.bid(1)
    num_kv = K.shape[2]
    b, kv = bh // num_kv, bh % num_kv
    if PDL:  # as the shipped split kernel: wait for the previous combine, let the next start
        ct.grid_dependency_control_wait()
        ct.grid_dependency_control_launch_dependents()
    # ROWS > 16: the query tile padded to a warpgroup MMA's 64 rows
    q = ct.load(Q, index=(b, kv, 0, 0), shape=(1, 1, ROWS, D), padding_mode=ct.PaddingMode.ZERO).reshape((ROWS, D))
    acc = ct.full((ROWS, D), 0.0, dtype=ct.float32)
    start = split * (CHUNK // TILE_N)
    for j in range(start, start + CHUNK // TILE_N):
        k_t = ct.load(
            K, index=(b, 0, kv, j), shape=(1, D, 1, TILE_N), order=(0, 3, 2, 1), latency=2
        ).reshape((D, TILE_N))
        v = ct.load(
            V, index=(b, kv, j, 0), shape=(1, 1, TILE_N, D), order=(0, 1, 3, 2), latency=4
        ).reshape((TILE_N, D))
        if FP8 == 1:  # float8 tiles cast to float16, 16-bit MMAs (the shipped design)
            k_t = k_t.astype(ct.float16)
            v = v.astype(ct.float16)
        s = ct.mma(q, k_t, ct.full((ROWS, TILE_N), 0.0, dtype=ct.float32))
        # FP8 == 2: q in float8 too, both MMAs in float8 (P rounded to e4m3)
        acc = ct.mma(s.astype(q.dtype), v, acc)
    ct.store(Out, index=(b, kv, split, 0, 0), tile=ct.extract(acc, (0, 0), (16, D)).reshape((1, 1, 1, 16, D)))
    if PDL:  # a row value per split for the combine to weigh (the real decode's LSE)
        ct.store(Lse, index=(b, kv, split, 0), tile=ct.max(ct.extract(acc, (0, 0), (16, D)), axis=1).reshape((1, 1, 1, 16)))


def per_call_us(fn_for_copy) -> float:
    """Steady-state time of one call: a CUDA graph of CALLS calls cycling over the
    COPIES input sets, replayed under do_bench."""
    for i in range(COPIES):
        fn_for_copy(i)  # JIT and warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(CALLS):
            fn_for_copy(c % COPIES)
    ms = do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    return ms * 1000 / CALLS


def mma_vs_cast(kernel, batch: int, length: int) -> float:
    """The float8-MMA stream against the float16-cast stream on the same cache (one
    split): the largest difference over the largest value. The queries and S are
    rounded to e4m3 in the first, so a few percent is expected; more means the
    float8 stream does not compute the same products."""
    k = torch.randn(batch, length, HKV, D, device="cuda").to(torch.float8_e4m3fn)
    v_t = torch.randn(batch, HKV, D, length, device="cuda").to(torch.float8_e4m3fn)
    q8 = (torch.randn(batch, HKV, 16, D, device="cuda") / 4).to(torch.float8_e4m3fn)
    outs = []
    for mode, rows, q in ((1, 16, q8.to(torch.float16)), (2, 64, q8)):
        out = torch.zeros(batch, HKV, 1, 16, D, device="cuda", dtype=torch.float32)
        lse = torch.zeros(batch, HKV, 1, 16, device="cuda", dtype=torch.float32)
        grid = (1, batch * HKV, 1)
        ct.launch(torch.cuda.current_stream(), grid, kernel, (q, k, v_t, out, lse, length, D, TILE_N, mode, False, rows))
        outs.append(out)
    torch.cuda.synchronize()
    return float((outs[1] - outs[0]).abs().max() / outs[0].abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    kernel = ct.kernel(stream_kernel, occupancy=2)
    try:
        import generated.fmha_decode_gqa8_bf16 as bf16_mod
        import generated.fmha_decode_gqa8_fp8kv as fp8_mod
    except Exception as exc:  # noqa: BLE001 - the ceiling still runs
        print(f"shipped modules not importable: {type(exc).__name__}: {exc}")
        bf16_mod = fp8_mod = None
    rows = []
    for batch, length in SHAPES:
        # Splits so that about two CTAs per SM run (132 SMs on an H100/H200), and the
        # split counts around it: the stream is timed at each, the best kept per cache.
        base = max(1, math.ceil(2 * 132 / (batch * HKV)))
        tiles = length // TILE_N
        counts = sorted({max(1, min(s, tiles // 2)) for s in (base // 2, base, 2 * base, 4 * base)})
        row = {"batch": batch, "length": length, "splits_tried": counts}
        row["fp8mma_vs_cast_rel_diff"] = mma_vs_cast(kernel, batch, length)
        for splits in counts:
            chunk = math.ceil(length / splits / TILE_N) * TILE_N
            padded = chunk * splits
            for name, fp8, qrows in VARIANTS:
                cdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
                qdt = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)[fp8]
                sets = []
                for _ in range(COPIES):
                    k = torch.randn(batch, padded, HKV, D, device="cuda").to(cdt)
                    v_t = torch.randn(batch, HKV, D, padded, device="cuda").to(cdt)
                    q = torch.randn(batch, HKV, 16, D, device="cuda").to(qdt)
                    out = torch.empty(batch, HKV, splits, 16, D, device="cuda", dtype=torch.float32)
                    lse = torch.zeros(batch, HKV, splits, 16, device="cuda", dtype=torch.float32)
                    sets.append((q, k, v_t, out, lse))
                grid = (splits, batch * HKV, 1)
                # The stream is read inside: under capture it is the graph's stream.
                us = per_call_us(
                    lambda i: ct.launch(
                        torch.cuda.current_stream(),
                        grid,
                        kernel,
                        (*sets[i], chunk, D, TILE_N, fp8, False, qrows),
                    )
                )
                if fp8_mod is not None and splits > 1:
                    final = torch.empty(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
                    pdl = torch.cuda.get_device_capability()[0] >= 9
                    rows_out = batch * HKV * (HQ // HKV)
                    repeats = -(-fp8_mod.PDL_MIN_COMBINE_CTAS // rows_out) if pdl else 1
                    split_tile = 1 << (splits - 1).bit_length()

                    def with_combine(i):
                        stream = torch.cuda.current_stream()
                        ct.launch(
                            stream,
                            grid,
                            kernel,
                            (*sets[i], chunk, D, TILE_N, fp8, pdl, qrows),
                            programmatic_dependent_launch=pdl,
                        )
                        ct.launch(
                            stream,
                            (batch * HKV, repeats * (HQ // HKV), 1),
                            fp8_mod.fmha_decode_combine_gqa8_bf16_kve4m3_d128_vt,
                            (final, sets[i][3], sets[i][4], 1, split_tile, pdl),
                            programmatic_dependent_launch=pdl,
                        )

                    combined = per_call_us(with_combine)
                    row[f"stream_combine_{name}_us_splits{splits}"] = combined
                    if combined < row.get(f"stream_combine_{name}_us", math.inf):
                        row[f"stream_combine_{name}_us"] = combined
                        row[f"stream_combine_{name}_splits"] = splits
                row[f"stream_{name}_us_splits{splits}"] = us
                if us < row.get(f"stream_{name}_us", math.inf):
                    cache_bytes = 2 * batch * length * HKV * D * (1 if fp8 else 2)
                    row[f"stream_{name}_us"] = us
                    row[f"stream_{name}_splits"] = splits
                    row[f"stream_{name}_tbps"] = cache_bytes * padded / length / us / 1e6
                if name == "fp8" and splits == counts[0]:
                    src = sets[0][1]
                    dst = torch.empty_like(src)
                    row["copy_fp8_k_cache_tbps"] = (
                        2 * src.numel() / per_call_us(lambda i: dst.copy_(src)) / 1e6
                    )
                del sets
        if bf16_mod is not None:
            for name, mod, cdt in (
                ("bf16", bf16_mod, torch.bfloat16),
                ("fp8", fp8_mod, torch.float8_e4m3fn),
            ):
                sets = []
                for _ in range(COPIES):
                    q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
                    k = torch.randn(batch, length, HKV, D, device="cuda").to(cdt)
                    v = torch.randn(batch, length, HKV, D, device="cuda").to(cdt)
                    if name == "fp8":
                        v = mod.transposed_v_cache(v)
                    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
                    sets.append((q, k, v, lens))
                one = torch.ones(1, device="cuda")
                kw = {"k_descale": one, "v_descale": one} if name == "fp8" else {}
                row[f"shipped_{name}_us"] = per_call_us(lambda i: mod.attention(*sets[i], **kw))
                del sets
            row["shipped_fp8_over_bf16_speed"] = row["shipped_bf16_us"] / row["shipped_fp8_us"]
            # The bound: the fastest float8 stream (no softmax, no combine) against the
            # shipped bf16-cache decode.
            row["best_stream_fp8_over_shipped_bf16_speed"] = row["shipped_bf16_us"] / row["stream_fp8_us"]
            # The bound of a split decode: the fastest float8 stream that merges its
            # splits, or the one-split stream where that is faster still.
            candidates = [row["stream_fp8_us"]] if row["stream_fp8_splits"] == 1 else []
            if "stream_combine_fp8_us" in row:
                candidates.append(row["stream_combine_fp8_us"])
            if candidates:
                row["best_split_decode_fp8_over_shipped_bf16_speed"] = row["shipped_bf16_us"] / min(
                    candidates
                )
        row["stream_fp8_over_bf16_speed"] = row["stream_bf16_us"] / row["stream_fp8_us"]
        row["stream_fp8mma_over_bf16_speed"] = row["stream_bf16_us"] / row["stream_fp8mma_us"]
        if "shipped_bf16_us" in row:
            best = [row["stream_fp8mma_us"]] if row["stream_fp8mma_splits"] == 1 else []
            if "stream_combine_fp8mma_us" in row:
                best.append(row["stream_combine_fp8mma_us"])
            if best:
                row["best_split_decode_fp8mma_over_shipped_bf16_speed"] = row["shipped_bf16_us"] / min(best)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        write_rows(args.json, rows)


if __name__ == "__main__":
    main()

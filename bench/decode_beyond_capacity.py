"""Decode lengths beyond the cache on the GPU: each decode module with one sequence
at capacity + 1 and at 2**31 - 1 against the fp64 reference at the capacity.

    python3 bench/decode_beyond_capacity.py
"""
import importlib, sys, torch
sys.path.insert(0, ".")
from specgen.check.cases import random_decode, decode_reference, hook_tensors, FP8_DESCALES
g = torch.Generator(device="cuda").manual_seed(0)
for name in ("fmha_decode_gqa8_bf16", "fmha_decode_gqa8_fp8kv", "fmha_decode_chunked_local",
             "fmha_decode_paged_mtp", "fmha_decode_mha_paged_f16", "fmha_decode_gqa4_bf16"):
    m = importlib.import_module(f"generated.{name}")
    spec = m.SPEC
    size = spec["paged"]["page_size"] if spec.get("paged") else 300
    b = random_decode(spec, [17, 2 * size], 2, 1, generator=g, device="cuda")
    extra = {n: FP8_DESCALES[n] for n in ("k_descale", "v_descale")} if spec.get("kv_dtype") else {}
    if spec.get("tensors"):
        extra.update(hook_tensors(spec, dict(batch=2, heads=2 * spec["gqa_ratio"], kv_heads=2, seq_q=1, seq_k=b.capacity), g, "cuda"))
    ref = decode_reference(spec, b, extra)
    for length in (2 * size + 1, 2**31 - 1):
        args = list(b.args()); args[3] = b.seq_lens.clone(); args[3][1] = length
        out = m.attention(*args, **extra)
        torch.cuda.synchronize()
        print(name, length, "max err", (out.double() - ref).abs().max().item(), "nan", torch.isnan(out).any().item(), flush=True)

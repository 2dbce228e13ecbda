"""The float8 prefill's V transpose kernel at several keys per CTA
(V_TRANSPOSE_KEYS): its median time on V [4, 4, S, 128] e4m3 at S 1k-16k, each copy
checked against torch's transpose. H100, 2026-11-26: 32 / 64 / 128 / 256 keys within
about 1 us of each other at every S; the module keeps 64 (experiments, section 50).

    python3 bench/fa3/transpose_keys.py
"""
import importlib.util, torch
from triton.testing import do_bench
s = importlib.util.spec_from_file_location("m", "generated/fmha_fp8_llama.py"); m = importlib.util.module_from_spec(s); s.loader.exec_module(m)
for S in (1024, 2048, 4096, 16384):
    v = torch.randn(4, 4, S, 128, device="cuda").to(torch.float8_e4m3fn)
    ref = v.transpose(2, 3).float()
    row = []
    for keys in (32, 64, 128, 256):
        m.V_TRANSPOSE_KEYS = keys
        assert torch.equal(m.transposed_v(v).float(), ref)
        row.append(f"{keys}: {do_bench(lambda: m.transposed_v(v), warmup=25, rep=200, return_mode='median')*1e3:.1f} us")
    print(S, ", ".join(row), flush=True)

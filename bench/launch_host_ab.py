"""Host time per eager call of two versions of a module, one process: a loop of 2000
small calls (host-bound), seven alternating rounds, medians in µs per call; outputs
compared bitwise. Prefill (B1 Hq32 S128 D128 bf16, q/k/v contiguous and transposed
from [B, S, H, D]) and decode (B1 L4096).

Usage: python bench/launch_host_ab.py OLD_PREFILL NEW_PREFILL OLD_DECODE NEW_DECODE
(fmha_gqa8_bf16 and fmha_decode_gqa8_bf16 as shipped, one of each pair an older
version written out with git show REV:generated/...)
"""

import importlib.util, time, statistics, sys, torch


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


pairs = {
    "prefill": (load(sys.argv[1], "p_old"), load(sys.argv[2], "p_new")),
    "prefill_bshd": (load(sys.argv[1], "t_old"), load(sys.argv[2], "t_new")),
    "decode": (load(sys.argv[3], "d_old"), load(sys.argv[4], "d_new")),
}
torch.manual_seed(0)
q = torch.randn(1, 32, 128, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 4, 128, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
qd = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
kc = torch.randn(1, 4096, 4, 128, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
lens = torch.tensor([4096], dtype=torch.int32, device="cuda")
qt = torch.randn(1, 128, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
kt = torch.randn(1, 128, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
vt = torch.randn_like(kt)


def calls(kind, m):
    if kind == "prefill":
        return lambda: m.attention(q, k, v)
    if kind == "prefill_bshd":
        return lambda: m.attention(qt, kt, vt)
    return lambda: m.attention(qd, kc, vc, lens)


for kind, (old, new) in pairs.items():
    fo, fn = calls(kind, old), calls(kind, new)
    assert torch.equal(fo(), fn())
    res = {"old": [], "new": []}
    for r in range(7):
        for label, f in (("old", fo), ("new", fn)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(2000):
                f()
            torch.cuda.synchronize()
            res[label].append((time.perf_counter() - t) / 2000 * 1e6)
    print(
        kind,
        {k: round(statistics.median(v), 2) for k, v in res.items()},
        "us per call (host-bound loop)",
    )

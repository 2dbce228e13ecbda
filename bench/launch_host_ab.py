"""Host time per eager call of two versions of a module, one process: a loop of 2000
small calls (host-bound), seven alternating rounds, medians in µs per call; outputs
compared bitwise. Prefill (B1 Hq32 S128 D128 bf16, q/k/v contiguous and transposed
from [B, S, H, D]) and decode (B1 L4096).

Usage: python bench/launch_host_ab.py OLD_PREFILL NEW_PREFILL OLD_DECODE NEW_DECODE
(fmha_gqa8_bf16 and fmha_decode_gqa8_bf16 as shipped, one of each pair an older
version written out with git show REV:generated/...)
"""

import sys

import torch

from host_loop import host_us, load, small_inputs

pairs = {
    "prefill": (load(sys.argv[1], "p_old"), load(sys.argv[2], "p_new")),
    "prefill_bshd": (load(sys.argv[1], "t_old"), load(sys.argv[2], "t_new")),
    "decode": (load(sys.argv[3], "d_old"), load(sys.argv[4], "d_new")),
}
x = small_inputs()


def calls(kind, m):
    if kind == "prefill":
        return lambda: m.attention(x.q, x.k, x.v)
    if kind == "prefill_bshd":
        return lambda: m.attention(x.qt, x.kt, x.vt)
    return lambda: m.attention(x.qd, x.kc, x.vc, x.lens)


for kind, (old, new) in pairs.items():
    fo, fn = calls(kind, old), calls(kind, new)
    assert torch.equal(fo(), fn())
    medians = host_us({"old": fo, "new": fn}, rounds=7, per_round=2000)
    print(kind, {k: round(t, 2) for k, t in medians.items()}, "us per call (host-bound loop)")

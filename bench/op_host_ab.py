"""Host time per call of a forward-only module before and after it gained custom ops,
and what torch.compile makes of the call, in one process: loops of 400 small calls
(host-bound), 25 alternating rounds, medians in µs per call; outputs compared
bitwise.

- old: the module without ops (``attention`` was the launcher itself);
- new: ``attention``, which asks _eager and calls the launcher (_forward);
- launcher: the new module's _forward called directly (what _eager's test costs);
- compiled: torch.compile(fullgraph=True) of the call (the op in an inductor graph);
- graphs (decode only): torch.compile(mode="reduce-overhead"): the step replayed
  as a CUDA graph, the cache marked as a static address (as a model's cache
  buffers are), so that the replay does not copy it in.

Prefill: B1 Hq32 S128 D128 bf16, contiguous and transposed from [B, S, H, D];
decode: B1 L4096 Hq32/Hkv4 D128 bf16.

Usage: python bench/op_host_ab.py OLD_PREFILL NEW_PREFILL OLD_DECODE NEW_DECODE
(fmha_gqa8_bf16 and fmha_decode_gqa8_bf16; the old ones written out with
git show REV:generated/...)
"""

import sys

import torch

from host_loop import host_us, load, small_inputs

old_p, new_p = load(sys.argv[1], "p_old"), load(sys.argv[2], "p_new")
old_d, new_d = load(sys.argv[3], "d_old"), load(sys.argv[4], "d_new")
x = small_inputs()
q, k, v, qt, kt, vt = x.q, x.k, x.v, x.qt, x.kt, x.vt
qd, kc, vc, lens = x.qd, x.kc, x.vc, x.lens
for t in (kc, vc):
    torch._dynamo.mark_static_address(t)

compiled_p = torch.compile(lambda q, k, v: new_p.attention(q, k, v), fullgraph=True)
compiled_d = torch.compile(lambda q, k, v, n: new_d.attention(q, k, v, n), fullgraph=True)
graphs_d = torch.compile(lambda q, k, v, n: new_d.attention(q, k, v, n), fullgraph=True,
                         mode="reduce-overhead")

kinds = {
    "prefill": {"old": lambda: old_p.attention(q, k, v), "new": lambda: new_p.attention(q, k, v),
                "launcher": lambda: new_p._forward(q, k, v),
                "compiled": lambda: compiled_p(q, k, v)},
    "prefill_bshd": {"old": lambda: old_p.attention(qt, kt, vt),
                     "new": lambda: new_p.attention(qt, kt, vt),
                     "launcher": lambda: new_p._forward(qt, kt, vt),
                     "compiled": lambda: compiled_p(qt, kt, vt)},
    "decode": {"old": lambda: old_d.attention(qd, kc, vc, lens),
               "new": lambda: new_d.attention(qd, kc, vc, lens),
               "launcher": lambda: new_d._forward(qd, kc, vc, lens),
               "compiled": lambda: compiled_d(qd, kc, vc, lens),
               "graphs": lambda: graphs_d(qd, kc, vc, lens)},
}

for kind, calls in kinds.items():
    want = calls["old"]()
    for label, call in calls.items():
        for _ in range(3):  # compile, warm up, record
            got = call()
        assert torch.equal(got, want), (kind, label)
    medians = host_us(calls, rounds=25, per_round=400)
    print(kind, {label: round(t, 2) for label, t in medians.items()},
          "us per call (host-bound loop)", flush=True)

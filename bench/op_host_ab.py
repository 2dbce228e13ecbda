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

import importlib.util
import statistics
import sys
import time

import torch


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # torch.compile imports the module of a traced function
    spec.loader.exec_module(module)
    return module


old_p, new_p = load(sys.argv[1], "p_old"), load(sys.argv[2], "p_new")
old_d, new_d = load(sys.argv[3], "d_old"), load(sys.argv[4], "d_new")
torch.manual_seed(0)
q = torch.randn(1, 32, 128, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 4, 128, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
qt = torch.randn(1, 128, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
kt = torch.randn(1, 128, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
vt = torch.randn_like(kt)
qd = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
kc = torch.randn(1, 4096, 4, 128, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
lens = torch.tensor([4096], dtype=torch.int32, device="cuda")
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
    times = {label: [] for label in calls}
    for _ in range(25):
        for label, call in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(400):
                call()
            torch.cuda.synchronize()
            times[label].append((time.perf_counter() - start) / 400 * 1e6)
    print(kind, {label: round(statistics.median(t), 2) for label, t in times.items()},
          "us per call (host-bound loop)", flush=True)

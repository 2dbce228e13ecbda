"""First-call latency of generated modules: import to first result, in fresh processes.

    python bench/first_call.py generated/fmha_gqa_causal.py [...] [--repeats 3] [--json FILE]

Each module must have been built for this GPU (`specgen build --targets sm_90`), so that
its <module>.aot/ folder exists. Per module, three modes, each in --repeats fresh
processes with an empty cuTile cache (CUDA_TILE_CACHE_DIR):

- jit:      SPECGEN_AOT=0, the first call lowers and compiles (cuTile's JIT);
- jit-warm: SPECGEN_AOT=0 with the cuTile disk cache a jit run left (tileiras skipped);
- aot:      the module's cubins from <module>.aot/.

A child imports the module, makes inputs, calls it once and synchronises (a training
spec's module then runs its backward once as well); it reports
the times, how each kernel's first call was served, and the largest difference from
the same call through torch's SDPA (decode: from the module's own JIT result).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import importlib.util, json, sys, time
t0 = time.perf_counter()
import torch
path = sys.argv[1]
spec = importlib.util.spec_from_file_location("m", path)
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
t_import = time.perf_counter() - t0
S = m.SPEC
dtype = getattr(torch, S["dtype"])
d, ratio = S["head_dim"], S["gqa_ratio"]
g = torch.Generator(device="cuda").manual_seed(0)
def rnd(*shape):
    return torch.randn(*shape, device="cuda", generator=g, dtype=torch.float32).to(dtype)
if S["family"] == "decode":
    B, L, hkv = 4, 4096, 8
    q = rnd(B, S["max_q_len"], hkv * ratio, d)
    kc, vc = rnd(B, L, hkv, d), rnd(B, L, hkv, d)
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    args, kwargs = (q, kc, vc, lens), {}
else:
    B, Sq, hkv = 2, 2048, 4
    q, k, v = rnd(B, hkv * ratio, Sq, d), rnd(B, hkv, Sq, d), rnd(B, hkv, Sq, d)
    args, kwargs = (q, k, v), {}
training = S["family"] != "decode" and S.get("backward", False)
if training:
    for t in (q, k, v):
        t.requires_grad_(True)
torch.cuda.synchronize()
t1 = time.perf_counter()
out = m.attention(*args, **kwargs)
out = out[0] if isinstance(out, tuple) else out
torch.cuda.synchronize()
t_first = time.perf_counter() - t1
t_backward = None
if training:  # the backward kernels' first calls too
    t2 = time.perf_counter()
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()
    t_backward = time.perf_counter() - t2
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    out = out.detach()
err = None
if S["family"] != "decode":
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(ratio, 1), v.float().repeat_interleave(ratio, 1),
        is_causal=S["causal"])
    err = (out.float() - ref).abs().max().item()
kernels = [v for v in vars(m).values() if isinstance(v, m.AotKernel)]
kernels += [v for v in getattr(m, "_KERNELS", {}).values() if isinstance(v, m.AotKernel)]
print(json.dumps({"t_import": t_import, "t_first_call": t_first, "t_first_backward": t_backward,
                  "t_total": time.perf_counter() - t0,
                  "aot_hits": sum(k.aot_hits for k in kernels),
                  "jit_compiles": sum(k.jit_compiles for k in kernels),
                  "max_abs_err_vs_sdpa": err, "aot_reason": m._AOT_STORE.reason}))
"""


def child(path: str, cache: str, aot: bool) -> dict:
    env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache, "SPECGEN_AOT": "1" if aot else "0"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{path}: child failed\n{done.stderr}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "t_process": time.perf_counter() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write all measurements here")
    args = parser.parse_args(argv)
    rows = []
    for path in args.modules:
        for mode in ("jit", "jit-warm", "aot"):
            runs = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory() as cache:
                    if mode == "jit-warm":
                        child(path, cache, aot=False)  # fills the cuTile disk cache
                    runs.append(child(path, cache, aot=(mode == "aot")))
            row = {"module": os.path.basename(path), "mode": mode, "runs": runs}
            for key in ("t_import", "t_first_call", "t_total"):
                row[key] = statistics.median(r[key] for r in runs)
            rows.append(row)
            last = runs[-1]
            print(f"{row['module']:<28} {mode:<9} import {row['t_import']:6.3f} s  first call "
                  f"{row['t_first_call']:7.4f} s  aot/jit {last['aot_hits']}/{last['jit_compiles']}  "
                  f"err {last['max_abs_err_vs_sdpa']}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

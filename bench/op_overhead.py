"""Where the host time of a compiled call goes, one process: loops of 1000 calls,
five rounds, medians in µs per call, of
- torch.compile of x * 2 (the compiled-code floor of this torch and host);
- a trivial torch.library custom op (one torch.empty_like) called eagerly and compiled;
- the decode module's call eagerly, compiled, and compiled with mode="reduce-overhead";
then cProfile of 500 compiled decode calls (functions by own time) and torch's log of
CUDA graph decisions for the reduce-overhead call.

Usage: TORCH_LOGS=cudagraphs python bench/op_overhead.py [MODULE_PATH]
(default generated/fmha_decode_gqa8_bf16.py)
"""

import cuda_device  # noqa: F401 (first: one line and exit 2 without a CUDA GPU)
import cProfile
import pstats
import sys

import torch

from host_loop import host_us, load, small_inputs

mod = load(sys.argv[1] if len(sys.argv) > 1 else "generated/fmha_decode_gqa8_bf16.py", "decode_under_test")


@torch.library.custom_op("specgen_bench::trivial", mutates_args=())
def trivial(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


trivial.register_fake(lambda x: torch.empty_like(x))

x = small_inputs()
q, kc, vc, lens = x.qd, x.kc, x.vc, x.lens

double = torch.compile(lambda x: x * 2.0, fullgraph=True)
trivial_compiled = torch.compile(lambda x: trivial(x), fullgraph=True)
step = torch.compile(lambda q, k, v, n: mod.attention(q, k, v, n), fullgraph=True)
graphs = torch.compile(lambda q, k, v, n: mod.attention(q, k, v, n), fullgraph=True,
                       mode="reduce-overhead")
calls = {
    "compiled x*2": lambda: double(q),
    "trivial op eager": lambda: trivial(q),
    "trivial op compiled": lambda: trivial_compiled(q),
    "decode eager": lambda: mod.attention(q, kc, vc, lens),
    "decode op eager": lambda: mod._OP(q, kc, vc, lens, None, 1.0 / 128**0.5),
    "decode compiled": lambda: step(q, kc, vc, lens),
    "decode reduce-overhead": lambda: graphs(q, kc, vc, lens),
}
for call in calls.values():
    for _ in range(3):
        call()
for label, t in host_us(calls, rounds=5, per_round=1000).items():
    print(f"{label:>24}: {t:8.2f} us per call", flush=True)

profile = cProfile.Profile()
profile.enable()
for _ in range(500):
    step(q, kc, vc, lens)
torch.cuda.synchronize()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(25)

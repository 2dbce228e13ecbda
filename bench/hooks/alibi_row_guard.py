"""fmha_alibi before and after the empty-row guard on every tile of a score_mod spec:
the two modules in one process, do_bench medians, alternated twice.

    python bench/hooks/alibi_row_guard.py OLD_MODULE.py   # (the module before the change)
"""
import importlib.util
import sys

import torch
from triton.testing import do_bench


def load(path, name):
    found = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def main(old_path):
    new = load("generated/fmha_alibi.py", "alibi_new")
    old = load(old_path, "alibi_old")
    print(torch.cuda.get_device_name(), flush=True)
    B, H, D = 4, 32, 128
    slope = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device="cuda")
    for S in (2048, 8192):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        a, b = old.attention(q, k, v, slope=slope), new.attention(q, k, v, slope=slope)
        diff = (a.float() - b.float()).abs().max().item()
        flops = 4 * B * H * S * S * D / 2
        for rep in range(2):
            for label, mod in (("old", old), ("new", new)):
                ms = do_bench(lambda: mod.attention(q, k, v, slope=slope), warmup=50, rep=300)
                print(f"S={S} rep{rep} {label}: {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOPS", flush=True)
        print(f"S={S} largest difference old/new: {diff:.3g}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

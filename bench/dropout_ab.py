"""Two dropout kernels (old and new) in one process, beside SDPA cuDNN's own dropout.

Times the forward alone of two prefill modules and the backward alone of two
training modules (autograd.grad of a saved forward), B4 H32 non-causal at the
modules' head dim, dropout_p 0.15, interleaved over three rounds (medians). Each
forward module's kept weight (attention of v = 1, whose mean is the kept fraction
times 1 / (1 - p)) is printed as a check of its keep rate.

Usage:  python bench/dropout_ab.py OUT.json FWD_OLD.py FWD_NEW.py TRAIN_OLD.py TRAIN_NEW.py
"""

import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specgen.compile.export import load_module_renamed  # noqa: E402

P = 0.15


def main() -> None:
    if len(sys.argv) != 6:
        raise SystemExit(__doc__.split("Usage:", 1)[1].strip())
    out_path, *paths = sys.argv[1:]
    names = ["old_fwd", "new_fwd", "old_train", "new_train"]
    # (the forward modules are inference modules: no op to rename)
    mods = {name: load_module_renamed(path, name, required=name.endswith("train"))
            for name, path in zip(names, paths)}
    d = mods["old_fwd"].HEAD_DIM
    B, H = 4, 32
    rows = []
    for S in [1024, 2048, 8192]:
        torch.manual_seed(0)
        q = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn_like(q, requires_grad=True)
        v = torch.randn_like(q, requires_grad=True)
        do = torch.randn_like(q)
        flops = 4 * B * H * S * S * d
        for t in ["old_fwd", "new_fwd"]:
            o = mods[t].attention(q.detach(), k.detach(), torch.ones_like(v), dropout_p=P, seed=7)
            rows.append({"S": S, "kernel": t, "mean_row_weight": o.float().mean().item()})
        outs = {t: mods[t].attention(q, k, v, dropout_p=P, seed=7) for t in ["old_train", "new_train"]}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=P)
        times = {t: [] for t in ["old_fwd", "new_fwd", "cudnn_fwd", "old_train_bwd", "new_train_bwd", "cudnn_bwd"]}
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        for r in range(3):
            for t in ["old_fwd", "new_fwd"]:
                times[t].append(do_bench(lambda: mods[t].attention(qd, kd, vd, dropout_p=P, seed=r)))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                times["cudnn_fwd"].append(do_bench(
                    lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, dropout_p=P)))
                times["cudnn_bwd"].append(do_bench(
                    lambda: torch.autograd.grad(ref_out, (q, k, v), do, retain_graph=True)))
            for t in ["old_train", "new_train"]:
                times[t + "_bwd"].append(do_bench(
                    lambda: torch.autograd.grad(outs[t], (q, k, v), do, retain_graph=True)))
        for t, runs in times.items():
            ms = statistics.median(runs)
            work = flops * (2.5 if t.endswith("bwd") else 1)
            rows.append({"S": S, "kernel": t, "ms": ms, "tflops": work / ms / 1e9, "runs": runs})
            print(json.dumps(rows[-1]), flush=True)
    Path(out_path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "B": B, "H": H, "D": d,
                                          "dropout_p": P, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

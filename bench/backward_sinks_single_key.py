"""Usage: python bench/backward_sinks_single_key.py (on a GPU, from the checkout).

The one-query, one-key case of fmha_train_gptoss_sinks against FlashAttention's rule,
per gradient: the kernel's largest error against fp64 autograd, the same math's error
in bf16, and their ratio to the allowance (2 x bf16 error + 1e-5), for several seeds."""

import torch

import generated.fmha_train_gptoss_sinks as m
from specgen.check import runner
from specgen.check.runner import Case

NAMES = ("dq", "dk", "dv", "dsinks")
rule = runner._fa_rule


def verbose_rule(torch_, got, exact, rough):
    for name, g, e, r in zip(NAMES, got, exact, rough):
        err = (g.double() - e).abs().max().item()
        rough_err = (r.double() - e).abs().max().item() if r is not None else 0.0
        print(f"  {name}: err {err:.3e}  bf16-math err {rough_err:.3e}  "
              f"ratio {err / (2 * rough_err + 1e-5):.2f}  |exact|max {e.abs().max().item():.3e}")
    return rule(torch_, got, exact, rough)


runner._fa_rule = verbose_rule
for seed in (57672, 1, 2, 3, 4, 5):
    for shape in ((1, 1, 1, 1, 0), (1, 1, 2, 2, 0), (1, 1, 1, 5, 4)):
        print(f"seed {seed} shape {shape}")
        row = runner.run_case(torch, m, Case(*shape), torch.Generator(device="cuda").manual_seed(seed))
        print(f"  ok {row['ok']} out_ok {row['out_ok']} grad_ratio {row['grad_ratio']:.2f}")

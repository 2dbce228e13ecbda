"""Usage: python bench/grad_case_detail.py SPEC_NAME CASE [CASE ...] (on a GPU).

CASE: SEED:I, one fuzz case of a training spec (as `specgen test --fuzz-case`
replays it), or B,HKV,SQ,SKV,Q_OFFSET@SEED, that shape with inputs drawn from SEED;
with FlashAttention's rule shown per gradient: the kernel's largest error against
fp64 autograd, the same math's error in the input dtype, the ratio to the allowance
(2 x that error + 1e-5) and where the largest error sits."""

import importlib
import random
import sys

import torch

from specgen.check import runner


def main(name: str, case_seeds: list[str]) -> None:
    module = importlib.import_module(f"generated.{name}")
    rule = runner._fa_rule
    names = ["dq", "dk", "dv"] + (["dsinks"] if module.SPEC.get("sinks") else []) + runner.learnable_tensors(module.SPEC)

    def verbose_rule(torch_, got, exact, rough):
        for label, g, e, r in zip(names, got, exact, rough):
            diff = (g.double() - e).abs()
            err = diff.max().item()
            rough_err = (r.double() - e).abs().max().item() if r is not None else 0.0
            where = tuple(int(i) for i in torch.nonzero(diff == err)[0]) if g.numel() else ()
            print(f"  {label} {tuple(g.shape)}: err {err:.3e} at {where}  input-dtype math err {rough_err:.3e}  "
                  f"ratio {err / (2 * rough_err + 1e-5):.2f}  |exact| max {e.abs().max().item():.3e}")
        return rule(torch_, got, exact, rough)

    runner._fa_rule = verbose_rule
    for case_seed in case_seeds:
        if "@" in case_seed:
            shape, _, seed = case_seed.partition("@")
            case = runner.Case(*(int(x) for x in shape.split(",")))
            gen = torch.Generator(device="cuda").manual_seed(int(seed))
        else:
            case = runner.fuzz_case(module.SPEC, case_seed)
            gen = torch.Generator(device="cuda").manual_seed(random.Random(case_seed).getrandbits(63))
        print(f"{name} {case_seed}: {case}")
        row = runner.run_case(torch, module, case, gen)
        print(f"  {runner.case_verdict(row)}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

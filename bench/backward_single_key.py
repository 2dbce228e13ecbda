"""Usage: python bench/backward_single_key.py (on a GPU, from the checkout).

Where the single-key backward's noise comes from: Sq = Skv = 1 gives exact dq = dk = 0
and dv = the group's sum of dO. Prints each gradient's largest error and the pieces."""

import torch
import generated.fmha_train_gqa_causal as m
from specgen.check.cases import random_qkv

torch.manual_seed(0)
spec = m.SPEC
for layout in ("contiguous", "sliced"):
    for trial in range(3):
        q, k, v = random_qkv(spec, 4, 2, 1, 1, layout=layout)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = m.attention(q, k, v)
        do = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        ref_dv = do.float().view(4, 2, 4, 1, 128).sum(2)
        print(
            layout,
            trial,
            "out-v",
            (out.float() - v.float().repeat_interleave(4, 1)).abs().max().item(),
            "dq",
            dq.float().abs().max().item(),
            "dk",
            dk.float().abs().max().item(),
            "dv err",
            (dv.float() - ref_dv).abs().max().item(),
            "|do|max",
            do.abs().max().item(),
        )

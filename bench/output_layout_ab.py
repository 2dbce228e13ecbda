"""Two versions of a prefill module and of a training module, one process: q, k, v
stored [B, S, H, D] and passed transposed (transformers' layout), the caller's
out.transpose(1, 2).reshape(B, S, -1) included, and in training the gradients of
that view through autograd. B4 Hq32 D128 bfloat16; CUDA-event means of 20 calls,
medians of five alternating rounds; outputs and gradients compared bitwise.

Usage: python bench/output_layout_ab.py OLD_PREFILL NEW_PREFILL OLD_TRAIN NEW_TRAIN
(module paths, e.g. git show REV:generated/fmha_gqa8_bf16.py > /tmp/old/fmha_gqa8_bf16.py
beside generated/fmha_gqa8_bf16.py; GQA 8 and GQA 4 specs as shipped)
"""

import importlib.util, statistics, sys, json, torch


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


res = {}


def t(fn, n=20):
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    fn()
    torch.cuda.synchronize()
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


B, Hq, Hkv, D = 4, 32, 8, 128
for S in (2048, 8192):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(
        B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g
    ).transpose(1, 2)
    for kind, old_p, new_p in (
        ("fwd", sys.argv[1], sys.argv[2]),
        ("train", sys.argv[3], sys.argv[4]),
    ):
        hkv = Hq // (8 if kind == "fwd" else 4)
        q, k, v = mk(Hq), mk(hkv), mk(hkv)
        old, new = load(old_p, f"o{kind}{S}"), load(new_p, f"n{kind}{S}")
        if kind == "fwd":
            f = {
                m: (
                    lambda mod=mod: mod.attention(q, k, v)
                    .transpose(1, 2)
                    .reshape(B, S, -1)
                )
                for m, mod in (("old", old), ("new", new))
            }
            print("out equal:", bool(torch.equal(f["old"](), f["new"]())))
        else:
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            do = torch.randn(
                B, S, Hq * D, device="cuda", dtype=torch.bfloat16, generator=g
            )

            def step(mod):
                out = mod.attention(qq, kk, vv)
                out = out[0] if isinstance(out, tuple) else out
                return torch.autograd.grad(
                    out.transpose(1, 2).reshape(B, S, -1), (qq, kk, vv), do
                )

            f = {"old": lambda: step(old), "new": lambda: step(new)}
            a, b = f["old"](), f["new"]()
            print(
                "grads equal:",
                [
                    bool(torch.equal(x, y)) or float((x - y).abs().max())
                    for x, y in zip(a, b)
                ],
            )
        times = {"old": [], "new": []}
        for r in range(5):
            for m in ("old", "new"):
                times[m].append(t(f[m]))
        row = {m: round(statistics.median(v), 4) for m, v in times.items()}
        row["new/old speed"] = round(row["old"] / row["new"], 4)
        res[f"{kind} S{S}"] = row
        print(kind, S, row, flush=True)
print(json.dumps(res))

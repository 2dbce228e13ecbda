"""Numerical extremes a launcher accepts must not give NaN for finite inputs: the
scale's upper bound (its float32 product with 1/ln 2) and the prescale_q bound a
module's docstring states for q. Kernels emulated on the CPU."""

import math
import re

import pytest
import torch

from specgen.check import emulate
from specgen.check.cases import compare, decode_reference, random_decode, reference_for

from .helpers import ROOT, render_spec_data

_MODULES = {}


def _module(name, data=None):
    if name not in _MODULES:
        if data is None:
            _MODULES[name] = emulate.load_module(ROOT / "generated" / f"{name}.py",
                                                 name=f"_extremes_{name}")
        else:
            plan, source = render_spec_data(data, formatted=False)
            _MODULES[name] = emulate.load_module(ROOT / "generated" / f"{plan.module_name}.py",
                                                 source=source, name=f"_extremes_{name}")
    return _MODULES[name]


def _prescale_factor(doc: str, scale: float) -> float:
    """What the docstring says q is multiplied by before it must fit the dtype."""
    found = re.search(r"and\s+q \* scale(?: / (ln 2|[0-9.e+-]+))?[^\n]*must\s+stay inside", doc)
    assert found, doc
    divisor = found.group(1)
    if divisor is None:
        return scale
    return scale / (math.log(2.0) if divisor == "ln 2" else float(divisor))


_SOFTCAP_F16 = {"name": "extremes_softcap_f16", "dtype": "float16", "head_dim": 64, "gqa_ratio": 2,
                "causal": True, "softcap": 0.01, "prescale_q": True,
                "targets": {"default": {"tile_m": 64, "tile_n": 64}}}


@pytest.mark.parametrize("name,data", [("fmha_gqa_causal", None), ("extremes_softcap_f16", _SOFTCAP_F16)])
def test_q_at_the_documented_prescale_bound_gives_finite_outputs(name, data):
    """A float16 prescale_q module documents how large q * scale (times what the kernel
    folds in: 1/ln 2 for exp2, 1/softcap) may be; a q just inside it must not overflow
    the rounded Q to inf (all-NaN rows)."""
    mod = _module(name, data)
    spec = mod.SPEC
    scale = 1.0
    bound = 65504.0 / _prescale_factor(mod.attention.__doc__, scale)
    g = torch.Generator().manual_seed(0)
    d, ratio = spec["head_dim"], spec["gqa_ratio"]
    q = torch.randn(1, ratio, 8, d, generator=g) * 0.01
    # Row 3 of head 0 at the bound, signs alternating: an overflowed Q gives +inf and
    # -inf products in one score (NaN), even through a soft-cap's tanh.
    q[0, 0, 3] = 0.99 * bound * (1 - 2 * (torch.arange(d) % 2))
    k = torch.randn(1, 1, 8, d, generator=g)
    v = torch.randn(1, 1, 8, d, generator=g)
    q, k, v = (t.half() for t in (q, k, v))
    with emulate.emulating():
        out = mod.attention(q, k, v, scale=scale)
    ref, _ = reference_for(spec, q, k, v, {}, scale=scale)
    assert torch.isfinite(out).all(), "q inside the documented bound gave non-finite outputs"
    assert compare(out, ref, "float16").ok


@pytest.mark.parametrize("name", ["fmha_mha_bf16", "fmha_decode_gqa8_bf16", "fmha_train_gqa_causal"])
def test_scale_whose_product_with_inv_ln2_overflows_is_refused(name):
    """A scale in (float32 max * ln 2, float32 max] made scale / ln 2 infinite in the
    kernels, and every output NaN even for q = 0 (exact answer: the mean of v).
    It is refused; the largest accepted scale gives the exact answer."""
    mod = _module(name)
    spec = mod.SPEC
    g = torch.Generator().manual_seed(1)
    if spec.get("family") == "decode":
        batch = random_decode(spec, [5, 9], 1, 1, g, device="cpu")
        batch.q.zero_()
        args = batch.args()
    else:
        d, ratio = spec["head_dim"], spec["gqa_ratio"]
        q = torch.zeros(1, ratio, 8, d, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 1, 8, d, generator=g).bfloat16() for _ in range(2))
        args = (q, k, v)
    with emulate.emulating():
        with pytest.raises(ValueError, match="scale must be at most"):
            mod.attention(*args, scale=2.4e38)
        largest = mod._SCALE_MAX
        out = mod.attention(*args, scale=largest)
    if spec.get("family") == "decode":
        ref = decode_reference(spec, batch, {}, scale=largest)
    else:
        ref, _ = reference_for(spec, *args, {}, scale=largest)
    assert torch.isfinite(out).all()
    assert compare(out, ref, spec["dtype"]).ok

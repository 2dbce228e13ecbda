"""The plan: every value the template prints, derived once, in Python, from a spec.

Templates only print. Anything here with an ``if`` is a decision about the kernel
that the template must not make; the template keeps ``{% if %}`` only where the
structure of the kernel changes (causal masking, split loops, block remap, K^T).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .spec import Spec, TargetConfig, spec_to_dict

DTYPE_SHORT = {"float16": "f16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class TargetPlan:
    name: str  # "default" or "sm_90"
    tile_m: int
    tile_n: int
    occupancy: int


@dataclass(frozen=True)
class Plan:
    spec: Spec
    module_name: str  # generated/<module_name>.py
    kernel_name: str  # procedural name: fmha_prefill_causal_gqa4_f16_d128
    dtype: str  # "float16"
    ct_dtype: str  # "ct.float16"
    torch_dtype: str  # "torch.float16"
    head_dim: int
    group_size: int
    causal: bool
    loop_split: bool
    block_remap: bool
    # EVEN_N (Skv divisible by tile_n) is a ct.Constant[bool] kernel argument only
    # where it can fold a mask: in the masked tiles of a split causal loop.
    even_n_param: bool
    k_transposed: bool
    exp2: bool
    flush_to_zero: bool
    approx_div: bool
    exp_fn: str  # "ct.exp2" | "ct.exp"
    exp_kwargs: str  # ", flush_to_zero=True" | ""
    div_kwargs: str  # ", flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX"
    k_load_kwargs: str  # ", latency=2" | ""
    v_load_kwargs: str
    targets: tuple[TargetPlan, ...]  # "default" first, then by architecture
    occupancy_expr: str  # "ct.ByTarget(sm_90=2, default=2)"
    compile_for: tuple[str, ...]
    spec_dict: dict
    optimizations: tuple[str, ...]  # one line each, for the module docstring

    def target(self, name: str) -> TargetPlan:
        """The launch config the generated launcher picks on device ``name``."""
        for target in self.targets:
            if target.name == name:
                return target
        return self.targets[0]

    @property
    def kernel_constants(self) -> tuple[str, ...]:
        """Names of the kernel's ct.Constant parameters, in signature order."""
        names = ("TILE_M", "TILE_N")
        return names + (("EVEN_N",) if self.even_n_param else ())


def _arch_key(name: str) -> tuple:
    if name == "default":
        return (0, 0, "")
    match = re.match(r"sm_(\d+)([a-z]?)$", name)
    return (1, int(match.group(1)), match.group(2))


def procedural_name(spec: Spec) -> str:
    """The one name of a kernel variant, used for the kernel, cache and bench rows."""
    mask = "causal" if spec.causal else "full"
    heads = "mha" if spec.gqa_ratio == 1 else f"gqa{spec.gqa_ratio}"
    return f"fmha_{spec.family}_{mask}_{heads}_{DTYPE_SHORT[spec.dtype]}_d{spec.head_dim}"


def _kwargs(**values) -> str:
    parts = [f"{key}={value}" for key, value in values.items() if value is not None]
    return "".join(", " + part for part in parts)


def _target_plans(targets: dict[str, TargetConfig]) -> tuple[TargetPlan, ...]:
    ordered = sorted(targets.items(), key=lambda item: _arch_key(item[0]))
    return tuple(
        TargetPlan(name, cfg.tile_m, cfg.tile_n, cfg.occupancy) for name, cfg in ordered
    )


def _optimizations(spec: Spec, block_remap: bool) -> tuple[str, ...]:
    fm, loads = spec.fast_math, spec.loads
    lines = []
    if fm.exp2:
        lines.append("exp2: the scale is folded by 1/ln2 so ex2 computes the exponent")
    if fm.flush_to_zero:
        lines.append("flush-to-zero on " + ("exp2 and " if fm.exp2 else "") + "the final division")
    if fm.approx_div:
        lines.append("approximate division in the final normalisation")
    if spec.loop_split:
        where = "near the diagonal" if spec.causal else "at the ragged end"
        lines.append(f"loop split: masks only on the key tiles {where}")
    if block_remap:
        lines.append("block remap: the heaviest (last) query tiles launch first")
    if loads.k_transposed:
        lines.append("K^T loaded directly with order=(0, 1, 3, 2)")
    if loads.k_latency is not None or loads.v_latency is not None:
        lines.append(f"latency hints: K={loads.k_latency}, V={loads.v_latency}")
    return tuple(lines) or ("none (baseline)",)


def make_plan(spec: Spec) -> Plan:
    fm = spec.fast_math
    block_remap = spec.use_block_remap
    targets = _target_plans(spec.targets)
    by_target = ", ".join(f"{t.name}={t.occupancy}" for t in targets[1:])
    occupancy_expr = (
        f"ct.ByTarget({by_target}, default={targets[0].occupancy})"
        if by_target
        else str(targets[0].occupancy)
    )
    return Plan(
        spec=spec,
        module_name=spec.name,
        kernel_name=procedural_name(spec),
        dtype=spec.dtype,
        ct_dtype=f"ct.{spec.dtype}",
        torch_dtype=f"torch.{spec.dtype}",
        head_dim=spec.head_dim,
        group_size=spec.gqa_ratio,
        causal=spec.causal,
        loop_split=spec.loop_split,
        block_remap=block_remap,
        even_n_param=spec.causal and spec.loop_split,
        k_transposed=spec.loads.k_transposed,
        exp2=fm.exp2,
        flush_to_zero=fm.flush_to_zero,
        approx_div=fm.approx_div,
        exp_fn="ct.exp2" if fm.exp2 else "ct.exp",
        # ct.exp has no flush_to_zero option; FTZ then applies to the division only.
        exp_kwargs=_kwargs(flush_to_zero=True if fm.exp2 and fm.flush_to_zero else None),
        div_kwargs=_kwargs(
            flush_to_zero=True if fm.flush_to_zero else None,
            rounding_mode="ct.RoundingMode.APPROX" if fm.approx_div else None,
        ),
        k_load_kwargs=_kwargs(latency=spec.loads.k_latency),
        v_load_kwargs=_kwargs(latency=spec.loads.v_latency),
        targets=targets,
        occupancy_expr=occupancy_expr,
        compile_for=tuple(spec.compile_for),
        spec_dict=spec_to_dict(spec),
        optimizations=_optimizations(spec, block_remap),
    )

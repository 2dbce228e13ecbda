"""The prefill kernel's argument list, written once.

Each :class:`Param` is one parameter of the generated ``fmha_prefill_*`` kernel, in
order. Three readers use the same list:

- the template prints the kernel's signature from ``name`` and ``annotation``, and
  the launcher's argument tuple from ``launch`` (an expression over the launcher's
  locals);
- ``specgen.compile.export.signatures`` turns each into a cuTile constraint for the
  AOT export (``kind``, ``dtype``, ``ndim``, ``layout``);
- ``specgen tune`` builds the same tuple from its own tensors (``role``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    name: str  # the kernel's parameter name
    kind: str  # "array", "scalar" (a runtime value) or "constant" (ct.Constant)
    launch: str  # the launcher's expression for it
    dtype: str = ""  # arrays and scalars: the cuTile dtype name
    ndim: int = 0  # arrays
    # arrays: "io" (q, k, v, out: 16-byte aligned rows), "small" (a float32 or int32
    # vector or table made contiguous)
    layout: str = ""
    last_dim: int | None = None  # arrays whose last axis is always this head dim
    annotation: str = ""  # the signature's annotation (scalars and constants)
    role: str = ""  # what it is, for callers that build the tuple themselves


def prefill_params(plan) -> tuple[Param, ...]:
    """The kernel parameters of a prefill plan, in order."""
    rows = 3 if plan.varlen else 4  # varlen q/k/v/out are packed [total, H, D]
    io_ndim, lse_ndim = rows, 2 if plan.varlen else 3
    params = [
        Param("Q", "array", "q", plan.dtype, io_ndim, "io", plan.head_dim, role="q"),
        Param("K", "array", "k", plan.dtype, io_ndim, "io", plan.head_dim, role="k"),
        Param("V", "array", "v_arg" if plan.v_layout_param else "v", plan.dtype, io_ndim, "io", plan.v_head_dim, role="v"),
        Param("Out", "array", "out", plan.out_dtype, io_ndim, "io", plan.v_head_dim, role="out"),
    ]
    if plan.sinks:
        params.append(Param("Sinks", "array", "sinks", "float32", 1, "small", role="sinks"))
    if plan.return_lse:
        params.append(Param("Lse", "array", "lse", "float32", lse_ndim, "small", role="lse"))
    for name, param, dtype, dims in plan.extra_tensors:
        params.append(Param(param, "array", f'tensors["{name}"]', dtype, len(dims), "small",
                            role=f"tensor:{name}"))
    if plan.block_sparse:
        params += [Param("MapCounts", "array", "block_map.counts", "int32", 4, "small",
                         role="map_counts"),
                   Param("MapIdx", "array", "block_map.indices", "int32", 4, "small",
                         role="map_indices")]
    if plan.varlen:
        params += [Param("CuSeqlensQ", "array", "cu_seqlens_q", "int32", 1, "small", role="cu_seqlens_q"),
                   Param("CuSeqlensK", "array", "cu_seqlens_k", "int32", 1, "small", role="cu_seqlens_k")]
    if plan.fp8:
        params.append(Param("Descales", "array", "descales", "float32", 1, "small", role="descales"))
    params.append(Param("qk_scale", "scalar", "float(scale)", "float32", annotation="float", role="scale"))
    if plan.varlen:  # varlen kernels derive q_offset per sequence, moved by q_shift
        params.append(Param("q_shift", "scalar", "q_shift", "int32", annotation="int", role="q_shift"))
    else:
        params.append(Param("q_offset", "scalar", "q_offset", "int32", annotation="int", role="q_offset"))
    if plan.dropout:
        params += [
            Param("dropout_threshold", "scalar", "dropout_threshold", "int32", annotation="int",
                  role="dropout_threshold"),
            Param("dropout_scale", "scalar", "65536.0 / (65536 - dropout_threshold)", "float32", annotation="float",
                  role="dropout_scale"),
            Param("seed", "scalar", "seed", "int32", annotation="int", role="seed"),
        ]
    params += [Param("TILE_M", "constant", "tile_m", annotation="ConstInt", role="tile_m"),
               Param("TILE_N", "constant", "tile_n", annotation="ConstInt", role="tile_n")]
    if plan.even_n_param:
        params.append(Param("EVEN_N", "constant", "seq_k % tile_n == 0", annotation="ConstBool",
                            role="even_n"))
    if plan.tile_order_param:
        params.append(Param("TILES_OUTER", "constant", "tiles_outer", annotation="ConstBool",
                            role="tiles_outer"))
    if plan.v_layout_param:
        params.append(Param("V_TRANSPOSED", "constant", "read_vt", annotation="ConstBool",
                            role="v_transposed"))
    return tuple(params)

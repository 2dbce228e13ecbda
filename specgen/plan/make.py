"""The plan: every value the template prints, derived once, in Python, from a spec.

Templates only print. Anything here with an ``if`` is a decision about the kernel
that the template must not make; the template keeps ``{% if %}`` only where the
structure of the kernel changes (causal masking, split loops, block remap, K^T).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from specgen.spec.hooks import Gather, Hook, block_quotients, compile_hook, rename_words, tile_pretest
from specgen.spec.derive import score_derivative, tensor_derivatives
from specgen.plan.abi import Param, prefill_params
from specgen.spec import defaults
from specgen.spec.fields import kernel_param
from specgen.spec import (
    HINT_DEFAULTS,
    HINT_FIELDS,
    LaunchConfig,
    Spec,
    TargetConfig,
    decode_rows,
    spec_to_dict,
)

DTYPE_SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3"}


@dataclass(frozen=True)
class MapSpan:
    """The map kernel's bound test (specgen.spec.hooks.tile_pretest) for one loop
    step of CHUNK tiles: the operands it gathers besides those the step already
    has, and the test, one entry per tile. Where the tiles that pass are then
    evaluated one at a time under the plain names (keys, doc_1), the step's own
    positions and operands are named span_* (span_keys, span_doc_1)."""

    gathers: tuple[Gather, ...]
    expr: str


@dataclass(frozen=True)
class TensorGrad:
    """The gradient of a learnable hook tensor through one of its subscripts in
    score_mod: dL/dtensor[indices] += dS * derivative, accumulated by the dQ kernel
    (per head or per row) or by the dK/dV kernel (varying with the key)."""

    tensor: str  # "slope"
    param: str  # the kernel parameter of its float32 gradient buffer: "DSlope"
    local: str  # the kernel variable of this subscript's accumulated contribution
    indices: tuple[str, ...]  # kernel expressions of the subscript's indices
    where: str  # "head" | "rows" | "keys", as the subscript's Gather
    uses_rows: bool  # an index reads q_idx
    derivative: Hook  # d(score_mod)/d(subscript), compiled like a hook
    source: str  # the subscript as written

    @property
    def index(self) -> str:
        """The indices as the tuple ct.atomic_add takes: "(head,)"."""
        return "(" + ", ".join(self.indices) + ("," if len(self.indices) == 1 else "") + ")"


@dataclass(frozen=True)
class ConfigPlan:
    """One launch config: used while seq_k <= max_seq_k (None: any length)."""

    max_seq_k: int | None
    tile_m: int
    tile_n: int
    hints: dict  # kernel options set (occupancy always; the rest when not auto)
    # Options that differ from the target's own config: the launcher makes a
    # replace_hints variant of the kernel for them. Empty for the target's config.
    extra_hints: dict
    tile_order: str = "per_head"  # "global": query tiles on the grid's slow axis
    v_transposed: bool = False  # the launcher passes V as [B, Hkv, D, Skv]
    persistent: bool = False  # one wave of CTAs loops over the work items

    @property
    def tiles_outer(self) -> bool:
        return self.tile_order == "global"

    def describe(self) -> str:
        """'64x64, occupancy 2, num_ctas 2 (seq_k <= 2048)'."""
        text = ", ".join([f"{self.tile_m}x{self.tile_n}"]
                         + [f"{k.replace('_', ' ') if k == 'opt_level' else k} {v}"
                            for k, v in self.hints.items()]
                         + (["global tile order"] if self.tiles_outer else [])
                         + (["V transposed"] if self.v_transposed else [])
                         + (["persistent"] if self.persistent else []))
        return text + (f" (seq_k <= {self.max_seq_k})" if self.max_seq_k else "")

    def as_dict(self) -> dict:
        data = {"max_seq_k": self.max_seq_k, "tile_m": self.tile_m, "tile_n": self.tile_n}
        data.update(self.hints)
        if self.tiles_outer:
            data["tile_order"] = self.tile_order
        if self.v_transposed:
            data["v_transposed"] = True
        if self.persistent:
            data["persistent"] = True
        if self.extra_hints:
            data["hints"] = dict(self.extra_hints)
        return data


@dataclass(frozen=True)
class TargetPlan:
    name: str  # "default" or "sm_90"
    tile_m: int  # the target's own config (the longest sequences)
    tile_n: int
    occupancy: int
    configs: tuple[ConfigPlan, ...]  # by_seq_k buckets first, the target's own last

    @property
    def hints(self) -> dict:
        return self.configs[-1].hints


@dataclass(frozen=True)
class Plan:
    spec: Spec
    module_name: str  # generated/<module_name>.py
    kernel_name: str  # procedural name: fmha_prefill_causal_gqa4_f16_d128
    dtype: str  # "float16"
    ct_dtype: str  # "ct.float16"
    torch_dtype: str  # "torch.float16"
    fp8: bool  # float8_e4m3fn q/k/v with per-tensor descales
    out_dtype: str  # "bfloat16": the output's element type
    out_dtype_name: str  # the launcher constant holding it: "DTYPE" or "OUT_DTYPE"
    head_dim: int
    v_head_dim: int  # of v and the output (head_dim unless the spec sets it)
    head_dim_tile: int  # head_dim rounded up to a power of two (a padded tile's width)
    v_head_dim_tile: int
    # (main, rest) widths where head_dim_split runs a head dim as two tiles, else None
    d_split: tuple[int, int] | None
    dv_split: tuple[int, int] | None
    d_parts: tuple[DPart, ...]  # the q/k tiles along D: one, or main and rest
    dv_parts: tuple[DPart, ...]  # the v/out tiles
    d_tile: str  # the constant of a q/k tile's (main tile's) D extent: "HEAD_DIM", ...
    dv_tile: str  # of a v/out tile: "HEAD_DIM", "V_HEAD_DIM", "HEAD_DIM_TILE", ...
    dv_name: str  # the constant holding v's head dim: "HEAD_DIM" or "V_HEAD_DIM"
    # padding_mode=ZERO on the q and k loads where D is padded (0 * 0 adds nothing)
    qk_pad_kwargs: str
    group_size: int
    causal: bool
    loop_split: bool
    block_remap: bool
    # EVEN_N (Skv divisible by tile_n) is a ct.Constant[bool] kernel argument only
    # where it can fold a mask: in the masked tiles of a split causal loop.
    even_n_param: bool
    # TILES_OUTER is a ct.Constant[bool] kernel argument only where some config
    # launches with tile_order "global" (query tiles on the grid's y axis).
    tile_order_param: bool
    # V_TRANSPOSED likewise, where some config reads V as [B, Hkv, D, Skv].
    v_layout_param: bool
    # The kernel loops over work items from ct.bid(0) in steps of the grid (a 1-D
    # grid), where some config launches persistent: one item per CTA otherwise.
    persistent_loop: bool
    k_transposed: bool
    exp2: bool
    flush_to_zero: bool
    approx_div: bool
    exp_fn: str  # "ct.exp2" | "ct.exp"
    exp_kwargs: str  # ", flush_to_zero=True" | ""
    div_kwargs: str  # ", flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX"
    k_load_kwargs: str  # ", latency=2" | ""
    v_load_kwargs: str
    # check_bounds=False on the K/V loads of the unmasked tiles
    unmasked_load_kwargs: str  # ", check_bounds=False" | ""
    prescale_q: bool
    qk_ahead: bool  # the next key tile's S formed before this tile's softmax
    # Issue-6 features. window_left/right: None = unbounded (causal: right is 0).
    window_left: int | None
    window_right: int | None  # non-causal only
    softcap: float | None
    sinks: bool
    return_lse: bool
    dropout: bool
    # Packed [total, H, D] inputs with cu_seqlens: per-sequence array views.
    varlen: bool
    # Expression hooks (None: absent) and the extra tensors they index:
    # (name, kernel parameter, dtype, launcher size expressions).
    score_mod: Hook | None
    mask_mod: Hook | None
    extra_tensors: tuple[tuple[str, str, str, tuple[str, ...]], ...]
    # A mask_mod is evaluated before each key tile's loads; a tile it hides wholly is skipped.
    skip_masked_tiles: bool
    # S comes out of the MMA (+ soft-cap, score_mod) already in the softmax's units.
    scores_scaled: bool
    scale_expr: str  # the softmax scale the kernel multiplies by: "qk_scale * INV_LN2"
    # Terms of the per-row mask of a masked key tile ("keys <= rows", ...).
    row_mask: tuple[str, ...]
    q_subtiles: int  # 1, or 2 for two halves of tile_m with their own softmax state
    # A CTA's tile_m rows are the group_size query heads of one KV head, TILE_P =
    # tile_m / group_size positions each (prefill).
    pack_gqa: bool
    halves: tuple[str, ...]  # name suffixes of the query tiles: ("",) or ("0", "1")
    sub_m: str  # rows of one query tile: "TILE_M" or "SUB_M"
    targets: tuple[TargetPlan, ...]  # "default" first, then by architecture
    kernel_options: str  # "occupancy=ct.ByTarget(sm_90=2, default=2), num_ctas=..."
    compile_for: tuple[str, ...]
    spec_dict: dict
    optimizations: tuple[str, ...]  # one line each, for the module docstring
    # Decode family (defaults for prefill plans).
    max_q_len: int = 1
    page_size: int | None = None  # paged KV cache: tokens per page
    splits: str | int = "auto"
    max_splits: int = 64
    pdl: str | bool = False  # decode: programmatic dependent launch
    decode_tile_m: int = 16  # rows of the packed query tile (GQA heads x tokens, padded)
    kv_dtype: str = ""  # decode: the KV cache's element type ("float8_e4m3fn", or the dtype)
    kv_fp8: bool = False  # decode: a float8 cache, with k/v descales, cast to float16 for the MMAs
    v_cache_transposed: bool = False  # decode: V cache [B, Hkv, D, L] / pages [P, Hkv, D, page_size]
    split_ctas_per_sm: int = 1  # decode: CTAs per SM the auto split count aims for (float8 cache: 2)
    # Decode: the key tiles after the last one every row sees (keys past the sequence,
    # or after a query token) are at most 1 (q_len 1) or 2 (q_len <= 8 < 16 <= tile_n)
    # per sequence, each masked in its own `if` rather than a loop.
    tail_tiles: int = 1
    combine_name: str = ""  # the decode family's split-combine kernel
    backward: bool = False  # also the backward kernels and an autograd Function
    # Where the targets are the measured defaults of the spec's class (the spec wrote
    # none, or exactly those): (target, the run that measured its config).
    measured_defaults: tuple[tuple[str, str], ...] = ()
    bwd_names: tuple[str, ...] = ()  # (dK/dV, dQ) kernel names
    # The backward kernels' tile: BWD_TILE_M query rows x BWD_TILE_N keys.
    bwd_tile: tuple[int, int] = (64, 64)
    bwd_dq_tile: tuple[int, int] = (128, 64)  # the dQ kernel's
    # The dK/dV and dQ kernels' sm_90 hints: CTAs per SM, and worker warps (None: the
    # compiler's choice).
    bwd_wide: bool = False  # the tiles of 256-wide head dims (below)
    bwd_dkdv_occupancy: int = 2
    bwd_dkdv_warps: int | None = None
    bwd_dq_occupancy: int = 1
    bwd_dq_warps: int | None = 8
    # The causal backward launches across heads where a grid has at most this many
    # waves, else head by head (bwd_heavy_first); None: always across heads.
    bwd_global_order_waves: int | None = 4
    # The dK/dV and dQ kernels' tiles hold BWD_TILE_M / group_size positions of the
    # group_size query heads of one KV head (pack_gqa with a block map), as the forward's.
    bwd_pack: bool = False
    tensor_grads: tuple[TensorGrad, ...] = ()  # learnable hook tensors' gradients
    # d(score_mod)/d(score) for the backward, derived from the hook (None: no
    # score_mod, or a bias whose derivative is 1).
    score_mod_grad: Hook | None = None
    # Block-sparse masks: the kernels follow a block map (MapCounts, MapIdx) built by
    # the map kernel; one map per query head where the mask_mod reads h, else one.
    block_sparse: bool = False
    map_per_head: bool = False
    map_kernel_name: str = ""
    # The bound test of a map row's loop step, over CHUNK tiles at once before any
    # pair is evaluated: over key tiles (a row by query tile) and over query tiles
    # (BY_KEYS); None: the mask_mod gives none.
    map_span: MapSpan | None = None
    map_span_by_keys: MapSpan | None = None
    # How a map row by query tile evaluates the pairs of its tiles that pass the
    # bound test: all CHUNK tiles of a step at once (True), or one tile at a time
    # (False, and always by key tile); see _block_sparse.
    map_steps: bool = False
    # (R, K) where the map kernel evaluates the mask once per R x K block of
    # positions instead of once per pair: a mask_mod that reads q_idx only as
    # q_idx // R and kv_idx only as kv_idx // K (None: not read), R and K powers of
    # two, with no causal or window terms. None: every pair is evaluated.
    map_blocks: tuple[int | None, int | None] | None = None

    @property
    def reads_beyond_qkv(self) -> bool:
        """Whether a prefill launcher passes its kernels tensors besides q, k and v
        (sinks, hook tensors, cu_seqlens, descales, a block map): a caller's out is
        then checked against them too, after they are checked themselves."""
        return bool(self.sinks or self.extra_tensors or self.varlen or self.fp8 or self.block_sparse)

    @property
    def folds_vmap(self) -> bool:
        """Whether a training module's vmap rules may fold torch.func.vmap's batch
        into the kernels' batch (one launch for the whole vmap, not one per entry).
        Not for packed varlen inputs (no batch axis), dropout (its mask is drawn per
        batch index, so a folded entry would get another entry's mask), a hook
        tensor with a batch axis or a hook that reads b (indexed by the kernels'
        batch, not the vmap's: see reads_batch_index)."""
        return not (self.varlen or self.dropout or self.reads_batch_index
                    or self.batch_axis_tensors)

    @property
    def batch_axis_tensors(self) -> bool:
        """Whether a hook tensor has a batch axis (indexed by the kernels' batch)."""
        return any("batch" in dims for *_, dims in self.extra_tensors)

    @property
    def reads_batch_index(self) -> bool:
        """Whether a hook reads b: the kernels' batch index (a packed batch's
        sequence), which a launch over a slice of the batch counts from the slice's
        first entry, and a vmap folded into the batch past the vmap's entry. Such a
        hook sees the caller's b only in one launch over the caller's whole batch:
        it is neither sliced nor folded."""
        return any("b" in h.uses for h in self.hooks)

    @property
    def _sliceable(self) -> bool:
        """Whether a prefill launch may run over slices of its batch (or of its packed
        sequences) where batch × heads pass the grid's y limit: not with block maps,
        float8 descales or hook tensors with a batch axis (each would need its own
        slice), a hook that reads b (a slice's kernels count b from its first
        entry: see reads_batch_index), or persistent work loops (a 1-D grid).
        An LSE gradient is sliced with the batch (a packed one is read at the rows'
        offsets as is). Dropout slices only without drops (its mask is drawn per
        batch index), which the launchers check at run time."""
        if self.block_sparse or self.fp8 or self.persistent_loop or self.reads_batch_index:
            return False
        return not self.batch_axis_tensors

    @property
    def slice_sums(self) -> bool:
        """Whether the backward's slices return gradients summed over the batch (the
        sinks', a learnable tensor's), which the sliced call adds up in float32."""
        return self.backward and bool(self.sinks or self.learnable)

    @property
    def batch_slices(self) -> bool:
        """A [B, H, S, D] prefill: slices of the batch, one _forward (and _backward)
        call each (see _sliceable; the backward adds up the slices' slice_sums)."""
        return not self.varlen and self._sliceable

    @property
    def varlen_slices(self) -> bool:
        """A packed varlen prefill: launches over slices of its sequences, each reading
        its slice of cu_seqlens (the kernels take rows at the offsets they give),
        forward and backward (see _sliceable). The sinks' gradient too: each slice's
        dQ kernel stores its sequences' shares, which the launcher gathers in the
        whole call's buffer and sums once. Not with learnable tensors (varlen takes
        no score_mod, so none has any), whose kernels would sum over one launch."""
        return self.varlen and self._sliceable and not self.learnable

    @property
    def decode_slices(self) -> bool:
        """Whether a decode batch whose batch × KV heads pass the grid's y limit runs
        as slices of the batch, a call each. Not with block maps, float8 caches (their
        descales may have a batch axis), hook tensors with a batch axis or a mask_mod
        that reads b (see reads_batch_index)."""
        return not (self.block_sparse or self.kv_fp8 or self.reads_batch_index
                    or self.batch_axis_tensors)

    @property
    def folds_vmap_grads(self) -> bool:
        """Whether the backward's vmap rule folds too: not where it returns a
        gradient summed over the batch (sinks, a learnable tensor), which a folded
        call would sum over the vmap's entries as well."""
        return self.folds_vmap and not (self.sinks or self.learnable)

    @property
    def decode_map_rows(self) -> int:
        """Rows of a decode map kernel's query tile: the split kernel's packed rows
        where the mask_mod reads h, else one per query token (padded to a power of two)."""
        return self.decode_tile_m if self.map_per_head else _pow2_ceil(self.max_q_len)

    # Keys per CTA of the V transpose kernel (its TILE_S).
    v_transpose_keys = 64

    @property
    def v_transpose_kernel_name(self) -> str:
        """The kernel that copies V to [B, Hkv, D, Skv] for configs with v_transposed."""
        return self.kernel_name.replace("fmha_prefill", "fmha_transpose_v", 1)

    @property
    def map_list_kernel_name(self) -> str:
        """A decode map's second kernel, which lists the tiles the first classified."""
        return self.map_kernel_name.replace("fmha_decode_map", "fmha_decode_map_list", 1)

    @property
    def hq_of_hkv(self) -> str:
        """Hq in terms of Hkv, as the docstrings state it: "8 * Hkv", or "Hkv"."""
        return f"{self.group_size} * Hkv" if self.group_size > 1 else "Hkv"

    @property
    def bwd_prescale(self) -> str | None:
        """What the forward multiplies Q by before rounding it (prescale_q), as the
        kernels write it from qk_scale; None without prescale_q. The backward takes
        that rounded Q for its scores, so that P = exp(S - lse) is the forward's: its
        dQ kernel forms Q * pre from Q and stores it for the dK/dV kernel (every query
        row belongs to one dQ tile)."""
        if not self.prescale_q:
            return None
        return "qk_scale / SOFTCAP" if self.softcap is not None else self.scale_expr

    @property
    def prescale_bound(self) -> str:
        """What a prescale_q caller's q must keep inside the dtype's range: q times
        the factor bwd_prescale names (the kernels round Q * that factor)."""
        if self.softcap is not None:
            return f"q * scale / {self.softcap}"
        if self.scale_expr == "qk_scale * INV_LN2":
            return "q * scale / ln 2 (q * scale * 1.4427)"
        return "q * scale"

    @property
    def bwd_prescale_host(self) -> str | None:
        """bwd_prescale as the backward's launcher computes it from ``scale`` on the
        host: in float32 arithmetic, through the module's ``_float32``; None without
        a backward or without prescale_q."""
        if not (self.backward and self.bwd_prescale):
            return None
        if self.bwd_prescale == "qk_scale":
            return "_float32(scale)"
        _, op, constant = self.bwd_prescale.split(" ")
        return f"_float32(_float32(scale) {op} _float32({constant}))"

    @property
    def bwd_masked(self) -> bool:
        """The backward's scores need more than causal/bounds masking and scaling:
        windows, soft-cap, hooks or sinks."""
        return bool(self.window_left is not None or self.window_right is not None
                    or self.softcap is not None or self.hooks or self.sinks)

    @property
    def bwd_dkdv_options(self) -> str:
        """The dK/dV kernel's AotKernel options."""
        return _sm90_hints(self.bwd_dkdv_occupancy, self.bwd_dkdv_warps)

    @property
    def bwd_dq_options(self) -> str:
        """The dQ kernel's AotKernel options."""
        return _sm90_hints(self.bwd_dq_occupancy, self.bwd_dq_warps)

    @property
    def bwd_order_rule(self) -> bool:
        """The causal backward picks its launch order per call (_global_order); else
        it always launches across heads (bwd_global_order_waves None)."""
        return self.bwd_heavy_first and self.bwd_global_order_waves is not None

    @property
    def bwd_heavy_first(self) -> bool:
        """The causal backward launches its heaviest tiles first, across heads: dK/dV's
        first key tiles and dQ's last query tiles (grid x over heads, y over tiles).
        A varlen grid covers the longest sequence and keeps its order."""
        return self.backward and self.causal and not self.varlen

    @property
    def bwd_natural(self) -> bool:
        """The backward's scores are formed in natural-log units: soft-cap and
        score_mod change the score itself. Masks (windows, mask_mod, block maps)
        only choose pairs, so their P is exp2(S * scale - lse / ln 2), one FMA."""
        return self.softcap is not None or self.score_mod is not None

    @property
    def bwd_split_dkdv(self) -> bool:
        """The dK/dV kernel runs the query tiles that see all of its keys in a loop of
        their own with no mask (causal and bounds masks only; not block-sparse), where
        its accumulators are at most [TILE_N, 128]: with the padded-256 head's
        one-CTA-per-SM kernel the three loops ran 21% slower on an H200 than one.
        Not with key-varying learnable subscripts: three bodies with their atomic adds
        spilled 1,328 bytes of stack at head_dim 64 (sm_90)."""
        return (self.bwd_split_dq and max(self.head_dim_tile, self.v_head_dim_tile) <= 128
                and not self.dkdv_tensor_grads)

    @property
    def bwd_split_dq(self) -> bool:
        """The dQ kernel runs its key tiles wholly visible to all rows with no mask.
        Soft-cap, score_mod and sinks change scores or rows, not which pairs are seen:
        their interior tiles drop the mask too and keep the rest. Windows and mask_mod
        choose pairs (and block maps list tiles), so they keep one masked loop."""
        return not (self.window_left is not None or self.window_right is not None
                    or self.mask_mod is not None or self.block_sparse)

    @property
    def bwd_post_is_one(self) -> bool:
        """The natural-log scores of a prescale_q spec whose forward multiplied Q by
        qk_scale itself: post = qk_scale / qk_scale is 1, and no step multiplies by it."""
        return self.bwd_natural and self.bwd_prescale == "qk_scale"

    @property
    def bwd_gathers(self) -> tuple[Gather, ...]:
        """The hook operands the backward's key steps gather (hooks and derivative)."""
        hooks = self.hooks + ((self.score_mod_grad,) if self.score_mod_grad else ())
        return tuple(g for h in hooks for g in h.gathers)

    @property
    def dq_tensor_grads(self) -> tuple[TensorGrad, ...]:
        """The learnable subscripts the dQ kernel accumulates: per head or per query
        row, summed in its registers (and corrected with its own D at its end)."""
        return tuple(t for t in self.tensor_grads if t.where != "keys")

    @property
    def dkdv_tensor_grads(self) -> tuple[TensorGrad, ...]:
        """The learnable subscripts that vary with the key: added by the dK/dV
        kernel, element by element (or summed over its query rows), with the D that
        the dQ kernel stored from its own P."""
        return tuple(t for t in self.tensor_grads if t.where == "keys")

    @property
    def dq_gathers(self) -> tuple[Gather, ...]:
        """What the dQ kernel gathers besides: its tensor derivatives' operands."""
        return tuple(g for t in self.dq_tensor_grads for g in t.derivative.gathers)

    @property
    def dkdv_grad_gathers(self) -> tuple[Gather, ...]:
        """The operands of the dK/dV kernel's tensor derivatives."""
        return tuple(g for t in self.dkdv_tensor_grads for g in t.derivative.gathers)

    @property
    def bwd_own_delta(self) -> bool:
        """Whether the dQ kernel replaces D = rowsum(dO * O) by the rowsum(P dP) of its
        own P at its end (for the dK/dV kernel, the sinks' gradient and the
        learnable tensors' sums): specs with sinks (not packed GQA, whose rows span
        heads) or learnable tensors."""
        return bool(self.tensor_grads) or (self.sinks and not self.bwd_pack)

    @property
    def learnable(self) -> tuple[tuple[str, str], ...]:
        """(tensor, gradient parameter) of each learnable tensor, in the order
        score_mod first reads them."""
        seen = {}
        for t in self.tensor_grads:
            seen.setdefault(t.tensor, t.param)
        return tuple(seen.items())

    @property
    def params(self) -> tuple[Param, ...]:
        """The prefill kernel's parameters, in order (specgen.plan.abi)."""
        return prefill_params(self)

    def target(self, name: str) -> TargetPlan:
        """The launch config the generated launcher picks on device ``name``."""
        for target in self.targets:
            if target.name == name:
                return target
        return self.targets[0]

    @property
    def rows_may_be_empty(self) -> bool:
        """A window, a mask_mod, or a causal row before the first key (q_offset < 0,
        or a varlen sequence with more queries than keys) can leave a row with no
        visible key in a tile, or at all: the softmax takes its exponents against 0
        there and the division guards l = 0. A score_mod can hide every key of a row
        too: a score of -inf (log(0), -1.0 / 0) on each of them, in any tile."""
        return (self.window_left is not None or self.window_right is not None
                or self.mask_mod is not None or self.varlen or self.causal
                or self.score_mod is not None)

    @property
    def key_limits(self) -> str:
        """What narrows the keys a query sees below the causal bound, for the
        launcher's docstring: "" (every key up to its position), else the window's
        and the mask_mod's clauses."""
        limits = []
        if self.window_left is not None or self.window_right is not None:
            limits.append("inside its window")
        if self.mask_mod is not None:
            limits.append("that the mask_mod allows")
        return (" " + " and ".join(limits)) if limits else ""

    @property
    def empty_row_causes(self) -> tuple[str, ...]:
        """What can leave a row with no visible key (rows_may_be_empty), as the
        comment on the guard of its division names it."""
        causes = []
        if self.window_left is not None or self.window_right is not None:
            causes.append("outside its window")
        elif self.causal:
            causes.append("causal, before the first key")
        if self.varlen:
            causes.append("a sequence without keys")
        if self.mask_mod is not None:
            causes.append("masked out")
        if self.score_mod is not None:
            causes.append("every score -inf")
        return tuple(causes)

    @property
    def hooks(self) -> tuple[Hook, ...]:
        return tuple(h for h in (self.score_mod, self.mask_mod) if h is not None)

    def map_gathers(self, where: str) -> tuple[Gather, ...]:
        """The mask_mod's operands as the map kernel loads them: once per CTA
        ("head"), by the query rows ("rows"), by the keys alone ("keys"), or by
        both ("pair": after both are known, in the loop either way round)."""
        # A gather is a pair's where its indices read the rows, or the local of a pair
        # gather (relb[bucket[q_idx, kv_idx]]: relb's index is bucket's local, which
        # is known only once both are). Inner subscripts come first in the list.
        pair, pair_names = [], ["rows"]
        for g in self.mask_mod.gathers:
            if g.where == "keys" and any(re.search(r"\b(" + "|".join(pair_names) + r")\b", i)
                                         for i in g.indices):
                pair.append(g)
                pair_names.append(re.escape(g.local))
        if where == "pair":
            return tuple(pair)
        return tuple(g for g in self.mask_mod.gathers if g.where == where and g not in pair)

    def gathers(self, where: str) -> tuple[Gather, ...]:
        """Hook operands loaded once per CTA ("head"), per query tile ("rows") or
        in every key step ("keys")."""
        return tuple(g for h in self.hooks for g in h.gathers if g.where == where)

    @property
    def tensor_params(self) -> dict[str, str]:
        """Extra tensor name -> its kernel parameter."""
        return {name: param for name, param, _, _ in self.extra_tensors}

    @property
    def map_tensors(self) -> tuple[str, ...]:
        """The extra tensors a block map depends on: those the mask_mod reads, in
        the spec's order (a score_mod's tensors do not change which tiles are seen)."""
        read = {g.tensor for g in self.mask_mod.gathers} if self.mask_mod else set()
        return tuple(name for name, _, _, _ in self.extra_tensors if name in read)

    @property
    def needs_rows(self) -> bool:
        """The kernel computes each row's absolute position (masks and hooks)."""
        return (bool(self.row_mask) or self.dropout
                or any("q_idx" in h.uses for h in self.hooks))

    @property
    def keys_every_step(self) -> bool:
        """A hook reads kv_idx: the key positions are needed in unmasked steps too."""
        return any("kv_idx" in h.uses for h in self.hooks)

    def score_gathers(self, where: str) -> tuple[Gather, ...]:
        """The score_mod's operands only: a block map's full tiles skip the mask_mod."""
        return tuple(g for g in (self.score_mod.gathers if self.score_mod else ())
                     if g.where == where)

    @property
    def full_tile_keys(self) -> bool:
        """A full tile (no mask) still needs the key positions: a score_mod that
        reads kv_idx."""
        return bool(self.score_mod and "kv_idx" in self.score_mod.uses)

    def visible_expr(self, half: str = "") -> str:
        """The per-row mask of a masked key tile, e.g. 'keys <= rows0'."""
        terms = [t.replace("rows", "rows" + half) for t in self.row_mask]
        return terms[0] if len(terms) == 1 else " & ".join(f"({t})" for t in terms)

    # Tile loads and stores: [B, H, S, D] arrays, or per-sequence views of packed
    # [total, H, D] arrays (varlen). Each returns the text of the call's arguments.
    @property
    def pos_tile(self) -> str:
        """The query positions one tile covers: TILE_M, or TILE_P with pack_gqa."""
        return "TILE_P" if self.pack_gqa else "TILE_M"

    @property
    def map_row_group(self) -> bool:
        """The forward map kernel lists ROW_GROUP consecutive query tiles per CTA,
        sharing one scan of the keys (packed GQA's tiles hold few positions; the
        steps form of per-position masks)."""
        return self.pack_gqa and self.map_steps

    @property
    def grid_heads(self) -> str:
        """The launcher's count of (batch, head) CTA rows: KV heads with pack_gqa."""
        return "batch * num_kv_heads" if self.pack_gqa else "batch * num_heads"

    def bwd_map_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The backward's two block maps, as the map kernel's constants: (query
        positions, keys, by_keys[, ROW_GROUP]) at the dQ kernel's tiles, then at the
        dK/dV kernel's (positions: tile rows / group_size where the backward packs GQA)."""
        group = self.group_size if self.bwd_pack else 1
        dq = (self.bwd_dq_tile[0] // group, self.bwd_dq_tile[1], False)
        kv = (self.bwd_tile[0] // group, self.bwd_tile[1], True)
        if self.map_row_group:  # by query tile, one CTA lists a packed tile's rows together
            return (*dq, group), (*kv, 1)
        return dq, kv

    def map_rows(self, tile_m: int) -> int:
        """The query positions of a tile of ``tile_m`` rows (the forward map's rows):
        tile_m, or tile_m / group_size with pack_gqa."""
        return tile_m // self.group_size if self.pack_gqa else tile_m

    @property
    def map_tile(self) -> str:
        """The generated launcher's expression of the forward map's (rows, keys) tile
        from a launch config ``config`` (map_rows, in the module's terms)."""
        rows = 'config["tile_m"] // GROUP_SIZE' if self.pack_gqa else 'config["tile_m"]'
        return f'({rows}, config["tile_n"])'

    def chain(self, a: str, b: str, init: str, dims: str = "d") -> str:
        """The MMA a @ b + init contracted over a head dim (``dims`` "d" or "dv"): one
        ct.mma, or where the head dim is split one per D tile, chained (the rest
        tile's operands are a and b with "{}" filled by the part's suffix)."""
        for part in self.d_parts if dims == "d" else self.dv_parts:
            init = f"ct.mma({a.format(part.suffix)}, {b.format(part.suffix)}, {init})"
        return init

    def load_q(self, tile: str, part: DPart) -> str:
        """The load arguments of query tile ``tile``'s D tile ``part``."""
        width, col = part.width, part.col
        if self.pack_gqa:  # the tile's heads are its KV head's group: tile index kv_head along H
            return f"Q, index=(batch, kv_head, {tile}, {col}), shape=(1, GROUP_SIZE, TILE_P, {width})"
        if self.varlen:
            return f"Qs, index=({tile}, head, {col}), shape=({self.sub_m}, 1, {width})"
        return f"Q, index=(batch, head, {tile}, {col}), shape=(1, 1, {self.sub_m}, {width})"

    @property
    def first_key_tile(self) -> str:
        """The first key tile a query tile visits (forward, and the backward's dQ
        kernel): past a left window's reach, else 0."""
        return "first_n" if self.window_left is not None else "0"

    @property
    def has_key_tiles(self) -> str:
        """The test that a query tile has a key tile to visit."""
        return "num_n > 0" if self.window_left is None else "first_n < num_n"

    def load_k_t(self, tile: str, part: DPart) -> str:
        """The load arguments of key tile ``tile``'s D tile ``part``, as K^T."""
        width, col = part.width, part.col
        if self.varlen:
            return (f"Ks,\n            index=({col}, kv_head, {tile}),\n            shape=({width}, 1, TILE_N),"
                    f"\n            order=(2, 1, 0)")
        return (f"K,\n            index=(batch, kv_head, {col}, {tile}),\n            shape=(1, 1, {width}, "
                f"TILE_N),\n            order=(0, 1, 3, 2)")

    def load_kv(self, array: str, part: DPart, tile: str) -> str:
        """The load arguments of ``array``'s (K or V) key tile ``tile``, D tile ``part``."""
        width, col = part.width, part.col
        if self.varlen:
            return f"{array}s, index=({tile}, kv_head, {col}), shape=(TILE_N, 1, {width})"
        return f"{array}, index=(batch, kv_head, {tile}, {col}), shape=(1, 1, TILE_N, {width})"

    def store_out(self, tile: str, col: str) -> str:
        if self.pack_gqa:
            return f"Out, index=(batch, kv_head, {tile}, {col})"
        if self.varlen:
            return f"Outs, index=({tile}, head, {col})"
        return f"Out, index=(batch, head, {tile}, {col})"

    def out_tile_shape(self, width: str) -> str:
        if self.pack_gqa:
            return f"(1, GROUP_SIZE, TILE_P, {width})"
        if self.varlen:
            return f"({self.sub_m}, 1, {width})"
        return f"(1, 1, {self.sub_m}, {width})"

    @property
    def kernel_constants(self) -> tuple[str, ...]:
        """Names of the kernel's ct.Constant parameters, in signature order."""
        if self.spec.family == "decode":
            return ("TILE_N", "SINGLE_SPLIT", "PDL")
        names = ("TILE_M", "TILE_N")
        names += ("EVEN_N",) if self.even_n_param else ()
        names += ("TILES_OUTER",) if self.tile_order_param else ()
        return names + (("V_TRANSPOSED",) if self.v_layout_param else ())


def _arch_key(name: str) -> tuple:
    if name == "default":
        return (0, 0, "")
    match = re.match(r"sm_(\d+)([a-z]?)$", name)
    return (1, int(match.group(1)), match.group(2))


def procedural_name(spec: Spec) -> str:
    """The one name of a kernel variant, used for the kernel, cache and bench rows."""
    heads = "mha" if spec.gqa_ratio == 1 else f"gqa{spec.gqa_ratio}"
    if spec.family == "decode":
        name = f"fmha_decode_{heads}_{DTYPE_SHORT[spec.dtype]}"
        name += f"_kv{DTYPE_SHORT[spec.kv_dtype]}" if spec.cache_dtype != spec.dtype else ""
        name += f"_d{spec.head_dim}"
        name += f"_q{spec.max_q_len}" if spec.max_q_len > 1 else ""
        name += f"_paged{spec.paged.page_size}" if spec.paged else ""
        return name + ("_vt" if spec.v_cache_transposed else "")
    mask = "causal" if spec.causal else "full"
    dims = f"d{spec.head_dim}" + (f"_dv{spec.v_head_dim}" if spec.v_head_dim else "")
    return f"fmha_{spec.family}_{mask}_{heads}_{DTYPE_SHORT[spec.dtype]}_{dims}"


def _kwargs(**values) -> str:
    parts = [f"{key}={value}" for key, value in values.items() if value is not None]
    return "".join(", " + part for part in parts)


def default_v_transposed(spec: Spec) -> bool:
    """What v_transposed: null means: float8 prefill reads V transposed (Hopper's
    float8 MMA takes its B operand K-major only)."""
    return spec.family == "prefill" and spec.dtype == "float8_e4m3fn" and not spec.varlen


def _config_plan(cfg: LaunchConfig, max_seq_k: int | None, own_hints: dict,
                 v_default: bool = False) -> ConfigPlan:
    hints = cfg.hints()
    extra = {}
    if hints != own_hints:
        # replace_hints needs every option of the target's own config restated
        # (an option the bucket leaves out is reset to its default).
        extra = {k: hints.get(k, HINT_DEFAULTS[k]) for k in HINT_FIELDS
                 if k in hints or k in own_hints}
    v_transposed = v_default if cfg.v_transposed is None else cfg.v_transposed
    return ConfigPlan(max_seq_k, cfg.tile_m, cfg.tile_n, hints, extra, cfg.tile_order,
                      v_transposed, bool(cfg.persistent))


def _target_plans(targets: dict[str, TargetConfig], v_default: bool = False
                  ) -> tuple[TargetPlan, ...]:
    ordered = sorted(targets.items(), key=lambda item: _arch_key(item[0]))
    plans = []
    for name, cfg in ordered:
        own = cfg.hints()
        configs = [_config_plan(b, b.max_seq_k, own, v_default) for b in cfg.by_seq_k]
        configs.append(_config_plan(cfg, None, own, v_default))
        plans.append(TargetPlan(name, cfg.tile_m, cfg.tile_n, cfg.occupancy, tuple(configs)))
    return tuple(plans)


def _measured_defaults(spec: Spec) -> tuple[tuple[str, str], ...]:
    data = spec.model_dump(mode="json")
    page = spec.paged.page_size if spec.paged else None
    rows = decode_rows(spec.gqa_ratio, spec.max_q_len) if spec.family == "decode" else None
    if spec_to_dict(spec)["targets"] != defaults.measured_targets(data, rows, page):
        return ()
    notes = []
    for target, entry in defaults.provenance(data).items():
        if entry:
            s = entry["source"]
            notes.append((target, f"{s['how']} of {s['spec']} on an {s['device']}, {s['date']}"))
    return tuple(notes)


def _kernel_options(targets: tuple[TargetPlan, ...]) -> str:
    """The @ct.kernel options: per target through ct.ByTarget, plain if all agree."""
    parts = []
    for option in HINT_FIELDS:
        # A hint left out is the compiler's default: None where cuTile takes None, 3
        # for opt_level, which ct.ByTarget must be given as a number.
        values = [(t.name, t.hints.get(option)) for t in targets]
        values = [(n, HINT_DEFAULTS[option] if v is None else v) for n, v in values]
        if all(v == HINT_DEFAULTS[option] for _, v in values):
            continue
        default = values[0][1]
        others = [(n, v) for n, v in values[1:] if v != default]
        if not others:
            parts.append(f"{option}={default}")
            continue
        by_target = ", ".join(f"{n}={v}" for n, v in others)
        tail = "" if default is None else f", default={default}"
        parts.append(f"{option}=ct.ByTarget({by_target}{tail})")
    return ", ".join(parts)


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
    if any(c.tile_order == "global" for t in spec.targets.values() for c in [t, *t.by_seq_k]):
        lines.append("global tile order (some configs): tile t of every head launches "
                     "before any head's tile t - 1")
    if loads.k_transposed:
        lines.append("K^T loaded directly with order=(0, 1, 3, 2)")
    configs = [c for t in spec.targets.values() for c in [t, *t.by_seq_k]]
    v_default = default_v_transposed(spec)
    v_t = [v_default if c.v_transposed is None else c.v_transposed for c in configs]
    if any(v_t):
        lines.append(("V" if all(v_t) else "V (some configs)") + " passed transposed, [B, Hkv, D, Skv], "
                     "so the P @ V MMA reads it K-major")
    if loads.k_latency is not None or loads.v_latency is not None:
        lines.append(f"latency hints: K={loads.k_latency}, V={loads.v_latency}")
    if loads.check_bounds == "masked":
        lines.append("no bounds checks on the K/V loads of the unmasked key tiles")
    if loads.allow_tma is not None:
        lines.append(f"allow_tma={loads.allow_tma} on the K/V loads")
    if spec.prescale_q:
        lines.append("Q pre-scaled once by the softmax scale, not every S tile")
    if spec.window is not None:
        lines.append("sliding window: key tiles wholly outside it are skipped, its edge tiles masked")
    if spec.q_subtiles == 2:
        lines.append("two query half-tiles per CTA share each K/V tile (ping-pong)")
    if spec.pack_gqa and spec.family == "prefill":
        lines.append(f"packed GQA: a tile holds tile_m / {spec.gqa_ratio} positions of the {spec.gqa_ratio} "
                     "query heads of one KV head, which read each K/V tile once")
    persistent = [bool(c.persistent) for c in configs]
    if any(persistent):
        lines.append(("persistent" if all(persistent) else "persistent (some configs)")
                     + ": one wave of CTAs loops over the work items in the tile order")
    return tuple(lines) or ("none (baseline)",)


def _row_mask(spec: Spec) -> tuple[str, ...]:
    terms = []
    if spec.family == "decode":
        # A decode query sees the cache up to its own position (causal among the new
        # tokens); the terms are printed where a mask_mod is evaluated.
        if spec.mask_mod is None:
            return ()
        terms.append("keys <= rows")
    elif spec.causal:
        terms.append("keys <= rows")
    elif spec.window is not None and spec.window.right is not None:
        terms.append("keys <= rows + WINDOW_RIGHT")
    if spec.window is not None and spec.window.left is not None:
        terms.append("keys >= rows - WINDOW_LEFT")
    return tuple(terms)


def _pow2_ceil(value: int) -> int:
    return 1 << (value - 1).bit_length()


_ZERO_PAD = ", padding_mode=ct.PaddingMode.ZERO"


@dataclass(frozen=True)
class DPart:
    """One tile of a head dim along D: the whole (padded) head dim, or the main or
    the rest tile of a split one. Variables of the rest tile carry ``suffix``."""
    suffix: str  # "" or "_rest"
    width: str  # the constant of its extent: "HEAD_DIM", "HEAD_DIM_MAIN", ...
    col: str  # its index along D in tiles of its own width: "0" or "REST_COL"
    pad: str  # padding_mode=ZERO on its loads where it reaches past the head dim


def _parts(dim: int, split, prefix: str) -> tuple[DPart, ...]:
    """The D tiles of a head dim ``dim`` (constants named with ``prefix``: "" or
    "V_"): split (main, rest), or one tile padded to a power of two."""
    if split:
        main, rest = split
        return (DPart("", f"{prefix}HEAD_DIM_MAIN", "0", ""),
                DPart("_rest", f"{prefix}HEAD_DIM_REST", f"{prefix}REST_COL",
                      _ZERO_PAD if main + rest > dim else ""))
    name = f"{prefix}HEAD_DIM" if dim & (dim - 1) == 0 else f"{prefix}HEAD_DIM_TILE"
    return (DPart("", name, "0", _ZERO_PAD if dim & (dim - 1) else ""),)


def _dims(spec: Spec) -> dict:
    """Head dims, their tiles along D and the names the template prints for them."""
    d, dv = spec.head_dim, spec.dv
    d_split, dv_split = spec.d_parts
    d_parts = _parts(d, d_split, "")
    if dv == d:
        dv_parts = d_parts
        dv_name = "HEAD_DIM"
    else:
        dv_parts = _parts(dv, dv_split, "V_")
        dv_name = "V_HEAD_DIM"
    return dict(
        head_dim=d, v_head_dim=dv, head_dim_tile=_pow2_ceil(d), v_head_dim_tile=_pow2_ceil(dv),
        d_split=d_split, dv_split=dv_split, d_parts=d_parts, dv_parts=dv_parts,
        d_tile=d_parts[0].width, dv_tile=dv_parts[0].width, dv_name=dv_name,
        qk_pad_kwargs=d_parts[0].pad,
    )


def tensor_param(name: str) -> str:
    """The kernel parameter of an extra tensor: doc_ids -> DocIds."""
    return kernel_param(name)


_DIM_EXPRS = {"batch": "batch", "heads": "num_heads", "kv_heads": "num_kv_heads",
              "seq_q": "seq_q", "seq_k": "seq_k"}


def _hooks(spec: Spec) -> dict:
    tensors = {n: (t.dtype, len(t.shape)) for n, t in spec.tensors.items()}
    counter: dict = {}  # one numbering for both hooks: gathered locals stay distinct
    hooks = {which: compile_hook(getattr(spec, which), which, tensors, counter)
             if getattr(spec, which) else None for which in ("score_mod", "mask_mod")}
    extra = tuple(
        (name, tensor_param(name), t.dtype,
         tuple(_DIM_EXPRS.get(d, str(d)) for d in t.shape))
        for name, t in spec.tensors.items()
    )
    return dict(**hooks, extra_tensors=extra)


def make_plan(spec: Spec, *, tile_order_param: bool | None = None,
              v_layout_param: bool | None = None, persistent_loop: bool | None = None) -> Plan:
    """The plan of ``spec``. ``tile_order_param`` forces the TILES_OUTER kernel
    argument on or off (``specgen tune`` searches both orders with one kernel);
    None: present where a config of the spec uses tile_order "global".
    ``v_layout_param`` does the same for V_TRANSPOSED (configs with v_transposed),
    ``persistent_loop`` for the work-item loop (configs with persistent)."""
    fm = spec.fast_math
    block_remap = spec.use_block_remap
    targets = _target_plans(spec.targets, default_v_transposed(spec))
    loads = spec.loads
    row_mask = _row_mask(spec)
    hooks = _hooks(spec)
    return Plan(
        spec=spec,
        module_name=spec.name,
        kernel_name=procedural_name(spec),
        dtype=spec.dtype,
        ct_dtype=f"ct.{spec.dtype}",
        torch_dtype=f"torch.{spec.dtype}",
        fp8=spec.dtype == "float8_e4m3fn",
        out_dtype=spec.output_dtype,
        out_dtype_name="DTYPE" if spec.output_dtype == spec.dtype else "OUT_DTYPE",
        **_dims(spec),
        group_size=spec.gqa_ratio,
        causal=spec.causal,
        loop_split=spec.loop_split,
        block_remap=block_remap,
        # (varlen: seq_k differs per sequence, so the masked tiles always bound-check)
        # (decode masks its tail tiles itself: no EVEN_N)
        even_n_param=(spec.family == "prefill" and bool(row_mask) and spec.loop_split
                      and not spec.varlen and not spec.block_sparse),
        tile_order_param=(any(c.tiles_outer for t in targets for c in t.configs)
                          if tile_order_param is None else tile_order_param),
        v_layout_param=(any(c.v_transposed for t in targets for c in t.configs)
                        if v_layout_param is None else v_layout_param),
        persistent_loop=(any(c.persistent for t in targets for c in t.configs)
                         if persistent_loop is None else persistent_loop),
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
        k_load_kwargs=_kwargs(latency=loads.k_latency, allow_tma=loads.allow_tma),
        v_load_kwargs=_kwargs(latency=loads.v_latency, allow_tma=loads.allow_tma),
        unmasked_load_kwargs=_kwargs(
            check_bounds=False if loads.check_bounds == "masked" else None
        ),
        prescale_q=spec.prescale_q,
        qk_ahead=spec.qk_ahead,
        window_left=spec.window.left if spec.window else None,
        window_right=spec.window.right if spec.window and not spec.causal else None,
        softcap=spec.softcap,
        sinks=spec.sinks,
        # (backward: the forward always stores the LSE the backward needs)
        return_lse=spec.return_lse or spec.backward,
        dropout=spec.dropout,
        varlen=spec.varlen,
        **hooks,
        skip_masked_tiles=spec.skip_masked_tiles and spec.mask_mod is not None,
        scores_scaled=spec.prescale_q or spec.softcap is not None or spec.score_mod is not None,
        # score_mod sees natural-log units: 1/ln2 is applied after it, not folded in.
        scale_expr="qk_scale * INV_LN2" if fm.exp2 and not spec.score_mod else "qk_scale",
        row_mask=row_mask,
        q_subtiles=spec.q_subtiles,
        pack_gqa=spec.pack_gqa and spec.family == "prefill",
        halves=("",) if spec.q_subtiles == 1 else ("0", "1"),
        sub_m="TILE_M" if spec.q_subtiles == 1 else "SUB_M",
        targets=targets,
        measured_defaults=_measured_defaults(spec),
        kernel_options=_kernel_options(targets),
        compile_for=tuple(spec.compile_for),
        spec_dict=spec_to_dict(spec),
        optimizations=_optimizations(spec, block_remap),
        **_decode(spec),
        **_block_sparse(spec, hooks["mask_mod"]),
        **_backward(spec),
        **_backward_hooks(spec),
    )


def _block_sparse(spec: Spec, mask: Hook | None) -> dict:
    """The map fields of a block_sparse spec; ``mask``: its compiled mask_mod."""
    if not spec.block_sparse:
        return {}
    tensors = {n: (t.dtype, len(t.shape)) for n, t in spec.tensors.items()}
    if spec.family == "decode":
        # One map row per (sequence, KV head where the mask_mod reads h): the key tiles
        # that some row of the kernel's packed query tile sees. Few rows, many tiles: a
        # row's tiles are classified by many CTAs, then listed by one per row (one CTA
        # stepping through a row took 60-280 µs on an H100, 4-20x the decode call).
        return dict(block_sparse=True, map_per_head="h" in mask.uses,
                    map_kernel_name=procedural_name(spec).replace("fmha_decode", "fmha_decode_map", 1))
    blocks = block_quotients(spec.mask_mod)
    if (spec.causal or spec.window or blocks is None
            or any(d is not None and d & (d - 1) for d in blocks)):
        blocks = None  # pairs, or blocks of a size the kernel cannot step by
    # A mask of per-position tensors (document or segment ids) passes the bound test
    # on the few tiles near the query's document: a step by query tile then
    # evaluates all its tiles' pairs at once and lists them with one scatter. A mask
    # of positions alone (chunks, prefixes) passes it on most tiles, where a whole
    # step's pairs cost 2-4x more per pair than one tile's (vector reductions over a
    # reshaped step): the tiles that pass are evaluated one at a time. H200, S 4k /
    # 8k / 16k, map time over one forward call: documents 7.2 / 6.5 / 5.0% all at
    # once against 10.7 / 6.1 / 4.0% one at a time; chunked-local 19.7 / 18.1 /
    # 17.6% against 7.1 / 5.5 / 4.2%. By key tile (the backward's dK/dV map) one at
    # a time won for documents too: the backward's two maps took 118 / 106 / 123 µs
    # against 162 / 261 / 439 µs (docs/experiments.md, section 34).
    steps = blocks is None and any(g.where in ("rows", "keys") for g in mask.gathers)
    return dict(block_sparse=True, map_per_head="h" in mask.uses,
                map_span=_map_span(spec.mask_mod, tensors, mask, "keys", rename=not steps),
                map_span_by_keys=_map_span(spec.mask_mod, tensors, mask, "rows", rename=True),
                map_blocks=blocks, map_steps=steps,
                map_kernel_name=procedural_name(spec).replace("fmha_prefill", "fmha_block_map", 1))


def _map_span(text: str, tensors: dict, mask: Hook, inner: str, rename: bool) -> MapSpan | None:
    """The bound test of a map step over CHUNK tiles of ``inner`` positions ("keys":
    key tiles, "rows": query tiles), or None where the mask_mod has none.
    ``rename``: the step's positions and operands are the span_* names (its tiles
    are then evaluated one at a time under the plain names); else the plain ones."""
    variable, shape = {"keys": ("kv_idx", "(CHUNK, TILE_N)"), "rows": ("q_idx", "(CHUNK, TILE_M)")}[inner]
    test = tile_pretest(text, tensors, mask.gathers, per_tile=(variable, shape))
    if test is None:
        return None
    if not rename:  # the step's own positions and operands, gathered with the pairs'
        return MapSpan(test.gathers, test.expr)
    other = "rows" if inner == "keys" else "keys"

    def reads(g: Gather, positions: str) -> bool:
        return any(re.search(rf"\b{positions}\b", i) for i in g.indices)

    # The operands the test reads by the inner positions alone (a side reading both
    # has no bounds), and any the mask_mod itself does not gather.
    side = [g for g in mask.gathers if g.where == inner and not reads(g, other)]
    # Renamed: the operands read at the inner positions, directly or through another
    # such operand (ids[b, ids[b, q_idx]]: inner subscripts come first).
    names = {inner: f"span_{inner}"}
    for g in side + list(test.gathers):
        if any(reads(g, name) for name in names):
            names[g.local] = f"span_{g.local}"

    def renamed(expr: str) -> str:
        return rename_words(expr, names)

    gathers = tuple(replace(g, local=renamed(g.local), indices=tuple(map(renamed, g.indices)))
                    for g in side + list(test.gathers))
    return MapSpan(gathers, renamed(test.expr))


def _backward_hooks(spec: Spec) -> dict:
    """What the backward kernels compute from the hooks, compiled like hooks, their
    gathered locals numbered after the forward hooks' own: score_mod_grad, the
    score_mod's derivative in the score (None where it is 1, a bias), and
    tensor_grads, one per distinct subscript of a learnable tensor in score_mod."""
    if not (spec.backward and spec.score_mod):
        return {}
    tensors = {n: (t.dtype, len(t.shape)) for n, t in spec.tensors.items()}
    counter: dict = {}
    forward = {}
    for which in ("score_mod", "mask_mod"):  # the forward hooks' numbering, then on
        if getattr(spec, which):
            forward[which] = compile_hook(getattr(spec, which), which, tensors, counter)
    # The forward score_mod's subscripts by their text (both sides ast.unparse of the
    # folded hook): a learnable tensor's gradient goes to the indices the forward read
    # it at, whose own subscripts (an id tensor inside the index) are the forward's
    # locals in the backward kernels too.
    by_source = {g.source: g for g in forward["score_mod"].gathers}
    text = score_derivative(spec.score_mod)
    score_mod_grad = (None if text == "1.0" else
                      compile_hook(text, "score_mod", tensors, counter, check_size=False))
    learnable = [n for n, t in spec.tensors.items() if t.learnable]
    grads = []
    for number, (source, text) in enumerate(tensor_derivatives(spec.score_mod, learnable)):
        subscript = compile_hook(source, "score_mod", tensors, {}, check_size=False)
        gather = by_source[source]
        grads.append(TensorGrad(
            tensor=gather.tensor, param="D" + tensor_param(gather.tensor), local=f"dsum_{number}",
            indices=gather.indices, where=gather.where, uses_rows="q_idx" in subscript.uses,
            derivative=compile_hook(text, "score_mod", tensors, counter, check_size=False),
            source=source))
    return dict(score_mod_grad=score_mod_grad, tensor_grads=tuple(grads))


def _sm90_hints(occupancy: int, warps: int | None) -> str:
    """AotKernel options asking sm_90 for ``occupancy`` CTAs per SM (and ``warps``
    worker warps)."""
    hints = f"occupancy=ct.ByTarget(sm_90={occupancy})"
    return hints + (f", num_worker_warps=ct.ByTarget(sm_90={warps})" if warps else "")


def _backward(spec: Spec) -> dict:
    if not spec.backward:
        return {}
    name = procedural_name(spec).replace("fmha_prefill", "fmha_bwd", 1)
    names = dict(bwd_names=(name.replace("fmha_bwd", "fmha_bwd_dkdv", 1),
                            name.replace("fmha_bwd", "fmha_bwd_dq", 1)))
    # The width a kernel holds per head dim: the padded tile, or main + rest where split.
    d_split, dv_split = spec.d_parts
    widest = max(sum(d_split) if d_split else _pow2_ceil(spec.head_dim),
                 sum(dv_split) if dv_split else _pow2_ceil(spec.dv))
    # (64-row tiles: at most 64 heads a group; learnable tensors' gradients are summed per head)
    packed = (spec.pack_gqa and spec.block_sparse and spec.gqa_ratio <= 64
              and not any(t.learnable for t in spec.tensors.values()))
    if widest >= 256:
        # Tiles 256 wide: the dK/dV kernel's two [TILE_N, 256] float32 accumulators
        # need the registers of two warp groups at one CTA per SM, and the dQ kernel
        # takes 64 rows. H200, B4 Hq32 Hkv8 D256 causal, S 2048 / 8192: 258 / 303
        # TFLOPS, against 51 / 56 with the D128 tiles (experiments, section 32).
        # MLA's 192 = 128 + 64 (split) keeps the D128 tiles below: dK/dV at two CTAs per
        # SM and dQ 128 x 64 measured 1.25x / 1.26x these at S 2048 / 8192 (H100,
        # 192/128 causal MHA; experiments, section 62).
        return dict(backward=True, **names, bwd_tile=(64, 64), bwd_dq_tile=(64, 64), bwd_pack=packed,
                    bwd_dkdv_occupancy=1, bwd_dkdv_warps=8, bwd_wide=True)
    if packed:
        # Packed GQA, as the forward: a tile's 64 rows are 64 / gqa_ratio positions of
        # each head of the group, so a key tile meets (and a query tile visits) the span
        # of fewer positions, and dQ's K/V tiles are read once per group. The dQ kernel
        # takes 64 rows at two CTAs per SM. H100, fmha_train_document (B4 Hq32 Hkv8
        # D128, documents of about 256 tokens), S 1k / 4k / 16k: 1.05 / 1.07 / 1.08x the
        # per-head kernels (dQ 128 x 64 at one CTA of two warp groups); with 128-row
        # packed tiles at one CTA of two warp groups in either kernel, 0.89-1.07x
        # (experiments, section 44).
        return dict(backward=True, **names, bwd_pack=True, bwd_dq_tile=(64, 64),
                    bwd_dq_occupancy=2, bwd_dq_warps=None,
                    # Short rows: a packed tile visits a few key (query) tiles, so no
                    # CTA streams a head's rows for long; across heads was 1.01-1.08x
                    # head by head at S 1k-16k (H200, experiments section 47).
                    bwd_global_order_waves=None)
    return dict(backward=True, **names)



def _decode(spec: Spec) -> dict:
    if spec.family != "decode":
        return {}
    rows = decode_rows(spec.gqa_ratio, spec.max_q_len)
    return dict(max_q_len=spec.max_q_len, page_size=spec.paged.page_size if spec.paged else None,
                splits=spec.splits, pdl=spec.pdl, decode_tile_m=rows,
                kv_dtype=spec.cache_dtype, kv_fp8=spec.cache_dtype == "float8_e4m3fn",
                v_cache_transposed=spec.v_cache_transposed,
                split_ctas_per_sm=2 if spec.cache_dtype == "float8_e4m3fn" else 1,
                # (max_q_len - 1) < 16 <= tile_n keys: the masked keys span at most 2 tiles.
                tail_tiles=1 if spec.max_q_len == 1 else 2,
                combine_name=procedural_name(spec).replace("fmha_decode", "fmha_decode_combine", 1))

"""The spec: the strict Pydantic model a kernel engineer writes in YAML.

Each constraint is stated once, here, with the message a user sees. Errors are
reported as ``<file>: <field.path>: <what is allowed>, got <value>``.
"""

from __future__ import annotations

import json
import keyword
import re
import sys
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
    field_validator,
    model_validator,
)

from specgen.errors import SpecError
from specgen.spec.defaults import measured_targets

TARGET_RE = re.compile(r"^sm_[1-9][0-9]{1,2}[a-z]?$")
MAX_SPEC_BYTES = 1 << 20


def _power_of_two_tile(value: int) -> int:
    if value < 16 or value > 256 or value & (value - 1):
        raise ValueError("must be a power of two in [16, 256]")
    return value


def _latency(value: Optional[int]) -> Optional[int]:
    if value is not None and not 1 <= value <= 10:
        raise ValueError("must be an integer in [1, 10] or null")
    return value


def _occupancy(value: int) -> int:
    if not 1 <= value <= 32:
        raise ValueError("must be an integer in [1, 32]")
    return value


def _target_name(value: str) -> str:
    if not TARGET_RE.match(value):
        raise ValueError("must be a GPU target such as sm_90, sm_100 or sm_120")
    return value


def _power_of_two(low: int, high: int):
    def check(value: Optional[int]) -> Optional[int]:
        if value is not None and (value < low or value > high or value & (value - 1)):
            raise ValueError(f"must be a power of two in [{low}, {high}] or null (auto)")
        return value

    return check


def _opt_level(value: Optional[int]) -> Optional[int]:
    if value is not None and not 0 <= value <= 3:
        raise ValueError("must be an integer in [0, 3] or null (the compiler's 3)")
    return value


def _head_dim(value: int) -> int:
    # Multiples of 8 keep every row of a 2-byte q/k/v 16-byte aligned (TMA).
    if not 16 <= value <= 256 or value % 8:
        raise ValueError("must be a multiple of 8 in [16, 256]")
    return value


TileSize = Annotated[int, AfterValidator(_power_of_two_tile)]
HeadDim = Annotated[int, AfterValidator(_head_dim)]
Latency = Annotated[Optional[int], AfterValidator(_latency)]
Occupancy = Annotated[int, AfterValidator(_occupancy)]
NumCtas = Annotated[Optional[int], AfterValidator(_power_of_two(1, 16))]
WorkerWarps = Annotated[Optional[int], AfterValidator(_power_of_two(1, 32))]
OptLevel = Annotated[Optional[int], AfterValidator(_opt_level)]


def _target_key(value: str) -> str:
    if value != "default" and not TARGET_RE.match(value):
        raise ValueError(
            "unknown target; allowed: 'default' or a GPU target such as sm_90, "
            "sm_100, sm_120"
        )
    return value


TargetName = Annotated[str, AfterValidator(_target_name)]
TargetKey = Annotated[str, AfterValidator(_target_key)]


class _Strict(BaseModel):
    # strict: YAML's "true" string or 1.5 is never coerced into a bool or an int.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class FastMath(_Strict):
    """Fast-math choices of the softmax and the final normalisation."""

    exp2: bool = Field(
        True, description="Fold 1/ln2 into the scale and use ct.exp2 (ex2.approx)."
    )
    flush_to_zero: bool = Field(
        True, description="flush_to_zero=True on exp2 and on the final division."
    )
    approx_div: bool = Field(
        True, description="rounding_mode=APPROX on the final normalisation."
    )


class Loads(_Strict):
    """How K and V tiles are loaded."""

    k_transposed: bool = Field(
        True,
        description="Load K^T directly with order=(0,1,3,2) instead of ct.permute.",
    )
    k_latency: Latency = Field(
        2, description="Latency hint of the K load, 1..10, or null for none."
    )
    v_latency: Latency = Field(
        4, description="Latency hint of the V load, 1..10, or null for none."
    )
    check_bounds: Literal["all", "masked"] = Field(
        "all",
        description="'masked' drops the bounds check (check_bounds=False) from the K "
        "and V loads of the unmasked key tiles, which are always inside the array; "
        "needs loop_split.",
    )
    allow_tma: Optional[bool] = Field(
        None,
        description="allow_tma of the K and V loads: false forbids TMA, null leaves "
        "the choice to the compiler.",
    )


class Window(_Strict):
    """A sliding window around each query's absolute position p = q_offset + i."""

    left: Optional[int] = Field(
        None, ge=0, le=2**31 - 1,
        description="Keys j >= p - left are visible; null: unbounded to the left.",
    )
    right: Optional[int] = Field(
        None, ge=0, le=2**31 - 1,
        description="Keys j <= p + right are visible; null: unbounded to the right. "
        "A causal kernel takes null or 0.",
    )

    @model_validator(mode="after")
    def _bounded(self):
        if self.left is None and self.right is None:
            raise ValueError("set left or right (or both); without either, drop window")
        return self


DIM_NAMES = ("batch", "heads", "kv_heads", "seq_q", "seq_k")
TENSOR_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,30}$")
# Names a tensor may not take: the launcher's own arguments and locals, the hook
# variables and functions, and module-level names of a generated module.
RESERVED_NAMES = frozenset({
    "q", "k", "v", "out", "scale", "q_offset", "sinks", "lse", "score", "b", "h", "q_idx",
    "kv_idx", "batch", "num_heads", "num_kv_heads", "seq_q", "seq_k", "name", "t", "want",
    "config", "kernel", "tile_m", "tile_n", "num_tiles", "tiles_outer", "grid", "what", "args",
    "ct", "torch", "math", "where", "abs", "exp", "log", "sqrt", "tanh", "min", "max",
    "expected", "dims", "tensors", "got", "dtype",
})


def _dim_size(value, handler):
    # A union (a name or a number): one message per entry instead of one per member.
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(
            f"must be one of {', '.join(DIM_NAMES)} or an integer in [1, 2**31 - 1]"
        ) from None


DimSize = Annotated[
    Union[Annotated[int, Field(ge=1, le=2**31 - 1)], Literal[DIM_NAMES]],
    WrapValidator(_dim_size),
]


class ExtraTensor(_Strict):
    """An extra input tensor of score_mod / mask_mod: attention(..., <name>=tensor)."""

    dtype: Literal["float32", "int32"] = Field(description="Element type.")
    shape: list[DimSize] = Field(
        min_length=1, max_length=4,
        description="Sizes: batch, heads, kv_heads, seq_q, seq_k or a number each; the "
        "launcher checks them before the launch.",
    )


class Paged(_Strict):
    """A paged KV cache: pages [num_pages, page_size, Hkv, D] and a page table."""

    page_size: int = Field(
        description="Tokens per page: a power of two in [16, 1024], at least the tile_n "
        "of every target (a key tile never spans two pages).",
    )

    @field_validator("page_size")
    @classmethod
    def _pow2(cls, value: int) -> int:
        if value < 16 or value > 1024 or value & (value - 1):
            raise ValueError("must be a power of two in [16, 1024]")
        return value


TileOrder = Literal["per_head", "global"]

HINT_FIELDS = ("occupancy", "num_ctas", "num_worker_warps", "opt_level")
# What each kernel option is when left out (replace_hints resets to these).
HINT_DEFAULTS = {"occupancy": None, "num_ctas": None, "num_worker_warps": None, "opt_level": 3}


class LaunchConfig(_Strict):
    """Tile sizes and compiler hints of one launch."""

    tile_m: TileSize = Field(description="Query rows per CTA (power of two, 16..256).")
    tile_n: TileSize = Field(description="Keys per inner step (power of two, 16..256).")
    occupancy: Occupancy = Field(2, description="CTAs per SM the compiler aims for.")
    num_ctas: NumCtas = Field(
        None, description="CTAs per cluster (CGA), a power of two 1..16; null: auto."
    )
    num_worker_warps: WorkerWarps = Field(
        None,
        description="Warps of the compute warp groups of a warp-specialised kernel, "
        "a power of two 1..32; null: auto.",
    )
    opt_level: OptLevel = Field(None, description="tileiras optimisation level 0..3; null: 3.")
    tile_order: TileOrder = Field(
        "per_head",
        description="Launch order of the query tiles. per_head: one (batch, head)'s "
        "tiles after another, which keeps its K/V in L2; global: tile t of every head "
        "before any head's next tile, so with block remap the heaviest tiles of all "
        "heads run first (wins on short causal sequences).",
    )

    def hints(self) -> dict[str, int]:
        """The kernel options this config sets (the ones left null are auto)."""
        return {k: getattr(self, k) for k in HINT_FIELDS if getattr(self, k) is not None}


class SeqBucket(LaunchConfig):
    """A launch config for key lengths up to ``max_seq_k``."""

    max_seq_k: int = Field(
        ge=1, le=2**31 - 1,
        description="This config applies while seq_k <= max_seq_k (the first match wins).",
    )


class TargetConfig(LaunchConfig):
    """Launch configuration for one GPU target: a config per key-length bucket,
    then the target's own fields for every longer sequence."""

    by_seq_k: list[SeqBucket] = Field(
        default_factory=list,
        description="Configs for short key lengths, in increasing max_seq_k; "
        "longer sequences use the target's own fields. Written by `specgen tune`.",
    )

    @field_validator("by_seq_k")
    @classmethod
    def _increasing(cls, value: list[SeqBucket]) -> list[SeqBucket]:
        for before, after in zip(value, value[1:]):
            if after.max_seq_k <= before.max_seq_k:
                raise ValueError(
                    f"max_seq_k must increase from bucket to bucket, got "
                    f"{before.max_seq_k} then {after.max_seq_k}"
                )
        return value


TUNABLE_FIELDS = (
    "tile_m", "tile_n", "occupancy", "num_ctas", "num_worker_warps", "opt_level", "tile_order",
)


def _distinct(value: list) -> list:
    if len(set(value)) != len(value):
        raise ValueError("lists a value twice")
    return value


def _choices(item):
    return Annotated[list[item], AfterValidator(_distinct)]


class AutotuneSpace(_Strict):
    """The values `specgen tune` tries for one target: every combination is timed."""

    tile_m: _choices(TileSize) = Field(
        default_factory=lambda: [64, 128], min_length=1
    )
    tile_n: _choices(TileSize) = Field(
        default_factory=lambda: [64, 128], min_length=1
    )
    occupancy: _choices(Occupancy) = Field(
        default_factory=lambda: [1, 2], min_length=1
    )
    num_ctas: _choices(NumCtas) = Field(
        default_factory=lambda: [None], min_length=1
    )
    num_worker_warps: _choices(WorkerWarps) = (
        Field(default_factory=lambda: [None], min_length=1)
    )
    opt_level: _choices(OptLevel) = Field(
        default_factory=lambda: [None], min_length=1
    )
    tile_order: _choices(TileOrder) = Field(
        default_factory=lambda: ["per_head"], min_length=1
    )
    seq_buckets: bool = Field(
        True,
        description="Keep a separate winner per sequence length of the suite when "
        "winners differ (written as by_seq_k); false keeps one config for all.",
    )
    min_gain: float = Field(
        0.02, ge=0.0, le=1.0,
        description="A bucket keeps its own config only if it beats the long-sequence "
        "winner by at least this fraction.",
    )

    def size(self) -> int:
        total = 1
        for name in TUNABLE_FIELDS:
            total *= len(getattr(self, name))
        return total


DEFAULT_TARGET = TargetConfig(tile_m=64, tile_n=64, occupancy=2)


def decode_rows(gqa_ratio: int, max_q_len: int) -> int:
    """Rows of a decode kernel's packed query tile: gqa_ratio heads x max_q_len
    tokens, rounded up to a power of two, at least 16 (the MMA's minimum)."""
    return max(16, 1 << (gqa_ratio * max_q_len - 1).bit_length())


class Spec(_Strict):
    """An attention kernel: what it computes and how it is built, per GPU target."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        title="specgen attention spec",
    )

    name: str = Field(
        description="Python identifier (not a keyword); the module is generated/<name>.py.",
    )
    family: Literal["prefill", "decode"] = Field(
        "prefill",
        description="Kernel family: prefill (queries against keys, [B, H, S, D]) or "
        "decode (a few new tokens against a KV cache, split-KV flash decoding).",
    )
    dtype: Literal["float16", "bfloat16", "float8_e4m3fn"] = Field(
        "float16",
        description="Element type of q, k and v (and of the output unless out_dtype "
        "says otherwise). float8_e4m3fn takes per-tensor q/k/v descales.",
    )
    out_dtype: Optional[Literal["float16", "bfloat16"]] = Field(
        None,
        description="Element type of the output; null: dtype (float8_e4m3fn: bfloat16).",
    )
    kv_dtype: Optional[Literal["float16", "bfloat16", "float8_e4m3fn"]] = Field(
        None,
        description="decode: element type of the KV cache; null: dtype. float8_e4m3fn "
        "halves the bytes a decode call reads: the cache holds value / descale and "
        "attention(..., k_descale, v_descale) passes the per-tensor descales.",
    )
    head_dim: HeadDim = Field(
        128,
        description="Head dimension D of q and k: a multiple of 8 in [16, 256]; one "
        "that is not a power of two (Phi: 80) is zero-padded to the next power of two "
        "inside the kernel.",
    )
    v_head_dim: Optional[HeadDim] = Field(
        None,
        description="Head dimension of v and the output when it differs from "
        "head_dim (DeepSeek MLA: head_dim 192, v_head_dim 128); null: head_dim.",
    )
    gqa_ratio: int = Field(
        1, ge=1, le=128, description="Query heads per KV head; 1 means MHA."
    )
    max_q_len: int = Field(
        1, ge=1, le=8,
        description="decode: new tokens per sequence and call (speculative decoding: "
        "more than 1); the query tile packs gqa_ratio heads x max_q_len tokens.",
    )
    paged: Optional[Paged] = Field(
        None, description="decode: a paged KV cache; null: contiguous [B, max_len, Hkv, D].",
    )
    causal: bool = Field(
        False,
        description="Query row i (absolute position q_offset+i) sees keys j <= q_offset+i.",
    )
    window: Optional[Window] = Field(
        None,
        description="Sliding window: key tiles wholly outside it are skipped, the "
        "edge tiles masked (Mistral: causal with left 4095). null: no window.",
    )
    softcap: Optional[float] = Field(
        None, gt=0, le=1e6,
        description="Logit soft-cap c: score = c * tanh(score / c) (Gemma 2: 50). "
        "null: none.",
    )
    tensors: dict[str, ExtraTensor] = Field(
        default_factory=dict,
        description="Extra tensors the expression hooks index, e.g. slope: {dtype: "
        "float32, shape: [heads]}; each becomes a keyword argument of attention.",
    )
    score_mod: Optional[str] = Field(
        None,
        description="Expression for the new score from score, b, h, q_idx, kv_idx and "
        "the tensors (ALiBi: 'score - slope[h] * (q_idx - kv_idx)'). null: none.",
    )
    mask_mod: Optional[str] = Field(
        None,
        description="Condition: key kv_idx is visible to query q_idx (documents: "
        "'doc[b, q_idx] == doc[b, kv_idx]'); ANDed with causal and window. null: none.",
    )
    skip_masked_tiles: bool = Field(
        False,
        description="With a mask_mod: test each key tile's mask first and branch around "
        "the tiles it hides from every row. Measured no faster on H200 for document "
        "masks (bench/NOTES.md, 15): the loads are pipelined ahead of the branch.",
    )
    dropout: bool = Field(
        False,
        description="Dropout on the attention probabilities: attention(..., dropout_p, "
        "seed); the mask comes from a counter-based hash of (seed, batch, head, query, "
        "key), so a seed reproduces it exactly.",
    )
    varlen: bool = Field(
        False,
        description="Packed variable-length batch (FlashAttention's varlen): q [total_q, "
        "Hq, D], k/v [total_k, Hkv, D] and attention(..., cu_seqlens_q, cu_seqlens_k, "
        "max_seqlen_q); each sequence's queries are the last of its keys.",
    )
    sinks: bool = Field(
        False,
        description="A learned sink logit per query head joins the softmax "
        "normaliser (gpt-oss); attention(..., sinks=tensor[Hq]) passes it.",
    )
    return_lse: bool = Field(
        False,
        description="attention returns (out, lse), lse [B, Hq, Sq] float32: the "
        "natural log of each row's softmax normaliser (-inf for a row that sees no key).",
    )
    fast_math: FastMath = Field(default_factory=FastMath)
    loop_split: bool = Field(
        True,
        description="Mask only the tiles near the diagonal / the ragged end; "
        "false masks on every iteration.",
    )
    block_remap: Optional[bool] = Field(
        None,
        description="Causal only: launch the heaviest query tiles first. "
        "null means on when causal.",
    )
    loads: Loads = Field(default_factory=Loads)
    targets: dict[TargetKey, TargetConfig] = Field(
        default_factory=dict,
        description="Launch config by the device's sm_XY, chosen at run time; "
        "'default' for any other device (filled with 64x64, occupancy 2 if absent). "
        "Left out (or empty), every target the shipped table of measured configs "
        "knows gets its entry for this spec's dtype, head dim, mask and extras "
        "(the generated module names the run that measured each); decode configs take "
        "tile_m from gqa_ratio x max_q_len.",
    )
    prescale_q: bool = Field(
        False,
        description="Multiply the Q tile by the softmax scale (and 1/ln2) once, in "
        "registers, instead of scaling every S tile.",
    )
    q_subtiles: Literal[1, 2] = Field(
        1,
        description="2 splits each CTA's tile_m query rows into two halves with their "
        "own softmax state that share every K and V tile, so one half's softmax can "
        "overlap the other's MMA (FA3's ping-pong, in tiles).",
    )
    splits: Union[Literal["auto"], Annotated[int, Field(ge=1, le=64)]] = Field(
        "auto",
        description="decode: KV splits per (batch, KV head); auto picks them from the SM "
        "count, batch, KV heads and length.",
    )
    pdl: Union[Literal["auto"], bool] = Field(
        False,
        description="decode: programmatic dependent launch (each kernel may start while "
        "the one before it finishes, and waits for it before reading): auto uses it on "
        "sm_90 (Hopper, where it was measured: an H200 gained at every shape of the "
        "decode suite), true on every sm_90+ device, false never.",
    )
    backward: bool = Field(
        False,
        description="Also generate the backward kernels (D = rowsum(dO * O), dK/dV with "
        "GQA reduction, dQ); attention becomes differentiable through a "
        "torch.autograd.Function. Causal or not, any gqa_ratio, power-of-two head_dim.",
    )
    compile_for: list[TargetName] = Field(
        default_factory=lambda: ["sm_90", "sm_100"],
        min_length=1,
        description="Targets `specgen build` AOT-compiles to prove the kernel builds.",
    )
    autotune: dict[TargetName, AutotuneSpace] = Field(
        default_factory=dict,
        description="Search space of `specgen tune` per target; the winners are "
        "written back into targets.",
    )

    @model_validator(mode="wrap")
    @classmethod
    def _measured_targets(cls, data, handler):
        # A spec without targets: validate it as written, then once more with the
        # measured configs of its class (specgen/spec/default_configs.json), so the
        # filled targets pass every check a written one does.
        if not isinstance(data, dict) or data.get("targets"):
            return handler(data)
        spec = handler(data)
        rows = decode_rows(spec.gqa_ratio, spec.max_q_len) if spec.family == "decode" else None
        page = spec.paged.page_size if spec.paged else None
        targets = measured_targets(spec.model_dump(mode="json"), rows, page)
        return handler({**data, "targets": targets})

    @field_validator("splits", "pdl", mode="wrap")
    @classmethod
    def _auto_union_message(cls, value, handler, info):
        # A union ('auto' or a number or a bool): one line instead of one per member.
        try:
            return handler(value)
        except ValidationError:
            allowed = {"splits": "'auto' or an integer in [1, 64]", "pdl": "'auto', true or false"}
            raise ValueError(f"must be {allowed[info.field_name]}") from None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if (
            not value.isascii()
            or not value.isidentifier()
            or keyword.iskeyword(value)
            or keyword.issoftkeyword(value)
            or value.startswith("_")
            or len(value) > 100
        ):
            raise ValueError(
                "must be a Python identifier that is not a keyword and does not "
                "start with '_' (letters, digits, '_'; at most 100 characters)"
            )
        return value

    @field_validator("targets", mode="after")
    @classmethod
    def _fill_default_target(cls, value: dict, info) -> dict:
        if "default" not in value:
            default = DEFAULT_TARGET
            if info.data.get("family") == "decode":  # the packed query tile's rows
                rows = decode_rows(info.data.get("gqa_ratio", 1), info.data.get("max_q_len", 1))
                paged = info.data.get("paged")
                tile_n = min(64, paged.page_size) if paged else 64
                default = TargetConfig(tile_m=rows, tile_n=tile_n, occupancy=2)
            value = {"default": default, **value}
        return value

    @field_validator("compile_for")
    @classmethod
    def _unique_targets(cls, value: list[str]) -> list[str]:
        seen = set()
        for target in value:
            if target in seen:
                raise ValueError(f"lists {target} twice")
            seen.add(target)
        return value

    @field_validator("tensors")
    @classmethod
    def _tensor_names(cls, value: dict) -> dict:
        for name in value:
            if not TENSOR_NAME_RE.match(name) or keyword.iskeyword(name) or name in RESERVED_NAMES:
                raise ValueError(
                    f"tensor name {name!r} must be a lowercase identifier (a-z, 0-9, _; at most "
                    "31 characters) that is not a keyword nor one of the launcher's names "
                    "(q, k, v, out, scale, sinks, b, h, q_idx, kv_idx, ...)"
                )
        return value

    @field_validator("score_mod", "mask_mod")
    @classmethod
    def _hook(cls, value: Optional[str], info) -> Optional[str]:
        if value is None:
            return value
        from specgen.spec.hooks import ExprError, compile_hook

        tensors = {n: (t.dtype, len(t.shape)) for n, t in (info.data.get("tensors") or {}).items()}
        try:
            compile_hook(value, info.field_name, tensors)
        except ExprError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _family_fields(self):
        """Each family takes only its own fields (a field another family owns is an error)."""
        decode_only = ("max_q_len", "paged", "splits", "pdl", "kv_dtype")
        prefill_only = ("v_head_dim", "out_dtype", "softcap", "tensors", "score_mod", "mask_mod",
                        "skip_masked_tiles", "dropout", "varlen", "return_lse", "block_remap",
                        "loop_split", "prescale_q", "q_subtiles", "backward")
        def changed(name: str) -> bool:  # set to something other than its default
            default = type(self).model_fields[name].get_default(call_default_factory=True)
            return getattr(self, name) != default

        if self.family == "prefill":
            wrong = [n for n in decode_only if changed(n)]
        else:
            wrong = [n for n in prefill_only if changed(n)]
            if self.dtype == "float8_e4m3fn":
                wrong.append("dtype float8_e4m3fn")
            if self.window is not None and self.window.right not in (None, 0):
                wrong.append("window.right")
        if wrong:
            raise ValueError(f"family {self.family}: {', '.join(wrong)} not supported by this family")
        if self.family == "decode":
            if self.cache_dtype == "float8_e4m3fn" and self.head_dim % 16:
                raise ValueError(f"kv_dtype float8_e4m3fn needs head_dim a multiple of 16 (16-byte "
                                 f"aligned cache rows), got {self.head_dim}")
            rows = decode_rows(self.gqa_ratio, self.max_q_len)
            for name, cfg in self.targets.items():
                if cfg.tile_m != rows:
                    raise ValueError(
                        f"targets.{name}.tile_m: a decode tile packs gqa_ratio x max_q_len = "
                        f"{self.gqa_ratio * self.max_q_len} query rows, padded to {rows}; set tile_m: {rows}"
                    )
                if self.paged and cfg.tile_n > self.paged.page_size:
                    raise ValueError(f"targets.{name}.tile_n {cfg.tile_n} is larger than paged.page_size "
                                     f"{self.paged.page_size}; a key tile must lie in one page")
                if cfg.by_seq_k:
                    raise ValueError(f"targets.{name}.by_seq_k: decode specs take one config per target")
        return self

    @model_validator(mode="after")
    def _tensors_used(self):
        used = " ".join(filter(None, (self.score_mod, self.mask_mod)))
        for name in self.tensors:
            if not re.search(rf"\b{name}\s*\[", used):
                raise ValueError(f"tensors.{name}: declared but used by neither score_mod nor mask_mod")
        return self

    @field_validator("backward")
    @classmethod
    def _backward_features(cls, value: bool, info) -> bool:
        if not value:
            return value
        used = [n for n in ("window", "softcap", "tensors", "score_mod", "mask_mod", "dropout",
                            "varlen", "sinks", "v_head_dim", "out_dtype") if info.data.get(n)]
        if info.data.get("dtype") == "float8_e4m3fn":
            used.append("dtype float8_e4m3fn")
        if info.data.get("q_subtiles", 1) > 1:
            used.append("q_subtiles 2")
        d = info.data.get("head_dim")
        if isinstance(d, int) and d & (d - 1):
            used.append(f"head_dim {d}")
        if used:
            raise ValueError(f"true does not support {', '.join(used)} yet; the backward kernels "
                             "cover causal/non-causal, GQA and power-of-two head dims")
        return value

    @field_validator("varlen")
    @classmethod
    def _varlen_combinations(cls, value: bool, info) -> bool:
        used = [n for n in ("score_mod", "mask_mod", "dropout") if info.data.get(n)]
        if value and used:
            raise ValueError(
                f"true does not support {', '.join(used)} yet (the reference's b and "
                "positions would be per sequence); use a padded batch, or a document "
                "mask_mod instead of varlen"
            )
        return value

    @field_validator("kv_dtype")
    @classmethod
    def _kv_dtype(cls, value: Optional[str], info) -> Optional[str]:
        dtype = info.data.get("dtype")
        if value is not None and value not in (dtype, "float8_e4m3fn"):
            raise ValueError(f"must be null, {dtype} (the dtype) or float8_e4m3fn")
        return value

    @field_validator("window")
    @classmethod
    def _causal_window(cls, value: Optional[Window], info) -> Optional[Window]:
        if value is not None and info.data.get("causal") and value.right not in (None, 0):
            raise ValueError(
                f"right {value.right} needs causal: false (a causal kernel never sees "
                "keys after the query); use null or 0"
            )
        return value

    @field_validator("block_remap")
    @classmethod
    def _check_block_remap(cls, value: Optional[bool], info) -> Optional[bool]:
        if value and not info.data.get("causal", False):
            raise ValueError(
                "true needs causal: true (non-causal query tiles all do the same "
                "work); use false or null"
            )
        return value

    @field_validator("loads")
    @classmethod
    def _check_bounds_needs_split(cls, value: Loads, info) -> Loads:
        if value.check_bounds == "masked" and not info.data.get("loop_split", True):
            raise ValueError(
                "check_bounds 'masked' needs loop_split: true (without the split "
                "every key tile is masked); use 'all'"
            )
        dims = [info.data.get("head_dim"), info.data.get("v_head_dim")]
        odd = [d for d in dims if isinstance(d, int) and d & (d - 1)]
        if value.check_bounds == "masked" and odd:
            raise ValueError(
                f"check_bounds 'masked' needs power-of-two head dims (head dim {odd[0]} "
                "is padded, so every tile reads past the array's last axis); use 'all'"
            )
        return value

    @field_validator("out_dtype")
    @classmethod
    def _out_dtype(cls, value: Optional[str], info) -> Optional[str]:
        if value is not None and value == info.data.get("dtype"):
            return None  # the same as leaving it out
        return value

    @field_validator("head_dim", "v_head_dim")
    @classmethod
    def _fp8_alignment(cls, value: Optional[int], info) -> Optional[int]:
        if value is not None and info.data.get("dtype") == "float8_e4m3fn" and value % 16:
            raise ValueError(
                "must be a multiple of 16 with dtype float8_e4m3fn (16-byte aligned rows of "
                "1-byte elements)"
            )
        return value

    @field_validator("prescale_q")
    @classmethod
    def _prescale_16_bit(cls, value: bool, info) -> bool:
        if value and info.data.get("dtype") == "float8_e4m3fn":
            raise ValueError("true needs a 16-bit dtype (a pre-scaled Q would be rounded back "
                             "to float8); use false")
        return value

    @property
    def output_dtype(self) -> str:
        """The element type of the output."""
        if self.out_dtype:
            return self.out_dtype
        return "bfloat16" if self.dtype == "float8_e4m3fn" else self.dtype

    @field_validator("v_head_dim")
    @classmethod
    def _v_head_dim(cls, value: Optional[int], info) -> Optional[int]:
        if value is not None and value == info.data.get("head_dim"):
            return None  # the same as leaving it out
        return value

    @property
    def dv(self) -> int:
        """The head dimension of v and the output."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def padded(self) -> bool:
        """A head dimension is not a power of two: tiles are zero-padded in D."""
        return any(d & (d - 1) for d in (self.head_dim, self.dv))

    @field_validator("q_subtiles")
    @classmethod
    def _subtiles_fit(cls, value: int, info) -> int:
        if value > 1:
            used = [name for name in ("window", "softcap", "score_mod", "mask_mod", "varlen",
                                      "dropout", "sinks", "return_lse")
                    if info.data.get(name)]
            if info.data.get("dtype") == "float8_e4m3fn":
                used.append("dtype float8_e4m3fn")
            if used:
                raise ValueError(f"{value} does not support {', '.join(used)} yet; use 1")
        for name, cfg in (info.data.get("targets") or {}).items():
            for bucket in [cfg, *cfg.by_seq_k]:
                if bucket.tile_m // value < 16:
                    raise ValueError(
                        f"{value} needs tile_m >= {16 * value} in every target, "
                        f"got tile_m {bucket.tile_m} in targets.{name}"
                    )
        return value

    @property
    def cache_dtype(self) -> str:
        """decode: the element type of the KV cache."""
        return self.kv_dtype or self.dtype

    @property
    def use_block_remap(self) -> bool:
        return self.causal if self.block_remap is None else self.block_remap


# --- loading ---------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one, and
    aliases: a spec is short, and nested aliases expand exponentially (a few
    hundred bytes of "billion laughs" would hold the validator for minutes)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None,
                f"alias *{event.anchor}: YAML aliases are not allowed in a spec; write the value out",
                event.start_mark,
            )
        return super().compose_node(parent, index)


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep=False):
    loader.flatten_mapping(node)
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first at line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML/JSON terms, shortened."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _field_path(loc: tuple) -> str:
    parts = []
    for item in loc:
        if item == "[key]":  # pydantic's marker for a bad mapping key
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The model class whose fields live at ``loc`` (for 'allowed keys' messages)."""
    model: Any = Spec
    for item in loc:
        if model is Spec and item == "targets":
            model = dict
            continue
        if model is dict:
            model = TargetConfig
            continue
        field = model.model_fields.get(item) if isinstance(item, str) else None
        annotation = getattr(field, "annotation", None)
        # Optional[Model]: the model inside.
        inner = [a for a in typing.get_args(annotation)
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if inner:
            annotation = inner[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _problem(error: dict) -> tuple[str, str]:
    loc = tuple(error["loc"])
    kind = error["type"]
    value = error.get("input")
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        allowed = ", ".join(model.model_fields) if model else "none"
        return _field_path(loc), f"unknown key; allowed keys: {allowed}"
    if kind == "missing":
        return _field_path(loc), "required field is missing"
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        message = f"must be one of {expected}"
    elif kind == "bool_type":
        message = "must be true or false"
    elif kind in ("int_type", "int_from_float"):
        message = "must be an integer"
    elif kind in ("dict_type", "model_type"):
        message = "must be a mapping"
    elif kind == "list_type":
        message = "must be a list"
    elif kind == "string_type":
        message = "must be a string"
    elif kind in ("float_type", "float_parsing", "finite_number"):
        message = "must be a finite number"
    elif kind in ("greater_than_equal", "less_than_equal", "greater_than"):
        owner = _model_at(loc[:-1])
        ctx = owner.model_fields.get(loc[-1]) if owner and isinstance(loc[-1], str) else None
        bounds = {type(m).__name__: m for m in getattr(ctx, "metadata", [])}
        low, high, above = bounds.get("Ge"), bounds.get("Le"), bounds.get("Gt")
        if low is not None and high is not None:
            message = f"must be an integer in [{low.ge}, {high.le}]"
        elif above is not None and high is not None:
            message = f"must be a number in ({above.gt}, {high.le}]"
        else:
            message = error["msg"]
    elif kind == "too_short":
        message = "must not be empty"
    elif kind == "value_error":
        message = str(error.get("ctx", {}).get("error", error["msg"]))
    else:
        message = error["msg"]
    # A mapping as a whole is not worth echoing: the message names the bad key.
    if not isinstance(value, dict):
        message += f", got {_show(value)}"
    return _field_path(loc), message


def validate_spec(data: Any, path: str | Path = "<spec>") -> Spec:
    """Validate already-parsed spec data; raise SpecError naming every bad field."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError(path, [("", f"a spec must be a YAML mapping, got {kind}")])
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(path, [_problem(e) for e in exc.errors()]) from None


def parse_spec_text(text: str, path: str | Path = "<spec>") -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (safe subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = getattr(exc, "context", None)
        detail = f"{context}; {problem}" if context else problem
        raise SpecError(path, [("", f"invalid YAML: {where}{detail}")]) from None
    except RecursionError:
        raise SpecError(path, [("", "invalid YAML: nested too deeply")]) from None
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        raise SpecError(path, [("", "invalid YAML: a number too long to read (more than "
                                    f"{sys.get_int_max_str_digits()} digits)")]) from None


def load_spec(path: str | Path) -> Spec:
    """Read, parse and validate one YAML spec file."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError(path, [("", f"file is larger than {MAX_SPEC_BYTES} bytes")])
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError(path, [("", f"cannot read: {exc.strerror}")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(path, [("", "file is not UTF-8 text")]) from None
    return validate_spec(parse_spec_text(text, path), path)


def compact_config(data: dict) -> dict:
    """A launch config as a spec writes it: null hints, an empty bucket list and
    the default tile order left out."""
    return {k: v for k, v in data.items()
            if v is not None and v != [] and not (k == "tile_order" and v == "per_head")}


def _target_dict(cfg: TargetConfig) -> dict:
    """A target's config without the hints left to the compiler (null), the default
    tile order or an empty bucket list."""
    data = compact_config(cfg.model_dump(mode="json"))
    if "by_seq_k" in data:
        data["by_seq_k"] = [compact_config(b) for b in data["by_seq_k"]]
    return data


def spec_to_dict(spec: Spec) -> dict:
    """The validated spec, defaults filled in, as plain JSON-compatible data.

    Target configs leave out the compiler hints that are null (auto) and empty
    bucket lists; ``autotune`` is left out when empty. The dict validates back to
    an equal spec.
    """
    data = spec.model_dump(mode="json")
    data["targets"] = {name: _target_dict(cfg) for name, cfg in spec.targets.items()}
    if not data["autotune"]:
        del data["autotune"]
    return data


def json_schema() -> dict:
    return Spec.model_json_schema()

"""The parts of a spec: the checked scalar types and the small models (fast math,
loads, window, extra tensors, pages, launch configs, the tune search space)."""

from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
    field_validator,
    model_validator,
)

class Problems(ValueError):
    """Several problems of one spec found by one check, each (field path, message):
    reported one per line, like the errors of single fields."""

    def __init__(self, items: list[tuple[str, str]]):
        super().__init__("; ".join(f"{path}: {message}" for path, message in items))
        self.items = items


# The GPU targets tileiras compiles for: the --gpu-name values of `tileiras --help`
# (nvidia-cuda-tileiras 13.4.92; cuda.tile itself keeps no list). A name outside it
# would only fail later, in the compiler. tests/test_compile.py compares it with the
# installed tileiras.
KNOWN_TARGETS = ("sm_80", "sm_86", "sm_87", "sm_88", "sm_89", "sm_90", "sm_100", "sm_103",
                 "sm_107", "sm_110", "sm_120", "sm_121")
MAX_SPEC_BYTES = 1 << 20


def target_problem(value: str) -> str | None:
    """Why ``value`` is not a GPU target specgen can compile for, or None."""
    if value in KNOWN_TARGETS:
        return None
    return f"must be a GPU target tileiras compiles for: {', '.join(KNOWN_TARGETS)}"


# The most rows or keys a tile holds (tile_m's and tile_n's bound).
MAX_TILE = 256


def _power_of_two_tile(value: int) -> int:
    if value < 16 or value > MAX_TILE or value & (value - 1):
        raise ValueError(f"must be a power of two in [16, {MAX_TILE}]")
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
    problem = target_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _power_of_two(low: int, high: int):
    def check(value: Optional[int]) -> Optional[int]:
        if value is not None and (value < low or value > high or value & (value - 1)):
            raise ValueError(f"must be a power of two in [{low}, {high}] or null (auto)")
        return value

    return check


def _worker_warps(value: Optional[int]) -> Optional[int]:
    # tileiras 13.3 and 13.4 take 4 or 8 only; 13.5 takes any power of two in [1, 32]
    # (cuda.tile._ir2bytecode._resolve_num_worker_warps). The installed 13.4 refuses
    # the others at compile time, so the spec does.
    if value is not None and value not in (4, 8):
        raise ValueError("must be 4 or 8 or null (auto) (tileiras 13.4 compiles no other)")
    return value


def _opt_level(value: Optional[int]) -> Optional[int]:
    if value is not None and not 0 <= value <= 3:
        raise ValueError("must be an integer in [0, 3] or null (the compiler's 3)")
    return value


def _head_dim(value: int) -> int:
    # Multiples of 8 keep every row of a 2-byte q/k/v 16-byte aligned (TMA).
    if not 16 <= value <= 256 or value % 8:
        raise ValueError("must be a multiple of 8 in [16, 256]")
    return value


def splits_head_dims(family: str, dtype: str, head_dim_split) -> bool:
    """Whether a spec's kernels split head dims that are not a power of two into two
    tiles (head_dim_split auto or true): 16-bit prefill only; float8 and decode pad."""
    return family == "prefill" and dtype != "float8_e4m3fn" and head_dim_split is not False


def head_dim_parts(value: int) -> tuple[int, int] | None:
    """The two power-of-two tiles a head dim that is not a power of two splits into
    (80: 64 + 16, 96: 64 + 32, 192: 128 + 64, 72: 64 + 16 with 8 padding columns):
    the largest power of two below it and the rest rounded up to a power of two, at
    least 16 (an MMA's K step). None where that is no narrower than one padded tile
    (a power of two itself; 112: 64 + 64 = 128)."""
    if value & (value - 1) == 0:
        return None
    main = 1 << (value.bit_length() - 1)
    rest = max(1 << (value - main - 1).bit_length(), 16)
    return (main, rest) if main + rest < 2 * main else None


# The JSON Schema says what the validators check where it can (an editor's hint; the
# validators' own messages are what a build prints).
TileSize = Annotated[int, AfterValidator(_power_of_two_tile),
                     Field(json_schema_extra={"enum": [1 << i for i in range(4, MAX_TILE.bit_length())]})]
HeadDim = Annotated[int, AfterValidator(_head_dim),
                    Field(json_schema_extra={"minimum": 16, "maximum": 256, "multipleOf": 8})]
# (JSON Schema's minimum, maximum and enum constrain numbers only, so null still passes.)
Latency = Annotated[Optional[int], AfterValidator(_latency),
                    Field(json_schema_extra={"minimum": 1, "maximum": 10})]
Occupancy = Annotated[int, AfterValidator(_occupancy),
                      Field(json_schema_extra={"minimum": 1, "maximum": 32})]
NumCtas = Annotated[Optional[int], AfterValidator(_power_of_two(1, 16)),
                    Field(json_schema_extra={"enum": [1, 2, 4, 8, 16, None]})]
WorkerWarps = Annotated[Optional[int], AfterValidator(_worker_warps),
                        Field(json_schema_extra={"enum": [4, 8, None]})]
OptLevel = Annotated[Optional[int], AfterValidator(_opt_level),
                     Field(json_schema_extra={"minimum": 0, "maximum": 3})]


def _target_key(value: str) -> str:
    if value != "default" and value not in KNOWN_TARGETS:
        raise ValueError(f"unknown target; allowed: 'default' or {', '.join(KNOWN_TARGETS)}")
    return value


def _exact_int(value):
    # A Literal of numbers compares by ==, so it would take true for 1 and 2.0 for 2;
    # an int field refuses both (strict), and so does this.
    if type(value) is not int:
        raise ValueError("must be an integer")
    return value


def int_choice(*values: int):
    """One of ``values``, integers only: Literal[values] without bools and floats."""
    return Annotated[Literal[values], BeforeValidator(_exact_int)]


# (The schema's enum of a map's key type becomes the map's propertyNames.)
TargetName = Annotated[str, AfterValidator(_target_name),
                       Field(json_schema_extra={"enum": list(KNOWN_TARGETS)})]
TargetKey = Annotated[str, AfterValidator(_target_key),
                      Field(json_schema_extra={"enum": ["default", *KNOWN_TARGETS]})]


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
        True, description="rounding_mode=APPROX on the final normalisation (prefill; the "
        "decode kernels divide exactly, one division per row, whatever it says)."
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
        "needs loop_split and power-of-two head dims.",
    )
    allow_tma: Optional[bool] = Field(
        None,
        description="allow_tma of the K and V loads: false forbids TMA, null leaves "
        "the choice to the compiler.",
    )


class Window(_Strict):
    """A sliding window around each query's absolute position p = q_offset + i."""

    # The kernels add a window to an int32 position (|p| < 2**30) and a tile: a
    # window up to 2**29 keeps that sum inside int32; a wider one is null.
    left: Optional[int] = Field(
        None, ge=0, le=2**29,
        description="Keys j >= p - left are visible; null: unbounded to the left. "
        "At most 2**29 (536870912); a wider window is null.",
    )
    right: Optional[int] = Field(
        None, ge=0, le=2**29,
        description="Keys j <= p + right are visible; null: unbounded to the right. "
        "A causal kernel takes null or 0. At most 2**29 (536870912); a wider window is null.",
    )

    @field_validator("left", "right", mode="before")
    @classmethod
    def _int32_room(cls, value):
        if type(value) is int and value > 2**29:
            raise ValueError("must be at most 2**29 (536870912); for a window without this bound use null")
        return value

    @model_validator(mode="after")
    def _bounded(self):
        if self.left is None and self.right is None:
            raise ValueError("set left or right (or both); without either, drop window")
        return self


DIM_NAMES = ("batch", "heads", "kv_heads", "seq_q", "seq_k")
TENSOR_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,30}$")
# Every argument a generated module's entry points can take, in any family and with
# any feature: a hook tensor becomes one more argument of the same functions, so
# these names would be duplicate arguments. From the signatures of attention,
# _forward, _backward, the custom ops (_op_*) and make_block_map in templates/;
# tests/test_bad_input.py checks them against every module in generated/.
LAUNCHER_ARGUMENTS = frozenset({
    "q", "k", "v", "out", "scale", "q_offset", "sinks", "block_map",  # every prefill call
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "q_shift",  # varlen
    "q_descale", "k_descale", "v_descale",  # float8
    "q_descale_t", "k_descale_t", "v_descale_t",  # float8, as the custom ops take them
    "cached",  # decode and float8: whether a call keeps its buffers
    "dropout_p", "seed",  # dropout
    "v_transposed",  # a V that transposed_v made
    "k_cache", "v_cache", "seq_lens", "page_table", "max_seq_len",  # decode
    "lse", "dout", "exact_delta", "float32_sums",  # backward
    "map_counts", "map_indices", "map_sizes", "dq_counts", "dq_indices", "kv_counts", "kv_indices", "counts",
    "indices",
    "batch", "num_heads", "seq_q", "seq_k", "device", "backward", "max_len", "q_len",  # maps
})
# The names a kernel of a generated module gives its parameters, its array slices
# and the module-level constants and classes it reads, in any family and with any
# feature, where they have no underscore (so kernel_param can make them: d_out ->
# DOut, p_d_l -> PDL). A hook tensor's kernel parameter and a learnable one's
# gradient ("D" + that) may not be one of these, nor each other's.
# tests/test_bad_input.py checks the set against the kernels of every module in
# generated/, bench/variants/ and bench/train/.
KERNEL_NAMES = frozenset({
    "Q", "K", "V", "Out", "Lse", "QS", "VT", "Descales", "KDescale", "VDescale",
    "Sinks", "CuSeqlensQ", "CuSeqlensK", "SeqLens", "PageTable", "OPart", "LsePart",
    "DOut", "DLse", "Delta", "DQ", "DK", "DV", "DSinkParts", "DSinks",
    "MapCounts", "MapIdx", "MapState",
    "Qs", "Ks", "Vs", "Outs", "Lses", "QSs", "DOuts", "DLses", "Deltas", "DQs", "DKs", "DVs",
    "AotKernel", "ConstInt", "ConstBool", "BlockMap", "PDL", "CHUNK", "LN2", "SOFTCAP",
})


# The kernels name a hook tensor's gathered operands <tensor>_<n>; their own locals
# of that form are the score_mod derivatives (dmod_<n>), a learnable tensor's
# gradient sums (dsum_<n>) and the block map's span bounds (span_<operand>). A
# tensor named so would give two locals one name (tests/test_bad_input.py checks
# these against the kernels of generated/).
KERNEL_LOCAL_NAMES = frozenset({"dmod", "dsum"})
KERNEL_LOCAL_PREFIXES = ("span_",)


def kernel_param(name: str) -> str:
    """A hook tensor's kernel parameter: doc_ids -> DocIds."""
    return name.title().replace("_", "")


# Names a tensor may not take: the launcher's arguments, its locals, the hook
# variables and functions, and module-level names of a generated module.
RESERVED_NAMES = LAUNCHER_ARGUMENTS | frozenset({
    "score", "b", "h", "q_idx", "kv_idx", "num_kv_heads", "name", "t", "want",
    "config", "kernel", "tile_m", "tile_n", "num_tiles", "tiles_outer", "grid", "what", "args",
    "ct", "torch", "math", "where", "abs", "exp", "log", "sqrt", "tanh", "min", "max",
    "expected", "dims", "tensors", "got", "dtype", "v_rows", "read_vt", "copy_v", "v_arg",
    # The launchers' locals, which would replace a tensor of that name partway (a
    # learnable tensor named dq failed in the backward; one named sums was replaced by
    # the batch slices' list of gradients). tests/test_bad_input.py checks the set
    # against the launchers of every module in generated/ and of the bench specs.
    "per_slice", "e", "part", "parts", "grad", "sums", "total",
    "built", "capacity", "chunk", "ctas", "cu", "delta", "descales", "dim", "dk", "dlse_weight",
    "dq", "dq_global", "dq_map", "dq_tiles", "dropout_threshold", "dsink_parts", "dsinks", "dv",
    "fits", "grads", "inner", "key", "kv_global", "kv_map", "lock", "lse_part", "lse_shape",
    "map_args", "map_heads", "maps", "n_tiles", "now", "o_part", "out_given", "out_shape", "outer",
    "padded", "pdl", "pre", "q_s", "repeats", "result", "rows", "s", "seq_slices", "shape",
    "sinks_f32", "slices", "split_tile", "splits", "state", "stream", "tile_p", "tiles", "total_q",
    "value", "width", "workspace",
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
    learnable: bool = Field(
        False,
        description="backward: true only: the tensor gets a gradient (a learnable ALiBi "
        "slope, a relative-position bias table). The backward kernels accumulate "
        "dL/dtensor with relaxed float32 atomic adds (per-head and per-row subscripts in "
        "the dQ kernel, key-varying ones in the dK/dV kernel), through the derivative of "
        "score_mod in each of the tensor's subscripts. float32 tensors read by score_mod "
        "only.",
    )


class Paged(_Strict):
    """A paged KV cache: pages [num_pages, page_size, Hkv, D] and a page table."""

    page_size: int = Field(
        description="Tokens per page: a power of two in [16, 1024], at least the tile_n "
        "of every target (a key tile never spans two pages).",
        json_schema_extra={"enum": [1 << i for i in range(4, 11)]},
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
        "4 or 8 (tileiras 13.4 compiles no other); null: auto.",
    )
    opt_level: OptLevel = Field(None, description="tileiras optimisation level 0..3; null: 3.")
    tile_order: TileOrder = Field(
        "per_head",
        description="Launch order of the query tiles. per_head: one (batch, head)'s "
        "tiles after another, which keeps its K/V in L2; global: tile t of every head "
        "before any head's next tile, so with block remap the heaviest tiles of all "
        "heads run first (wins on short causal sequences). Decode specs take "
        "per_head only.",
    )
    v_transposed: Optional[bool] = Field(
        None,
        description="Prefill: the launcher hands the kernel V as [B, Hkv, D, Skv] (a "
        "copy per call by the module's transpose kernel, counted in its time, unless a "
        "forward-only module's caller passes one made once: attention(q, k, "
        "transposed_v(v), v_transposed=True)), so the "
        "P @ V MMA reads its "
        "B operand K-major, the layout Hopper's float8 MMA needs (with V as given, "
        "the kernel transposes every V tile through shared memory byte by byte). "
        "null: true for float8 prefill, false otherwise. Not for varlen or decode.",
    )
    persistent: Optional[bool] = Field(
        None,
        description="Prefill: launch one wave of CTAs (SMs x occupancy) that loop over "
        "the (query tile, batch, head) work items in the tile order, heaviest causal "
        "tiles first, instead of one CTA per item. null: false. Not for varlen or decode.",
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
    "v_transposed", "persistent",
)


def _distinct(value: list) -> list:
    if len(set(value)) != len(value):
        raise ValueError("lists a value twice")
    return value


def _choices(item):
    return Annotated[list[item], AfterValidator(_distinct),
                     Field(json_schema_extra={"uniqueItems": True})]


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
    v_transposed: _choices(Optional[bool]) = Field(
        default_factory=lambda: [None], min_length=1
    )
    persistent: _choices(Optional[bool]) = Field(
        default_factory=lambda: [None], min_length=1
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



"""The spec: the strict Pydantic model a kernel engineer writes in YAML.

Each constraint is stated once, here, with the message a user sees. Errors are
reported as ``<file>: <field.path>: <what is allowed>, got <value>``; loading and
error formatting live in :mod:`specgen.spec.load`.
"""

from __future__ import annotations

import ast
import keyword
import sys
from contextvars import ContextVar
from typing import Annotated, Literal, Optional, Union

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from specgen.errors import shortened
from specgen.spec.defaults import measured_targets
from specgen.spec.fields import (
    DEFAULT_TARGET,
    MAX_TILE,
    KERNEL_NAMES,
    KNOWN_TARGETS,
    KERNEL_LOCAL_NAMES,
    KERNEL_LOCAL_PREFIXES,
    RESERVED_NAMES,
    TENSOR_NAME_RE,
    AutotuneSpace,
    ExtraTensor,
    FastMath,
    HeadDim,
    Problems,
    Loads,
    Paged,
    TargetConfig,
    TargetKey,
    TargetName,
    Window,
    _Strict,
    decode_rows,
    head_dim_parts,
    int_choice,
    kernel_param,
    splits_head_dims,
)

# Packages a generated module imports or sits beside: a spec named after one would
# shadow it.
SHADOWED_PACKAGES = ("torch", "cuda", "triton", "numpy", "specgen", "generated",
                     # what torch and cuda.tile import with them, and the site hooks
                     "torchgen", "typing_extensions", "cutile_cache", "tqdm", "sympy", "mpmath",
                     "networkx", "filelock", "fsspec", "jinja2", "markupsafe", "setuptools",
                     "pkg_resources", "packaging", "sitecustomize", "usercustomize",
                     # what specgen and its tests load
                     "pydantic", "pydantic_core", "yaml", "black", "pytest", "hypothesis",
                     "transformers", "pip", "wheel")
# The float32 values of a prefill tile's S and accumulator per thread, tile_m x (tile_n
# + padded D) / threads, that cuTile 1.7 compiles for sm_90: 512 to 768 compiled (128 or
# 256 rows, D64 to D256, 4 warps), 1024 failed with no message (256 x 256 at D256,
# 4 warps; "Return code 5"), where 8 warps (512) compile.
MAX_TILE_VALUES_PER_THREAD = 768
# Standard-library modules and soft keywords of the Python versions specgen runs on
# (3.10 and later) that this interpreter may not list, so that a name refused on one
# version is refused on every one.
OTHER_STDLIB = frozenset({
    "tomllib", "annotationlib", "compression", "distutils", "imp", "asynchat", "asyncore",
    "smtpd", "aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap",
    "msilib", "nis", "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd", "sunau",
    "telnetlib", "uu", "xdrlib", "lib2to3", "binhex",
})
SOFT_KEYWORDS = frozenset({"_", "case", "match", "type"})
# False while a spec written without targets is validated with the configs filled in
# for it: a check that a filled config fails then names the user's fields instead.
_TARGETS_WRITTEN: ContextVar[bool] = ContextVar("targets_written", default=True)


def _indexes(expression: str, tensor: str) -> bool:
    """The hook expression subscripts the tensor (tensor[...]): read from its syntax
    tree, so a comment or a string that names it does not count."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return False  # the hook's own check reports it
    return any(isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
               and node.value.id == tensor for node in ast.walk(tree))


# Top-level fields that belong to one family: a spec of the other family that sets
# one (even at its default) is refused. The spec reference's family column
# is made from this table.
FAMILY_ONLY = {
    **dict.fromkeys(("max_q_len", "paged", "splits", "pdl", "kv_dtype", "v_cache_transposed"),
                    "decode"),
    **dict.fromkeys(("v_head_dim", "out_dtype", "softcap", "score_mod", "skip_masked_tiles",
                     "dropout", "varlen", "return_lse", "block_remap", "loop_split",
                     "prescale_q", "q_subtiles", "qk_ahead", "pack_gqa", "head_dim_split", "backward",
                     "deterministic", "context_parallel", "causal"), "prefill"),
}


def other_family_fields(family: str) -> list[str]:
    """The fields FAMILY_ONLY gives the family other than ``family``: a spec of
    ``family`` refuses them, even at their defaults."""
    other = "prefill" if family == "decode" else "decode"
    return [name for name, owner in FAMILY_ONLY.items() if owner == other]


# The largest soft-cap a float16 prescale_q takes: Q * scale / softcap stays within
# float16's normal range (above 6.1e-5) to about 1e-3 of its values' size at the
# default scale (float16 softcap 1e5, D64: output error 2e-2, LSE 2.4e-2).
FP16_PRESCALE_CAP = 1000.0


def target_buckets(targets: dict) -> list[tuple[str, object]]:
    """(where, config) of every launch config of ``targets``: each target's own and
    its by_seq_k buckets, ``where`` the field path an error names."""
    return [(where, bucket) for name, cfg in targets.items()
            for where, bucket in [(f"targets.{name}", cfg)] + [
                (f"targets.{name}.by_seq_k[{i}]", b) for i, b in enumerate(cfg.by_seq_k)]]


def _target_order(value: dict) -> dict:
    """A per-target mapping in one order whatever the file's: default first, then
    the targets by architecture, so a module does not change with the keys' order."""
    rank = {name: i for i, name in enumerate(("default",) + KNOWN_TARGETS)}
    return dict(sorted(value.items(), key=lambda item: rank.get(item[0], len(rank))))

class Spec(_Strict):
    """An attention kernel: what it computes and how it is built, per GPU target."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        title="specgen attention spec",
    )

    name: str = Field(
        json_schema_extra={"pattern": "^[A-Za-z][A-Za-z0-9_]*$", "maxLength": 100},
        description="Python identifier (not a keyword, not starting with '_', nor the "
        "name of a standard-library module or of a package the module or specgen imports: "
        "torch, cuda, triton, numpy, specgen, generated, ...); the module is "
        "generated/<name>.py.",
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
        "that is not a power of two (Phi: 80) runs in the prefill kernels as two tiles "
        "in D where they are narrower than one padded tile (80 = 64 + 16; see "
        "head_dim_split), else zero-padded to the next power of two. Decode takes "
        "powers of two.",
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
        description="Query row i (absolute position q_offset+i) sees keys j <= q_offset+i. "
        "Decode is always causal among its new tokens and takes no causal field.",
    )
    window: Optional[Window] = Field(
        None,
        description="Sliding window: key tiles wholly outside it are skipped, the "
        "edge tiles masked (Mistral: causal with left 4095). null: no window.",
    )
    softcap: Optional[float] = Field(
        None, ge=0.01, le=1e6,
        description="Logit soft-cap c: score = c * tanh(score / c) (Gemma 2: 50). "
        "At least 0.01: the kernels scale scores by 1 / c, and with prescale_q Q by "
        "scale / c in the input dtype, which a smaller c would overflow. null: none.",
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
        "'doc[b, q_idx] == doc[b, kv_idx]'); ANDed with causal and window (decode: "
        "q_idx is the new token's cache position). null: none.",
    )
    skip_masked_tiles: bool = Field(
        False,
        description="With a mask_mod: test each key tile's mask first and branch around "
        "the tiles it hides from every row. Measured no faster on an H200 for document "
        "masks: the loads are pipelined ahead of the branch.",
    )
    block_sparse: bool = Field(
        False,
        description="With a mask_mod: the kernels visit only the key tiles that hold a "
        "visible pair, from a block map built on the GPU once per batch (decode: once "
        "per step) by make_block_map in the generated module, reusable across layers; "
        "full tiles run without evaluating the mask. Wins where the mask hides most "
        "tiles (documents, chunked-local attention, block patterns).",
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
        "natural log of each row's softmax normaliser (for a row that sees no key: -inf, or "
        "the head's sink logit with sinks).",
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
    q_subtiles: int_choice(1, 2) = Field(
        1,
        description="2 splits each CTA's tile_m query rows into two halves with their "
        "own softmax state that share every K and V tile, so one half's softmax can "
        "overlap the other's MMA (FA3's ping-pong, in tiles).",
    )
    qk_ahead: bool = Field(
        False,
        description="Form the next key tile's S = Q K^T before this tile's softmax, so the "
        "tensor cores may compute it while the exponentials run (measured slower on an H100 "
        "for every shipped prefill case; off by default).",
    )
    head_dim_split: Union[Literal["auto"], bool] = Field(
        "auto",
        description="A head_dim (or v_head_dim) that is not a power of two runs as two tiles "
        "in D, a power of two and the rest (80 = 64 + 16, 96 = 64 + 32, 192 = 128 + 64), "
        "with one MMA chain each, instead of one tile zero-padded to the next power of two "
        "(80 in 128 columns does 1.6x the MMA work). auto: on for 16-bit prefill wherever "
        "the two tiles are narrower than the padded one; false pads.",
    )
    pack_gqa: bool = Field(
        False,
        description="Stack the gqa_ratio query heads that share a KV head along each CTA's "
        "tile: a tile holds tile_m / gqa_ratio positions of every head of the group, so each "
        "K/V tile is read once per group and a query tile spans fewer positions (fewer keys "
        "wasted at mask borders). Pays where rows are short: packed documents. Needs a gqa_ratio "
        "that is a power of two >= 2 and tile_m >= gqa_ratio. With block_sparse "
        "and backward, the backward kernels pack the same way.",
    )
    splits: Union[Literal["auto"], Annotated[int, Field(ge=1, le=64)]] = Field(
        "auto",
        description="decode: KV splits per (batch, KV head); auto picks them from the SM "
        "count, batch, KV heads and length.",
    )
    pdl: Union[Literal["auto"], bool] = Field(
        "auto",
        description="decode: programmatic dependent launch (each kernel may start while "
        "the one before it finishes, and waits for it before reading): auto uses it on "
        "sm_90 (Hopper, where it was measured: an H200 gained at every shape of the "
        "decode suite), true on every sm_90+ device, false never.",
    )
    v_cache_transposed: bool = Field(
        False,
        description="decode: the V cache is stored transposed, keys last: [B, Hkv, D, "
        "max_len] (max_len a multiple of 16), or pages [num_pages, Hkv, D, page_size]. "
        "P @ V then reads pairs of adjacent keys, which a float8 cache needs to leave "
        "shared memory in words rather than bytes (1.1x faster decode on an H200). The "
        "generated transposed_v_cache() converts a cache in the usual layout.",
    )
    backward: bool = Field(
        False,
        description="Also generate the backward kernels (D = rowsum(dO * O), dK/dV with "
        "GQA reduction, dQ); attention becomes differentiable (a torch.library custom op "
        "under torch.compile, a torch.autograd.Function when eager). Covers causal or not, windows, soft-cap, score_mod/mask_mod hooks "
        "(learnable tensors too), sinks, dropout, any gqa_ratio and head_dim, and "
        "v_head_dim.",
    )
    deterministic: bool = Field(
        False,
        description="backward: bitwise-reproducible gradients. The dK/dV and dQ kernels "
        "own their output tiles and sum in a fixed order (GQA heads inside the dK/dV "
        "kernel), so they are deterministic as generated; true also refuses what "
        "would not be: learnable tensors, whose gradients are accumulated with atomics.",
    )
    context_parallel: Optional[Literal["ring", "ulysses"]] = Field(
        None,
        description="The mode specgen.parallel's ContextParallelAttention uses for this "
        "module when the call names none: 'ring' (K/V shards passed around the ranks, "
        "overlapped with the kernels; needs return_lse or backward) or 'ulysses' "
        "(all-to-all over heads; the heads must divide by the world size). null: ring. "
        "See [context parallelism](context-parallel.md).",
    )
    compile_for: list[TargetName] = Field(
        default_factory=lambda: ["sm_90", "sm_100"],
        min_length=1,
        json_schema_extra={"uniqueItems": True},
        description="Targets `specgen build` AOT-compiles to prove the kernel builds.",
    )
    autotune: dict[TargetName, AutotuneSpace] = Field(
        default_factory=dict,
        description="Search space of `specgen tune` per target; the winners are "
        "written back into targets. Prefill only.",
    )

    @field_validator("autotune", mode="after")
    @classmethod
    def _autotune_order(cls, value: dict) -> dict:
        return _target_order(value)

    @field_validator("splits", "pdl", "head_dim_split", mode="wrap")
    @classmethod
    def _auto_union_message(cls, value, handler, info):
        # A union ('auto' or a number or a bool): one line instead of one per member.
        try:
            return handler(value)
        except ValidationError:
            allowed = {"splits": "'auto' or an integer in [1, 64]", "pdl": "'auto', true or false",
                       "head_dim_split": "'auto', true or false"}
            raise ValueError(f"must be {allowed[info.field_name]}") from None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if (
            not value.isascii()
            or not value.isidentifier()
            or keyword.iskeyword(value)
            or keyword.issoftkeyword(value)
            or value in SOFT_KEYWORDS
            or value.startswith("_")
            or len(value) > 100
        ):
            raise ValueError(
                "must be a Python identifier that is not a keyword and does not "
                "start with '_' (letters, digits, '_'; at most 100 characters)"
            )
        if value in sys.stdlib_module_names or value in OTHER_STDLIB or value in SHADOWED_PACKAGES:
            # generated/<name>.py, copied beside a user's code, would be imported in
            # place of that module (by the generated code itself: torch, math, os).
            raise ValueError(
                "must not be the name of a Python standard-library module nor of "
                f"{', '.join(SHADOWED_PACKAGES)} (generated/<name>.py would shadow it)"
            )
        return value

    @field_validator("max_q_len")
    @classmethod
    def _decode_rows_fit(cls, value: int, info) -> int:
        ratio = info.data.get("gqa_ratio")
        if info.data.get("family") == "decode" and ratio and decode_rows(ratio, value) > MAX_TILE:
            raise ValueError(
                f"a decode tile packs gqa_ratio x max_q_len query rows, at most {MAX_TILE}; "
                f"gqa_ratio {ratio} allows max_q_len <= {max(1, MAX_TILE // ratio)}")
        return value

    @field_validator("targets", mode="after")
    @classmethod
    def _fill_default_target(cls, value: dict, info) -> dict:
        if "default" not in value:
            default = DEFAULT_TARGET
            if info.data.get("family") == "decode":  # the packed query tile's rows
                if "gqa_ratio" not in info.data or "max_q_len" not in info.data:
                    return value  # reported on those fields; nothing to fill from
                rows = decode_rows(info.data["gqa_ratio"], info.data["max_q_len"])
                paged = info.data.get("paged")
                tile_n = min(64, paged.page_size) if paged else 64
                default = TargetConfig(tile_m=rows, tile_n=tile_n, occupancy=2)
            value = {"default": default, **value}
        return _target_order(value)

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
        # One order whatever the file's (the spec's hash sorts keys): the kernels' and
        # the custom op's parameters follow it, so two files that differ only in the
        # order of their tensors give one module, not two with one op name.
        value = dict(sorted(value.items()))
        for name in value:
            # fullmatch: the pattern's $ also matches before a final line break ("slope\n").
            if not TENSOR_NAME_RE.fullmatch(name) or keyword.iskeyword(name):
                raise ValueError(
                    f"tensor name {shortened(name)!r} must be a lowercase identifier (a-z, 0-9, _; "
                    "starting with a letter; at most 31 characters) that is not a Python keyword"
                )
            if name in RESERVED_NAMES:
                # Named in full: a short name such as 't' or 'grid' fits the pattern, and
                # a message that showed only the pattern left no clue why it was refused.
                taken = ", ".join(sorted(n for n in RESERVED_NAMES if TENSOR_NAME_RE.fullmatch(n)))
                raise ValueError(
                    f"tensor name {name!r} must be none of the names the generated module "
                    f"already uses (its launchers' arguments and locals, the hook names and "
                    f"functions): {taken}"
                )
        for name in value:
            if name in KERNEL_LOCAL_NAMES or name.startswith(KERNEL_LOCAL_PREFIXES):
                raise ValueError(
                    f"tensor name {name!r} would clash with the kernels' own locals (dmod_N, dsum_N, "
                    "span_*); rename the tensor"
                )
        for name, tensor in value.items():
            if not (isinstance(tensor, ExtraTensor) and tensor.learnable):
                continue
            if "d" + name in value:
                raise ValueError(
                    f"tensor name {'d' + name!r} is the name of the learnable tensor {name}'s "
                    "gradient in the backward; rename it"
                )
            # The gradient's local "d" + name must not be one of the launchers' own
            # names either: a learnable q_tiles replaced (or was replaced by) dq_tiles,
            # elta the backward's delta.
            if "d" + name in RESERVED_NAMES:
                raise ValueError(
                    f"learnable tensor name {name!r}: its gradient in the backward is the "
                    f"local {'d' + name!r}, a name the generated module already uses; rename it"
                )
        taken = {}
        for name, tensor in value.items():
            params = [kernel_param(name)]
            if isinstance(tensor, ExtraTensor) and tensor.learnable:
                params.append("D" + params[0])  # its gradient's parameter
            for param in params:
                if param in KERNEL_NAMES:
                    raise ValueError(
                        f"tensor name {name!r} becomes the kernel parameter {param}, a name the "
                        "kernels already use; rename the tensor"
                    )
                if param in taken:
                    raise ValueError(
                        f"tensor names {taken[param]!r} and {name!r} both become the kernel "
                        f"parameter {param}; rename one"
                    )
                taken[param] = name
        return value

    @field_validator("score_mod", "mask_mod")
    @classmethod
    def _hook(cls, value: Optional[str], info) -> Optional[str]:
        if value is None or "tensors" not in info.data:
            return value  # without valid tensors, only their own error is reported
        from specgen.spec.hooks import ExprError, compile_hook

        tensors = {n: (t.dtype, len(t.shape)) for n, t in (info.data.get("tensors") or {}).items()}
        try:
            compile_hook(value, info.field_name, tensors)
        except ExprError as exc:
            raise ValueError(str(exc)) from None
        # Kept in one spelling (spaces, parentheses, a comment or a YAML block's
        # newline do not matter): the module, its spec hash and its op name follow
        # what the hook computes, not how it was typed.
        return ast.unparse(ast.parse(value.strip(), mode="eval"))

    @model_validator(mode="after")
    def _cross_field(self):
        """The checks that relate fields of the whole spec, all reported together."""
        problems = (self._family_problems() + self._tensor_problems() + self._learnable_problems()
                    + self._block_sparse_problems() + self._context_parallel_problems()
                    + self._qk_ahead_problems() + self._pack_gqa_problems()
                    + self._head_dim_split_problems() + self._tile_size_problems())
        if problems:
            raise Problems(problems)
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _measured_targets(cls, data, handler):
        # A spec without targets: validate it as written, then once more with the
        # measured configs of its class (specgen/spec/default_configs.json), so the
        # filled targets pass every check a written one does. Declared after
        # _cross_field, so that it wraps it: the cross-field checks run while
        # _TARGETS_WRITTEN says the targets were filled in.
        if not isinstance(data, dict) or data.get("targets"):
            return handler(data)
        token = _TARGETS_WRITTEN.set(False)
        try:
            spec = handler(data)
            rows = decode_rows(spec.gqa_ratio, spec.max_q_len) if spec.family == "decode" else None
            page = spec.paged.page_size if spec.paged else None
            targets = measured_targets(spec.model_dump(mode="json"), rows, page)
            return handler({**data, "targets": targets})
        finally:
            _TARGETS_WRITTEN.reset(token)

    def _family_problems(self) -> list[tuple[str, str]]:
        """Each family takes only its own fields (a field another family owns is an error)."""

        def changed(name: str) -> bool:  # set to something other than its default
            default = type(self).model_fields[name].get_default(call_default_factory=True)
            return getattr(self, name) != default

        other = "prefill" if self.family == "decode" else "decode"
        owned = other_family_fields(self.family)
        # Written at all, even at its default (a prefill spec's `pdl: auto` would read
        # as a request that family prefill ignores).
        problems = [(n, f"a {other} field, not supported by family {self.family}")
                    for n in owned if (changed(n) or n in self.model_fields_set) and n != "causal"]
        if self.family == "decode":
            if "causal" in self.model_fields_set:
                # Left to its default (false), the field used to be read as given.
                problems.append(("causal", "a prefill field, not supported by family decode, "
                                           "which is always causal (each new token sees the "
                                           "cache and the new tokens before it); remove the "
                                           f"field, got {str(self.causal).lower()}"))
            if self.loads.check_bounds != "all":
                problems.append(("loads.check_bounds", "family decode checks every load's bounds "
                                                       "(its tiles stop at each sequence's length); "
                                                       f"use 'all', got {self.loads.check_bounds!r}"))
            if self.dtype == "float8_e4m3fn":
                problems.append(("dtype", "float8_e4m3fn is not supported by family decode "
                                          "(a float8 cache is kv_dtype: float8_e4m3fn)"))
            if self.window is not None and self.window.right not in (None, 0):
                problems.append(("window.right", f"family decode takes null or 0, got {self.window.right}"))
            # The decode grid is (splits, batch x KV heads): no query tiles whose order
            # tile_order could change, so "global" would be accepted and do nothing.
            problems += [(f"{where}.tile_order", "family decode has no query tiles to launch in "
                                                 'another order; use per_head, got "global"')
                         for where, bucket in self._target_buckets() if bucket.tile_order == "global"]
            # specgen tune searches prefill specs: a decode search space would never run.
            if self.autotune:
                problems.append(("autotune", "family decode takes no search space (specgen tune "
                                             "searches prefill specs; set tile_n and occupancy under "
                                             f"targets and time them with specgen bench), got "
                                             f"{', '.join(self.autotune)}"))
            # A decode query sits at a cache position: tables along positions are seq_k long.
            problems += [(f"tensors.{name}.shape[{i}]", "family decode has no seq_q (its queries "
                                                         "sit at cache positions): use seq_k, the "
                                                         "cache's length")
                         for name, t in self.tensors.items() for i, d in enumerate(t.shape)
                         if d == "seq_q"]
        if self.family == "decode" or self.varlen:
            what = "family decode" if self.family == "decode" else "varlen"
            for where, bucket in self._target_buckets():
                if bucket.v_transposed:
                    problems.append((f"{where}.v_transposed",
                                     f"{what} reads V as given; use null or false, got true"))
                if bucket.persistent:
                    problems.append((f"{where}.persistent",
                                     f"{what} launches one CTA per work item; use null or "
                                     "false, got true"))
        if self.family != "decode":
            return problems
        if self.head_dim & (self.head_dim - 1):
            # The decode kernels' tiles are head_dim wide (cuTile's tiles are powers of two).
            problems.append(("head_dim", f"family decode needs a power of two (16, 32, 64, 128 or 256; "
                                         f"the prefill pads other sizes), got {self.head_dim}"))
        rows = decode_rows(self.gqa_ratio, self.max_q_len)
        for name, cfg in self.targets.items():
            if cfg.tile_m != rows:
                problems.append((f"targets.{name}.tile_m",
                                 f"a decode tile packs gqa_ratio x max_q_len = {self.gqa_ratio * self.max_q_len} "
                                 f"query rows, padded to {rows}; set tile_m: {rows} (or leave targets out), "
                                 f"got {cfg.tile_m}"))
            if self.paged and cfg.tile_n > self.paged.page_size:
                problems.append((f"targets.{name}.tile_n",
                                 f"must be at most paged.page_size {self.paged.page_size} (a key tile "
                                 f"must lie in one page), got {cfg.tile_n}"))
            if cfg.by_seq_k:
                problems.append((f"targets.{name}.by_seq_k", "decode specs take one config per target"))
        return problems

    def _tile_size_problems(self) -> list[tuple[str, str]]:
        """A prefill tile whose float32 S and accumulator need more values per thread
        than cuTile's compiler can place (it fails with no message) is refused here."""
        if self.family != "prefill":
            return []
        width = 1 << (max(self.head_dim, self.dv) - 1).bit_length()  # the padded D
        problems = []
        for where, bucket in self._target_buckets():
            warps = bucket.num_worker_warps or 4
            counted = f"{warps} warps" if bucket.num_worker_warps else "4 warps, as null counts"
            values = bucket.tile_m * (bucket.tile_n + width) // (32 * warps)
            if values > MAX_TILE_VALUES_PER_THREAD:
                problems.append((f"{where}.tile_m", (
                    f"tile_m x (tile_n + head dim {width}) / (32 x {counted}) must be at most "
                    f"{MAX_TILE_VALUES_PER_THREAD} float32 values per thread, which the compiler "
                    f"can place; use num_worker_warps: 8 or smaller tiles, got {bucket.tile_m} x "
                    f"({bucket.tile_n} + {width}) / {32 * warps} = {values}")))
        return problems

    def _target_buckets(self) -> list[tuple[str, object]]:
        return target_buckets(self.targets)

    def _tensor_problems(self) -> list[tuple[str, str]]:
        hooks = [h for h in (self.score_mod, self.mask_mod) if h]
        return [(f"tensors.{name}", "declared but used by neither score_mod nor mask_mod")
                for name in self.tensors if not any(_indexes(h, name) for h in hooks)]

    def _block_sparse_problems(self) -> list[tuple[str, str]]:
        if not self.block_sparse:
            return []
        problems = []
        if self.mask_mod is None:
            problems.append(("block_sparse", "true needs a mask_mod (the block map is built "
                                             "from it)"))
        if self.skip_masked_tiles:
            problems.append(("skip_masked_tiles", "true cannot be combined with block_sparse: "
                                                  "true (the map already skips the hidden tiles)"))
        for where, bucket in self._target_buckets():
            if bucket.persistent:
                problems.append((f"{where}.persistent",
                                 "block_sparse launches one CTA per query tile; use null "
                                 "or false, got true"))
        return problems

    def _qk_ahead_problems(self) -> list[tuple[str, str]]:
        """qk_ahead carries S from one step of the key loop to the next: the loops must
        visit consecutive tiles with one query tile."""
        if not self.qk_ahead:
            return []
        used = [name for name, on in (("q_subtiles 2", self.q_subtiles > 1),
                                      ("skip_masked_tiles", self.skip_masked_tiles),
                                      ("block_sparse", self.block_sparse)) if on]
        if used:
            return [("qk_ahead", f"true cannot be combined with {', '.join(used)} (their key loops "
                                 "skip tiles or split the query tile); use false")]
        return []

    def _head_dim_split_problems(self) -> list[tuple[str, str]]:
        """true must have something to split, in a dtype whose MMA takes a 16-wide K."""
        if self.head_dim_split is not True or self.family != "prefill":
            return []
        if self.dtype == "float8_e4m3fn":
            return [("head_dim_split", "true needs a 16-bit dtype (float8 pads its head dims); "
                                       "use auto or false")]
        if not any(head_dim_parts(d) for d in (self.head_dim, self.dv)):
            return [("head_dim_split", f"true needs a head_dim or v_head_dim that splits into two "
                                       f"power-of-two tiles narrower than one padded tile (such as "
                                       f"80, 96, 160 or 192), got {self.head_dim}/{self.dv}; "
                                       "use auto or false")]
        return []

    @property
    def d_parts(self) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """The (main, rest) tiles of head_dim and of v_head_dim where the kernels split
        them (head_dim_split), else None."""
        if not splits_head_dims(self.family, self.dtype, self.head_dim_split):
            return None, None
        return head_dim_parts(self.head_dim), head_dim_parts(self.dv)

    def _pack_gqa_problems(self) -> list[tuple[str, str]]:
        """A packed tile holds several query heads' rows: every row must need the same
        K/V head and nothing per head that the kernel keeps once per CTA."""
        if not self.pack_gqa or self.family != "prefill":
            return []
        from specgen.spec.hooks import ExprError, compile_hook

        ratio = self.gqa_ratio
        if ratio < 2 or ratio & (ratio - 1):
            return [("pack_gqa", f"true needs gqa_ratio a power of two >= 2 (tile rows are powers "
                                 f"of two), got gqa_ratio {ratio}")]
        tensors = {n: (t.dtype, len(t.shape)) for n, t in self.tensors.items()}
        reads_h = []
        for kind in ("score_mod", "mask_mod"):
            expr = getattr(self, kind)
            try:
                if expr is not None and "h" in compile_hook(expr, kind, tensors).uses:
                    reads_h.append(f"a {kind} that reads h")
            except ExprError:
                pass  # reported by the field's own validator
        used = reads_h + [name for name, on in (
            ("varlen", self.varlen), ("sinks", self.sinks), ("dropout", self.dropout),
            ("q_subtiles 2", self.q_subtiles > 1), ("qk_ahead", self.qk_ahead),
            ("context_parallel", self.context_parallel is not None)) if on]
        problems = []
        if used:
            problems.append(("pack_gqa", f"true cannot be combined with {', '.join(used)} (a packed "
                                         "tile mixes query heads); use false"))
        filled = {name for name, cfg in self.targets.items()
                  if not _TARGETS_WRITTEN.get() or (name == "default" and cfg is DEFAULT_TARGET)}
        small = [self.targets[name].tile_m for name in filled if self.targets[name].tile_m < ratio]
        if small:
            # Configs the user did not write: name the fields they did.
            problems.append(("pack_gqa", f"true with gqa_ratio {ratio} needs tile_m >= {ratio}, "
                                         f"and the default launch configs have tile_m {min(small)}; "
                                         f"write targets (with default) with tile_m >= {ratio}"))
        for where, bucket in self._target_buckets():
            if bucket.tile_m < ratio and where.split(".")[1] not in filled:
                problems.append((f"{where}.tile_m", f"pack_gqa needs tile_m >= gqa_ratio {ratio} "
                                                    f"(tile_m / gqa_ratio positions per tile), "
                                                    f"got {bucket.tile_m}"))
            if bucket.persistent:
                problems.append((f"{where}.persistent", "pack_gqa launches one CTA per query "
                                                        "tile; use null or false, got true"))
        return problems

    def _context_parallel_problems(self) -> list[tuple[str, str]]:
        """What a sequence shard cannot compute on its own (specgen.parallel)."""
        mode = self.context_parallel
        if mode is None or self.family != "prefill":
            return []
        where = "context_parallel"
        refused = [("score_mod", self.score_mod is not None), ("mask_mod", self.mask_mod is not None),
                   ("sinks", self.sinks), ("dropout", self.dropout), ("block_sparse", self.block_sparse),
                   ("dtype float8_e4m3fn", self.dtype == "float8_e4m3fn")]
        problems = [(where, f"{mode} cannot split a spec with {name} (it depends on absolute "
                            f"positions, per-row state or descales), got {mode!r}")
                    for name, on in refused if on]
        if mode == "ring" and not (self.return_lse or self.backward):
            problems.append((where, "'ring' merges partial results through their LSE: it needs "
                                    "return_lse: true or backward: true"))
        if mode == "ring" and self.varlen and self.window is not None:
            problems.append((where, "'ring' splits packed batches without windows; use 'ulysses'"))
        return problems

    def _learnable_problems(self) -> list[tuple[str, str]]:
        problems = []
        for name, t in self.tensors.items():
            if not t.learnable:
                continue
            where = f"tensors.{name}.learnable"
            if self.family == "decode":
                problems.append((where, "family decode has no backward, so no tensor gets a "
                                        "gradient; use false"))
            elif not self.backward:
                problems.append((where, "true needs backward: true (a gradient comes from the "
                                        "backward kernels)"))
            elif t.dtype != "float32":
                problems.append((where, f"true needs dtype float32 (an {t.dtype} tensor has no "
                                        "gradient)"))
            elif not _indexes(self.score_mod or "", name):
                problems.append((where, "true needs the tensor in score_mod (a mask_mod "
                                        "gives it no gradient)"))
            elif self.deterministic:
                problems.append((where, "true cannot be combined with deterministic: true (its "
                                        "gradient is accumulated with atomic adds)"))
            else:
                from specgen.spec.derive import tensor_derivatives
                from specgen.spec.hooks import ExprError

                try:
                    derivatives = tensor_derivatives(self.score_mod, [name])
                except ExprError as exc:
                    problems.append((where, f"true needs a score_mod with a derivative in {name}: {exc}"))
                else:
                    if not derivatives:  # read only in conditions or integer indices
                        problems.append((where, f"true needs score_mod's value to vary with {name} (it "
                                                "is read only where the value does not depend on it, such as "
                                                "a condition: its gradient is 0); drop learnable"))
        if self.deterministic and not self.backward and self.family == "prefill":
            problems.append(("deterministic", "true needs backward: true"))
        return problems

    @field_validator("backward")
    @classmethod
    def _backward_features(cls, value: bool, info) -> bool:
        if not value:
            return value
        used = [n for n in ("out_dtype",) if info.data.get(n)]
        if info.data.get("dtype") == "float8_e4m3fn":
            used.append("dtype float8_e4m3fn")
        if info.data.get("q_subtiles", 1) > 1:
            used.append("q_subtiles 2")
        if used:
            raise ValueError(f"true does not support {', '.join(used)} yet; the backward kernels "
                             "cover causal/non-causal, windows, soft-cap, score_mod/mask_mod "
                             "hooks, sinks, dropout, varlen, GQA, any head_dim and v_head_dim")
        score_mod = info.data.get("score_mod")
        if score_mod:
            from specgen.spec.derive import score_derivative
            from specgen.spec.hooks import ExprError

            try:
                score_derivative(score_mod)
            except ExprError as exc:
                raise ValueError(f"true needs a score_mod with a derivative in score: {exc}") from None
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
        if "dtype" not in info.data:
            return value  # dtype has its own error; nothing to compare with
        dtype = info.data["dtype"]
        if value is not None and value not in (dtype, "float8_e4m3fn"):
            raise ValueError(f"must be null, {dtype} (the dtype) or float8_e4m3fn")
        return value

    @field_validator("window")
    @classmethod
    def _causal_window(cls, value: Optional[Window], info) -> Optional[Window]:
        if value is not None and info.data.get("causal") and value.right not in (None, 0):
            raise Problems([("right", f"{value.right} needs causal: false (a causal kernel never "
                                      "sees keys after the query); use null or 0")])
        return value

    @field_validator("block_remap")
    @classmethod
    def _check_block_remap(cls, value: Optional[bool], info) -> Optional[bool]:
        if value and info.data.get("causal") is False:  # (an invalid causal has its own error)
            raise ValueError(
                "true needs causal: true (non-causal query tiles all do the same "
                "work); use false or null"
            )
        return value

    @field_validator("loads")
    @classmethod
    def _check_bounds_needs_split(cls, value: Loads, info) -> Loads:
        if value.check_bounds == "masked" and not info.data.get("loop_split", True):
            raise Problems([("check_bounds", "'masked' needs loop_split: true (without the split "
                                             "every key tile is masked); use 'all'")])
        dims = [info.data.get("head_dim"), info.data.get("v_head_dim")]
        odd = [d for d in dims if isinstance(d, int) and d & (d - 1)]
        if value.check_bounds == "masked" and odd:
            raise Problems([("check_bounds", f"'masked' needs power-of-two head dims (head dim "
                                             f"{odd[0]} is padded, so every tile reads past the "
                                             "array's last axis); use 'all'")])
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
        softcap = info.data.get("softcap")
        if value and info.data.get("dtype") == "float16" and softcap and softcap > FP16_PRESCALE_CAP:
            raise ValueError(
                f"true with float16 needs softcap <= {FP16_PRESCALE_CAP:g} (Q is pre-multiplied "
                f"by scale / softcap in float16, and softcap {softcap:g} takes it below float16's "
                "normal range, where its digits are lost); use false, or bfloat16")
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
        for where, bucket in target_buckets(info.data.get("targets") or {}):
            if bucket.tile_m // value < 16:
                raise ValueError(
                    f"{value} needs tile_m >= {16 * value} in every target, "
                    f"got tile_m {bucket.tile_m} in {where}"
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



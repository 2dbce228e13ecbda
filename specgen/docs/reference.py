"""docs/spec-reference.md, walked from the Pydantic model.

Every field of the model needs a description: the entry of DESCRIPTIONS under its
dotted path, else the field's own ``description=``. A field with neither, or an
entry whose field is gone, raises DocsError, so the reference cannot fall behind
the model without a test failing.
"""

from __future__ import annotations

import os
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel
from pydantic.fields import FieldInfo

from specgen.spec import Spec

from .base import REGENERATE, DocsError


# --- spec reference: the words -----------------------------------------------

# One entry per field, by dotted path. Maps are written with a placeholder key
# (PLACEHOLDERS), list items with "[]". A field inherited from a model already
# documented elsewhere (SeqBucket's launch fields) is described where it first
# appears.
DESCRIPTIONS: dict[str, str] = {
    "name": "Module name: `specgen build` writes `generated/<name>.py`. An ASCII Python "
    "identifier that is not a keyword (soft keywords included) and does not start with `_`, "
    "at most 100 characters, and not the name of a standard-library module (of any Python "
    "from 3.10) or of a package the module or specgen imports (`torch`, `typing_extensions`, "
    "`jinja2`, ...): `generated/<name>.py` would be imported in its place.",
    "family": "`prefill`: queries against keys, `[B, H, S, D]` tensors "
    "(`templates/fmha_prefill.py.jinja`). `decode`: a few new tokens per sequence against "
    "a KV cache, split-KV flash decoding with a combine kernel "
    "(`templates/fmha_decode.py.jinja`; see [features](features.md#decode-family)).",
    "dtype": "Element type of q, k and v. `float8_e4m3fn` (prefill): `attention(..., "
    "q_descale, k_descale, v_descale)` takes one descale per tensor (a float or a "
    "one-element device tensor); q·k is scaled back by q's and k's descales (folded into "
    "the softmax scale) and the output by v's; P is rounded to e4m3 for the P·V MMA, as in "
    "FlashAttention-3. It needs head dims that are multiples of 16 and `prescale_q: false`. "
    "A decode spec keeps a 16-bit `dtype` and sets `kv_dtype` for a float8 cache.",
    "out_dtype": "Element type of the output. `null`: `dtype`, or `bfloat16` when `dtype` "
    "is `float8_e4m3fn`.",
    "kv_dtype": "Element type of the KV cache: `null` (= `dtype`), the spec's `dtype`, or "
    "`float8_e4m3fn`, which halves the bytes a call reads. A float8 cache holds value / "
    "descale; `attention(..., k_descale=, v_descale=)` takes one descale per tensor (a "
    "positive float or a one-element float32 tensor on q's device), and needs `head_dim` "
    "a multiple of 16.",
    "head_dim": "Head dimension D of q and k (`HEAD_DIM`). One that is not a power of two "
    "(Phi-2: 80) runs as two tiles in D where that is narrower than one padded tile "
    "(`HEAD_DIM_MAIN` + `HEAD_DIM_REST`: 80 = 64 + 16; see `head_dim_split`), else it is "
    "zero-padded to the next power of two inside the kernel (`HEAD_DIM_TILE`, "
    "`padding_mode=ZERO` on the loads); padding columns of the output are never stored. "
    "Family decode takes powers of two.",
    "v_head_dim": "Head dimension of v and the output when it differs from `head_dim` "
    "(DeepSeek MLA: `head_dim` 192, `v_head_dim` 128), split or padded the same way. `null`: "
    "`head_dim`.",
    "gqa_ratio": "Query heads per KV head (`GROUP_SIZE`); 1 is multi-head attention. The "
    "launcher checks `Hq == gqa_ratio * Hkv`.",
    "max_q_len": "New tokens per sequence and call (more than 1 for speculative "
    "decoding). The query tile packs `gqa_ratio` × `max_q_len` rows, at most 256; token t of a call "
    "with q_len tokens sees keys j ≤ `seq_len − q_len + t`.",
    "paged": "A paged KV cache (vLLM / FlashInfer layout); see [`paged`](#paged). `null`: "
    "a contiguous cache `[B, max_len, Hkv, D]`.",
    "causal": "Query row i, at absolute position `q_offset + i`, sees keys j ≤ "
    "`q_offset + i`. Key tiles past the diagonal are skipped. Decode is always causal (each new token "
    "sees the cache and the new tokens before it) and takes no `causal` field.",
    "window": "A sliding window around each query position; see [`window`](#window). "
    "`null`: no window.",
    "softcap": "Logit soft-cap c: `score = c · tanh(score / c)` (Gemma 2: 50), applied to "
    "the scaled scores before the mask. With `prescale_q`, Q is pre-multiplied by "
    "scale / c. `null`: none.",
    "tensors": "Extra inputs that `score_mod` and `mask_mod` index, by name; each becomes a "
    "keyword argument of `attention`, its shape and dtype checked before the launch. Each "
    "declared tensor must be used by a hook.",
    "score_mod": "A Python expression for the new score over `score`, `b`, `h`, `q_idx`, "
    "`kv_idx` and the `tensors` (ALiBi: `score - slope[h] * (q_idx - kv_idx)`), printed "
    "into every key step after the scaling and soft-cap. `score` is in natural-log units; "
    "`q_idx` is the absolute position `q_offset + row`. Only a whitelist of constructs is "
    "accepted: [expression hooks](features.md#expression-hooks). `null`: none.",
    "mask_mod": "A condition over `b`, `h`, `q_idx`, `kv_idx` and the `tensors`: key "
    "`kv_idx` is visible to query `q_idx` (documents: `doc[b, q_idx] == doc[b, kv_idx]`). "
    "ANDed with `causal` and `window` in every key step; a row that sees no key gives "
    "zeros. `null`: none.",
    "skip_masked_tiles": "With a `mask_mod`: evaluate the mask on each key tile before "
    "loading K and V, and branch around a tile it hides from every row of the query tile "
    "(block sparsity without a precomputed tile list). No effect without a `mask_mod`. "
    "Off by default because it measured no faster: on an H200 with documents of about "
    "256 tokens, the K/V loads are pipelined ahead of the branch, so their memory traffic "
    "stays ([experiments](experiments.md), section 15).",
    "block_sparse": "With a `mask_mod`: a block map lists, per (batch, query tile), the "
    "key tiles that hold a visible pair, split into full tiles (every pair visible: run "
    "without the mask) and partial ones (mask evaluated); the kernels visit only those. "
    "The map is built on the GPU by one generated kernel (`make_block_map`, no host "
    "sync) and can be reused across layers and steps. See "
    "[block-sparse masks](features.md#block-sparse-masks).",
    "dropout": "Dropout on the attention probabilities: `attention(..., dropout_p, seed)`. "
    "A probability is kept where its 16 bits of murmur3's finaliser of (seed, b·H + h, query "
    "position, key pair) clear `round(p · 2¹⁶)`; one hash serves keys k and k + 8 of each "
    "aligned 16. A seed reproduces its mask exactly "
    "(`specgen.check.reference.dropout_keep` regenerates it); kept weights are scaled by "
    "the inverse of the keep rate, 2¹⁶ / (2¹⁶ − round(p · 2¹⁶)), so the output stays unbiased; "
    "p must be below 1 − 2⁻¹⁷. The LSE is the one before dropout.",
    "varlen": "A packed batch without padding (FlashAttention's varlen): q `[total_q, Hq, "
    "D]`, k/v `[total_k, Hkv, D]` and `attention(..., cu_seqlens_q=, cu_seqlens_k=, "
    "max_seqlen_q=None, max_seqlen_k=None)`. Each sequence's queries are its last "
    "positions (bottom-right causal), read through per-sequence array views, so a tile "
    "never crosses into the next sequence; `lse` is `[Hq, total_q]`. Not yet with "
    "`score_mod`, `mask_mod` or `dropout`.",
    "sinks": "A learned logit per query head joins the softmax normaliser (gpt-oss): "
    "`attention(..., sinks=t)` with t of shape `[Hq]`.",
    "return_lse": "`attention` returns `(out, lse)`: lse `[B, Hq, Sq]` float32, the natural "
    "log of each row's softmax normaliser (sink included). A row that sees no key has "
    "lse −inf, or with sinks the head's sink logit, since the sink alone makes its "
    "normaliser.",
    "fast_math": "Fast-math choices of the softmax and the final normalisation; see "
    "[`fast_math`](#fast_math).",
    "loop_split": "Run the key loop in two parts: the unmasked tiles, then a masked loop "
    "for the diagonal and the ragged end. `false` masks every iteration.",
    "block_remap": "Causal only: the heaviest query tiles (the last, which see the most "
    "keys) launch first. `null`: on when `causal`.",
    "loads": "How the K and V tiles are loaded; see [`loads`](#loads).",
    "targets": "Launch configs by GPU target, picked at run time from the device's "
    "`sm_XY`; see [`targets.<target>`](#targets-target).",
    "prescale_q": "Multiply the Q tile by the softmax scale (times 1/ln 2 with `exp2`) once, "
    "in registers, instead of scaling every S tile. Needs a 16-bit `dtype`. The scaled Q "
    "is rounded to the dtype, so each score carries a relative error of about 2^-9 "
    "(bf16): negligible at the default scale 1/sqrt(head_dim), but at scales near 1 and "
    "above the scores (and gradients) lose accuracy; leave it off for such scales. A "
    "`score_mod` that branches on the score's value (`where(score > 0.25, ...)`) can take "
    "the other branch for a score that lies within that error of the threshold, and a "
    "steep one (`sqrt(score)`) magnifies the error; `specgen test`'s gradient rule counts "
    "this rounding as part of the kernel's math. With a "
    "`softcap` Q is multiplied by scale / softcap, which float16 holds only for a softcap "
    "up to 1000 (a larger one is refused; bfloat16 has the range).",
    "q_subtiles": "`2` splits each CTA's `tile_m` query rows into two halves with their own "
    "softmax state that share every K and V tile, so one half's softmax can overlap the "
    "other's MMA (FlashAttention-3's ping-pong, in tiles). Needs `tile_m` ≥ 32 in every "
    "config; not yet with `window`, `softcap`, hooks, `varlen`, `dropout`, `sinks`, "
    "`return_lse` or float8.",
    "qk_ahead": "Form the next key tile's S = Q·Kᵀ before this tile's softmax. The two do "
    "not depend on each other, so the compiler issues the next tile's tensor-core MMA first "
    "and runs this tile's exponentials while it computes (FlashAttention-3's "
    "intra-warpgroup overlap, written in the loop; an offline sm_90 build shows the MMA's "
    "wait moved past the softmax). The loops stop before the last key tile, which runs "
    "after them on the S its predecessor formed. Not with `q_subtiles: 2`, "
    "`skip_masked_tiles` or `block_sparse`. On an H100 it ran slower than the shipped "
    "configs in every case measured (bf16 causal GQA 8, D64 and fp16 D128 non-causal, float8; "
    "[tuning](tuning.md)); compare it with `specgen bench --variants` before turning it on.",
    "head_dim_split": "How a `head_dim` or `v_head_dim` that is not a power of two is tiled. "
    "`auto` (16-bit prefill): as two tiles in D, the largest power of two below it and the "
    "rest rounded up to a power of two of at least 16 (80 = 64 + 16, 96 = 64 + 32, "
    "160 = 128 + 32, 192 = 128 + 64), wherever the two are narrower than one padded tile; "
    "every product over D becomes two chained MMAs and every output over D two "
    "accumulators (`q`, `q_rest`; `acc`, `acc_rest`), forward and backward. 112 and 224 "
    "(64 + 64, 128 + 128) and float8 stay padded. On an H100, B4 Hq32 causal, S 1k-8k: "
    "Phi-2's D80 forward 1.10-1.20x and backward 1.25x the padded kernels; MLA's 192/128 "
    "forward 1.04-1.06x and backward 1.47-1.49x (with the backward tiles of its split width). "
    "`false` pads (`HEAD_DIM_TILE`); `true` "
    "asks for the split and is refused where there is none.",
    "splits": "KV splits per (batch, KV head): each split writes a partial output and "
    "log-sum-exp, a combine kernel merges them. `auto` picks the count at run time: "
    "enough CTAs to fill the SMs once (a set number per SM), at least two key tiles per "
    "split, at most 64 (`module.launch_plan(...)` shows the choice).",
    "pdl": "Programmatic dependent launch: each kernel (split, combine, the next call's "
    "split) may start while the one before it finishes, and waits for it before reading. "
    "`auto`: on sm_90, where it was measured; `true`: on every sm_90 or later device; "
    "`false`: never (the generated code is then the same as without the field).",
    "backward": "Also generate FlashAttention-2's backward kernels (D = rowsum(dO·O); dK "
    "and dV per key tile, summed over each KV head's query heads; dQ per query tile) and "
    "make `attention` differentiable: a `torch.library` custom op under `torch.compile`, "
    "a `torch.autograd.Function` with the same functions when eager. Covers every "
    "prefill feature (masks, windows, soft-cap, hooks and learnable hook tensors, sinks, "
    "dropout, varlen, any head dim 16-256, `v_head_dim`, any `gqa_ratio`); a float8 "
    "`dtype` (and its `out_dtype`) is refused with a one-line error. See "
    "[features](features.md#training-backward-true).",
    "compile_for": "The targets `specgen build` AOT-compiles, one cubin per launch config "
    "of each; the cubins are left in `generated/<name>.aot/` for the module's first "
    "call. `--targets` overrides the list.",
    "autotune": "The search space of `specgen tune` per target; changes nothing in the "
    "module. See [`autotune.<target>`](#autotune-target) and [tuning](tuning.md).",
    "paged.page_size": "Tokens per page, a power of two in [16, 1024]. The cache is "
    "`k_pages`/`v_pages` `[num_pages, page_size, Hkv, D]` with a `[B, max_pages]` int32 "
    "page table; the page size must be at least every target's `tile_n`, so that a key "
    "tile lies in one page.",
    "window.left": "How many keys before the query position it sees: key j is visible when "
    "j ≥ p − left. `null`: unbounded to the left.",
    "window.right": "How many keys after the query position it sees: j ≤ p + right. `null`: "
    "unbounded to the right. A causal spec, and every decode spec, takes `null` or 0.",
    "tensors.<name>.dtype": "Element type of the tensor.",
    "tensors.<name>.shape": "One to four sizes, each a dimension name or a number; the "
    "launcher checks the tensor against them before the launch. A hook's index outside "
    "the tensor reads 0.",
    "fast_math.exp2": "Fold 1/ln 2 into the scale and use `ct.exp2` (the faster ex2 "
    "instruction); `false` uses `ct.exp` with the natural scale.",
    "fast_math.flush_to_zero": "`flush_to_zero=True` on `ct.exp2` and on the final "
    "division (`ct.exp` has no such option).",
    "fast_math.approx_div": "`rounding_mode=APPROX` on the final normalisation (prefill; "
    "the decode kernels divide exactly, one division per row, whatever it says).",
    "loads.k_transposed": "Load K^T directly with `order=(0, 1, 3, 2)`; `false` loads K and "
    "transposes it with `ct.permute`.",
    "loads.k_latency": "`latency=` hint of the K loads; `null`: no hint.",
    "loads.v_latency": "`latency=` hint of the V loads; `null`: no hint.",
    "loads.check_bounds": "`masked` drops the bounds check (`check_bounds=False`) from the "
    "K and V loads of the unmasked key tiles, which always lie inside the arrays. Needs "
    "`loop_split` and power-of-two head dims.",
    "loads.allow_tma": "`allow_tma=` on the K and V loads: `false` forbids TMA (measured 6× "
    "slower on an H200), `null` leaves the choice to the compiler.",
    "targets.<target>.tile_m": "Query rows per CTA (`TILE_M`). Decode: the packed query "
    "tile, `gqa_ratio` × `max_q_len` rounded up to a power of two, at least 16.",
    "targets.<target>.tile_n": "Keys per step of the key loop (`TILE_N`).",
    "targets.<target>.occupancy": "CTAs per SM the compiler aims for.",
    "targets.<target>.num_ctas": "CTAs per cluster; `null`: the compiler's choice.",
    "targets.<target>.num_worker_warps": "Warps of the compute warp groups of a "
    "warp-specialised kernel (8: two warp groups); `null`: the compiler's choice.",
    "targets.<target>.opt_level": "tileiras optimisation level; `null`: 3.",
    "targets.<target>.tile_order": "Launch order of the query tiles. `per_head` puts them "
    "on grid x: one (batch, head)'s tiles run together and its K/V stays in L2. `global` "
    "puts them on grid y: tile t of every head launches before any head's next tile, so "
    "with block remap the heaviest causal tiles of all heads go first; it wins on short "
    "causal sequences. Printed as a `TILES_OUTER` kernel constant only where a config "
    "uses `global`. Decode specs take `per_head` only.",
    "targets.<target>.by_seq_k": "Configs for shorter key lengths, in increasing "
    "`max_seq_k`: the launcher takes the first bucket with `seq_k <= max_seq_k`, else the "
    "target's own fields. A bucket with other compiler options gets its own "
    "`replace_hints` kernel, made once at import. Written by `specgen tune`; decode specs "
    "take none.",
    "targets.<target>.by_seq_k[].max_seq_k": "The bucket serves calls with `seq_k <= "
    "max_seq_k`; the first match wins.",
    "autotune.<target>.tile_m": "`tile_m` values to try.",
    "autotune.<target>.tile_n": "`tile_n` values to try.",
    "autotune.<target>.occupancy": "`occupancy` values to try.",
    "autotune.<target>.num_ctas": "`num_ctas` values to try (`null`: the compiler's choice).",
    "autotune.<target>.num_worker_warps": "`num_worker_warps` values to try (`null`: the "
    "compiler's choice).",
    "autotune.<target>.opt_level": "`opt_level` values to try (`null`: 3).",
    "autotune.<target>.tile_order": "`tile_order` values to try.",
    "autotune.<target>.v_transposed": "`v_transposed` values to try (`null`: the default, "
    "true for float8 prefill). One kernel takes both layouts; the transposing copy is made "
    "outside the timing.",
    "autotune.<target>.persistent": "`persistent` values to try (`null`: false). With "
    "`true` in the list, one kernel in the work-item loop form serves every config.",
    "autotune.<target>.seq_buckets": "Keep a separate winner for a shorter length of the "
    "suite where it beats the longest length's winner by `min_gain` (written as "
    "`by_seq_k`); `false` keeps one config for every length.",
    "autotune.<target>.min_gain": "How much faster (a fraction) a shorter length's winner "
    "must be, at that length, than the long-sequence winner to get its own bucket.",
}

# The key each map of the model is written with.
PLACEHOLDERS = {"tensors": "<name>", "targets": "<target>", "autotune": "<target>"}

# Top-level fields that belong to one family, as the validator reads them.
from specgen.spec.model import FAMILY_ONLY  # noqa: E402

# A paragraph under a section's heading, where the fields alone do not explain it.
SECTION_TEXT = {
    "window": (
        "A query at absolute position p = `q_offset + i` sees key j when "
        "p − `left` ≤ j ≤ p + `right`. `left` counts the keys *before* the query; the "
        "query's own key (j = p) is always included. So a window of W tokens that ends at "
        "the query is `left: W − 1`: Mistral's 4096-token window is `{left: 4095}` with "
        "`causal: true`, and a transformers model's `sliding_window` maps to "
        "`left = sliding_window − 1`. Set at least one bound. Key tiles wholly outside "
        "the window are skipped by the loop bounds, the edge tiles are masked, and a row "
        "that sees no key gives zeros (LSE −inf, or the head's sink logit with sinks). "
        "Decode specs take `left` only."
    ),
    "paged": "Decode only. `attention(q, k_pages, v_pages, seq_lens, page_table, ...)`.",
    "tensors.<name>": (
        "Example: `tensors: {slope: {dtype: float32, shape: [heads]}}` with "
        "`score_mod: score - slope[h] * (q_idx - kv_idx)`, called as "
        "`attention(q, k, v, slope=t)`. The name is a lowercase identifier (at most 31 "
        "characters) that is neither a keyword nor one of the names the module's functions "
        "already use (any family's launcher arguments and locals, such as `seed`, `seq_lens`, "
        "`out`, `shape`, `value`; the error for such a name lists them all), nor `d` + a "
        "learnable tensor's name; and a learnable tensor's `d` + name (its gradient in the "
        "backward) is none of those names either."
    ),
    "targets.<target>": (
        "`<target>` is `default` or a GPU target such as `sm_90`. The launcher picks the "
        "config of the device's `sm_XY`, else `default`; compiler options "
        "(`occupancy`, `num_ctas`, `num_worker_warps`, `opt_level`) are compiled in per "
        "target with `ct.ByTarget`, so no kernel is made per call. A spec that writes "
        "targets without `default` gets 64×64 tiles, occupancy 2, there (decode: the "
        "packed `tile_m`). A spec that leaves `targets` out gets, for every target the "
        "shipped table of measured configs (`specgen/spec/default_configs.json`) knows, "
        "the entry for its family, dtype, head-dim bucket, masking and extras; the "
        "generated module names the run that measured each."
    ),
    "targets.<target>.by_seq_k[]": "Each bucket is a launch config plus `max_seq_k`.",
    "autotune.<target>": (
        "`<target>` is a GPU target such as `sm_90`. `specgen tune SPEC --target "
        "<target>` times every combination of these lists and writes the winners into "
        "`targets.<target>`; see [tuning](tuning.md)."
    ),
}

INTRO = """\
A spec is a YAML file validated by a strict Pydantic model (`specgen.spec.Spec`):
unknown keys, wrong types (a quoted `"true"` is not a bool) and out-of-range values
are errors, each reported on one line as `<file>: <field.path>: <what is allowed>,
got <value>`. Scalars are read as YAML 1.2 reads them: a boolean is `true` or
`false`, never `yes` or `on`; an integer is plain decimal (`0200` and `0x80` are
refused, not read as octal or hex). Every field but `name` has a default, so `name: x` plus
`causal: true` is a whole spec.

The same model ships as a JSON Schema, [`specs/schema.json`](../specs/schema.json)
(`specgen schema` prints it). Point your editor's YAML plugin at it for checking and
completion, for example with `# yaml-language-server: $schema=schema.json` at the top
of a spec. The schema knows the keys, types, choices, bounds, head-dim and tile sizes
and the name's form; the rules between fields, the target names and the hooks are
checked by `specgen build` (`specgen build SPEC --no-compile` renders without
compiling; exit 2 lists every problem, the rules between fields once each field is valid), so a spec the editor accepts may still be
refused there, with one line naming the field.

The *family* column says which kernel family takes a field; setting a field of the
other family (even to its default) is an error.
"""


# --- spec reference: walking the model ---------------------------------------


def _number(value: Any) -> str:
    if value == 2**31 - 1:
        return "2³¹ − 1"
    if isinstance(value, float):
        text = format(value, "g")
        return text.replace("e+0", "e").replace("e+", "e")
    return str(value)


def _yaml_value(value: Any) -> str:
    """A value as a spec would write it (flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, BaseModel):
        return "{}"  # a nested model of all defaults; its fields are listed below
    if isinstance(value, (int, float)):
        return _number(value)
    return str(value)


def _rule(func) -> str:
    """What an AfterValidator allows, in its own words: the message it raises for a
    value it refuses. Probing keeps the reference in step with the messages users see."""
    for probe in (-1, "?", [0, 0]):
        try:
            func(probe)
        except ValueError as exc:
            text = str(exc)
            break
        except (TypeError, AttributeError):
            continue
    else:
        raise DocsError(f"cannot describe validator {func.__qualname__}: no probe value fails it")
    for lead in ("must be ", "allowed: "):
        if lead in text:
            text = text.split(lead, 1)[1]
            text = re.sub(r"^(a|an) ", "", text)
            return re.sub(r" or null\b", ", or `null`", text)
    if text == "lists a value twice":
        return "each value at most once"
    return f"checked: {text}"


def _flatten(extras) -> list:
    out = []
    for item in extras:
        out.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    return out


def _bounds(constraints) -> str:
    found = {}
    for c in constraints:
        for name in ("ge", "gt", "le", "lt"):
            if getattr(c, name, None) is not None:
                found[name] = getattr(c, name)
    if not found:
        return ""
    low = (f"[{_number(found['ge'])}" if "ge" in found
           else f"({_number(found['gt'])}" if "gt" in found else "(−∞")
    high = (f"{_number(found['le'])}]" if "le" in found
            else f"{_number(found['lt'])})" if "lt" in found else "∞)")
    return f" in {low}, {high}"


def _sizes(constraints) -> list[str]:
    low = next((c.min_length for c in constraints if getattr(c, "min_length", None)), None)
    high = next((c.max_length for c in constraints if getattr(c, "max_length", None)), None)
    if low and high:
        return [f"{low} to {high} entries"]
    if low == 1:
        return ["non-empty"]
    return [f"at least {low} entries"] if low else []


def _anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "-", path.lower()).strip("-")


def _link(path: str) -> str:
    return f"[`{path}`](#{_anchor(path)})"


def _is_model(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _allowed(tp, constraints: list, path: str, children: list) -> str:
    """The values a type allows, in words. Nested models are linked, and recorded in
    ``children`` as (path, model) to be documented in their own sections."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extras = get_args(tp)
        return _allowed(base, [*constraints, *_flatten(extras)], path, children)
    rules = [_rule(c.func) for c in constraints if isinstance(c, AfterValidator)]
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(tp) if a is not type(None)]
        if rules:  # a validator of the whole union (e.g. an optional latency)
            text = "; ".join(rules)
        else:
            text = " or ".join(_allowed(m, constraints, path, children) for m in members)
        if len(members) < len(get_args(tp)) and "null" not in text:
            text += ", or `null`"
        return text
    if origin is Literal:
        return ", ".join(f"`{_yaml_value(v)}`" for v in get_args(tp))
    if origin is list:
        (item,) = get_args(tp)
        text = "list of " + _allowed(item, [], f"{path}[]", children)
        notes = _sizes(constraints) + rules
        return text + (f" ({'; '.join(notes)})" if notes else "")
    if origin is dict:
        key, value = get_args(tp)
        leaf = path.rsplit(".", 1)[-1]
        if leaf not in PLACEHOLDERS:
            raise DocsError(f"{path}: a map without a placeholder key in PLACEHOLDERS")
        child = f"{path}.{PLACEHOLDERS[leaf]}"
        key_text = _allowed(key, [], child, children)
        key_text = f"`{PLACEHOLDERS[leaf]}`" + (f" ({key_text})" if key_text != "string" else "")
        return f"map from {key_text} to {_allowed(value, [], child, children)}"
    if rules:
        return "; ".join(rules)
    if _is_model(tp):
        children.append((path, tp))
        return _link(path)
    if tp is bool:
        return "`true`, `false`"
    if tp is int:
        return "integer" + _bounds(constraints)
    if tp is float:
        return "number" + _bounds(constraints)
    if tp is str:
        return "string"
    raise DocsError(f"{path}: cannot describe the type {tp!r}")


def _declared_by(model: type[BaseModel], name: str) -> type[BaseModel]:
    """The most basic model class that has field ``name`` (where it was declared)."""
    owner = model
    for base in model.__mro__[1:]:
        if _is_model(base) and name in getattr(base, "model_fields", {}):
            owner = base
    return owner


def _description(path: str, field: FieldInfo) -> str:
    text = DESCRIPTIONS.get(path) or field.description
    if not text:
        raise DocsError(
            f"{path}: the field has no description; add one to DESCRIPTIONS in "
            "specgen/docs.py (or description= in the model)"
        )
    return " ".join(text.split()).replace("|", "\\|")


def _sections(model: type[BaseModel], path: str, seen: dict) -> list[dict]:
    """The sections of ``model`` at ``path`` and of every model under it, depth first.
    ``seen`` maps (declaring class, field) to the path where it was documented."""
    rows, inherited, children = [], [], []
    for name, field in model.model_fields.items():
        full = f"{path}.{name}" if path else name
        key = (_declared_by(model, name), name)
        if key in seen:
            inherited.append((name, seen[key]))
            continue
        seen[key] = full
        default = "required" if field.is_required() else _yaml_value(
            field.get_default(call_default_factory=True))
        rows.append({
            "path": full,
            "name": name,
            "allowed": _allowed(field.annotation, list(field.metadata), full, children),
            "default": default,
            "family": FAMILY_ONLY.get(name, "both") if not path else None,
            "description": _description(full, field),
        })
    section = {"path": path, "model": model, "rows": rows, "inherited": inherited}
    out = [section]
    for child_path, child in children:
        out.extend(_sections(child, child_path, seen))
    return out


def _section_markdown(section: dict) -> list[str]:
    path = section["path"]
    top = not path
    lines = ["## Top-level fields" if top else f'<a id="{_anchor(path)}"></a>\n\n## `{path}`', ""]
    text = SECTION_TEXT.get(path) or (section["model"].__doc__ or "").strip()
    if text and not top:
        lines += [" ".join(text.split()), ""]
    if top:
        lines += ["| field | family | allowed | default | description |", "|---|---|---|---|---|"]
    else:
        lines += ["| field | allowed | default | description |", "|---|---|---|---|"]
    for row in section["rows"]:
        cells = [f"`{row['name']}`"]
        if top:
            cells.append(row["family"])
        cells += [row["allowed"], f"`{row['default']}`" if row["default"] != "required" else "required",
                  row["description"]]
        lines.append("| " + " | ".join(c.replace("\n", " ") for c in cells) + " |")
    if section["inherited"]:
        names = ", ".join(f"`{name}`" for name, _ in section["inherited"])
        where = sorted({p.rsplit(".", 1)[0] for _, p in section["inherited"]})
        lines += ["", f"Also {names}, as in " + ", ".join(_link(w) for w in where) + "."]
    return lines + [""]


def check_descriptions() -> list[str]:
    """Every documented path; raises DocsError for a field without a description or an
    entry of DESCRIPTIONS that names no field."""
    paths = [row["path"] for s in _sections(Spec, "", {}) for row in s["rows"]]
    stale = sorted(set(DESCRIPTIONS) - set(paths))
    if stale:
        raise DocsError(f"DESCRIPTIONS names fields the model does not have: {', '.join(stale)}")
    unknown = sorted(set(FAMILY_ONLY) - set(Spec.model_fields))
    if unknown:
        raise DocsError(f"FAMILY_ONLY names fields the model does not have: {', '.join(unknown)}")
    return paths


def _spec_summary(spec: Spec) -> str:
    """What a shipped spec is, from its validated fields."""
    short = {"float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8 e4m3"}
    parts = []
    if spec.family == "prefill":
        parts.append("causal" if spec.causal else "non-causal")
    parts.append("MHA" if spec.gqa_ratio == 1 else f"GQA {spec.gqa_ratio}:1")
    dtype = short[spec.dtype]
    if spec.out_dtype:
        dtype += f" in, {short[spec.out_dtype]} out"
    if spec.kv_dtype and spec.kv_dtype != spec.dtype:
        dtype += f", {short[spec.kv_dtype]} KV cache"
    parts.append(dtype)
    parts.append(f"D{spec.head_dim}" + (f"/{spec.v_head_dim}" if spec.v_head_dim else ""))
    if spec.window:
        bounds = {k: getattr(spec.window, k) for k in ("left", "right")
                  if getattr(spec.window, k) is not None}
        parts.append("window " + _yaml_value(bounds))
    for name in ("softcap",):
        if getattr(spec, name) is not None:
            parts.append(f"{name} {_number(getattr(spec, name))}")
    for name in ("score_mod", "mask_mod"):
        if getattr(spec, name):
            # A | inside backticks still splits a markdown table's cell.
            parts.append(f"{name} `{getattr(spec, name)}`".replace("|", "\\|"))
    parts += [n for n in ("sinks", "dropout", "varlen", "return_lse", "backward") if getattr(spec, n)]
    # The optimisations a spec turns off (all are on by default).
    if spec.family == "prefill":
        off = [name for name, on in spec.fast_math.model_dump().items() if not on]
        if off:
            parts.append(f"exact math ({', '.join(off)} off)")
        if not spec.loop_split:
            parts.append("no loop split")
        if spec.causal and not spec.use_block_remap:
            parts.append("no block remap")
        if not spec.loads.k_transposed:
            parts.append("K transposed in registers")
        if spec.loads.k_latency is None and spec.loads.v_latency is None:
            parts.append("no latency hints")
    if spec.family == "decode":
        if spec.max_q_len > 1:
            parts.append(f"up to {spec.max_q_len} tokens per call")
        if spec.paged:
            parts.append(f"paged ({spec.paged.page_size}-token pages)")
        if spec.pdl != "auto":  # not the default
            parts.append(f"pdl {_yaml_value(spec.pdl)}")
    if spec.block_sparse:
        parts.append("block-sparse (a block map)")
    return ", ".join(parts)


def load_specs(specs_dir: Path) -> list[tuple[Path, Spec]]:
    """Every spec file (*.yaml, *.yml) in ``specs_dir`` with its validated spec, as
    `specgen build` reads them; DocsError naming the file and field otherwise."""
    from specgen.compile.jobs import shared_names, spec_files
    from specgen.errors import SpecError
    from specgen.spec import load_spec

    specs, problems = [], []
    for path in (p for p in spec_files(specs_dir) if p.is_file()):  # a broken link: not read
        try:
            specs.append((path, load_spec(path)))
        except SpecError as exc:
            problems += exc.lines()
    problems += shared_names((path, spec.name) for path, spec in specs)
    if problems:  # one line each
        raise DocsError("\n".join(problems))
    return specs


def _shipped_specs(specs: list[tuple[Path, Spec]], link_base: Path) -> list[str]:
    paths = [path for path, _ in specs]
    lines = [
        "## Shipped specs",
        "",
        f"{len(paths)} specs ship in `specs/`; each is a starting point to copy.",
        "",
        "| spec | family | what it is |",
        "|---|---|---|",
    ]
    for path, spec in specs:
        link = Path(os.path.relpath(path, link_base)).as_posix()
        lines.append(f"| [`{spec.name}`]({link}) | {spec.family} | {_spec_summary(spec)} |")
    return lines + [""]


def spec_reference_markdown(specs_dir: Path | None = None,
                            specs: list[tuple[Path, Spec]] | None = None) -> str:
    """docs/spec-reference.md: every field of the Spec model and of the models under it
    (name, allowed values, default, description); with ``specs_dir``, a table of the
    specs it holds. Raises DocsError where a field has no description."""
    check_descriptions()
    lines = [
        f"<!-- Generated by specgen.docs from the Spec model. Do not edit: run `{REGENERATE}`. -->",
        "",
        "# Spec reference",
        "",
        INTRO,
    ]
    for section in _sections(Spec, "", {}):
        lines += _section_markdown(section)
    if specs_dir is not None:
        if specs is None:
            specs = load_specs(specs_dir)
        lines += _shipped_specs(specs, specs_dir.parent / "docs")
    return "\n".join(lines).rstrip() + "\n"

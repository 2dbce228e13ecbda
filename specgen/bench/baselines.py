"""The one registry of baselines every suite times a generated kernel against.

A baseline declares what it computes (per suite, the spec features it honours;
the dtypes it takes) and, for a case it can run, builds a callable
``fn(inputs) -> out``. For a case it cannot run it gives a one-line reason, which
the result row shows in place of a number. Nothing here imports torch, FA3 or
TileGym until a callable is built, so the registry is read on any machine.

``fa3`` and ``tilegym`` are opt-in (``--baselines cudnn,fa3``): they are used
where installed and reported with a reason where not, never required.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from specgen.errors import UsageError

SUITES = ("prefill", "decode", "backward")
# The spec features that change what attention computes; a baseline that does
# not honour one the spec uses would time another function, so it is not run.
FEATURES = ("window", "softcap", "sinks", "score_mod", "mask_mod", "dropout", "varlen")
SIXTEEN_BIT = frozenset({"float16", "bfloat16"})
FLOAT8 = "float8_e4m3fn"


def features(plan) -> tuple[str, ...]:
    """The FEATURES a plan uses, in FEATURES' order."""
    on = {
        "window": plan.spec.window is not None,
        "softcap": plan.softcap is not None,
        "sinks": bool(plan.sinks),
        "score_mod": plan.score_mod is not None,
        "mask_mod": plan.mask_mod is not None,
        "dropout": bool(plan.dropout),
        "varlen": bool(plan.varlen),
    }
    return tuple(name for name in FEATURES if on[name])


@dataclass
class Inputs:
    """One case's tensors as baselines read them, made outside the timing.

    prefill: q [B, Hq, S, D], k/v [B, Hkv, S, D] in 16 bits (a float8 spec's
    baselines get 16-bit copies: torch has no float8 attention), k_full/v_full
    the K/V repeated to Hq heads, kernel_qkv the float8 originals (fa3 reads
    them), packed the varlen batch ([T, H, D] with cu_seqlens).
    decode: q [B, Hq, 1, D], k/v [B, Hkv, L, D] (the cache, dequantised to q's dtype).
    backward: q/k/v and k_full/v_full are autograd leaves.
    ``cache`` holds what a baseline prepares once per inputs (a transposed copy,
    a block mask): its first call is the untimed correctness call."""

    q: Any = None
    k: Any = None
    v: Any = None
    k_full: Any = None
    v_full: Any = None
    kernel_qkv: Optional[tuple] = None
    packed: Any = None
    extra: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)


Reason = str
Runner = Callable[[Inputs], Any]


@dataclass(frozen=True)
class Baseline:
    name: str
    label: str  # as tables show it
    # suite -> the FEATURES it honours there; a suite absent here has no path.
    supports: Mapping[str, frozenset]
    build: Callable[[Any, str, Any], Runner]  # (torch, suite, plan) -> fn(inputs); GPU only
    dtypes: frozenset = SIXTEEN_BIT  # the 16-bit dtypes it takes
    float8: bool = False  # takes float8 q/k/v itself (else the suite hands it 16-bit copies)
    # prefill and backward: reads K/V repeated to the query heads (k_full/v_full).
    expands_kv: bool = False
    # Timed after every specgen kernel of the run: importing it changes process
    # state that specgen's launchers rely on (see tilegym).
    late: bool = False
    default: bool = False  # in --baselines' default set
    absent: Mapping[str, str] = field(default_factory=dict)  # suite -> why there is no path
    probe: Callable[[], Optional[Reason]] = lambda: None  # why it is not installed here
    shape_limits: Optional[Callable[[str, Any], Optional[Reason]]] = None
    note: Optional[str] = None  # how it ran, in every row it times (unless the row has its own)

    def input_dtype(self, plan) -> str:
        """The dtype of the q/k/v it is handed."""
        return plan.out_dtype if plan.fp8 and not self.float8 else plan.dtype

    def limits(self, suite: str, plan) -> Optional[Reason]:
        """Why it cannot compute this spec in this suite (None: it can). Pure: no GPU,
        no import of the baseline."""
        if suite not in self.supports:
            return self.absent.get(suite, f"{self.label} has no {suite} path")
        missing = [f for f in features(plan) if f not in self.supports[suite]]
        if missing:
            return f"{self.label} has no {', '.join(missing)}"
        dtype = self.input_dtype(plan)
        if dtype not in self.dtypes and not (dtype == FLOAT8 and self.float8):
            return f"{self.label} takes {', '.join(sorted(self.dtypes))}, not {dtype}"
        return self.shape_limits(suite, plan) if self.shape_limits else None

    def reason(self, suite: str, plan) -> Optional[Reason]:
        """Why it will not run here: not installed, or :meth:`limits`."""
        return self.probe() or self.limits(suite, plan)

    def make(self, torch, suite: str, plan) -> Runner | Reason:
        """The callable for this spec in this suite, or the one-line reason why not
        (a build that raises is reported by its error's first line)."""
        reason = self.reason(suite, plan)
        if reason:
            return reason
        try:
            return self.build(torch, suite, plan)
        except Exception as exc:  # noqa: BLE001 - reported in the row, not dropped
            from specgen.bench.core import error_line

            return error_line(exc)


# --- torch SDPA: cuDNN and FlashAttention-2 ------------------------------------


def _sdpa(backend_name: str) -> Callable[[Any, str, Any], Runner]:
    def build(torch, suite: str, plan) -> Runner:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        backend = getattr(SDPBackend, backend_name)
        causal, ratio, dropout = plan.causal, plan.group_size, plan.dropout
        if suite == "prefill" and plan.varlen:
            return _sdpa_varlen(torch, backend_name, plan)
        if suite == "decode":  # enable_gqa: K/V not expanded

            def run(x: Inputs):
                with sdpa_kernel([backend]):
                    return sdpa(x.q, x.k, x.v, enable_gqa=ratio > 1)

            return run

        def run(x: Inputs):
            # SDPA's own dropout: another RNG, so other outputs; the same work.
            p = x.extra.get("dropout_p", 0.0) if dropout else 0.0
            with sdpa_kernel([backend]):
                return sdpa(x.q, x.k_full, x.v_full, is_causal=causal, dropout_p=p)

        return run

    return build


def _sdpa_varlen(torch, backend_name: str, plan) -> Runner:
    """torch's own varlen ops on the packed batch: FA2 through
    aten._flash_attention_forward (GQA in the kernel), cuDNN through
    aten._cudnn_attention_forward with K/V expanded to the query heads once,
    outside the timing."""
    causal, ratio = plan.causal, plan.group_size

    def fa2(x: Inputs):
        packed = x.packed
        sizes = packed.kwargs()  # host-side lengths: no device read while timed
        return torch.ops.aten._flash_attention_forward(
            packed.q, packed.k, packed.v, packed.cu_seqlens_q, packed.cu_seqlens_k,
            sizes["max_seqlen_q"], sizes["max_seqlen_k"], 0.0, causal, False)[0]

    def cudnn(x: Inputs):
        packed = x.packed
        sizes = packed.kwargs()
        if "cudnn" not in x.cache:  # cuDNN's op wants Hq K/V heads: expanded once, untimed
            x.cache["cudnn"] = tuple(t.repeat_interleave(ratio, 1) if ratio > 1 else t
                                     for t in (packed.k, packed.v))
        k, v = x.cache["cudnn"]
        return torch.ops.aten._cudnn_attention_forward(
            packed.q, k, v, None, packed.cu_seqlens_q, packed.cu_seqlens_k,
            sizes["max_seqlen_q"], sizes["max_seqlen_k"], False, 0.0, causal)[0]

    return cudnn if backend_name == "CUDNN_ATTENTION" else fa2


# --- FlexAttention ---------------------------------------------------------------


# The row note of every Flex timing: how it was compiled. The performance page marks
# Flex figures without it (an earlier bench compiled Flex with torch's default,
# which recompiles it for dynamic shapes at the second length: a slower kernel).
FLEX_STATIC = "compiled per shape (torch.compile dynamic=False)"


def _flex(torch, suite: str, plan) -> Runner:
    """FlexAttention compiled once per spec. Prefill: the window and mask_mod as a
    block mask, the soft-cap and score_mod as its score_mod (both evaluated from
    the spec's checked expressions); varlen as one packed sequence whose block mask
    keeps each query in its own sequence. Decode: its decoding path, the window and
    mask_mod as a block mask whose query index is the new token's position. Backward: the
    prefill's block mask and score_mod, differentiated by Flex."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from specgen.bench.flops import window_of
    from specgen.check.reference import visible as visible_rule
    from specgen.spec.hooks import torch_fn

    causal, ratio = plan.causal, plan.group_size
    if suite == "backward":
        import torch._functorch.config as functorch_config

        # The timing replays one backward graph (retain_graph=True), which a
        # compiled backward with donated buffers refuses.
        functorch_config.donated_buffer = False
    # Static shapes: a kernel specialised to each case, as a model with fixed
    # lengths gets (with the default, a second shape recompiles it dynamic, slower).
    # One compiled kernel per shape, for every spec of the run: dynamo's default limit
    # of 8 recompiles of flex_attention is reached within a run, and a call past it
    # falls back to Flex's unfused eager path (or fails under graph capture).
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
    compiled = torch.compile(flex_attention, dynamic=False)
    left, right = window_of(plan) or (None, None)
    mask_fn = torch_fn(plan.spec.mask_mod) if plan.mask_mod else None
    # A mask_mod that reads h needs a block mask per query head.
    mask_heads = mask_fn is not None and "h" in plan.mask_mod.uses
    tensor_names = tuple(plan.spec.tensors)
    hook_tensors: dict = {}  # the current call's extra tensors, read by the hooks
    if suite == "decode":
        # A block mask even where nothing is masked: without one, Flex's decode call
        # ran 16-20x slower than with one that marks every block full (H100).
        decode_masks: dict[tuple, Any] = {}

        def run_decode(x: Inputs):
            # Every sequence of a bench case holds L keys; its q_len new tokens are
            # the last positions: Flex's query index i is position L - q_len + i.
            q_len, length = x.q.shape[2], x.k.shape[2]
            hook_tensors.clear()
            hook_tensors.update({n: x.extra[n] for n in tensor_names})

            def visible(b, h, qi, ki):
                pos = qi + (length - q_len)
                allowed = visible_rule(pos, ki, causal=True, left=left)
                if mask_fn:
                    env = {"b": b, "h": h, "q_idx": pos, "kv_idx": ki}
                    allowed = allowed & mask_fn(env, hook_tensors)
                return allowed

            key = (x.q.shape[0], q_len, length)
            if key not in decode_masks:
                decode_masks[key] = create_block_mask(
                    visible, x.q.shape[0], x.q.shape[1] if mask_heads else None, q_len, length,
                    device="cuda")
            return compiled(x.q, x.k, x.v, block_mask=decode_masks[key], enable_gqa=ratio > 1)

        return run_decode

    softcap = plan.softcap
    score_fn = torch_fn(plan.spec.score_mod) if plan.score_mod else None

    def modify(score, b, h, qi, ki):
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        if score_fn:
            env = {"score": score, "b": b, "h": h, "q_idx": qi, "kv_idx": ki}
            score = score_fn(env, hook_tensors).to(score.dtype)
        return score

    score_mod = modify if softcap or score_fn else None

    if plan.varlen:

        def run_packed(x: Inputs):
            packed = x.packed
            total = packed.q.shape[0]
            if "flex" not in x.cache:
                cu = packed.cu_seqlens_q.long()
                doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device="cuda"), cu[1:] - cu[:-1])

                def same_sequence(b, h, qi, ki):  # equal q/k lengths: packed offsets are positions
                    return (doc[qi] == doc[ki]) & visible_rule(qi, ki, causal=causal, left=left,
                                                               right=right)

                x.cache["flex"] = create_block_mask(same_sequence, None, None, total, total,
                                                    device="cuda")
            q, k, v = (t.transpose(0, 1)[None] for t in (packed.q, packed.k, packed.v))
            out = compiled(q, k, v, block_mask=x.cache["flex"], enable_gqa=ratio > 1,
                           score_mod=score_mod)
            return out[0].transpose(0, 1)

        return run_packed

    def visible(b, h, qi, ki):
        allowed = visible_rule(qi, ki, causal=causal, left=left, right=right)
        if mask_fn:
            allowed = allowed & mask_fn({"b": b, "h": h, "q_idx": qi, "kv_idx": ki}, hook_tensors)
        return allowed

    masked = causal or left is not None or right is not None or mask_fn is not None
    masks: dict[tuple, Any] = {}

    def run(x: Inputs):
        key = (x.q.shape[2], x.k.shape[2])
        hook_tensors.clear()
        hook_tensors.update({n: x.extra[n] for n in tensor_names})
        if masked and key not in masks:
            masks[key] = create_block_mask(visible, x.q.shape[0] if mask_fn else None,
                                           x.q.shape[1] if mask_heads else None,
                                           key[0], key[1], device="cuda")
        return compiled(x.q, x.k, x.v, block_mask=masks.get(key), enable_gqa=ratio > 1,
                        score_mod=score_mod)

    return run


# --- FlashAttention-3 (the fa3-fwd wheel) --------------------------------------


def _fa3_module():
    """fa3_fwd_interface, whose code imports its build config under upstream's
    name, flash_attn_config: the wheel's own fa3_fwd_config is registered there first."""
    import fa3_fwd_config

    sys.modules["flash_attn_config"] = fa3_fwd_config
    import fa3_fwd_interface

    return fa3_fwd_interface


def _fa3_probe() -> Optional[Reason]:
    try:
        _fa3_module()
    except Exception as exc:  # noqa: BLE001 - any failure to load means not available here
        from specgen.bench.core import error_line

        return f"fa3 not available ({error_line(exc)}); pip install fa3-fwd"
    return None


def _fa3_shapes(suite: str, plan) -> Optional[Reason]:
    d, dv = plan.head_dim, plan.v_head_dim
    if d > 256:
        return f"FA3 takes head_dim up to 256, got {d}"
    if dv != d and (d, dv) != (192, 128):
        return f"FA3 takes v_head_dim = head_dim, or 128 with head_dim 192; got {d}/{dv}"
    return None


def _fa3(torch, suite: str, plan) -> Runner:
    """flash_attn_func on [B, S, H, D] copies (made once per inputs, untimed); GQA
    in the kernel; float8 with float32 descales [B, Hkv] (ones: the suite's unit
    descales). Decode: flash_attn_with_kvcache over the cache, its own split count."""
    fa3 = _fa3_module()
    causal, softcap = plan.causal, plan.softcap or 0.0

    def bshd(t):
        return t.transpose(1, 2).contiguous()

    if suite == "decode":

        def run_decode(x: Inputs):
            if "fa3" not in x.cache:
                x.cache["fa3"] = (bshd(x.q), bshd(x.k), bshd(x.v))
            q, k, v = x.cache["fa3"]
            out = fa3.flash_attn_with_kvcache(q, k, v, causal=False, softcap=softcap)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

        return run_decode

    def run(x: Inputs):
        if "fa3" not in x.cache:
            q, k, v = x.kernel_qkv or (x.q, x.k, x.v)
            descales = {}
            if q.dtype == torch.float8_e4m3fn:
                ones = torch.ones(k.shape[0], k.shape[1], dtype=torch.float32, device=q.device)
                descales = dict(q_descale=ones, k_descale=ones, v_descale=ones)
            x.cache["fa3"] = ((bshd(q), bshd(k), bshd(v)), descales)
        (q, k, v), descales = x.cache["fa3"]
        out = fa3.flash_attn_func(q, k, v, causal=causal, softcap=softcap, **descales)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return run


# --- TileGym (cuTile) ------------------------------------------------------------


def _tilegym_probe() -> Optional[Reason]:
    # find_spec, not import: importing tilegym patches cuda.tile.launch for the
    # whole process (see core.run's late pass).
    if importlib.util.find_spec("tilegym") is None:
        return "tilegym not available (not installed); pip install tilegym"
    return None


# A packed-document mask_mod: one int tensor of document ids along the sequence.
_DOCUMENT_MASK = re.compile(r"^\s*(\w+)\[b, q_idx\]\s*==\s*\1\[b, kv_idx\]\s*$")


def _document_tensor(plan) -> Optional[str]:
    """The document-id tensor of a spec whose only mask is ``doc[b, q_idx] ==
    doc[b, kv_idx]`` (with or without causal), else None."""
    hook = plan.mask_mod
    if hook is None or plan.score_mod is not None or plan.window_left is not None \
            or plan.window_right is not None or plan.softcap:
        return None
    found = _DOCUMENT_MASK.match(hook.source)
    return found.group(1) if found else None


def _tilegym_shapes(suite: str, plan) -> Optional[Reason]:
    d, dv = plan.head_dim, plan.v_head_dim
    if plan.mask_mod is not None:
        if suite != "prefill":
            return "TileGym has no masked or block-sparse backward"
        if _document_tensor(plan) is None:
            return ("TileGym's block-sparse prefill (prefill_attention_kv_ragged) runs packed-document "
                    "masks only, one sequence per document")
    if dv != d:
        return f"TileGym takes v_head_dim = head_dim, got {d}/{dv}"
    if suite != "decode" and d & (d - 1):
        return f"TileGym's fmha takes a power-of-two head_dim, got {d}"
    return None


def _tilegym(torch, suite: str, plan) -> Runner:
    """TileGym 1.5.1's cuTile attention: tile_fmha (forward), tile_fmha_with_backward
    (its autograd Function) and fmha_decode, on [B, H, S, D] with GQA in the kernel.
    Importing tilegym patches cuda.tile.launch process-wide, so core.run builds this
    only in its late pass, after every specgen kernel of the run."""
    from specgen.bench.core import note_launch_patched

    note_launch_patched("tilegym")
    causal = plan.causal
    if suite == "decode":
        from tilegym.ops.cutile.flash_decode import fmha_decode

        return lambda x: fmha_decode(x.q, x.k, x.v, None)
    if suite == "backward":
        from tilegym.ops.cutile.attention import tile_fmha_with_backward

        return lambda x: tile_fmha_with_backward(x.q, x.k, x.v, None, causal)
    if plan.mask_mod is not None:
        return _tilegym_documents(torch, plan)
    from tilegym.ops.cutile.attention import tile_fmha

    return lambda x: tile_fmha(x.q, x.k, x.v, scaling=None, is_causal=causal)


def _tilegym_documents(torch, plan) -> Runner:
    """A packed-document mask as TileGym's ragged prefill sees it: every document a
    sequence of its own (FlashInfer's layout, [T, H, D] rows of one document after
    another), so only the blocks inside a document are computed. The packing is
    made once per inputs, untimed."""
    from tilegym.suites.flashinfer.cutile import prefill_attention_kv_ragged

    name, causal = _document_tensor(plan), plan.causal
    scale = 1.0 / math.sqrt(plan.head_dim)

    def run(x: Inputs):
        if "tilegym" not in x.cache:
            batch, heads, seq, dim = x.q.shape
            ids = x.extra[name].reshape(-1)
            # A document starts where the id changes, and at every batch row.
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[1:] = ids[1:] != ids[:-1]
            starts[::seq] = True
            offsets = starts.nonzero().flatten()
            lengths = torch.diff(offsets, append=offsets.new_tensor([batch * seq]))
            packed = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[3]).contiguous()
                      for t in (x.q, x.k, x.v)]
            x.cache["tilegym"] = (packed, lengths.to(torch.int32), offsets.to(torch.int32),
                                  int(lengths.numel()), int(lengths.max()), (batch, seq, heads))
        (q, k, v), lengths, offsets, count, longest, (batch, seq, heads) = x.cache["tilegym"]
        out, _ = prefill_attention_kv_ragged(q, k, v, lengths, lengths, offsets, None, scale, 1.0,
                                             count, longest, is_causal=causal)
        return out.view(batch, seq, heads, -1).transpose(1, 2)

    return run


# --- the registry ----------------------------------------------------------------

_NONE = frozenset()
_SDPA = {"prefill": frozenset({"dropout", "varlen"}), "decode": _NONE, "backward": frozenset({"dropout"})}

REGISTRY: dict[str, Baseline] = {
    b.name: b
    for b in (
        Baseline("cudnn", "SDPA cuDNN", _SDPA, _sdpa("CUDNN_ATTENTION"), expands_kv=True,
                 default=True),
        Baseline("flash", "SDPA FA2", _SDPA, _sdpa("FLASH_ATTENTION"), expands_kv=True,
                 default=True),
        Baseline("flex", "FlexAttention",
                 {"prefill": frozenset({"window", "softcap", "score_mod", "mask_mod", "varlen"}),
                  "decode": frozenset({"window", "mask_mod"}),
                  "backward": frozenset({"window", "softcap", "score_mod", "mask_mod", "varlen"})},
                 _flex, default=True, note=FLEX_STATIC),
        Baseline("fa3", "FA3",
                 {"prefill": frozenset({"softcap"}), "decode": frozenset({"softcap"})},
                 _fa3, dtypes=frozenset({"bfloat16"}), float8=True,
                 absent={"backward": "FA3 (fa3-fwd) is a forward-only build"},
                 probe=_fa3_probe, shape_limits=_fa3_shapes),
        Baseline("tilegym", "TileGym",
                 {"prefill": frozenset({"mask_mod"}), "decode": _NONE, "backward": _NONE},
                 _tilegym, late=True, probe=_tilegym_probe, shape_limits=_tilegym_shapes),
    )
}
NAMES = tuple(REGISTRY)
DEFAULT = tuple(name for name, b in REGISTRY.items() if b.default)


def label(name: str) -> str:
    """A kernel's name as tables show it ("specgen" is the generated kernel)."""
    return "specgen (cuTile)" if name == "specgen" else REGISTRY[name].label if name in REGISTRY else name


def parse_baselines(text: str) -> tuple[str, ...]:
    """--baselines: comma-separated registry names, in the order given."""
    parts = [n.strip() for n in text.split(",")]
    if not all(parts):
        raise UsageError(f"--baselines: expected comma-separated names from {', '.join(NAMES)}, "
                         f"got {text!r}")
    names = tuple(dict.fromkeys(parts))
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise UsageError(
            f"--baselines: unknown {', '.join(unknown)}; allowed: {', '.join(NAMES)}"
        )
    return names

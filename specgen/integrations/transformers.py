"""A generated prefill kernel as a Hugging Face transformers attention backend.

One line, no monkey-patching::

    from specgen.integrations.transformers import register

    register("generated.fmha_gqa_causal")  # or a module object, or specs/x.yaml
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="specgen")

``register`` adds the kernel to transformers' ``AttentionInterface`` under ``name``
and gives the same name sdpa's mask builder in ``AttentionMaskInterface``. That
builder returns no mask when plain causal (or full) attention over the whole KV is
what the layer needs (no padding; prefill of an empty cache, or one new token);
those calls run the specgen kernel. Calls that come with a mask (padded batches,
chunked prefill against a filled cache, a sliding window that binds) fall back:
the kernel takes no arbitrary mask, and getting the numbers right comes first. The
fallback is transformers' own sdpa function, or, for a spec with a soft-cap or
sinks (which sdpa cannot apply), attention written in float32 torch operations
with the mask, the soft-cap and the sinks, as transformers' eager layers compute
it. ``stats`` on the returned function counts both kinds of call, and the first
fallback warns once. Under torch.compile a call is counted (and warned about) when
it is traced, once per compiled graph, not each time the compiled code runs: the
counts are never read or written in the traced code, where Dynamo guarded on them
(a recompile per forward) and the warning broke the graph.

What the layer asks for is checked against the spec before any launch, with a
ValueError that names both sides: causal or not, the GQA ratio, a sliding window
(window.left == sliding_window - 1; right 0 for a causal layer, == left for a
bidirectional one), a soft-cap, sinks (``s_aux``), dropout, and
gradients (only a ``backward: true`` spec is differentiable), the dtype and head
dims, ``output_attentions`` (the kernel forms no weights to return), and the layer
arguments that would change the result and that the kernel does not take (see
``DROPPED_ARGUMENTS``). These checks run on the fallback's calls too. The device is
checked by the generated ``attention`` itself.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Union

# Names transformers ships; registering over them would change every model that
# asks for them.
BUILTIN_NAMES = ("eager", "sdpa", "flash_attention_2", "flash_attention_3",
                 "flash_attention_4", "flex_attention")

# The way out of a window mismatch for models whose layers differ.
MIXED_LAYERS = ("; a model that mixes sliding and full layers registers a spec for each: "
                "register([sliding_spec, full_spec])")

# Layer arguments that change what attention computes and that neither the kernel
# nor the fallbacks take: given (not None), they are refused rather than dropped.
DROPPED_ARGUMENTS = {
    "position_bias": "an additive score bias, as T5's relative positions; write the bias "
                     "as the spec's score_mod, or use attn_implementation='sdpa' for this model",
    "head_mask": "a per-head scaling of the attention weights",
    "indices": "a sparse selection of keys per query, as DeepSeek-V3.2's top-k indexer "
               "gives; the kernel would attend to every key",
    "block_indices": "a sparse selection of key blocks per query; the kernel would attend "
                     "to every key",
    "sinks": "sink logits under a name other than s_aux, whose semantics the spec's "
             "sinks do not promise",
    "cu_seq_lens_q": "packed sequences (cu_seqlens); the kernel would attend across them",
    "cu_seq_lens_k": "packed sequences (cu_seqlens); the kernel would attend across them",
}


def load_kernel_module(module_or_spec: Union[ModuleType, str, Path]) -> ModuleType:
    """A generated module from a module object, a dotted module name
    (``generated.fmha_gqa_causal``), a generated ``.py`` file or a spec file
    (``.yaml``/``.yml``, validated and rendered in memory)."""
    if isinstance(module_or_spec, ModuleType):
        module = module_or_spec
    elif isinstance(module_or_spec, (str, Path)):
        text = str(module_or_spec)
        path = Path(text)
        if path.suffix in (".yaml", ".yml"):
            module = _module_from_spec(path)
        elif path.suffix == ".py":
            if not path.is_file():
                raise ValueError(f"register: no generated module at {text}")
            from specgen.check.gpu import import_module_file

            module = import_module_file(path)
        else:
            try:
                module = importlib.import_module(text)
            except ImportError as exc:
                raise ValueError(
                    f"register: cannot import {text!r} ({exc}); give a module, a dotted "
                    "module name, a generated .py file or a spec .yaml"
                ) from exc
    else:
        raise ValueError(
            "register: expected a generated module, a module name or a spec path, got "
            f"{type(module_or_spec).__name__}"
        )
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, dict) or not callable(getattr(module, "attention", None)):
        raise ValueError(
            f"register: {getattr(module, '__name__', module)!r} is not a specgen module "
            "(it needs SPEC and attention)"
        )
    family = spec.get("family", "prefill")
    unsupported = [
        why for why, bad in (
            (f"family {family!r} (decode kernels read a serving KV cache layout)", family != "prefill"),
            ("varlen (packed sequences take cu_seqlens)", spec.get("varlen")),
            ("float8_e4m3fn (needs descales)", spec.get("dtype") == "float8_e4m3fn"),
            ("tensors: (hook tensors have no source in a transformers layer)", spec.get("tensors")),
            ("a score_mod or mask_mod (a transformers layer's attention is plain; the hook "
             "would change what the model computes)", spec.get("score_mod") or spec.get("mask_mod")),
        ) if bad
    ]
    if unsupported:
        raise ValueError(
            f"register: spec {spec.get('name')!r} cannot serve as a transformers "
            f"attention backend: {'; '.join(unsupported)}"
        )
    return module


def _module_from_spec(path: Path) -> ModuleType:
    from specgen.compile.export import load_module_from_source
    from specgen.errors import SpecError
    from specgen.plan.make import make_plan
    from specgen.emit.render import render
    from specgen.spec import load_spec

    try:
        plan = make_plan(load_spec(path))
    except SpecError as exc:
        raise ValueError(f"register: {'; '.join(exc.lines())}") from exc
    rendered = render(plan, str(path))
    return load_module_from_source(plan.module_name, rendered.text, f"<specgen {path}>")


# The devices whose autocast state the adapter reads (torch.is_autocast_enabled raises
# for some others, such as meta).
_AUTOCAST_DEVICES = ("cuda", "cpu")


def masked_attention(query, key, value, mask, *, scale: float, softcap=None, sinks=None,
                     dropout: float = 0.0):
    """Attention under a transformers mask, in float32 torch operations: the fallback
    for a spec whose soft-cap or sinks transformers' sdpa function cannot apply.

    ``query`` [B, Hq, Sq, D], ``key``/``value`` [B, Hkv, Skv, D]; ``mask`` boolean
    (True: attend) or additive, broadcastable to [B, Hq, Sq, Skv]; a 4-D mask's key
    axis may be longer (a static cache's), as transformers' mask builders give it.
    Scores a boolean mask hides take float32's lowest value, as transformers' eager
    layers do, so a row with no visible key averages V; an additive mask is added as
    given (a row of -inf gives NaN, as in eager, unless a sink joins it). A sink logit
    (one per query head) joins every row's normaliser. Returns [B, Sq, Hq, Dv] in the
    query's dtype.
    """
    import torch

    # Inside torch.autocast (mixed-precision training) the matmuls would run in its
    # lower precision: the scores and the weighted sum in bfloat16, not float32.
    device = query.device.type
    autocast_off = (torch.autocast(device, enabled=False)
                    if torch._C._is_any_autocast_enabled() and device in _AUTOCAST_DEVICES
                    else contextlib.nullcontext())
    with autocast_off:
        return _masked_attention(query, key, value, mask, scale=scale, softcap=softcap,
                                 sinks=sinks, dropout=dropout)


def _masked_attention(query, key, value, mask, *, scale, softcap, sinks, dropout):
    import torch

    groups = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(groups, dim=1)
    v = value.float().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask.dim() == 4:
        mask = mask[:, :, :, : key.shape[-2]]
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask.float()
    if sinks is not None:
        column = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, column], dim=-1)
    weights = torch.softmax(scores, dim=-1)
    if sinks is not None:
        weights = weights[..., :-1]
    if dropout > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout, training=True)
    return torch.matmul(weights, v).to(query.dtype).transpose(1, 2).contiguous()


def sliding_window_of(spec: dict):
    """The transformers ``sliding_window`` a spec serves: left + 1 of its window, or
    None (full attention) for a spec without one; a window with no left bound serves
    no layer (-1)."""
    window = spec.get("window")
    if window is None:
        return None
    return -1 if window.get("left") is None else window["left"] + 1


def make_attention_function(module: Union[ModuleType, list, tuple]) -> Callable:
    """The function transformers calls in each attention layer:
    ``(layer, query [B, Hq, Sq, D], key, value [B, Hkv, Skv, D], attention_mask,
    **kwargs) -> (out [B, Sq, Hq, Dv], None)``.

    Several modules (a list) serve a model whose layers differ in their sliding
    window (Gemma 2 and 3, gpt-oss: sliding and full layers): each call runs the one
    whose window is the layer's ``sliding_window`` (none for a full layer)."""
    if isinstance(module, (list, tuple)):
        return _dispatching_function(list(module))
    return _layer_function(module, {"kernel": 0, "fallback": 0})


def _dispatching_function(modules: list) -> Callable:
    if not modules:
        raise ValueError("register: give at least one generated module or spec")
    stats = {"kernel": 0, "fallback": 0}
    by_window: dict = {}
    for module in modules:
        window = sliding_window_of(module.SPEC)
        if window == -1:
            raise ValueError(
                f"register: spec {module.SPEC.get('name')!r} has a window with no left bound "
                f"({module.SPEC.get('window')}), which no transformers layer's sliding_window "
                "describes")
        if window in by_window:
            raise ValueError(
                f"register: specs {by_window[window].module.SPEC.get('name')!r} and "
                f"{module.SPEC.get('name')!r} both serve "
                + ("full-attention layers" if window is None else f"sliding_window {window}")
                + "; give one kernel per kind of layer")
        by_window[window] = _layer_function(module, stats, in_list=True)
    served = ", ".join("full attention" if w is None else f"sliding_window {w}" for w in by_window)

    def attention_function(layer, query, key, value, attention_mask, **kwargs):
        sliding = kwargs.get("sliding_window")
        chosen = by_window.get(sliding)
        if chosen is None:
            raise ValueError(
                "specgen: the layer has "
                + ("no sliding window" if sliding is None else f"sliding_window {sliding}")
                + f" and the registered kernels serve {served}; register a spec for it too")
        return chosen(layer, query, key, value, attention_mask, **kwargs)

    attention_function.stats = stats
    attention_function.modules = modules  # (a single registration has .module)
    attention_function.__name__ = "specgen_" + "_".join(m.SPEC.get("name") for m in modules)
    return attention_function


def _count(at_trace: Callable, count: Callable[[], None]) -> None:
    """Count a call (``stats``, the first fallback's warning). Outside torch.compile
    ``count`` runs. Under it, Dynamo calls ``at_trace`` (``count`` taking comptime's
    context) while it traces, so a call is counted once per traced graph, not each
    time the compiled code runs: read or written in the traced code, the counts were
    guarded (a recompile on every call, the model run eagerly past the recompile
    limit, FailOnRecompileLimitHit under fullgraph=True) and the warning was a graph
    break. Other tracers (torch.export's non-strict mode) run Python: ``count`` runs.
    ``at_trace`` is made before tracing (comptime refuses a function that the traced
    code makes with free variables)."""
    import torch

    if not torch.compiler.is_compiling():
        count()
        return
    from torch._dynamo.comptime import comptime

    comptime(at_trace, count)


def _layer_function(module: ModuleType, stats: dict, in_list: bool = False) -> Callable:
    """One kernel's attention function; ``stats`` counts its calls. ``in_list``: one of
    several registered together (its refusals do not suggest registering a list)."""
    import torch

    spec = module.SPEC
    kernel = module.attention
    causal_spec = bool(spec.get("causal"))
    ratio = spec.get("gqa_ratio", 1)
    window = spec.get("window")
    return_lse = bool(spec.get("return_lse"))
    # Masked calls of a soft-cap or sinks spec, which sdpa cannot apply, run masked_attention.
    torch_fallback = bool(spec.get("softcap") or spec.get("sinks"))
    name = spec.get("name")
    dtype, head_dim = getattr(torch, spec["dtype"]), spec["head_dim"]
    v_head_dim = spec.get("v_head_dim") or head_dim

    def autocast(*tensors):
        """Inside torch.autocast whose lower precision is the spec's dtype, the layer's
        float32 (or other half-precision) query, key and value in that dtype, as sdpa
        takes them: mixed-precision training keeps float32 weights, and rotary
        embeddings in float32 make the query and key float32 while the value is not."""
        if not torch._C._is_any_autocast_enabled():
            return tensors
        device = tensors[0].device.type
        if (device not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(device)
                or torch.get_autocast_dtype(device) != dtype):
            return tensors
        # float64 (and float8) stay as given, and are refused: autocast leaves float64 alone.
        castable = (torch.float32, torch.float16, torch.bfloat16)
        return tuple(t.to(dtype) if t.dtype in castable else t for t in tensors)

    def draw_seed() -> int:
        """A dropout seed from torch's CPU generator. Under a tracer of torch modes
        (make_fx, torch.export's non-strict mode) the draw is a real one, outside the
        modes, and the trace holds it as a constant as it held Python's random draw:
        a traced draw is a data-dependent int there, which those tracers refuse. The
        device is named: under ``with torch.device("cuda")`` the draw was a CUDA
        tensor, its int() a device sync per layer."""
        with contextlib.ExitStack() as modes_off:
            if not torch.compiler.is_dynamo_compiling() and (
                    torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()):
                from torch.utils._python_dispatch import _disable_current_modes

                modes_off.enter_context(_disable_current_modes())
                modes_off.enter_context(torch._C.DisableTorchFunction())
            return int(torch.randint(2**31 - 1, (), device="cpu"))

    def real(what: str, number) -> float:
        """The layer's ``scaling`` or ``dropout`` as a float: a real number, NumPy's
        too, not a bool or a string (float() took True and "0.1"). .item() reads a
        NumPy scalar, under torch.compile too, where dynamo shows it as an array."""
        if type(number).__module__ == "numpy" and getattr(number, "ndim", None) == 0:
            number = number.item()
        if isinstance(number, bool) or not isinstance(number, numbers.Real):
            raise ValueError(f"specgen {name}: the layer's {what} must be a float, got {number!r}")
        return float(number)

    def needs_grad(*tensors) -> bool:
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in tensors)

    def check(layer, query, key, value, dropout: float, kwargs) -> dict:
        """Kernel keyword arguments for this call, or a ValueError naming the mismatch.
        Run on every call, the fallback's too: a model the kernel cannot serve fails
        at once, not only on the batches without a mask."""
        extra: dict[str, Any] = {}
        if kwargs.get("output_attentions"):
            raise ValueError(
                f"specgen {name}: output_attentions=True asks for the attention weights, "
                "which the kernel never forms; use attn_implementation='eager' for them"
            )
        for what, t, want in (("query", query, head_dim), ("key", key, head_dim),
                              ("value", value, v_head_dim)):
            if t.dtype != dtype or t.shape[-1] != want:
                raise ValueError(
                    f"specgen {name}: the layer's {what} is {t.dtype} with head_dim "
                    f"{t.shape[-1]}; the spec has dtype {spec.get('dtype')} and head_dim {want}"
                )
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(layer, "is_causal", True)
        if bool(is_causal) != causal_spec:
            raise ValueError(
                f"specgen {name}: the layer is {'causal' if is_causal else 'non-causal'} "
                f"and the spec has causal: {str(causal_spec).lower()}"
            )
        if query.dim() == 4 and key.dim() == 4 and key.shape[1] * ratio != query.shape[1]:
            raise ValueError(
                f"specgen {name}: the layer has {query.shape[1]} query heads and "
                f"{key.shape[1]} KV heads; the spec has gqa_ratio {ratio}"
            )
        for argument, what in DROPPED_ARGUMENTS.items():
            if kwargs.get(argument) is not None:
                raise ValueError(
                    f"specgen {name}: the layer passes {argument} ({what}), which the "
                    "kernel does not take"
                )
        sliding = kwargs.get("sliding_window")
        # transformers' sliding_window W: a causal layer sees keys p - (W - 1) .. p, a
        # bidirectional one (ModernBERT, Gemma 3 with use_bidirectional_attention) keys
        # p - (W - 1) .. p + W - 1, so its window's right bound is its left one; a right
        # of 0 there ran a one-sided window on the kernel's (unmasked) calls.
        left = sliding - 1 if isinstance(sliding, int) else "N - 1"
        if window is None and sliding is not None:
            raise ValueError(
                f"specgen {name}: the layer has sliding_window {sliding} and the spec has no "
                f"window; give the spec window: {{left: {left}, right: {0 if causal_spec else left}}}"
                f"{'' if in_list else MIXED_LAYERS}"
            )
        if window is not None:
            rights = (None, 0) if causal_spec else (window.get("left"),)
            if sliding is None or window.get("left") != sliding - 1 or window.get("right") not in rights:
                raise ValueError(
                    f"specgen {name}: the spec's window {window} needs a layer with "
                    f"sliding_window == left + 1 (and right "
                    + ("0 or null: the layer is causal" if causal_spec
                       else "== left: the layer is bidirectional")
                    + f"), and the layer has sliding_window {sliding}"
                    f"{'' if in_list else MIXED_LAYERS}"
                )
        softcap = kwargs.get("softcap")
        if (softcap or None) != spec.get("softcap"):
            raise ValueError(
                f"specgen {name}: the layer's soft-cap is {softcap} and the spec's "
                f"softcap is {spec.get('softcap')}"
            )
        sinks = kwargs.get("s_aux")
        if spec.get("sinks"):
            if sinks is None:
                raise ValueError(f"specgen {name}: the spec has sinks and the layer passes no s_aux")
            extra["sinks"] = sinks
        elif sinks is not None:
            raise ValueError(f"specgen {name}: the layer passes sinks (s_aux) and the spec has none")
        if dropout > 0.0:
            if not spec.get("dropout"):
                raise ValueError(
                    f"specgen {name}: the layer asks for attention dropout {dropout} and "
                    "the spec has dropout: false"
                )
            # A fresh seed per call from torch's CPU generator (no device sync), so
            # that torch.manual_seed reproduces a run and activation checkpointing,
            # which restores torch's RNG state before it recomputes a layer, draws
            # the forward's seed again: the backward then drops the same weights.
            extra.update(dropout_p=dropout, seed=draw_seed())
        if needs_grad(query, key, value, sinks) and not spec.get("backward"):
            raise ValueError(
                f"specgen {name}: gradients are required and the spec has no backward "
                "kernels; set backward: true in the spec (or use torch.no_grad())"
            )
        return extra

    def count_kernel() -> None:
        stats["kernel"] += 1

    def count_fallback() -> None:
        stats["fallback"] += 1
        if stats["fallback"] == 1:
            warnings.warn(
                f"specgen {name}: a call with an attention mask (padding, or a "
                "filled cache under chunked prefill) runs "
                + ("float32 torch attention (soft-cap, sinks)" if torch_fallback
                   else "transformers' sdpa")
                + " instead; see specgen.integrations.transformers",
                # count_fallback, _count, the layer function, (a list registration's
                # dispatching function,) its caller: the model's line
                stacklevel=5 if in_list else 4,
            )

    # count_kernel and count_fallback as comptime calls them under torch.compile.
    kernel_at_trace = lambda ctx: count_kernel()  # noqa: E731
    fallback_at_trace = lambda ctx: count_fallback()  # noqa: E731

    def attention_function(layer, query, key, value, attention_mask, scaling=None,
                           dropout=0.0, **kwargs):
        query, key, value = autocast(query, key, value)
        dropout = 0.0 if dropout is None else real("dropout", dropout)
        extra = check(layer, query, key, value, dropout, kwargs)
        scale = real("scaling", scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        if attention_mask is not None:
            _count(fallback_at_trace, count_fallback)
            if torch_fallback:
                return masked_attention(query, key, value, attention_mask, scale=scale,
                                        softcap=spec.get("softcap"), sinks=extra.get("sinks"),
                                        dropout=dropout), None
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(layer, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, **kwargs)
        q_len, kv_len = query.shape[2], key.shape[2]
        q_offset = 0
        if causal_spec:
            if q_len == 1:  # one new token sees the whole cache
                q_offset = kv_len - 1
            elif kv_len > q_len:
                # No mask and more keys than queries: a static cache's empty tail
                # after a prefill from position 0 (transformers' sdpa path slices
                # it off the same way).
                key, value = key[:, :, :q_len], value[:, :, :q_len]
        if needs_grad(query, key, value, extra.get("sinks")):
            # Autograd owns the kernel's output. A generated module lays it out in
            # query's order of axes (transformers' [B, Sq, Hq, Dv] here), so this
            # .contiguous() is a view, not a copy.
            out = kernel(query, key, value, scale=scale, q_offset=q_offset, **extra)
            if return_lse:  # (out, lse): the layer has no use for the LSE
                out = out[0]
            out = out.transpose(1, 2).contiguous()
        else:
            # The kernel stores transformers' layout [B, Sq, Hq, Dv] itself, through a
            # transposed view of it: no copy of the output follows.
            out = query.new_empty((query.shape[0], q_len, query.shape[1], v_head_dim))
            kernel(query, key, value, scale=scale, q_offset=q_offset, out=out.transpose(1, 2), **extra)
        _count(kernel_at_trace, count_kernel)
        return out, None

    attention_function.stats = stats
    attention_function.module = module
    attention_function.__name__ = f"specgen_{name}"
    return attention_function


def register(module_or_spec: Union[ModuleType, str, Path, list, tuple],
             name: str = "specgen") -> Callable:
    """Register a generated kernel as transformers attention backend ``name``;
    ``from_pretrained``/``from_config(..., attn_implementation=name)`` then uses it.
    A list registers one kernel per kind of layer, for models that mix sliding and
    full layers: ``register(["specs/local.yaml", "specs/global.yaml"])``; each call
    runs the kernel whose window is the layer's ``sliding_window``.

    Returns the registered function; its ``stats`` dict counts the calls that ran
    a kernel and those that fell back (calls with a mask), and ``module`` (a list
    registration: ``modules``) holds the generated module(s).

    Raises:
        ValueError: a module or spec cannot serve (decode, varlen, fp8, hook
            tensors), two serve the same kind of layer, or ``name`` is not a new
            identifier.
        ImportError: transformers is not installed.
    """
    if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"register: name must be letters, digits, '_' or '-', got {name!r}")
    if name in BUILTIN_NAMES:
        raise ValueError(
            f"register: {name!r} is one of transformers' own backends "
            f"({', '.join(BUILTIN_NAMES)}); choose another name"
        )
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError(
            "specgen.integrations.transformers needs transformers>=4.56 "
            "(pip install 'transformers>=4.56')"
        ) from exc
    if isinstance(module_or_spec, (list, tuple)):
        module = [load_kernel_module(one) for one in module_or_spec]
    else:
        module = load_kernel_module(module_or_spec)
    function = make_attention_function(module)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    return function

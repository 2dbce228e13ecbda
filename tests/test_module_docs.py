"""What a generated module's own documentation says, run on the CPU (the kernels
emulated): the Usage call of its docstring works as written, and the rules its
docstrings state (which lengths are refused, what a block map is tied to, what a
decode call allocates) are the ones its launcher follows."""

import re

import pytest
import torch

from specgen.check import emulate
from specgen.check.cases import (
    FP8_DESCALES,
    feature_inputs,
    random_decode,
    random_packed,
    random_qkv,
    shape_dims,
)

from .helpers import (
    DECODE_SPEC_NAMES,
    DENSE_SPEC_NAMES,
    VARLEN_SPEC_NAMES,
    emulated_module,
    emulated_spec_module,
    prefill_variant_data,
)
from .test_allocations import _Allocations

_MODULES = {}


def _module(name):
    """The generated module ``name`` with its kernels emulated (loaded once per process)."""
    if name not in _MODULES:
        _MODULES[name] = emulated_module(name, "module_docs")
    return _MODULES[name]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _usage_line(module) -> str:
    """The call of the module docstring's Usage block, its comment dropped."""
    usage = module.__doc__.split("Usage::", 1)[1]
    calls = [line.strip() for line in usage.splitlines() if "attention(" in line]
    assert len(calls) == 1, calls
    return calls[0].split("  #", 1)[0]


def _usage_names(module) -> dict:
    """The names a Usage call reads, with values of the module's shapes: the tensors,
    the keyword tensors the spec adds (sinks, hook tensors, cu_seqlens, the page
    table) and the descales."""
    spec, gen = module.SPEC, _gen(1)
    if spec["family"] == "decode":
        q_len = spec.get("max_q_len", 1)
        batch = random_decode(spec, [40, q_len + 3], 1, q_len, generator=gen, device="cpu")
        names = dict(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache,
                     seq_lens=batch.seq_lens, page_table=batch.page_table,
                     k_scale=FP8_DESCALES["k_descale"], v_scale=FP8_DESCALES["v_descale"])
        dims = batch.dims()
    elif spec["varlen"]:
        batch = random_packed(spec, [(5, 9), (17, 17)], 1, generator=gen, device="cpu")
        names = dict(q=batch.q, k=batch.k, v=batch.v, cu_seqlens_q=batch.cu_seqlens_q,
                     cu_seqlens_k=batch.cu_seqlens_k)
        dims = {"batch": 2, "heads": batch.q.shape[1], "kv_heads": batch.k.shape[1],
                "seq_q": 17, "seq_k": 17}
    else:
        q, k, v = random_qkv(spec, 2, 1, 24, 40, generator=gen, device="cpu")
        names, dims = dict(q=q, k=k, v=v), shape_dims(q, k)
    names.update(feature_inputs(spec, dims, generator=gen, device="cpu"))
    return names


@pytest.mark.parametrize("name", DENSE_SPEC_NAMES + VARLEN_SPEC_NAMES + DECODE_SPEC_NAMES)
def test_the_usage_call_of_the_module_docstring_runs_as_written(name):
    """Every module's Usage line is a call that attention takes: it names the keyword
    tensors the spec makes required (a hook tensor, sinks, a packed batch's
    cu_seqlens) and unpacks what attention returns ((out, lse) with return_lse).
    Was: `out = attention(q, k, v)` for every prefill module, a TypeError for those
    with required keywords (ALiBi's slope, a document mask's doc, sinks, varlen's
    cu_seqlens) and an `out` that was a tuple for the modules that return the LSE."""
    module = _module(name)
    line = _usage_line(module)
    names = {**_usage_names(module), "attention": module.attention}
    with emulate.emulating(), torch.no_grad():
        exec(line, names)  # noqa: S102 - the module's own Usage line
    assert isinstance(names["out"], torch.Tensor), line
    if "lse" in line.split("=", 1)[0]:
        assert isinstance(names["lse"], torch.Tensor), line


@pytest.mark.parametrize("name", ["fmha_gqa_causal", "fmha_gptoss_sinks", "fmha_train_gqa_causal"])
def test_the_lengths_the_docstring_allows_are_the_ones_attention_takes(name):
    """Skv = 0 with Sq > 0 is refused (no key at all), which the docstring says
    (was: "Sq and Skv are arbitrary"); Sq = 0 with Skv = 0 is taken."""
    module = _module(name)
    doc = module.attention.__doc__
    assert "Sq and Skv are arbitrary;" not in doc
    assert "Skv = 0 with Sq > 0 (refused" in doc
    q, k, v = random_qkv(module.SPEC, 1, 1, 5, 0, generator=_gen(), device="cpu")
    extra = feature_inputs(module.SPEC, shape_dims(q, k), generator=_gen(), device="cpu")
    with emulate.emulating(), torch.no_grad():
        with pytest.raises(ValueError, match="at least one key"):
            module.attention(q, k, v, **extra)
        module.attention(q[:, :, :0], k, v, **extra)


def _map_call(module, q, k, v, extra):
    """make_block_map's arguments for attention(q, k, v, **extra)."""
    hooks = {n: extra[n] for n in module.SPEC["tensors"]}
    return (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), hooks


# A block-sparse spec whose hook tensor only its score_mod reads: its block map does
# not depend on the tensor.
_SCORE_ONLY_HOOK = {"tensors": {"slope": {"dtype": "float32", "shape": ["heads"]}},
                    "score_mod": "score - slope[h] * (q_idx - kv_idx)",
                    "mask_mod": "q_idx // 64 == kv_idx // 64", "block_sparse": True}


@pytest.mark.parametrize("name", ["fmha_document_mask", "fmha_chunked_local", "score_only_hook"])
def test_make_block_map_says_what_the_map_is_tied_to(name):
    """make_block_map's docstring claims attention refuses a map with other hook
    tensors only where it does (tensors the mask_mod reads), and names the default
    device it uses: a spec without hook tensors builds on the current device (was:
    "that of the hook tensors", of a module that has none, and "attention refuses it
    with other tensors" of maps that no tensor ties)."""
    if name == "score_only_hook":
        module = emulated_spec_module(prefill_variant_data("score_only_hook", _SCORE_ONLY_HOOK),
                                      "module_docs")
    else:
        module = _module(name)
    doc = module.make_block_map.__doc__
    q, k, v = random_qkv(module.SPEC, 1, 1, 100, 100, generator=_gen(), device="cpu")
    extra = feature_inputs(module.SPEC, shape_dims(q, k), generator=_gen(), device="cpu")
    sizes, hooks = _map_call(module, q, k, v, extra)
    with emulate.emulating(), torch.no_grad():
        block_map = module.make_block_map(*sizes, **hooks)
        assert block_map.device == torch.device("cpu")  # the emulated current device
        refused = []
        for n in hooks:
            try:
                module.attention(q, k, v, **{**extra, n: extra[n].clone()}, block_map=block_map)
            except ValueError as error:
                assert "block_map was built from another" in str(error)
                refused.append(n)
    claims = "attention refuses it with other" in doc
    assert claims == bool(refused), (refused, doc)
    if hooks:
        assert f"(default: that of {next(iter(hooks))})" in doc
    else:
        assert "(default: the current one)" in doc
        assert "hook tensors" not in doc


def test_a_block_sparse_decode_docstring_names_the_map_a_call_without_one_builds():
    """The decode module's docstring promises no allocation after the first call of a
    shape but the output: a block-sparse decode call with block_map=None builds its
    map each call, which the docstring now says; with a map, the output alone."""
    module = _module("fmha_decode_chunked_local")
    batch = random_decode(module.SPEC, [600, 700], 1, 1, generator=_gen(), device="cpu")
    with emulate.emulating(), torch.no_grad():
        module._forward(*batch.args())
        block_map = module.make_block_map(batch.seq_lens, batch.q.shape[2], batch.k_cache.shape[1])
        made, launch = {}, module.ct.launch
        try:
            for label, kwargs in (("none", {}), ("map", {"block_map": block_map})):
                log = _Allocations(module)  # wraps module.ct.launch
                with log:
                    module._forward(*batch.args(), **kwargs)
                made[label] = log.made
        finally:
            module.ct.launch = launch
    assert made["map"] == [("empty", tuple(batch.q.shape))]
    assert len(made["none"]) > 1  # the output and the map's tensors
    design = re.sub(r"\s+", " ", module.__doc__)
    assert "allocation but the output (and a call's own block map where it passes block_map=None" in design

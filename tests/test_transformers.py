"""specgen.integrations.transformers on the CPU: the adapter's glue (layouts, GQA,
q_offset for decode steps, the mask fallback, the checks) around a stand-in for a
generated module whose ``attention`` is the fp64 reference. The real kernels run
in tests/test_gpu.py (test_transformers_*)."""

import re
import types
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specgen.integrations import transformers as tf_integration  # noqa: E402
from specgen.check.reference import attention_reference  # noqa: E402
from .helpers import qwen2_model  # noqa: E402


def stand_in(**spec_fields):
    """A module shaped like a generated prefill module, computing with the reference."""
    spec = {"name": "stand_in", "family": "prefill", "dtype": "float32", "head_dim": 32,
            "gqa_ratio": 2, "causal": True, "window": None, "softcap": None, "sinks": False,
            "dropout": False, "varlen": False, "tensors": {}, "return_lse": False,
            "backward": False}
    spec.update(spec_fields)
    module = types.ModuleType("stand_in")
    module.SPEC = spec
    module.calls, module.outs = [], []

    def attention(q, k, v, *, scale=None, q_offset=0, out=None, **extra):
        module.calls.append((tuple(q.shape), tuple(k.shape), q_offset, extra))
        module.outs.append(out)
        assert q.shape[1] == spec["gqa_ratio"] * k.shape[1]
        # Both bounds: a bidirectional sliding layer's right one decides its result.
        window = (spec["window"]["left"], spec["window"].get("right")) if spec["window"] else None
        result = attention_reference(q, k, v, causal=spec["causal"], scale=scale,
                                     q_offset=q_offset, window=window).to(q.dtype)
        if out is None:
            return result
        assert out.shape == result.shape and out.stride(-1) == 1  # as a generated module checks
        return out.copy_(result)

    module.attention = attention
    return module


def tiny_qwen2(implementation: str, seed: int = 0):
    return qwen2_model(implementation, "tiny", torch.float32, seed=seed).eval()


def test_logits_and_greedy_generation_match_sdpa():
    module = stand_in()
    function = tf_integration.register(module, name="specgen-cpu-test")
    ours, sdpa = tiny_qwen2("specgen-cpu-test"), tiny_qwen2("sdpa")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(ids).logits, sdpa(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert function.stats["kernel"] == 2 and function.stats["fallback"] == 0
    # Prefill then 12 decode steps: every step is a kernel call with q_offset = Skv - 1.
    with torch.no_grad():
        gen_a = ours.generate(ids, max_new_tokens=12, do_sample=False)
        gen_b = sdpa.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(gen_a, gen_b)
    decode_calls = [c for c in module.calls if c[0][2] == 1]
    assert decode_calls and all(off == kv[2] - 1 for _, kv, off, _ in decode_calls)
    assert function.stats["fallback"] == 0
    # Without gradients the kernel writes transformers' layout itself: out is a
    # transposed view of a [B, Sq, Hq, D] buffer, so no copy follows.
    assert module.outs and all(o is not None and o.transpose(1, 2).is_contiguous() for o in module.outs)
    assert any(not o.is_contiguous() for o in module.outs)  # the prefill's


def test_padded_batch_falls_back_to_sdpa_with_one_warning():
    function = tf_integration.register(stand_in(), name="specgen-cpu-pad")
    ours, sdpa = tiny_qwen2("specgen-cpu-pad"), tiny_qwen2("sdpa")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        a = ours(ids, attention_mask=mask).logits
        b = sdpa(ids, attention_mask=mask).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert function.stats == {"kernel": 0, "fallback": 2}
    (warned,) = [w for w in caught if "runs transformers' sdpa instead" in str(w.message)]
    assert "modeling_qwen2" in warned.filename  # the model's line that called the layer


def test_a_list_registrations_fallback_warning_points_at_the_models_line():
    """A list (one kernel per kind of layer, as Gemma 2's pair) calls the layer's
    function from its dispatching one: one frame more, and the warning named
    specgen's own dispatcher line instead of the model's."""
    full, sliding = stand_in(), stand_in(window={"left": 63, "right": None}, name="sliding")
    tf_integration.register([full, sliding], name="specgen-cpu-pad-list")
    ours = tiny_qwen2("specgen-cpu-pad-list")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        ours(ids, attention_mask=mask)
    (warned,) = [w for w in caught if "runs transformers' sdpa instead" in str(w.message)]
    assert "modeling_qwen2" in warned.filename, warned.filename


@pytest.mark.parametrize("fields, message", [
    ({"gqa_ratio": 4}, "4 query heads and 2 KV heads; the spec has gqa_ratio 4"),
    ({"causal": False}, "the layer is causal and the spec has causal: false"),
    ({"window": {"left": 63, "right": None}}, "needs a layer with sliding_window == left + 1"),
    ({"softcap": 30.0}, "the layer's soft-cap is None and the spec's softcap is 30.0"),
    ({"dtype": "bfloat16"}, "the layer's query is torch.float32 with head_dim 32; the spec has "
                            "dtype bfloat16 and head_dim 32"),
    ({"head_dim": 64}, "the layer's query is torch.float32 with head_dim 32; the spec has dtype "
                       "float32 and head_dim 64"),
])
def test_mismatched_spec_is_refused_before_any_launch(fields, message):
    module = stand_in(**fields)
    tf_integration.register(module, name="specgen-cpu-bad")
    model = tiny_qwen2("specgen-cpu-bad")
    with pytest.raises(ValueError, match=re.escape(message)), torch.no_grad():
        model(torch.zeros((1, 8), dtype=torch.long))
    assert module.calls == []


@pytest.mark.parametrize("fields", [{"dtype": "bfloat16"}, {"head_dim": 64}])
def test_a_spec_of_another_dtype_or_head_dim_is_refused_on_padded_batches_too(fields):
    """A padded batch goes to sdpa; it is still checked, so a model the kernel cannot
    serve fails on its first call, whatever the batch."""
    module = stand_in(**fields)
    function = tf_integration.register(module, name="specgen-cpu-bad-padded")
    model = tiny_qwen2("specgen-cpu-bad-padded")
    ids = torch.zeros((2, 8), dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="the spec has dtype"), torch.no_grad():
        model(ids, attention_mask=mask)
    assert function.stats == {"kernel": 0, "fallback": 0}


@pytest.mark.parametrize("kwargs, message", [
    ({"position_bias": torch.zeros(1, 4, 8, 8)}, "the layer passes position_bias"),
    ({"head_mask": torch.ones(4)}, "the layer passes head_mask"),
    ({"indices": torch.zeros(1, 8, 4, dtype=torch.long)}, "the layer passes indices (a sparse "
                                                          "selection of keys per query"),
    ({"block_indices": torch.zeros(1, 8, 2, dtype=torch.long)}, "the layer passes block_indices"),
    ({"sinks": torch.zeros(4)}, "the layer passes sinks (sink logits under a name other than s_aux"),
    ({"cu_seq_lens_q": torch.tensor([0, 8], dtype=torch.int32)}, "the layer passes cu_seq_lens_q"),
    ({"sliding_window": 4}, "the layer has sliding_window 4 and the spec has no window; give the spec "
                            "window: {left: 3, right: 0}"),
])
def test_layer_arguments_the_kernel_would_drop_are_refused(kwargs, message):
    """A T5-style position_bias, a head_mask, a sparse key selection (DeepSeek-V3.2's
    indexer passes indices= to every backend but eager and sdpa), sinks under another
    name, packed cu_seqlens or a sliding window that the spec lacks used to be dropped
    on the kernel's path (3.6 off sdpa for a position_bias; indices: 0.65 off the
    sparse attention)."""
    module = stand_in()
    function = tf_integration.make_attention_function(module)
    layer = types.SimpleNamespace(is_causal=True)
    q = torch.zeros(1, 4, 8, 32)
    kv = torch.zeros(1, 2, 8, 32)
    with pytest.raises(ValueError, match=re.escape(message)):
        function(layer, q, kv, kv, None, **kwargs)
    assert module.calls == []
    function(layer, q, kv, kv, None, position_bias=None, sliding_window=None)  # None is no argument
    assert len(module.calls) == 1


def test_output_attentions_is_refused():
    module = stand_in()
    tf_integration.register(module, name="specgen-cpu-weights")
    model = tiny_qwen2("specgen-cpu-weights")
    with pytest.raises(ValueError, match="output_attentions=True asks for the attention weights"), \
            torch.no_grad():
        model(torch.zeros((1, 8), dtype=torch.long), output_attentions=True)
    assert module.calls == []


def test_gradients_need_a_backward_spec():
    module = stand_in()
    tf_integration.register(module, name="specgen-cpu-grad")
    model = tiny_qwen2("specgen-cpu-grad").train()
    with pytest.raises(ValueError, match="set backward: true"):
        model(torch.zeros((1, 8), dtype=torch.long))
    assert module.calls == []


def test_a_training_call_takes_the_kernels_own_output():
    """With gradients the kernel allocates its output (autograd owns it) and the
    adapter hands transformers a copy in its layout; the loss matches sdpa's."""
    module = stand_in(backward=True)
    tf_integration.register(module, name="specgen-cpu-train")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for implementation in ("specgen-cpu-train", "sdpa"):
        model = tiny_qwen2(implementation).train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-4, rtol=1e-4)
    assert module.outs and all(o is None for o in module.outs)


@pytest.mark.parametrize("target, message", [
    ("specs/fmha_decode_gqa8_bf16.yaml", "family 'decode'"),
    ("specs/fmha_varlen_llama.yaml", "varlen"),
    ("specs/fmha_fp8_llama.yaml", "float8_e4m3fn"),
    ("specs/fmha_alibi.yaml", "tensors:"),
    ("specs/fmha_chunked_local.yaml", "a score_mod or mask_mod"),
    ("no.such.module", "cannot import 'no.such.module'"),
    ("generated/nope.py", "no generated module at generated/nope.py"),
    (42, "expected a generated module, a module name or a spec path, got int"),
])
def test_register_refuses_what_cannot_serve(target, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tf_integration.register(target, name="specgen-cpu-refused")


@pytest.mark.parametrize("name", ["sdpa", "eager", "flash_attention_2", "", "a b", None])
def test_register_refuses_builtin_or_bad_names(name):
    with pytest.raises(ValueError, match="register: "):
        tf_integration.register("generated.fmha_gqa_causal", name=name)


def test_register_from_spec_and_module_name_gives_the_generated_kernel():
    by_spec = tf_integration.register("specs/fmha_train_gqa_causal.yaml", name="specgen-cpu-spec")
    by_name = tf_integration.register("generated.fmha_train_gqa_causal", name="specgen-cpu-name")
    assert by_spec.module.SPEC == by_name.module.SPEC
    assert by_name.module.SPEC["backward"] is True
    from transformers import AttentionInterface

    assert AttentionInterface()["specgen-cpu-spec"] is by_spec


def eager_reference(q, k, v, mask, *, scale, softcap=None, sinks=None):
    """transformers' eager attention in float64: scores, soft-cap, an additive mask of
    the dtype's lowest value, a sink column joining the softmax."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    s = q.double() @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask[..., : k.shape[2]], torch.finfo(torch.float64).min)
    if sinks is not None:
        s = torch.cat([s, sinks.double().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)], -1)
    w = torch.softmax(s, dim=-1)
    if sinks is not None:
        w = w[..., :-1]
    return (w @ v).transpose(1, 2)


@pytest.mark.parametrize("fields", [{"sinks": True}, {"softcap": 5.0}, {"sinks": True, "softcap": 5.0}])
def test_masked_calls_of_softcap_and_sinks_specs_keep_them(fields):
    """transformers' sdpa function takes no sinks (it dropped s_aux: 0.60 off eager) and
    refuses a soft-cap; a masked call of such a spec runs float32 torch attention with
    both, and with the mask, against eager attention in float64."""
    module = stand_in(gqa_ratio=2, backward=True, **fields)
    function = tf_integration.make_attention_function(module)
    layer = types.SimpleNamespace(is_causal=True)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 7, 32, generator=g) * 3
    k, v = torch.randn(2, 2, 12, 32, generator=g) * 3, torch.randn(2, 2, 12, 32, generator=g)
    mask = torch.ones(2, 1, 7, 12, dtype=torch.bool).tril(diagonal=3)
    mask[1, :, :, :4] = False  # left padding
    mask[1, :, 0] = False  # a row that sees no key
    kwargs = {"softcap": fields.get("softcap")}
    sinks = None
    if fields.get("sinks"):
        sinks = kwargs["s_aux"] = torch.randn(4, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, weights = function(layer, q, k, v, mask, scaling=0.2, **kwargs)
    ref = eager_reference(q, k, v, mask, scale=0.2, softcap=fields.get("softcap"), sinks=sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert weights is None and module.calls == [] and function.stats["fallback"] == 1
    assert any("float32 torch attention" in str(w.message) for w in caught)
    if sinks is not None:  # the sink logits get their gradient through the fallback
        sinks.requires_grad_(True)
        function(layer, q, k, v, mask, scaling=0.2, **kwargs)[0].sum().backward()
        assert sinks.grad is not None and sinks.grad.abs().sum() > 0


def test_a_sinks_spec_trains_the_sinks_alone_through_the_kernels_output():
    """With only s_aux requiring gradients the adapter must not pass out= (the
    generated module refuses out= under autograd) and must check the spec trains."""
    module = stand_in(sinks=True, backward=True)
    function = tf_integration.make_attention_function(module)
    layer = types.SimpleNamespace(is_causal=True)
    q, kv = torch.zeros(1, 4, 8, 32), torch.zeros(1, 2, 8, 32)
    sinks = torch.zeros(4, requires_grad=True)
    function(layer, q, kv, kv, None, s_aux=sinks)
    assert module.outs == [None]
    frozen = tf_integration.make_attention_function(stand_in(sinks=True))
    with pytest.raises(ValueError, match="set backward: true"):
        frozen(layer, q, kv, kv, None, s_aux=sinks)


def test_a_return_lse_spec_serves_without_its_lse():
    module = stand_in(return_lse=True, backward=True)
    inner = module.attention

    def with_lse(q, k, v, **kwargs):
        out = inner(q, k, v, **kwargs)
        return out, torch.zeros(q.shape[:3])

    module.attention = with_lse
    function = tf_integration.make_attention_function(module)
    layer = types.SimpleNamespace(is_causal=True)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 8, 32, generator=g)
    kv = torch.randn(1, 2, 8, 32, generator=g)
    plain, _ = tf_integration.make_attention_function(stand_in())(layer, q, kv, kv, None)
    out, _ = function(layer, q, kv, kv, None)
    torch.testing.assert_close(out, plain)
    out, _ = function(layer, q.requires_grad_(True), kv, kv, None)  # autograd's path
    torch.testing.assert_close(out.detach(), plain)
    assert tf_integration.register("specs/fmha_gptoss_sinks.yaml", name="specgen-cpu-lse").module.SPEC["return_lse"]


def test_gpt_oss_with_the_shipped_sinks_kernel_matches_eager_padded_or_not():
    """The shipped gpt-oss spec (sinks, a 128-key window, return_lse) serves a tiny
    GptOss model: unpadded calls run its kernel (emulated), a padded batch runs the
    float32 fallback with the sinks; both match transformers' eager attention (the
    fallback used to be sdpa, which dropped the sinks: logits 0.53 off)."""
    import copy

    from specgen.check import emulate
    from .helpers import ROOT

    module = emulate.load_module(ROOT / "generated" / "fmha_gptoss_sinks.py", name="gptoss_emulated")
    function = tf_integration.register(module, name="specgen-cpu-gptoss")
    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=1, head_dim=64, sliding_window=128,
        layer_types=["sliding_attention"] * 2, num_local_experts=2, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False)

    def model(implementation):
        torch.manual_seed(0)
        made = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=implementation, dtype=torch.float32)
        with torch.no_grad():
            for layer in made.model.layers:  # zeros at init: make the sinks matter
                layer.self_attn.sinks.normal_(0, 2.0)
        return made.to(torch.bfloat16).eval()

    # Every expert on every token (no top-k choice for rounding to flip between a
    # batch and a single row); eager in float32 on the bf16-rounded weights.
    ours, eager = model("specgen-cpu-gptoss"), model("eager").float()
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad(), emulate.emulating(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = (ours(ids[:1]).logits.float() - eager(ids[:1]).logits).abs().max()
        assert function.stats == {"kernel": 2, "fallback": 0}
        padded = (ours(ids, attention_mask=mask).logits.float()
                  - eager(ids, attention_mask=mask).logits)[:, 6:].abs().max()
        assert function.stats == {"kernel": 2, "fallback": 2}
    # bf16 logits of about 1: one or two bf16 steps apart, where dropping the sinks
    # moved them by 0.5
    assert alone < 0.02 and padded < 0.02, (float(alone), float(padded))


def test_a_model_of_sliding_and_full_layers_runs_a_kernel_for_each():
    """Gemma 2/3 and gpt-oss mix sliding and full layers; one spec could serve only one
    kind, and each error pointed at the other. A list registers one per kind."""
    import copy

    import transformers as tf

    from .helpers import QWEN2_SIZES

    local = stand_in(window={"left": 7, "right": None}, name="local")
    full = stand_in(name="full")
    function = tf_integration.register([local, full], name="specgen-cpu-mixed")
    config = tf.Qwen2Config(num_hidden_layers=2, tie_word_embeddings=False, sliding_window=8,
                            use_sliding_window=True, max_window_layers=2,
                            layer_types=["sliding_attention", "full_attention"],
                            **QWEN2_SIZES["tiny"])

    def model(implementation):
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32,
                                                   attn_implementation=implementation).eval()

    ours, sdpa = model("specgen-cpu-mixed"), model("sdpa")
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(ours(ids[:, :6]).logits, sdpa(ids[:, :6]).logits, atol=1e-4, rtol=1e-4)
        assert len(local.calls) == 1 and len(full.calls) == 1  # no mask: both kernels
        # The window binds past 8 tokens: the sliding layer falls back with its mask.
        torch.testing.assert_close(ours(ids).logits, sdpa(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(local.calls) == 1 and len(full.calls) == 2
    assert function.stats == {"kernel": 3, "fallback": 1}
    layer = types.SimpleNamespace(is_causal=True)
    q, kv = torch.zeros(1, 4, 8, 32), torch.zeros(1, 2, 8, 32)
    with pytest.raises(ValueError, match="the layer has sliding_window 4096 and the registered "
                                         "kernels serve sliding_window 8, full attention"):
        function(layer, q, kv, kv, None, sliding_window=4096)
    with pytest.raises(ValueError, match="both serve full-attention layers"):
        tf_integration.register([full, stand_in(name="other")], name="specgen-cpu-twice")
    with pytest.raises(ValueError, match="has a window with no left bound"):
        tf_integration.register([full, stand_in(causal=False, window={"left": None, "right": 4})],
                                name="specgen-cpu-unbounded")
    # A spec of the list whose window cannot serve the layer it was picked for says so,
    # without suggesting a list registration.
    two_sided = stand_in(causal=False, window={"left": 7, "right": 2}, name="two_sided")
    listed = tf_integration.make_attention_function([two_sided, stand_in(causal=False)])
    with pytest.raises(ValueError, match=r"and the layer has sliding_window 8$"):
        listed(types.SimpleNamespace(is_causal=False), q, kv, kv, None, sliding_window=8)
    single = tf_integration.make_attention_function(full)
    with pytest.raises(ValueError, match=re.escape("register([sliding_spec, full_spec])")):
        single(layer, q, kv, kv, None, sliding_window=8)


def test_a_compiled_model_neither_recompiles_nor_breaks_on_the_adapters_counts():
    """torch.compile(fullgraph=True) of a model on a generated module (emulated): the
    adapter's stats read and written in the traced code were guarded on their values
    (a recompile on every forward; the 9th raised FailOnRecompileLimitHit, and without
    fullgraph the model ran eagerly from then on), and the first fallback's warning
    was a graph break (Unsupported under fullgraph). Under Dynamo a call is counted
    when traced, once per graph."""
    from torch._dynamo.utils import counters

    from specgen.check import emulate
    from .helpers import emulated_spec_module, prefill_variant_data

    data = prefill_variant_data("tf_compile", {"dtype": "bfloat16", "head_dim": 32, "gqa_ratio": 2})
    module = emulated_spec_module(data, "tf_compile")
    function = tf_integration.register(module, name="specgen-cpu-compile")
    model = qwen2_model("specgen-cpu-compile", "tiny", torch.bfloat16).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), emulate.emulating(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = model(ids).logits
        eager_padded = model(ids[1:], attention_mask=mask[1:]).logits
        assert function.stats == {"kernel": 2, "fallback": 2}
        function.stats.update(kernel=0, fallback=0)  # the first fallback warns again
        for _ in range(10):
            assert torch.equal(compiled(ids).logits, eager)
        for _ in range(3):
            assert torch.equal(compiled(ids[1:], attention_mask=mask[1:]).logits, eager_padded)
    assert counters["stats"]["unique_graphs"] == 2  # with a mask and without
    assert function.stats == {"kernel": 2, "fallback": 2}  # each layer's call, traced once
    assert sum("runs transformers' sdpa instead" in str(w.message) for w in caught) == 2


def test_a_bidirectional_sliding_layer_needs_a_two_sided_window():
    """ModernBERT's local layers are bidirectional: sliding_window W sees keys within
    W - 1 on both sides. A non-causal spec with right: 0 (what the missing-window error
    suggested) was taken and ran a one-sided window (logits 5.9 off sdpa); the window
    that serves, right == left, was refused."""
    import copy

    config = transformers.ModernBertConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, local_attention=16, global_attn_every_n_layers=3,
        max_position_embeddings=256, initializer_range=0.5, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2)
    window = config.sliding_window + 1  # what the local layers pass

    def model(implementation):
        torch.manual_seed(0)
        return transformers.ModernBertForMaskedLM._from_config(
            copy.deepcopy(config), attn_implementation=implementation).eval()

    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    full = stand_in(causal=False, gqa_ratio=1, name="full")
    one_sided = stand_in(causal=False, gqa_ratio=1, window={"left": window - 1, "right": 0},
                         name="one_sided")
    tf_integration.register([one_sided, full], name="specgen-cpu-bidi-one-sided")
    with pytest.raises(ValueError, match=re.escape(
            "needs a layer with sliding_window == left + 1 (and right == left: the layer is "
            f"bidirectional), and the layer has sliding_window {window}")), torch.no_grad():
        model("specgen-cpu-bidi-one-sided")(ids)
    assert one_sided.calls == []
    single = tf_integration.make_attention_function(stand_in(causal=False, gqa_ratio=1))
    q = torch.zeros(1, 4, 8, 32)
    with pytest.raises(ValueError, match=re.escape(
            f"give the spec window: {{left: {window - 1}, right: {window - 1}}}")):
        single(types.SimpleNamespace(is_causal=False), q, q, q, None, sliding_window=window)
    two_sided = stand_in(causal=False, gqa_ratio=1, window={"left": window - 1, "right": window - 1},
                         name="two_sided")
    full = stand_in(causal=False, gqa_ratio=1, name="full")
    function = tf_integration.register([two_sided, full], name="specgen-cpu-bidi")
    with torch.no_grad():
        torch.testing.assert_close(model("specgen-cpu-bidi")(ids).logits, model("sdpa")(ids).logits,
                                   atol=1e-4, rtol=1e-4)
    assert function.stats == {"kernel": 3, "fallback": 0}
    assert len(two_sided.calls) == 2 and len(full.calls) == 1

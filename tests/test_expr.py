"""Expression hooks: the whitelist, the kernel text, and torch evaluation."""

import math

import pytest
import torch

from specgen.errors import SpecError
from specgen.spec.hooks import ExprError, compile_hook, evaluate
from specgen.check.reference import attention_reference
from specgen.spec import validate_spec

TENSORS = {"slope": ("float32", 1), "doc": ("int32", 2)}


def test_alibi_prints_hoisted_gather_and_kernel_names():
    hook = compile_hook("score - slope[h] * (q_idx - kv_idx)", "score_mod", TENSORS)
    assert hook.kernel == "(s - (slope_0 * (rows - keys)))"
    assert [(g.local, g.indices, g.where) for g in hook.gathers] == [("slope_0", ("head",), "head")]
    assert hook.uses == {"h", "q_idx", "kv_idx"} and hook.kind == "float"


def test_document_mask_gathers_per_tile_and_per_step():
    hook = compile_hook("doc[b, q_idx] == doc[b, kv_idx]", "mask_mod", TENSORS)
    assert hook.kernel == "(doc_0 == doc_1)"
    assert [(g.indices, g.where) for g in hook.gathers] == [
        (("batch", "rows"), "rows"), (("batch", "keys"), "keys")]


@pytest.mark.parametrize("text,kernel", [
    ("score * 0.5 if q_idx > kv_idx else score", "ct.where((rows > keys), (s * 0.5), s)"),
    ("where(q_idx - kv_idx < 128, score, score - 1)", "ct.where(((rows - keys) < 128), s, (s - 1))"),
    ("score + (q_idx - kv_idx) / 2", "(s + (ct.astype((rows - keys), ct.float32) / 2.0))"),
    ("tanh(score / 30) * 30", "(ct.tanh((s / 30.0)) * 30)"),
    ("-abs(q_idx - kv_idx)", "ct.astype((-ct.abs((rows - keys))), ct.float32)"),
    ("min(score, 10.0)", "ct.minimum(s, 10.0)"),
])
def test_score_mods_print(text, kernel):
    assert compile_hook(text, "score_mod", TENSORS).kernel == kernel


@pytest.mark.parametrize("text,kernel", [
    ("q_idx - kv_idx < 256 and h % 2 == 0", "(((rows - keys) < 256) & ((head % 2) == 0))"),
    ("not (kv_idx < 4) or b == 1", "((~(keys < 4)) | (batch == 1))"),
    ("0 <= q_idx - kv_idx < 64", "((0 <= (rows - keys)) & ((rows - keys) < 64))"),
    ("(kv_idx % 64 == 0) | (q_idx == kv_idx)", "(((keys % 64) == 0) | (rows == keys))"),
])
def test_mask_mods_print(text, kernel):
    assert compile_hook(text, "mask_mod", TENSORS).kernel == kernel


# Payloads that must never reach generated source, each with the reason given.
INJECTIONS = [
    ("__import__('os').system('rm -rf /')", "calling __import__('os').system is not allowed"),
    ("__import__('os')", "calling __import__ is not allowed"),
    ("score.__class__", "attribute access is not allowed"),
    ("().__class__.__bases__[0]", "only declared tensors can be indexed"),
    ("slope.__class__", "attribute access is not allowed"),
    ("(lambda: 0)()", "calling lambda"),  # Python 3.10's ast.unparse writes "lambda : 0"
    ("[x for x in (1, 2)]", "a comprehension is not allowed"),
    ("{x: 1 for x in (1,)}", "a comprehension is not allowed"),
    ("sum(x for x in (1, 2))", "calling sum is not allowed"),
    ("eval('1')", "calling eval is not allowed"),
    ("open('/etc/passwd')", "calling open is not allowed"),
    ("'abc'", "constant 'abc' is not allowed"),
    ("f'{score}'", "an f-string is not allowed"),
    ("(y := 3)", "assignment (:=) is not allowed"),
    ("score; import os", "is not a Python expression"),
    ("score\nimport os", "is not a Python expression"),
    ("globals()", "calling globals is not allowed"),
    ("slope[h:]", "a slice is not allowed"),
    ("score ** 2", "'**' is not allowed"),
    ("os", "unknown name 'os'"),
    ("score if True else None", "constant None is not allowed"),
    ("*score", "is not a Python expression"),
    ("exp(score, base=2)", "exp() takes 1 positional argument"),
    ("slope", "tensor 'slope' must be indexed"),
    ("slope[h, b]", "slope has 1 dimension, indexed with 2"),
    ("slope[score]", "indices must be integers"),
    ("1e999", "only finite number constants are allowed"),
    # numbers the kernels' float32 would make 0 or inf (the fp64 reference would not)
    ("score * 1e39", "constant 1e+39 is outside float32's normal range"),
    ("score / 1e-320", "constant 1e-320 is outside float32's normal range"),
    ("score + sqrt(-1)", "sqrt(-1) is not a finite float32 number"),
    ("score + log(0)", "log(0) is not a finite float32 number"),
    ("score + exp(100)", "exp(100) is not a finite float32 number"),
    ("score - log(-2.5)", "log(-2.5) is not a finite float32 number"),
    ("2 ** 40", "'**' is not allowed"),
    ("2147483648", "does not fit in int32"),
    ("q_idx > kv_idx", "must be a number (the new score), got a condition"),
    # one number per row, per key or per head, not a tile of scores (the forward
    # failed to compile: an MMA of [TILE_M, 1] and [TILE_N, D])
    ("q_idx * 0.01", "must read score, or vary with both q_idx and kv_idx (write score * 0.0 + ..."),
    ("slope[h]", "must read score, or vary with both q_idx and kv_idx"),
    ("where(kv_idx > 3, 0.0, -1.0)", "must read score, or vary with both q_idx and kv_idx"),
    ("3.0", "must read score, or vary with both q_idx and kv_idx"),
    ("score " * 200, "longer than 500 characters"),
]


@pytest.mark.parametrize("text,reason", INJECTIONS, ids=[t[:30] for t, _ in INJECTIONS])
def test_payloads_are_rejected(text, reason):
    with pytest.raises(ExprError, match=None) as info:
        compile_hook(text, "score_mod", TENSORS)
    assert reason in str(info.value)


def test_spec_error_names_field_and_expression(tmp_path):
    data = {"name": "x", "mask_mod": "__import__('os')"}
    with pytest.raises(SpecError) as info:
        validate_spec(data, "specs/x.yaml")
    assert str(info.value) == ("specs/x.yaml: mask_mod: calling __import__ is not allowed; functions: "
                               "abs, exp, log, sqrt, tanh, min, max, where, got \"__import__('os')\"")


@pytest.mark.parametrize("data,message", [
    ({"tensors": {"slope": {"dtype": "float32", "shape": ["heads"]}}},
     "tensors.slope: declared but used by neither score_mod nor mask_mod"),
    ({"tensors": {"out": {"dtype": "float32", "shape": ["heads"]}}, "score_mod": "out[h]"},
     "tensors: tensor name 'out' must be none of the names the generated module already uses"),
    ({"tensors": {"Slope": {"dtype": "float32", "shape": ["heads"]}}, "score_mod": "Slope[h]"},
     "tensors: tensor name 'Slope' must be a lowercase identifier"),
    ({"tensors": {"x": {"dtype": "float64", "shape": ["heads"]}}, "score_mod": "x[h]"},
     "tensors.x.dtype: must be one of 'float32' or 'int32', got \"float64\""),
    ({"tensors": {"x": {"dtype": "float32", "shape": ["rows"]}}, "score_mod": "x[h]"},
     "tensors.x.shape[0]"),
    ({"score_mod": "score", "q_subtiles": 2,
      "targets": {"default": {"tile_m": 64, "tile_n": 64}}},
     "q_subtiles: 2 does not support score_mod yet; use 1"),
])
def test_hook_spec_errors(data, message):
    with pytest.raises(SpecError) as info:
        validate_spec({"name": "x", **data}, "s.yaml")
    assert message in str(info.value)


def test_evaluate_matches_torch_and_reads_zero_outside():
    slope = torch.tensor([0.5, 0.25], dtype=torch.float32)
    env = {"score": torch.zeros(1, 2, 3, 4, dtype=torch.float64),
           "b": torch.arange(1).view(-1, 1, 1, 1), "h": torch.arange(2).view(1, -1, 1, 1),
           "q_idx": torch.arange(3).view(1, 1, -1, 1), "kv_idx": torch.arange(4).view(1, 1, 1, -1)}
    got = evaluate("score - slope[h] * (q_idx - kv_idx)", env, {"slope": slope})
    want = -slope.view(1, 2, 1, 1).double() * (torch.arange(3).view(3, 1) - torch.arange(4))
    assert torch.equal(got, want)
    doc = torch.tensor([[0, 0, 1]], dtype=torch.int32)  # kv_idx 3 is outside: reads 0
    mask = evaluate("doc[b, q_idx] == doc[b, kv_idx]", env, {"doc": doc})
    assert mask[0, 0].tolist() == [[True, True, False, True], [True, True, False, True],
                                   [False, False, True, False]]


@pytest.mark.parametrize("text,plain", [
    ("(kv_idx <= q_idx) | (not True)", "kv_idx <= q_idx"),
    ("(kv_idx <= q_idx) & True", "kv_idx <= q_idx"),
    ("(not False) != (kv_idx > q_idx)", "not kv_idx > q_idx"),
    ("(kv_idx > q_idx) == False", "not kv_idx > q_idx"),
    ("where(True, kv_idx <= q_idx, False)", "kv_idx <= q_idx"),
    ("kv_idx <= q_idx if True else False", "kv_idx <= q_idx"),
    ("(kv_idx <= q_idx) or ~True or (q_idx < 0)", "kv_idx <= q_idx or q_idx < 0"),
    ("(kv_idx <= q_idx) and (not (True and False))", "kv_idx <= q_idx"),
])
def test_true_and_false_fold_to_the_conditions_python_means(text, plain):
    """True and False are conditions, as in Python: ``not True`` is False (not
    Python's ``~True == -2``) and ``where(True, a, b)`` is a. The kernel's text,
    the torch evaluation (the fp64 reference, Flex) and the block-map tests all read
    the folded tree."""
    assert compile_hook(text, "mask_mod", {}).kernel == compile_hook(plain, "mask_mod", {}).kernel
    env = {"b": torch.arange(1).view(-1, 1, 1, 1), "h": torch.arange(1).view(1, -1, 1, 1),
           "q_idx": torch.arange(7).view(1, 1, -1, 1), "kv_idx": torch.arange(9).view(1, 1, 1, -1)}
    assert torch.equal(evaluate(text, env, {}), evaluate(plain, env, {}))


def test_a_constant_hook_is_a_tensor_and_a_number_beside_true_is_still_refused():
    env = {"q_idx": torch.arange(3).view(-1, 1), "kv_idx": torch.arange(4).view(1, -1)}
    assert torch.equal(evaluate("not False", env, {}), torch.tensor(True))
    q, k, v = (torch.randn(1, 1, 5, 16, dtype=torch.float64) for _ in range(3))
    assert torch.allclose(attention_reference(q, k, v, causal=False, mask_mod="True"),
                          attention_reference(q, k, v, causal=False))
    # folding never turns a number into a condition: q_idx & True stays refused
    with pytest.raises(ExprError, match="combine conditions"):
        compile_hook("(q_idx & True) == 1", "mask_mod", {})


def test_reference_hooks_equal_explicit_bias_and_mask():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 16, generator=gen) for _ in range(3))
    slope = torch.tensor([0.3, 0.1])
    out = attention_reference(q, k, v, causal=True, score_mod="score - slope[h] * (q_idx - kv_idx)",
                              tensors={"slope": slope})
    dist = (torch.arange(9).view(9, 1) - torch.arange(9)).double()
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(16) - slope.view(1, 2, 1, 1) * dist
    scores = scores.masked_fill(dist < 0, -math.inf)
    assert torch.allclose(out, torch.softmax(scores, -1) @ v.double())

    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0] * 9], dtype=torch.int32)
    out = attention_reference(q, k, v, causal=False, mask_mod="doc[b, q_idx] == doc[b, kv_idx]",
                              tensors={"doc": doc})
    same = doc[:, None, :, None] == doc[:, None, None, :]
    scores = (q.double() @ k.double().transpose(-1, -2) / 4).masked_fill(~same, -math.inf)
    assert torch.allclose(out, torch.softmax(scores, -1) @ v.double())


def test_hooks_trace_into_compiled_flex_attention():
    """The Flex baseline runs the hooks inside torch.compile(fullgraph=True): no
    graph break (a break would fall back to unfused Flex and misstate the baseline)."""
    from specgen.spec.hooks import torch_fn
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    score_fn = torch_fn("score - slope[h] * (q_idx - kv_idx)")
    mask_fn = torch_fn("doc[b, q_idx] == doc[b, kv_idx]")
    gen = torch.Generator().manual_seed(0)
    tensors = {"slope": torch.rand(2, generator=gen),
               "doc": torch.cumsum((torch.rand(1, 128, generator=gen) < 0.03).int(), -1, dtype=torch.int32)}

    def score_mod(score, b, h, qi, ki):
        return score_fn({"score": score, "b": b, "h": h, "q_idx": qi, "kv_idx": ki}, tensors)

    def mask_mod(b, h, qi, ki):
        return (qi >= ki) & mask_fn({"b": b, "h": h, "q_idx": qi, "kv_idx": ki}, tensors)

    # Three tensors: torch 2.10's CPU Flex refuses one buffer as q, k and v.
    q, k, v = (torch.randn(1, 2, 128, 16, generator=gen) for _ in range(3))
    block_mask = create_block_mask(mask_mod, 1, None, 128, 128, device="cpu")
    out = torch.compile(flex_attention, fullgraph=True)(q, k, v, score_mod=score_mod, block_mask=block_mask)
    ref = attention_reference(q, k, v, causal=True, score_mod="score - slope[h] * (q_idx - kv_idx)",
                              mask_mod="doc[b, q_idx] == doc[b, kv_idx]", tensors=tensors)
    assert (out.double() - ref).abs().max() < 1e-4

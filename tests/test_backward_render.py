"""The backward kernels' structure: the dQ kernel's exact D for one-key-tile rows (and
the launch order it needs), the loop split of the plain masks, checked by running the
generated loop bounds against a brute-force classification of every tile."""

import ast
import itertools
import math
import re

import pytest

from specgen.emit.render import render
from specgen.plan.make import make_plan
from specgen.spec import load_spec, validate_spec

from .helpers import ROOT, kernel_source


def _text(name: str) -> str:
    return (ROOT / "generated" / f"{name}.py").read_text()


def _launch_order(text: str) -> list[str]:
    """The backward kernels in the order the launcher starts them."""
    backward = text[text.index("def _backward("):]
    backward = backward[: backward.index("\n\n\n")]
    return sorted(("fmha_bwd_dq_", "fmha_bwd_dkdv_"), key=lambda n: backward.index(f"        {n}"))


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gptoss_sinks",
                                  "fmha_train_gemma2", "fmha_train_document"])
def test_dq_forms_the_exact_delta_of_a_one_tile_row_and_runs_before_dkdv(name):
    """Where a query tile sees one key tile, D = rowsum(P dP) from the dQ kernel's own
    P and dP replaces dO . O (the rounded output), and dK/dV reads it after."""
    text = _text(name)
    dq = kernel_source(text, "fmha_bwd_dq_")
    head, _, loops = dq.partition("== 1:")
    # ... and only where the caller says the call holds every key its rows see.
    assert re.search(r"if \(?num_n( - first_n\))? \* exact_delta $", head) or \
        "if (num_partial + num_full) * exact_delta " in head
    assert "exact_delta: int," in dq
    block = loops[: loops.index("    for ")]
    if "sinks" in name:
        assert "delta = ct.sum(p * dp, axis=-1, keepdims=True)" in block
    else:
        # the sum about the dP of a key with P > 0, divided by the row's sum of P
        assert "ref = ct.max(ct.where(p > 0.0, dp, -math.inf), axis=-1, keepdims=True)" in block
        assert "spread = ct.sum(p * (dp - ref), axis=-1, keepdims=True)" in block
        assert "spread / ct.where(total > 0.0, total, 1.0)" in block
    if "sinks" in name:
        # A kernel that stores D' of its own P at its end (sinks) stores neither the
        # one-tile D nor, where exact_delta is 1, D = dO . O at its start.
        assert not re.search(r"ct\.store\(\s*Delta,", block)
        assert re.search(r"if exact_delta == 0:[^\n]*\n\s+ct\.store\(\s*Delta,", head)
        tail = loops[loops.rindex("if exact_delta == 1:"):]
        assert re.search(r"ct\.store\(\s*Delta,\s*index=\(batch, head, tile\),\s*tile=own", tail)
    else:
        assert re.search(r"ct\.store\(\s*Delta,", block)
    assert _launch_order(text) == ["fmha_bwd_dq_", "fmha_bwd_dkdv_"]


def test_backward_exponentials_flush_to_zero():
    for name in ("fmha_train_gqa_causal", "fmha_train_gemma2"):
        text = _text(name)
        for prefix in ("fmha_bwd_dkdv_", "fmha_bwd_dq_"):
            source = kernel_source(text, prefix)
            calls = source.count("ct.exp2(")
            assert calls and source.count("flush_to_zero=True") == calls, (name, prefix)


def _loops(source: str, var: str) -> list[str]:
    """The bodies of the kernel's ``for <var> in range(...)`` loops, in order."""
    parts = source.split(f"for {var} in range(")[1:]
    return [p.partition(f"for {var} in range(")[0] for p in parts]


def test_plain_causal_backward_runs_interior_tiles_without_a_mask():
    text = _text("fmha_train_gqa_causal")
    dkdv = kernel_source(text, "fmha_bwd_dkdv_")
    assert [line.strip() for line in dkdv.splitlines() if "for i in range(" in line] == [
        "for i in range(first_m, lo_m):", "for i in range(lo_m, hi_m):", "for i in range(hi_m, end_m):"]
    first, interior, last = _loops(dkdv, "i")
    assert "visible =" in first and "visible =" in last and "visible =" not in interior
    dq = kernel_source(text, "fmha_bwd_dq_")
    interior, edge = _loops(dq, "j")
    assert "visible =" not in interior and "visible =" in edge


@pytest.mark.parametrize("spec", ["specs/fmha_train_gemma2.yaml", "bench/train/fmha_train_d256.yaml"])
def test_no_dkdv_split_for_masked_or_wide_heads(spec):
    """Windows/soft-cap keep one masked loop; a padded-256 head keeps one dK/dV loop
    (three were slower there) but its dQ still splits."""
    plan = make_plan(load_spec(ROOT / spec))
    text = render(plan, spec).text
    assert "lo_m" not in kernel_source(text, "fmha_bwd_dkdv_")
    assert ("hi_n" in kernel_source(text, "fmha_bwd_dq_")) == (not plan.bwd_masked)


class _Ct:
    @staticmethod
    def cdiv(a, b):
        return -(-a // b)


def _bounds(source: str, names: set, **values) -> dict:
    """Run the kernel's top-level statements that set ``names`` (assignments, and ifs
    that only assign them) with ``values`` bound, as Python integers."""
    fn = ast.parse(source).body[0]
    keep = []
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id in names for t in stmt.targets
        ):
            keep.append(stmt)
        elif isinstance(stmt, ast.If) and all(
            isinstance(s, ast.Assign) and all(isinstance(t, ast.Name) and t.id in names for t in s.targets)
            for s in stmt.body
        ) and not stmt.orelse:
            keep.append(stmt)
    scope = {"ct": _Ct, "min": min, "max": max, **values}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "<bounds>", "exec"), scope)
    return scope


def _visible(row, key, seq_q, seq_k, q_offset):
    return row < q_offset + seq_q and key < seq_k and key <= row


CASES = list(itertools.product([1, 63, 64, 130, 257], [1, 64, 100, 256, 300], [0, 5, 64, -3, 200]))


@pytest.mark.parametrize("seq_q,seq_k,q_offset", CASES)
def test_causal_loop_split_bounds_classify_every_tile(seq_q, seq_k, q_offset):
    """The dK/dV and dQ loop bounds of the plain causal backward, run as Python: the
    unmasked loops visit only tiles whose every pair is visible, and the loops
    together visit every tile with a visible pair."""
    text = _text("fmha_train_gqa_causal")
    dkdv = kernel_source(text, "fmha_bwd_dkdv_")
    dq = kernel_source(text, "fmha_bwd_dq_")
    TM, TN = 64, 64
    for kv_tile in range(math.ceil(seq_k / TN)):
        b = _bounds(dkdv, {"first_m", "end_m", "lo_m", "hi_m"}, kv_tile=kv_tile, TILE_M=TM, TILE_N=TN,
                    seq_q=seq_q, seq_k=seq_k, q_offset=q_offset)
        masked = [*range(b["first_m"], b["lo_m"]), *range(b["hi_m"], b["end_m"])]
        interior = list(range(b["lo_m"], b["hi_m"]))
        assert len(set(masked + interior)) == len(masked + interior), (kv_tile, b)  # once each
        for i in range(math.ceil(seq_q / TM)):
            pairs = [(q_offset + i * TM + r, kv_tile * TN + c) for r in range(TM) for c in range(TN)]
            seen = [_visible(row, key, seq_q, seq_k, q_offset) for row, key in pairs]
            if i in interior:
                assert all(seen), (kv_tile, i)
            if any(seen):
                assert i in masked or i in interior, (kv_tile, i)
    TM, TN = 128, 64
    for tile in range(math.ceil(seq_q / TM)):
        b = _bounds(dq, {"end_row", "num_n", "hi_n"}, tile=tile, TILE_M=TM, TILE_N=TN,
                    seq_q=seq_q, seq_k=seq_k, q_offset=q_offset)
        assert 0 <= b["hi_n"] <= max(b["num_n"], 0)  # range(0, hi_n), then range(hi_n, num_n)
        for j in range(math.ceil(seq_k / TN)):
            pairs = [(q_offset + tile * TM + r, j * TN + c) for r in range(TM) for c in range(TN)]
            seen = [_visible(row, key, seq_q, seq_k, q_offset) for row, key in pairs]
            if j < b["hi_n"]:
                assert all(seen), (tile, j)
            if any(seen):
                assert j < b["num_n"], (tile, j)


@pytest.mark.parametrize("name", ["alibi", "vit_dropout", "varlen_llama", "mla_d192", "phi2_d80"])
def test_bench_training_copies_of_the_feature_specs_stay_the_shipped_specs(name):
    """bench/train/fmha_train_<name>.yaml is specs/fmha_<name>.yaml with backward: true:
    the backward suite times ALiBi, dropout, varlen, MLA's 192/128 and Phi-2's padded
    D80 on the shipped specs' own configs."""
    import yaml

    from specgen.plan.make import make_plan
    from specgen.spec import validate_spec

    shipped = yaml.safe_load((ROOT / "specs" / f"fmha_{name}.yaml").read_text())
    train = yaml.safe_load((ROOT / "bench" / "train" / f"fmha_train_{name}.yaml").read_text())
    assert train.pop("name") == f"fmha_train_{name}" and train.pop("backward") is True
    shipped.pop("name")
    assert train == shipped
    assert make_plan(validate_spec({**train, "name": f"fmha_train_{name}", "backward": True})).backward


@pytest.mark.parametrize("changes,split_dq,split_dkdv", [
    ({"softcap": 30.0}, True, True),
    ({"sinks": True}, True, True),
    ({"tensors": {"slope": {"dtype": "float32", "shape": ["heads"]}},
      "score_mod": "score - slope[h] * (q_idx - kv_idx)"}, True, True),
    ({"tensors": {"colb": {"dtype": "float32", "shape": ["seq_k"], "learnable": True}},
      "score_mod": "score + colb[kv_idx]"}, True, False),
    ({"window": {"left": 256}}, False, False),
    ({"mask_mod": "(q_idx // 64) != (kv_idx // 64) + 3"}, False, False),
])
def test_interior_tiles_run_unmasked_where_no_pair_is_chosen(changes, split_dq, split_dkdv):
    """Soft-cap, score_mod and sinks change scores, not which pairs are seen: both
    backward kernels run their interior tiles without the mask (the dK/dV kernel not
    with key-varying learnable subscripts, whose atomic adds spilled in three loop
    bodies). Windows and mask_mod keep one masked loop."""
    data = {"name": "interior", "dtype": "bfloat16", "head_dim": 64, "gqa_ratio": 2,
            "causal": True, "backward": True, **changes}
    plan = make_plan(validate_spec(data))
    assert (plan.bwd_split_dq, plan.bwd_split_dkdv) == (split_dq, split_dkdv)
    source = render(plan, "specs/interior.yaml").text
    dq, dkdv = kernel_source(source, "fmha_bwd_dq_"), kernel_source(source, "fmha_bwd_dkdv_")
    assert ("for j in range(0, hi_n):" in dq) == split_dq
    assert ("for i in range(lo_m, hi_m):" in dkdv) == split_dkdv
    if split_dq:  # the interior step forms P with no mask and no select
        interior = dq[dq.index("for j in range(0, hi_n):"):dq.index("for j in range(hi_n, num_n):")]
        assert "visible =" not in interior and "where(visible" not in interior
        assert "# every pair visible" in interior
        assert "score_mod" not in changes or "score_mod:" in interior
    if split_dkdv:
        interior = dkdv[dkdv.index("for i in range(lo_m, hi_m):"):dkdv.index("for i in range(hi_m, end_m):")]
        assert "visible =" not in interior and "where(visible" not in interior and "ct.exp2(" in interior


@pytest.mark.parametrize("extra", [{}, {"softcap": 30.0}, {"fast_math": {"exp2": False}}],
                         ids=["exp2", "softcap", "natural_exp"])
def test_prescale_is_float32_arithmetic_on_the_host(extra):
    """prescale_q's backward takes pre = the forward's Q multiplier, computed on the
    host in float32 as the kernel does (struct, no tensor op per call): the same value
    as float32 tensor arithmetic for scales over sixty orders of magnitude."""
    import random

    import torch

    from .helpers import render_spec_data

    data = {"name": "pre", "dtype": "bfloat16", "head_dim": 64, "causal": True, "backward": True,
            "prescale_q": True, **extra}
    plan, source = render_spec_data(data)
    assert plan.bwd_prescale == {"exp2": "qk_scale * INV_LN2", "softcap": "qk_scale / SOFTCAP"}.get(
        "softcap" if extra.get("softcap") else "exp2" if not extra else "", "qk_scale")
    assert plan.bwd_prescale_host and source.count("import struct") == 1
    namespace = {}
    helper = source[source.index("def _float32"):source.index("\n\n\n", source.index("def _float32"))]
    exec("import struct\nimport math\nINV_LN2 = 1.0 / math.log(2.0)\n"
         f"SOFTCAP = {extra.get('softcap', 1.0)}\n" + helper, namespace)
    rng = random.Random(0)
    scales = [1 / math.sqrt(d) for d in range(1, 300)] + [10 ** rng.uniform(-30, 30) for _ in range(3000)]
    scales += [2.4e38, 3.0e38, torch.finfo(torch.float32).max]  # pre overflows to inf, as in float32
    ops = {"qk_scale": lambda t: t,
           "qk_scale * INV_LN2": lambda t: t * (1.0 / math.log(2.0)),
           "qk_scale / SOFTCAP": lambda t: t / extra.get("softcap", 1.0)}
    for scale in scales:
        want = ops[plan.bwd_prescale](torch.tensor(scale, dtype=torch.float32)).item()
        assert eval(plan.bwd_prescale_host, namespace, {"scale": scale}) == want, scale
    inference = render_spec_data({**data, "backward": False})[1]
    assert "import struct" not in inference  # only a backward needs it


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gemma2", "fmha_train_document",
                                  "fmha_train_gptoss_sinks"])
def test_attention_documents_what_it_returns(name):
    """A training module's attention() returns (out, lse) only where the spec has
    return_lse; its docstring said (out, lse) for every training module (the
    launcher's, which returns the LSE for the backward)."""
    tree = ast.parse(_text(name))
    doc = next(ast.get_docstring(n) for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "attention")
    returns = doc[doc.index("Returns:"):doc.index("Raises:")]
    if "\nreturn_lse: true" in (ROOT / "specs" / f"{name}.yaml").read_text():
        assert "(out, lse)" in returns
    else:
        assert "(out, lse)" not in returns and "The output, [B, Hq, Sq," in returns

"""Bad input of every kind gives one line naming the file (or option), the field, the
value and what is allowed, exit 2 and nothing written; never a traceback."""

import ast
import re

import pytest

from specgen.errors import SpecError
from specgen.spec import load_spec, parse_spec_text, validate_spec
from specgen.spec.fields import KNOWN_TARGETS, RESERVED_NAMES

from .helpers import ROOT, SPECS, unknown_kernel_names


def _lines(data, path="specs/bad.yaml"):
    with pytest.raises(SpecError) as info:
        validate_spec(data, path)
    return info.value.lines()


def _text_lines(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return [line.replace(f"{path}: ", "") for line in info.value.lines()]


# --- YAML --------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("name: a\n? [a, b]\n: 1\n",
     "invalid YAML: line 2, column 3: a list cannot be a mapping key; keys are plain names"),
    ("name: a\nfast_math: {[a]: 1}\n",
     "invalid YAML: line 2, column 13: a list cannot be a mapping key; keys are plain names"),
    ("name: a\nfast_math: {{a: 1}: 1}\n", "a mapping cannot be a mapping key"),
])
def test_a_list_or_mapping_as_key_is_one_line(tmp_path, text, expected):
    (line,) = _text_lines(tmp_path, text)
    assert line.startswith("invalid YAML: line 2, column") and expected in line, line


@pytest.mark.parametrize("text,expected", [
    # YAML 1.1 would read 0200 as octal and 2:08 as base 60 (both 128).
    ("head_dim: 0200", 'head_dim: must be an integer, got "0200"'),
    ("head_dim: 2:08", 'head_dim: must be an integer, got "2:08"'),
    ("head_dim: 0x80", 'head_dim: must be an integer, got "0x80"'),
    ("head_dim: 1_28", 'head_dim: must be an integer, got "1_28"'),
    ("head_dim: !!int 0x80", "invalid YAML: line 2, column 11: '0x80' is not a decimal integer"),
])
def test_integers_are_plain_decimal(tmp_path, text, expected):
    assert _text_lines(tmp_path, f"name: a\n{text}\n") == [expected]


@pytest.mark.parametrize("text,value", [
    ("5e1", 50.0), ("1.5e-3", 1.5e-3), (".5", 0.5), ("+2.", 2.0), ("-3E2", -300.0),
])
def test_floats_are_read_in_yaml_1_2_form(text, value):
    assert parse_spec_text(f"softcap: {text}\n") == {"softcap": value}


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "y", "Yes", "OFF"])
def test_yaml_1_1_booleans_are_strings(tmp_path, word):
    # YAML 1.1 (PyYAML's default) would read these as true/false.
    assert parse_spec_text(f"causal: {word}\n") == {"causal": word}
    assert _text_lines(tmp_path, f"name: a\ncausal: {word}\n") == [
        f'causal: must be true or false, got "{word}"']


@pytest.mark.parametrize("word,value", [
    ("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False),
    ("FALSE", False),
])
def test_yaml_1_2_booleans_read_as_booleans(word, value):
    assert parse_spec_text(f"causal: {word}\n") == {"causal": value}


@pytest.mark.parametrize("text,expected", [
    # Explicit tags read YAML 1.2 forms only; 1.1's merge keys, dates and other types are refused.
    ("causal: !!bool yes", "invalid YAML: line 2, column 9: 'yes' is not true or false"),
    ("softcap: !!float 1:30", "invalid YAML: line 2, column 10: '1:30' is not a number"),
    ("softcap: !!float fifty", "invalid YAML: line 2, column 10: 'fifty' is not a number"),
    ("softcap: !!float 1_0", "invalid YAML: line 2, column 10: '1_0' is not a number"),
    ("<<: {causal: true}", "invalid YAML: line 2, column 1: merge keys (<<) are not allowed in a spec"),
    ("softcap: 2001-12-14", 'softcap: must be a finite number, got "2001-12-14"'),
    ("softcap: !!binary aGk=", "invalid YAML: line 2, column 10: the tag !!binary is not allowed in a spec"),
    ("compile_for: !!set {sm_90}", "invalid YAML: line 2, column 14: the tag !!set is not allowed in a spec"),
    # keys are names: 1 and true (equal in Python) used to be one duplicate key
    ("1: x", "invalid YAML: line 2, column 1: a mapping key must be a name, got '1'"),
    ("fast_math: {true: 1}", "invalid YAML: line 2, column 13: a mapping key must be a name, got 'true'"),
])
def test_yaml_1_1_forms_behind_tags_are_refused(tmp_path, text, expected):
    (line,) = _text_lines(tmp_path, f"name: a\n{text}\n")
    assert line.startswith(expected), line


def test_explicit_1_2_tags_still_read():
    assert parse_spec_text("a: !!float 1e3\nb: !!bool false\nc: !!int 64\n") == {
        "a": 1000.0, "b": False, "c": 64}


@pytest.mark.parametrize("text,expected", [
    # A tag reads its whole scalar: a block scalar's "true\n" used to pass the check
    # and compare unequal to "true", making causal false.
    ("causal: !!bool |\n  true", "invalid YAML: line 2, column 9: 'true\\n' is not true or false"),
    ("causal: !!bool >\n  True", "invalid YAML: line 2, column 9: 'True\\n' is not true or false"),
    ("softcap: !!float |\n  .5", "invalid YAML: line 2, column 10: '.5\\n' is not a number"),
    # PyYAML's !!null read anything as null
    ("softcap: !!null 50", "invalid YAML: line 2, column 10: '50' is not null"),
    ("window: !!null '{left: 3}'", "invalid YAML: line 2, column 9: '{left: 3}' is not null"),
])
def test_an_explicit_tag_takes_its_whole_scalar(tmp_path, text, expected):
    assert _text_lines(tmp_path, f"name: a\n{text}\n") == [expected]


def test_an_explicit_null_still_reads():
    assert parse_spec_text("a: !!null\nb: !!null ~\nc: !!null null\nd: !!null ''\n") == {
        "a": None, "b": None, "c": None, "d": None}


@pytest.mark.parametrize("char,name", [
    ("\x85", "U+0085 NEXT LINE"), ("\u2028", "U+2028 LINE SEPARATOR"),
    ("\u2029", "U+2029 PARAGRAPH SEPARATOR")])
def test_yaml_1_1_line_breaks_are_refused(tmp_path, char, name):
    # PyYAML broke the comment there and read `softcap: 50` as a key; YAML 1.2 (an
    # editor, ruamel.yaml in specgen tune) reads the whole line as a comment.
    lines = _text_lines(tmp_path, f"name: a\r\n# softcap: off{char}softcap: 50\n")
    assert lines == [f"invalid YAML: line 2, column 15: {name} is not allowed in a spec (YAML 1.1 "
                     "reads it as a line break, YAML 1.2 as text); use a plain line break"]


@pytest.mark.parametrize("text,expected", [
    ('"": 1', '"": unknown key; allowed keys: name,'),
    ('fast_math: {"exp2 ": true}', 'fast_math."exp2 ": unknown key (did you mean exp2?)'),
    ('"a.b": 1', '"a.b": unknown key; allowed keys: name,'),
    ("softcap: .inf", "softcap: must be a number in [0.01, 1000000.0], got .inf"),
    ("softcap: -.inf", "softcap: must be a number in [0.01, 1000000.0], got -.inf"),
])
def test_a_key_or_value_is_shown_as_written(tmp_path, text, expected):
    (line,) = _text_lines(tmp_path, f"name: a\n{text}\n")
    assert line.startswith(expected), line


@pytest.mark.parametrize("text", [
    '? "{k}"\n: 1', '? "{k}"\n: 1\n? "{k}"\n: 2', "targets:\n  ? {k}\n  : {{tile_m: 64, tile_n: 64}}",
    "tensors:\n  ? {k}\n  : {{dtype: float32, shape: [heads]}}", '? !!float "{d}"\n: 1'])
def test_a_huge_key_is_shortened(tmp_path, text):
    (line,) = _text_lines(tmp_path, "name: a\n" + text.format(k="k" * 100_000, d="1" * 100_000) + "\n")
    assert len(line) < 1000 and "..." in line, line[:200]


@pytest.mark.parametrize("key", ["caus\\nal", "x\\nspecs/other.yaml: name: forged", "a\\u2028b"])
def test_a_key_with_a_line_break_stays_on_one_line(tmp_path, key):
    (line,) = _text_lines(tmp_path, f'name: a\n"{key}": true\n')
    assert "unknown key" in line and "\n" not in line and "\u2028" not in line


@pytest.mark.parametrize("text,expected", [
    # a second, false line used to follow the first
    ("dtype: fp8\nkv_dtype: float16", ["dtype: must be one of"]),
    ("causal: yes\nblock_remap: true", ["causal: must be true or false"]),
])
def test_one_bad_field_gives_one_line(tmp_path, text, expected):
    lines = _text_lines(tmp_path, f"name: a\n{text}\n")
    assert len(lines) == len(expected) and all(l.startswith(e) for l, e in zip(lines, expected)), lines


@pytest.mark.parametrize("score_mod", [
    # each constant float32's, the derivative not (constants beyond float32 are
    # refused by themselves: tests/test_expr.py)
    "score / 1e-30 / 1e-30", "score * 1e30 * 1e30", "tanh(score) / 1e-30 / 1e-30"])
def test_a_hook_whose_derivative_overflows_is_refused(tmp_path, score_mod):
    (line,) = _text_lines(tmp_path, f'name: a\nbackward: true\nscore_mod: "{score_mod}"\n')
    assert line.startswith("backward: true needs a score_mod with a derivative in score: "
                           "the derivative is not finite"), line


def test_a_learnable_tensor_whose_derivative_overflows_is_refused(tmp_path):
    (line,) = _text_lines(tmp_path, "name: a\nbackward: true\nscore_mod: \"score + exp(slope[h] * 1e30 * 1e30)\"\n"
                          "tensors: {slope: {dtype: float32, shape: [heads], learnable: true}}\n")
    assert line == "tensors.slope.learnable: true needs a score_mod with a derivative in slope: the derivative is not finite"


def test_a_tensor_named_only_in_a_hook_comment_is_unused(tmp_path):
    lines = _text_lines(tmp_path, 'name: a\nscore_mod: "score  # slope[h]"\n'
                                  "tensors: {slope: {dtype: float32, shape: [heads]}}\n")
    assert lines == ["tensors.slope: declared but used by neither score_mod nor mask_mod"]


def test_plain_integers_still_read_as_integers():
    assert parse_spec_text("a: 128\nb: -1\nc: +4\nd: 0\n") == {"a": 128, "b": -1, "c": 4, "d": 0}


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_specs_read_as_pyyaml_reads_them(path):
    import yaml

    text = path.read_text()
    assert repr(parse_spec_text(text, path)) == repr(yaml.safe_load(text))


# --- the model's messages ------------------------------------------------------------

TARGETS = ", ".join(KNOWN_TARGETS)
SLOPE = {"slope": {"dtype": "float32", "shape": ["heads"]}}

ONE_LINE = [
    # unknown keys below maps and lists list the allowed keys
    ({"autotune": {"sm_90": {"foo": 1}}},
     "autotune.sm_90.foo: unknown key; allowed keys: tile_m, tile_n, occupancy, num_ctas, "
     "num_worker_warps, opt_level, tile_order, v_transposed, persistent, seq_buckets, min_gain"),
    ({"tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "device": "cpu"}},
      "score_mod": "score - slope[h]"},
     "tensors.slope.device: unknown key; allowed keys: dtype, shape, learnable"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "by_seq_k": [
        {"max_seq_k": 64, "tile_m": 64, "tile_n": 64, "by_seq_k": []}]}}},
     "targets.sm_90.by_seq_k[0].by_seq_k: unknown key; allowed keys: tile_m, tile_n, occupancy, "
     "num_ctas, num_worker_warps, opt_level, tile_order, v_transposed, persistent, max_seq_k"),
    # pydantic's own wording, rewritten
    ({"autotune": {"sm_90": {"min_gain": 2}}},
     "autotune.sm_90.min_gain: must be a number in [0.0, 1.0], got 2"),
    ({"tensors": {"slope": {"dtype": "float32", "shape": ["heads"] * 5}},
      "score_mod": "score - slope[h]"},
     'tensors.slope.shape: must have at most 4 entries, got ["heads", "heads", "heads", "heads", '
     '"heads"]'),
    # a module name that would shadow what the generated code (or its user) imports
    ({"name": "torch"}, "name: must not be the name of a Python standard-library module nor of "
                        "torch, cuda, triton, numpy, specgen, generated"),
    ({"name": "random"}, "name: must not be the name of a Python standard-library module"),
    # what import torch itself loads (a generated typing_extensions.py broke it), and
    # names refused on another Python version than this one
    ({"name": "typing_extensions"}, "name: must not be the name of a Python standard-library "
                                    "module nor of torch, cuda"),
    ({"name": "sitecustomize"}, "name: must not be the name"),
    ({"name": "distutils"}, "name: must not be the name of a Python standard-library module"),
    ({"name": "tomllib"}, "name: must not be the name of a Python standard-library module"),
    # binhex: a standard module up to 3.10 only; refused on every version
    ({"name": "binhex"}, "name: must not be the name of a Python standard-library module"),
    ({"name": "type"}, "name: must be a Python identifier that is not a keyword"),
    # bools and floats are not integers, in a choice of numbers too
    ({"q_subtiles": True}, "q_subtiles: must be an integer, got true"),
    ({"q_subtiles": 2.0}, "q_subtiles: must be an integer, got 2.0"),
    ({"head_dim": 128.0}, "head_dim: must be an integer, got 128.0"),
    # hooks: one "got", and no division by a literal zero
    ({"score_mod": "score // 2"}, "score_mod: '//' needs integers, got score // 2"),
    ({"score_mod": "score / 0"}, "score_mod: '/' by zero is undefined, got score / 0"),
    ({"score_mod": "q_idx // 0 + score"}, "score_mod: '//' by zero is undefined, got q_idx // 0"),
    ({"score_mod": "score + 1/0"}, "score_mod: '/' by zero is undefined, got 1 / 0"),
    ({"mask_mod": "q_idx % -0 == 0"}, "mask_mod: '%' by zero is undefined, got q_idx % -0"),
    ({"score_mod": "score / 0.0"}, "score_mod: '/' by zero is undefined, got score / 0.0"),
    # ... nor by arithmetic that is zero whatever the indices
    ({"mask_mod": "kv_idx % (q_idx - q_idx) == 0"},
     "mask_mod: '%' by zero is undefined, got kv_idx % (q_idx - q_idx)"),
    ({"score_mod": "score / (2 * h - h - h)"},
     "score_mod: '/' by zero is undefined, got score / (2 * h - h - h)"),
    ({"score_mod": "score + q_idx // (0 * kv_idx)"},
     "score_mod: '//' by zero is undefined, got q_idx // (0 * kv_idx)"),
    ({"score_mod": "score / -(1.5 - 0.5 * 3)"}, "score_mod: '/' by zero is undefined"),
    # ... or zero on every branch, or of two integer constants
    ({"score_mod": "score / abs(0)"}, "score_mod: '/' by zero is undefined, got score / abs(0)"),
    ({"score_mod": "score / min(0, -0.0)"}, "score_mod: '/' by zero is undefined"),
    ({"score_mod": "score / where(q_idx > 0, 0, 0.0)"}, "score_mod: '/' by zero is undefined"),
    ({"score_mod": "score / (0 if q_idx > 0 else 0)"}, "score_mod: '/' by zero is undefined"),
    ({"score_mod": "score / (1 // 2)"}, "score_mod: '/' by zero is undefined"),
    # a bad tensor is the only line, not also the hooks that use it
    ({"tensors": {"Slope": {"dtype": "float32", "shape": ["heads"]}},
      "score_mod": "score - Slope[h]"},
     "tensors: tensor name 'Slope' must be a lowercase identifier"),
    # the name's own line, not the hook's "only declared tensors can be indexed"
    ({"tensors": {"slope\n": {"dtype": "float32", "shape": ["heads"]}},
      "score_mod": "score - slope[h]"},
     "tensors: tensor name 'slope\\n' must be a lowercase identifier"),
    # targets tileiras compiles for, and the worker warps it takes
    ({"compile_for": ["sm_999"]},
     f'compile_for[0]: must be a GPU target tileiras compiles for: {TARGETS}, got "sm_999"'),
    ({"targets": {"sm_91": {"tile_m": 64, "tile_n": 64}}},
     f"targets.sm_91: unknown target; allowed: 'default' or {TARGETS}, got \"sm_91\""),
    ({"autotune": {"sm_91": {}}}, "autotune.sm_91: must be a GPU target tileiras compiles for"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "num_worker_warps": 32}}},
     "targets.sm_90.num_worker_warps: must be 4 or 8 or null (auto) (tileiras 13.4 compiles no "
     "other), got 32"),
    ({"autotune": {"sm_90": {"num_worker_warps": [None, 16]}}},
     "autotune.sm_90.num_worker_warps[1]: must be 4 or 8 or null (auto)"),
    # configs the user never wrote are not blamed
    ({"family": "decode", "gqa_ratio": 128, "max_q_len": 8},
     "max_q_len: a decode tile packs gqa_ratio x max_q_len query rows, at most 256; gqa_ratio 128 "
     "allows max_q_len <= 2, got 8"),
    ({"family": "decode", "gqa_ratio": 64, "max_q_len": 8, "targets": {}},
     "max_q_len: a decode tile packs gqa_ratio x max_q_len query rows, at most 256; gqa_ratio 64 "
     "allows max_q_len <= 4, got 8"),
    ({"pack_gqa": True, "gqa_ratio": 128, "targets": {}},
     "pack_gqa: true with gqa_ratio 128 needs tile_m >= 128, and the default launch configs have "
     "tile_m 64; write targets (with default) with tile_m >= 128"),
    ({"pack_gqa": True, "gqa_ratio": 128, "targets": {"sm_90": {"tile_m": 128, "tile_n": 64}}},
     "pack_gqa: true with gqa_ratio 128 needs tile_m >= 128, and the default launch configs have "
     "tile_m 64"),
]


@pytest.mark.parametrize("overrides,expected", ONE_LINE, ids=[e.split(":")[0] for _, e in ONE_LINE])
def test_one_line_in_the_projects_words(overrides, expected):
    lines = _lines({"name": "ok", **overrides})
    assert len(lines) == 1 and lines[0].startswith(f"specs/bad.yaml: {expected}"), lines
    assert "Input should" not in lines[0] and "after validation" not in lines[0]
    assert lines[0].count(", got ") <= 1


@pytest.mark.parametrize("hook", [
    "score / (q_idx - kv_idx + 1)",  # zero at some positions only: the hook's business
    "score + q_idx // (h - 2 * h + 3 * h + 1)",
    "score / (2 * h + 0.5 - 2 * h + 0.5)",
    "score / (0.1 + 0.2 - 0.3)",  # not zero in floats (5.6e-17)
    "score / where(q_idx > 0, 0, 1)",
    "score + -2147483648",  # int32's minimum
])
def test_a_divisor_that_is_not_always_zero_is_allowed(hook):
    assert validate_spec({"name": "ok", "score_mod": hook}).score_mod is not None


def test_a_written_target_is_still_blamed_for_its_own_tile():
    (line,) = _lines({"name": "ok", "pack_gqa": True, "gqa_ratio": 128, "targets": {
        "default": {"tile_m": 128, "tile_n": 64}, "sm_90": {"tile_m": 64, "tile_n": 64}}})
    assert line.startswith("specs/bad.yaml: targets.sm_90.tile_m: pack_gqa needs tile_m >= gqa_ratio 128")


def test_decode_rows_at_the_limit_are_fine():
    spec = validate_spec({"name": "ok", "family": "decode", "gqa_ratio": 128, "max_q_len": 2})
    assert spec.targets["default"].tile_m == 256


@pytest.mark.parametrize("name", sorted(
    {"seed", "dropout_p", "q_descale", "k_descale", "v_descale", "seq_lens", "page_table",
     "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "q_shift", "block_map",
     "sinks", "out", "scale", "q_offset", "k_cache", "v_cache", "max_seq_len"}))
def test_launcher_argument_names_are_not_tensor_names(name):
    (line,) = _lines({"name": "ok", "tensors": {name: {"dtype": "float32", "shape": ["heads"]}},
                      "score_mod": f"score - {name}[h]"})
    assert line.startswith(f"specs/bad.yaml: tensors: tensor name '{name}' must be")


@pytest.mark.parametrize("name", ["t", "grid", "config", "where"])
def test_a_reserved_tensor_name_is_refused_as_taken_not_as_malformed(name):
    """A short name such as 't' fits the lowercase-identifier pattern; the line says
    that the module already uses it, and lists the names taken, the one given among them."""
    (line,) = _lines({"name": "ok", "tensors": {name: {"dtype": "float32", "shape": ["heads"]}},
                      "score_mod": f"score - {name}[h]"})
    assert line.startswith(f"specs/bad.yaml: tensors: tensor name '{name}' must be none of the names "
                           "the generated module already uses"), line
    assert "lowercase identifier" not in line
    assert f" {name}," in line or line.endswith(f" {name}")


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_reserved_names_cover_the_locals_of_the_batch_slices(path):
    """The batch slices' calls pass every tensor on, so a tensor named as one of
    their locals was replaced by it: a learnable tensor named sums (the backward's
    float32 sums) reached the second slice as a list, one named part or e as a tuple
    or an int. Every name those blocks assign is reserved."""
    tree = ast.parse((ROOT / "generated" / f"{path.stem}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "per_slice" for t in node.targets):
            names.add("per_slice")
        if isinstance(node, ast.If) and "per_slice" in ast.unparse(node.test):
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    assert names - RESERVED_NAMES == set()


@pytest.mark.parametrize("name", ["sums", "parts", "part", "grad", "e", "per_slice"])
def test_a_learnable_tensor_named_as_a_slice_local_is_refused(name):
    (line,) = _lines({"name": "ok", "backward": True,
                      "tensors": {name: {"dtype": "float32", "shape": ["heads"], "learnable": True}},
                      "score_mod": f"score - {name}[h]"})
    assert line.startswith(f"specs/bad.yaml: tensors: tensor name '{name}' must be none of the names "
                           "the generated module already uses"), line


def _signature_names(path) -> set:
    """The argument names of a generated module's entry points."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and (
                node.name in ("attention", "_forward", "_backward", "make_block_map")
                or node.name.startswith("_op_")):
            args = node.args
            names |= {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    return names


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_reserved_names_cover_every_generated_signature(path):
    """Every argument a shipped module's entry points take is reserved (so a hook
    tensor of that name cannot make a duplicate argument)."""
    module = ROOT / "generated" / f"{path.stem}.py"
    if not module.is_file():
        pytest.skip(f"{module} not generated")
    spec = load_spec(path)
    missing = _signature_names(module) - set(spec.tensors) - RESERVED_NAMES - {"ctx", "inputs",
                                                                             "output", "_dlse", "dlse"}
    assert not missing, f"{module.name}: add {sorted(missing)} to LAUNCHER_ARGUMENTS"


@pytest.mark.parametrize("tensors,message", [
    ({"a_1b": {}, "a1_b": {}}, "tensor names 'a1_b' and 'a_1b' both become the kernel parameter A1B; rename one"),
    ({"map_state": {}}, "tensor name 'map_state' becomes the kernel parameter MapState, a name the kernels "
                        "already use"),
    ({"d_out": {}}, "tensor name 'd_out' becomes the kernel parameter DOut"),
    ({"d_lses": {}}, "tensor name 'd_lses' becomes the kernel parameter DLses"),
    ({"map_idx": {}}, "tensor name 'map_idx' becomes the kernel parameter MapIdx"),
    ({"qs": {}}, "tensor name 'qs' becomes the kernel parameter Qs"),
    ({"slope": {"learnable": True}, "d_slope": {}},
     "tensor names 'd_slope' and 'slope' both become the kernel parameter DSlope; rename one"),
])
def test_tensor_names_that_make_one_kernel_parameter_are_refused(tensors, message):
    """A hook tensor is a kernel parameter named kernel_param(name) (a learnable one's
    gradient "D" + that): two of them, or one and a name the kernels use, would be a
    duplicate argument or a shadowed array."""
    specs = {n: {"dtype": "float32", "shape": ["heads"], **extra} for n, extra in tensors.items()}
    score = "score - " + " - ".join(f"{n}[h]" for n in tensors)
    (line,) = _lines({"name": "ok", "backward": True, "tensors": specs, "score_mod": score})
    assert line == f"specs/bad.yaml: tensors: {message}" or line.startswith(f"specs/bad.yaml: tensors: {message}")


def test_kernel_names_cover_every_kernel_of_the_templates():
    """KERNEL_NAMES holds every name a hook tensor's parameter could clash with, over
    the shipped modules and the training specs (the bench variants and the random
    specs of tests/test_fuzz.py are checked where those render)."""
    from specgen.emit.render import render_raw
    from specgen.plan.make import make_plan

    texts = {p.name: (p.read_text(), load_spec(ROOT / "specs" / f"{p.stem}.yaml"))
             for p in (ROOT / "generated").glob("*.py") if (ROOT / "specs" / f"{p.stem}.yaml").is_file()}
    for path in sorted((ROOT / "bench" / "train").glob("*.yaml")):
        spec = load_spec(path)
        texts[path.name] = (render_raw(make_plan(spec)), spec)
    assert len(texts) > 40
    for where, (text, spec) in texts.items():
        missing = unknown_kernel_names(text, spec.tensors)
        assert not missing, f"{where}: add {sorted(missing)} to KERNEL_NAMES"


def _kernel_locals(text: str) -> set:
    """The names the kernels of module source ``text`` assign."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and any("ernel" in ast.unparse(d) for d in node.decorator_list):
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def test_kernel_local_names_cover_every_local_a_tensor_could_spell():
    """A hook tensor's operands are the kernels' locals <tensor>_<n>: every other
    local of that form (and every span_ local) must be one KERNEL_LOCAL_NAMES or
    KERNEL_LOCAL_PREFIXES refuses as a tensor name, over the shipped modules and the
    training specs."""
    from specgen.emit.render import render_raw
    from specgen.plan.make import make_plan
    from specgen.spec.fields import KERNEL_LOCAL_NAMES, KERNEL_LOCAL_PREFIXES

    texts = {p.name: (p.read_text(), load_spec(ROOT / "specs" / f"{p.stem}.yaml"))
             for p in (ROOT / "generated").glob("*.py") if (ROOT / "specs" / f"{p.stem}.yaml").is_file()}
    for path in sorted((ROOT / "bench" / "train").glob("*.yaml")):
        spec = load_spec(path)
        texts[path.name] = (render_raw(make_plan(spec)), spec)
    seen = set()
    for where, (text, spec) in texts.items():
        for name in _kernel_locals(text):
            family = re.fullmatch(r"([a-z][a-z0-9_]*)_\d+", name)
            if name.startswith(KERNEL_LOCAL_PREFIXES):
                seen.add(next(p for p in KERNEL_LOCAL_PREFIXES if name.startswith(p)))
            elif family and family[1] not in (spec.tensors or {}):
                assert family[1] in KERNEL_LOCAL_NAMES, f"{where}: the local {name}: add {family[1]!r} to KERNEL_LOCAL_NAMES"
                seen.add(family[1])
    assert seen == set(KERNEL_LOCAL_NAMES) | set(KERNEL_LOCAL_PREFIXES)  # none listed in vain


@pytest.mark.parametrize("tensor", ["dmod", "dsum", "span_doc"])
def test_tensor_names_that_are_kernel_locals_are_refused(tmp_path, tensor):
    """dmod compiled to wrong gradients (the derivative overwrote the gathered
    slope); dsum and span_<tensor> failed to compile."""
    text = (f"name: w\ndtype: float16\nhead_dim: 128\ncausal: true\nbackward: true\n"
            f"tensors:\n  {tensor}: {{dtype: float32, shape: [heads], learnable: true}}\n"
            f"score_mod: score - {tensor}[h] * (q_idx - kv_idx)\n")
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=f"tensor name '{tensor}' would clash with the kernels' own locals"):
        load_spec(path)


# --- the command line ------------------------------------------------------------------


def _run(capsys, *args):
    """main() in-process: (exit code, stdout, stderr lines)."""
    from specgen.commands.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


@pytest.fixture
def project(tmp_path, monkeypatch):
    import shutil

    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    (tmp_path / "README.md").write_text("# a file, not a folder\n")
    (tmp_path / "bad.py").write_text("def f(:\n")
    (tmp_path / "literal.py").write_text('SPEC = {"a": foo()}\n')
    (tmp_path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    results = tmp_path / "broken" / "gpu"
    results.mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "results" / "h200" / "fmha_gqa_causal-prefill.json.gz", results)
    (results / "fmha_prefix_lm-prefill.json").write_text('{"schema": 3,')
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "a.yaml").symlink_to("b.yaml")
    (tmp_path / "loop" / "b.yaml").symlink_to("a.yaml")
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "a.yaml").symlink_to("gone.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


SPEC = "specs/fmha_gqa_causal.yaml"


@pytest.mark.parametrize("args,expected", [
    (["build", SPEC, "--no-compile", "--gen", "README.md"], "--gen README.md: exists and is not a folder"),
    (["build", SPEC, "--no-compile", "--gen", "specs/fmha_alibi.yaml"],
     "--gen specs/fmha_alibi.yaml: exists and is not a folder"),
    (["build", SPEC, "--no-compile", "--gen", ""], "--gen: expected a folder, got ''"),
    (["build", SPEC, "--no-compile", "--gen", "README.md/sub"],
     "specgen build: --gen README.md/sub: README.md is not a folder"),
    (["test", SPEC, "--emulate", "--gen", "README.md"], "--gen README.md: exists and is not a folder"),
    (["schema", "--file", "specs"], "--file specs: exists and is not a regular file"),
    (["schema", "--file", "nowhere/schema.json"], "--file nowhere/schema.json: no such folder nowhere"),
    (["schema", "--file", ""], "--file: expected a file name, got ''"),
    (["docs", "--root", "README.md"],
     "specgen docs: README.md is not a checkout of specgen (it has no specs/ or bench/results/): "
     "`specgen docs` regenerates specgen's own docs/ pages, not a page of your specs"),
    (["docs", "--root", "specs"],
     "specgen docs: specs is not a checkout of specgen (it has no specs/ or bench/results/): "
     "`specgen docs` regenerates specgen's own docs/ pages, not a page of your specs"),
    (["docs", "--check", "--root", ""], "specgen docs: --root: expected a folder, got ''"),
    (["build", SPEC, "--check", "--force"],
     "specgen build: --check and --force cannot be combined (--check writes nothing)"),
    (["test", SPEC, "--fuzz", "5", "--fuzz-case", "0:1"],
     "specgen test: --fuzz and --fuzz-case cannot be combined (--fuzz-case replays one case)"),
    (["test", SPEC, "--seed", "5", "--fuzz-case", "0:1"],
     "specgen test: --seed and --fuzz-case cannot be combined (the case names its own seed"),
    (["test", SPEC, "--quick", "--fuzz", "1"],
     "specgen test: --quick and --fuzz cannot be combined (--fuzz draws its own shapes)"),
    (["diff", "--templates", SPEC, "--set", "causal=false"],
     "specgen diff: --templates re-renders specs as they are; it takes no --set"),
    (["build", SPEC, "--no-compile", "--targets", "sm_90,,sm_100"],
     "--targets: expected a comma-separated list like sm_90,sm_100 without empty items, got "
     "'sm_90,,sm_100'"),
    (["build", SPEC, "--no-compile", "--targets", "sm_90,sm_90"],
     "--targets: lists sm_90 twice, got 'sm_90,sm_90'"),
    (["build", SPEC, "--no-compile", "--targets", "sm_91"],
     f"--targets: 'sm_91' must be a GPU target tileiras compiles for: {TARGETS}"),
    (["diff", SPEC, "--no-compile", "--set", "head_dim=" + "9" * 5000],
     "--set head_dim: invalid YAML: a number too long to read"),
    (["diff", SPEC, "--no-compile", "--set", "head_dim=" + "[" * 3000 + "]" * 3000],
     "--set head_dim: invalid YAML: nested too deeply"),
    (["diff", SPEC, "--no-compile", "--set", "head_dim=0200"],
     '--set head_dim: head_dim: must be an integer, got "0200"'),
    # diff's inputs: a module that is not one, text that is not UTF-8, a --results file
    (["diff", "bad.py", SPEC, "--no-compile"], "bad.py: not a generated module (no specgen header)"),
    (["diff", "literal.py", SPEC, "--no-compile"],
     "literal.py: not a generated module (no specgen header)"),
    (["diff", "latin1.yaml", SPEC, "--no-compile"], "latin1.yaml: file is not UTF-8 text"),
    (["diff", SPEC, "specs/fmha_prefix_lm.yaml", "--no-compile", "--results", "README.md"],
     "--results README.md: exists and is not a folder"),
    (["diff", SPEC, "specs/fmha_prefix_lm.yaml", "--no-compile", "--results", "broken"],
     "specgen diff: --results: broken/gpu/fmha_prefix_lm-prefill.json: not valid JSON"),
    # build: a symlink loop among the specs
    (["build", "loop", "--no-compile"], "loop/a.yaml: a symlink loop"),
    (["build", "dangling", "--no-compile"], "dangling/a.yaml: a symbolic link to gone.yaml, which does not exist"),
    # argparse's own errors: one line
    (["build"], "specgen build: error: the following arguments are required: PATH"),
    (["build", SPEC, "--bogus"], "specgen build: error: unrecognized arguments: --bogus"),
    # an unknown option is named before a missing PATH, and a unique prefix is no unknown
    (["build", "--bogus"], "specgen build: error: unrecognized arguments: --bogus"),
    (["build", "--bogus=3", "--gen", "x"], "specgen build: error: unrecognized arguments: --bogus=3"),
    (["build", "--ge", "x"], "specgen build: error: the following arguments are required: PATH"),
    (["diff"], "specgen diff: give two specs or modules"),
    (["nope"], "specgen: error: argument COMMAND: invalid choice: 'nope'"),
    ([], "specgen: error: a command is required: one of build, test, tune, bench, diff, schema, "
         "docs (specgen --help says more)"),
    (["test", SPEC, "--fuzz", "x"], "specgen test: error: argument --fuzz: invalid int value: 'x'"),
])
def test_cli_misuse_is_one_line_and_exit_2(project, capsys, args, expected):
    if expected.startswith("--"):  # an option's error names its command first
        expected = f"specgen {args[0]}: {expected}"
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    code, _, err = _run(capsys, *args)
    assert code == 2 and len(err) == 1 and err[0].startswith(expected), err
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before  # nothing written


def test_a_symlink_loop_is_named_on_every_python(project, capsys, monkeypatch):
    """Python 3.13's Path.resolve(strict=True) raises OSError(ELOOP) for a loop where
    3.10-3.12 raise RuntimeError: both are one line naming the loop."""
    import errno
    import os
    from pathlib import Path

    real = Path.resolve

    def resolve(self, strict=False):
        if strict and self.parent.name == "loop":
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(self))
        return real(self, strict)

    monkeypatch.setattr(Path, "resolve", resolve)
    code, _, err = _run(capsys, "build", "loop", "--no-compile")
    assert code == 2 and err == ["loop/a.yaml: a symlink loop"], err


def test_schema_file_replaces_a_regular_file(project, capsys):
    target = project / "schema.json"
    target.write_text("old")
    assert _run(capsys, "schema", "--file", target)[0] == 0
    assert target.read_text().startswith("{")


def test_schema_file_writes_through_a_symbolic_link(project, capsys):
    """A link given as --file keeps being a link: its target gets the schema, as a
    plain open() would write it (it used to be replaced by a regular file)."""
    target = project / "shared" / "schema.json"
    target.parent.mkdir()
    target.write_text("old")
    link = project / "schema-link.json"
    link.symlink_to(target)
    assert _run(capsys, "schema", "--file", link)[0] == 0
    assert link.is_symlink() and target.read_text().startswith("{")
    assert sorted(p.name for p in target.parent.iterdir()) == ["schema.json"]  # no temporary left


@pytest.mark.parametrize("args", [
    ["specs/fmha_alibi.yaml", "specs/fmha_gqa_causal.yaml"],
    ["specs/fmha_alibi.yaml", "specs/fmha_gqa_causal.yaml", "--json"],
    ["specs/fmha_alibi.yaml", "--set", "score_mod=score * 2 - slope[h]"],
])
def test_diff_shows_hooks_by_their_source(project, capsys, args):
    stat = [] if "--json" in args else ["--stat"]  # --json carries the whole source diff
    code, out, err = _run(capsys, "diff", *args, "--no-compile", *stat)
    assert code == 1 and err == [], err
    if "--json" in args:
        import json

        plan = {c["field"]: c for c in json.loads(out)["plan"]}
        assert plan["score_mod"]["a"] == "score - slope[h] * (q_idx - kv_idx)"
        assert plan["score_mod"]["b"] is None
    else:
        assert 'score_mod: "score - slope[h] * (q_idx - kv_idx)" → ' in out


def test_the_emulator_rewrites_device_names_not_tensor_names():
    from specgen.check.emulate import _NoDevice

    source = ('t = {"cuda": cuda}\n'
              'device = torch.device("cuda" if device is None else device)\n'
              'ok = device.type != "cuda"\n'
              'other = torch.device("cuda", 0)\n')
    text = ast.unparse(_NoDevice().visit(ast.parse(source)))
    assert "{'cuda': cuda}" in text
    assert "torch.device('cpu' if device is None else device)" in text
    assert "device.type != 'cpu'" in text and "torch.device('cpu', 0)" in text


def test_a_tensor_named_cuda_renders_and_imports_in_the_emulator(tmp_path):
    from specgen.check.emulate import load_module
    from specgen.emit.render import render
    from specgen.plan.make import make_plan

    spec = validate_spec({"name": "cuda_tensor", "causal": True, "head_dim": 64,
                          "tensors": {"cuda": {"dtype": "float32", "shape": ["heads"]}},
                          "score_mod": "score - cuda[h] * (q_idx - kv_idx)"})
    source = render(make_plan(spec), "specs/cuda_tensor.yaml").text
    compile(source, "cuda_tensor.py", "exec")  # no duplicate argument
    path = tmp_path / "cuda_tensor.py"
    path.write_text(source)
    module = load_module(path, source=source)
    assert "cuda" in module.attention.__code__.co_varnames


def test_hidden_files_of_a_spec_folder_are_not_specs(project, capsys):
    """An editor's lock link (.#x.yaml, pointing nowhere) and backup (.~x.yaml, a copy
    with the same name:) beside the specs: a build of the folder reads neither."""
    folder = project / "mine"
    folder.mkdir()
    text = (project / SPEC).read_text()
    (folder / "fmha_gqa_causal.yaml").write_text(text)
    (folder / ".#fmha_gqa_causal.yaml").symlink_to("user@host.1234")
    (folder / ".~fmha_gqa_causal.yaml").write_text(text)
    code, out, err = _run(capsys, "build", folder, "--no-compile", "--gen", project / "gen")
    assert code == 0, err
    assert sorted(p.name for p in (project / "gen").glob("*.py")) == ["__init__.py", "fmha_gqa_causal.py"]


def test_timing_commands_name_a_missing_triton(monkeypatch):
    """bench, tune and bench --variants time with triton's do_bench: where triton
    does not import (a CPU build of torch on a GPU machine), one line says so."""
    import sys

    from specgen.check.gpu import require_do_bench
    from specgen.errors import UsageError

    monkeypatch.setitem(sys.modules, "triton.testing", None)
    with pytest.raises(UsageError) as info:
        require_do_bench("tune")
    assert str(info.value).startswith("specgen tune: times kernels with triton.testing.do_bench, and triton "
                                      "does not import")
    assert "install a CUDA build of torch" in str(info.value) and "\n" not in str(info.value)


def _launcher_locals(source: str) -> set[str]:
    """The names the functions of a module that take q and k (or a cache, or the hook
    tensors) assign, that a tensor of that name would be shadowed by: neither their
    own parameters nor names with a leading underscore (which no tensor name has)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        args = node.args
        params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        if not ({"q", "k"} <= params or "k_cache" in params or "tensors" in params):
            continue
        found |= {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)
                  and sub.id not in params and not sub.id.startswith("_")}
    return found


def test_reserved_names_cover_every_launcher_local():
    """A tensor is a keyword argument of the launchers, which pass it on by name: a
    local of the same name (dq, shape, key, value, n_tiles, ...) replaced it partway,
    so a learnable tensor named dq failed in the backward and one named value was
    another object by the time it reached the kernels. Every such local of the shipped
    modules and of the bench specs' (rendered here) is reserved."""
    import yaml

    from specgen.spec.fields import TENSOR_NAME_RE

    from .helpers import render_spec_data

    sources = [path.read_text() for path in sorted((ROOT / "generated").glob("fmha_*.py"))]
    for path in sorted((ROOT / "bench").glob("*/*.yaml")):
        data = yaml.safe_load(path.read_text())
        if isinstance(data, dict) and "name" in data and "spec" not in data:
            sources.append(render_spec_data(data, formatted=False)[1])
    # (A learnable tensor's gradient is the local "d" + its name: refused as another
    # tensor's name by the validator, below.)
    missing = {name for source in sources for name in _launcher_locals(source)
               if TENSOR_NAME_RE.fullmatch(name)} - RESERVED_NAMES - {"dslope"}
    assert not missing, f"add {sorted(missing)} to RESERVED_NAMES"


def test_a_tensor_named_as_a_learnable_ones_gradient_is_refused():
    """The backward keeps a learnable tensor's gradient in the local "d" + its name: a
    second tensor of that name was replaced by it."""
    specs = {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True},
             "dslope": {"dtype": "float32", "shape": ["heads"]}}
    (line,) = _lines({"name": "ok", "backward": True, "tensors": specs, "score_mod": "score - slope[h] - dslope[h]"})
    assert line == ("specs/bad.yaml: tensors: tensor name 'dslope' is the name of the learnable tensor "
                    "slope's gradient in the backward; rename it")


@pytest.mark.parametrize("name, local", [("q_tiles", "dq_tiles"), ("elta", "delta"), ("q_global", "dq_global")])
def test_a_learnable_tensor_whose_gradient_is_named_as_a_launcher_local_is_refused(name, local):
    """A learnable tensor's gradient is the backward's local "d" + its name: a
    learnable q_tiles was replaced by the dQ tile count (AttributeError: 'int' object
    has no attribute 'dim' in the backward), a learnable elta replaced delta (the
    kernels read a [heads] tensor as D). Refused in one line, as a reserved name is."""
    (line,) = _lines({"name": "ok", "backward": True,
                      "tensors": {name: {"dtype": "float32", "shape": ["heads"], "learnable": True}},
                      "score_mod": f"score - {name}[h]"})
    assert line == (f"specs/bad.yaml: tensors: learnable tensor name {name!r}: its gradient in the "
                    f"backward is the local {local!r}, a name the generated module already uses; "
                    "rename it")


def test_no_learnable_tensor_name_gives_a_reserved_gradient_local():
    """Every valid name whose "d" + name is reserved is refused for a learnable tensor."""
    import keyword

    from specgen.spec.fields import TENSOR_NAME_RE

    for reserved in sorted(RESERVED_NAMES):
        name = reserved[1:]
        if (not reserved.startswith("d") or not TENSOR_NAME_RE.fullmatch(name) or name in RESERVED_NAMES
                or keyword.iskeyword(name)):
            continue
        with pytest.raises(SpecError, match=f"its gradient in the backward is the local '{reserved}'"):
            validate_spec({"name": "ok", "backward": True, "score_mod": f"score - {name}[h]",
                           "tensors": {name: {"dtype": "float32", "shape": ["heads"], "learnable": True}}})

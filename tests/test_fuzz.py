"""Spec fuzzing with hypothesis.

Random valid specs render to black-clean, deterministic, importable modules whose
top level holds nothing but the template's own statements; a sample compiles for
sm_90. Random invalid specs (one fault each, or hostile YAML) get one error line
naming the file, exit 2, no traceback and no file written.

Examples per test: 30 by default, SPECGEN_FUZZ_EXAMPLES to change;
the sm_90 compile sample: SPECGEN_FUZZ_COMPILE (default 4).
"""

import ast
import contextlib
import io
import keyword
import os
import tempfile
from pathlib import Path

import black
import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specgen.commands import cli  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402
from specgen.errors import SpecError  # noqa: E402
from specgen.plan.make import make_plan  # noqa: E402
from specgen.emit.render import BLACK_MODE, render, render_raw  # noqa: E402
from specgen.spec import Spec, validate_spec  # noqa: E402

from .helpers import unknown_kernel_names  # noqa: E402

# 30 random specs of each family in the default run (about 20 s each on one core); a deep run:
# SPECGEN_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz.py. derandomize=True
# makes every run draw the same specs, so a failure reproduces.
EXAMPLES = int(os.environ.get("SPECGEN_FUZZ_EXAMPLES", "30"))
COMPILE_EXAMPLES = int(os.environ.get("SPECGEN_FUZZ_COMPILE", "4"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

pow2 = st.sampled_from([16, 32, 64, 128, 256])
names = st.from_regex(r"[a-z][a-z0-9_]{0,30}", fullmatch=True).filter(
    lambda n: not keyword.iskeyword(n))


@st.composite
def launch_config(draw, tile_m=None):
    config = {"tile_m": tile_m or draw(st.sampled_from([16, 32, 64, 128])),
              "tile_n": draw(st.sampled_from([16, 32, 64, 128])),
              "occupancy": draw(st.integers(1, 4))}
    if draw(st.booleans()):
        config["num_worker_warps"] = draw(st.sampled_from([None, 4, 8]))
    if draw(st.booleans()):
        config["opt_level"] = draw(st.sampled_from([None, 0, 1, 2, 3]))
    return config


@st.composite
def prefill_specs(draw):
    dtype = draw(st.sampled_from(["float16", "bfloat16", "float8_e4m3fn"]))
    head_dim = draw(st.sampled_from([16, 32, 48, 64, 80, 96, 128, 192, 256]))
    spec = {"name": draw(names), "dtype": dtype, "head_dim": head_dim,
            "gqa_ratio": draw(st.sampled_from([1, 2, 4, 8])),
            "causal": draw(st.booleans())}
    if draw(st.booleans()):
        spec["v_head_dim"] = draw(st.sampled_from([64, 128]))
    if draw(st.integers(0, 3)) == 0:
        left = draw(st.one_of(st.none(), st.integers(0, 4096)))
        right = None if spec["causal"] else draw(st.one_of(st.none(), st.integers(0, 4096)))
        if left is not None or right is not None:
            spec["window"] = {"left": left, "right": right}
    if draw(st.integers(0, 3)) == 0:
        spec["softcap"] = draw(st.floats(0.5, 1000.0, allow_nan=False))
    feature = draw(st.sampled_from(["none", "none", "sinks", "lse", "dropout", "varlen",
                                    "alibi", "doc_mask", "backward"]))
    if feature == "sinks":
        spec["sinks"] = True
    elif feature == "lse":
        spec["return_lse"] = True
    elif feature == "dropout":
        spec["dropout"] = True
    elif feature == "varlen":
        spec["varlen"] = True
    elif feature == "alibi":
        spec["tensors"] = {"slope": {"dtype": "float32", "shape": ["heads"]}}
        spec["score_mod"] = "score - slope[h] * abs(q_idx - kv_idx)"
    elif feature == "doc_mask":
        spec["tensors"] = {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}}
        spec["mask_mod"] = "doc[b, q_idx] == doc[b, kv_idx]"
    elif feature == "backward":
        spec = {k: v for k, v in spec.items() if k not in ("window", "softcap", "v_head_dim")}
        spec.update(backward=True, dtype=draw(st.sampled_from(["float16", "bfloat16"])),
                    head_dim=draw(st.sampled_from([32, 64, 128])))
    spec["fast_math"] = {"exp2": draw(st.booleans()), "flush_to_zero": draw(st.booleans()),
                         "approx_div": draw(st.booleans())}
    spec["loop_split"] = draw(st.booleans())
    spec["block_remap"] = draw(st.sampled_from([None, True, False]))
    spec["loads"] = {"k_transposed": draw(st.booleans()),
                     "k_latency": draw(st.one_of(st.none(), st.integers(1, 10))),
                     "v_latency": draw(st.one_of(st.none(), st.integers(1, 10))),
                     "allow_tma": draw(st.sampled_from([None, True, False]))}
    spec["prescale_q"] = draw(st.booleans())
    spec["targets"] = {"default": draw(launch_config())}
    if draw(st.booleans()):
        spec["targets"]["sm_90"] = draw(launch_config())
    return spec


@st.composite
def decode_specs(draw):
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    q_len = draw(st.integers(1, 8))
    rows = max(16, 1 << (ratio * q_len - 1).bit_length())
    spec = {"name": draw(names), "family": "decode",
            "dtype": draw(st.sampled_from(["float16", "bfloat16"])),
            "head_dim": draw(st.sampled_from([64, 128])), "gqa_ratio": ratio, "max_q_len": q_len,
            "splits": draw(st.one_of(st.just("auto"), st.integers(1, 64))),
            "targets": {"default": {"tile_m": rows, "tile_n": draw(st.sampled_from([32, 64, 128])),
                                    "occupancy": draw(st.integers(1, 4))}}}
    if draw(st.booleans()):
        spec["paged"] = {"page_size": draw(st.sampled_from([16, 32, 64, 128, 256]))}
    if draw(st.booleans()):
        spec["window"] = {"left": draw(st.integers(0, 8192))}
    spec["sinks"] = draw(st.booleans())
    return spec


def _validated(data: dict) -> Spec | None:
    try:
        return validate_spec(data, "fuzz.yaml")
    except SpecError:
        return None


ALLOWED_IMPORTS = {"dataclasses", "hashlib", "json", "linecache", "math", "numbers", "operator", "os", "struct", "sys",
                   "threading", "types", "torch", "cuda.tile"}
# The AOT runtime's names from cuda.tile (its ByTarget sentinel and the signature types).
ALLOWED_FROM = {"cuda.tile._by_target", "cuda.tile.compilation"}
ALLOWED_TOP_CALLS = {"_register", "_lookup", "math.log", "math.sqrt", "_AotStore", "_imported_source_sha256",
                     "os.path.join", "os.path.dirname", "os.path.abspath",
                     "getattr", "threading.RLock",
                     # the op registry's process-wide lock
                     "sys.modules.setdefault", "types.ModuleType", "_REGISTRY.__dict__.setdefault",
                     # _eager's plain tensor types
                     "frozenset",
                     # a block map's sources by its counts, for the custom ops
                     "torch.utils.weak.WeakIdKeyDictionary",
                     # attention() as torch.compile leaves it to run eagerly
                     "torch.compiler.disable"}
ALLOWED_CLASSES = {"_AotStore", "AotKernel", "_EagerAttention", "_FuncAttention", "_FuncGrads"}


def _check_module_text(text: str, spec_dict: dict) -> None:
    """The injection property, on the generated source itself: the top level is
    only imports of the standard library modules above, torch and cuda.tile,
    assignments, kernels, functions and the AOT runtime's two classes; the only calls
    run at import are math.log/sqrt, the AOT folder's path and store, the locks and the
    op registration; SPEC reads back as a literal
    equal to the validated spec (every spec string went through repr)."""
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Import):
            assert {a.name for a in node.names} <= ALLOWED_IMPORTS, ast.dump(node)
        elif isinstance(node, ast.ImportFrom):
            assert node.module in ALLOWED_FROM, f"from-import in generated code: {ast.dump(node)}"
        elif isinstance(node, ast.ClassDef):
            assert node.name in ALLOWED_CLASSES, node.name
        elif isinstance(node, ast.Expr):
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                assert ast.unparse(call.func) in ALLOWED_TOP_CALLS, ast.unparse(node)
        else:
            assert isinstance(node, ast.FunctionDef), ast.dump(node)[:200]
    spec_nodes = [n for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "SPEC" for t in n.targets)]
    assert len(spec_nodes) == 1
    assert ast.literal_eval(spec_nodes[0].value) == spec_dict


# One test per family, so the two halves of the examples run on two workers.
@FUZZ
@given(prefill_specs())
def test_random_valid_prefill_specs_render_clean_importable_modules(data):
    _render_clean_importable(data)


@FUZZ
@given(decode_specs())
def test_random_valid_decode_specs_render_clean_importable_modules(data):
    _render_clean_importable(data)


def _render_clean_importable(data):
    spec = _validated(data)
    assume(spec is not None)
    event(f"family {spec.family}")
    plan = make_plan(spec)
    # Deterministic: a second validation and plan give the same template output (black
    # is deterministic itself, so the formatted module is compared once, below).
    assert render_raw(make_plan(validate_spec(data, "fuzz.yaml"))) == render_raw(plan)
    first = render(plan, "specs/fuzz.yaml").text
    # render() formats with one pass of black; that another pass changes nothing
    # (the module is black-clean) is checked on every module (about 0.2 s).
    assert black.format_str(first, mode=BLACK_MODE) == first
    _check_module_text(first, plan.spec_dict)
    assert not unknown_kernel_names(first, spec.tensors)  # KERNEL_NAMES is complete
    module = load_module_from_source(f"fuzz_{plan.module_name}", first, f"<fuzz {plan.module_name}>")
    assert module.SPEC == plan.spec_dict and callable(module.attention)


def test_the_valid_strategies_mostly_produce_valid_specs():
    """Guards the test above against a strategy that drifts into invalid specs
    (assume() would then skip nearly everything)."""
    valid = []

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(st.one_of(prefill_specs(), decode_specs()))
    def sample(data):
        valid.append(_validated(data) is not None)

    sample()
    assert sum(valid) >= 0.5 * len(valid), f"{sum(valid)} of {len(valid)} valid"


@pytest.mark.slow
@settings(max_examples=COMPILE_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.one_of(prefill_specs(), decode_specs()))
def test_a_sample_of_random_specs_compiles_for_sm_90(data):
    from specgen.compile.export import compile_target

    spec = _validated(data)
    assume(spec is not None)
    plan = make_plan(spec)
    before = os.environ.get("SPECGEN_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["SPECGEN_CACHE_DIR"] = cache
        try:
            result = compile_target(plan, render(plan, "specs/fuzz.yaml").text, "<fuzz>", "sm_90")
        finally:
            if before is None:
                os.environ.pop("SPECGEN_CACHE_DIR", None)
            else:
                os.environ["SPECGEN_CACHE_DIR"] = before
    assert result.size > 0


# --- invalid specs -----------------------------------------------------------

BAD_NAMES = ["class", "def", "None", "True", "import", "lambda", "a;b", "a'b", 'a"b', "a\nb",
             "a b", "1abc", "_private", "", "x" * 101, "a.b", "a-b", "__import__('os')",
             "os.system('x')", "a\\b", "a\tb", "$x", "a/b"]
BAD_TILES = [0, 1, 8, 24, 300, 512, -16, 2**40, 10**30]
HUGE = [10**30, -(10**30), 2**63, 2**64 + 1]


def _fields() -> dict:
    return {
        "head_dim": ("int", []), "gqa_ratio": ("int", []), "max_q_len": ("int", []),
        "causal": ("bool", []), "dropout": ("bool", []), "varlen": ("bool", []),
        "sinks": ("bool", []), "return_lse": ("bool", []), "loop_split": ("bool", []),
        "prescale_q": ("bool", []), "backward": ("bool", []),
        "dtype": ("enum", []), "family": ("enum", []),
    }


wrong_values = {
    "int": st.one_of(st.text(max_size=8), st.floats(allow_nan=True), st.booleans(),
                     st.lists(st.integers(), max_size=3), st.just({})),
    "bool": st.one_of(st.sampled_from(["yes", "no", "true", "on", "1"]), st.integers(),
                      st.floats(), st.lists(st.booleans(), max_size=2)),
    "enum": st.one_of(st.text(max_size=12).filter(
        lambda s: s not in ("float16", "bfloat16", "float8_e4m3fn", "prefill", "decode")),
        st.integers(), st.booleans()),
}


@st.composite
def mutated_specs(draw):
    """(YAML text, what was broken) for a valid prefill spec with one fault."""
    base = draw(prefill_specs())
    assume(_validated(base) is not None)
    kind = draw(st.sampled_from(["type", "tile", "unknown", "missing_name", "bad_name", "huge",
                                 "nested_unknown"]))
    spec = dict(base)
    if kind == "type":
        field, (typ, _) = draw(st.sampled_from(sorted(_fields().items())))
        spec[field] = draw(wrong_values[typ])
    elif kind == "tile":
        which = draw(st.sampled_from(["tile_m", "tile_n"]))
        spec["targets"] = {"default": {**base["targets"]["default"], which: draw(st.sampled_from(BAD_TILES))}}
    elif kind == "unknown":
        key = draw(st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True).filter(
            lambda k: k not in Spec.model_fields))
        spec[key] = draw(st.one_of(st.integers(), st.text(max_size=5), st.booleans()))
    elif kind == "nested_unknown":
        where = draw(st.sampled_from(["loads", "fast_math", "targets.default"]))
        key = draw(st.sampled_from(["tile_k", "latency", "exp3", "fast", "x"]))
        if where == "targets.default":
            spec["targets"] = {"default": {**base["targets"]["default"], key: 1}}
        else:
            spec[where] = {**base[where], key: 1}
    elif kind == "missing_name":
        del spec["name"]
    elif kind == "bad_name":
        spec["name"] = draw(st.sampled_from(BAD_NAMES))
    else:
        field = draw(st.sampled_from(["head_dim", "gqa_ratio", "max_q_len", "softcap"]))
        spec[field] = draw(st.sampled_from(HUGE))
    return yaml.safe_dump(spec, sort_keys=False), kind


HOSTILE = [
    "",
    "# only a comment\n",
    "- a\n- b\n",
    "just a string\n",
    "42\n",
    "name: !!python/object/apply:os.system ['echo pwned']\n",
    "name: !!python/name:os.system\n",
    "name: x\nhead_dim: !!python/object/new:int [64]\n",
    "name: x\nhead_dim: !!binary aGVsbG8=\n",
    "a: &a [x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c]\nname: x\n",
    "name: &n x\nscore_mod: *n\n",
    "name: x\nname: y\n",
    "name: [x\n",
    "name: x\n\ttabbed: 1\n",
    "name: x\nhead_dim: " + "[" * 3000 + "]" * 3000 + "\n",
    "name: x\nsoftcap: 1" + "0" * 5000 + "\n",
    "name: x\nsoftcap: .nan\n",
    "name: x\nsoftcap: .inf\n",
    "name: x\nscore_mod: \"__import__('os').system('x')\"\n",
    "name: x\nmask_mod: \"(lambda: 1)()\"\n",
    "name: x\ntensors: {\"a b\": {dtype: float32, shape: [heads]}}\n",
    "name: x\ntargets: {\"sm_90;rm\": {tile_m: 64, tile_n: 64}}\n",
    "name: x\ncompile_for: [\"sm_90\\nimport os\"]\n",
]


def _build(text: bytes) -> tuple[int, str, bool]:
    """`specgen build` on a spec with ``text``: exit code, stderr, whether anything
    was written."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_bytes(text)
        out = Path(tmp) / "gen"
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["build", str(path), "--no-compile", "--out", str(out)])
        return code, err.getvalue().replace(str(path), "fuzz.yaml"), out.exists() and any(out.iterdir())


def _assert_one_clean_line(code: int, stderr: str, wrote: bool) -> None:
    lines = stderr.strip("\n").split("\n")
    assert code == 2, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("fuzz.yaml: "), stderr
    assert "Traceback" not in stderr and not wrote


@FUZZ
@given(mutated_specs())
def test_random_invalid_specs_get_one_line_and_exit_2(case):
    text, kind = case
    event(kind)
    _assert_one_clean_line(*_build(text.encode()))


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_yaml_gets_one_line_and_exit_2(text):
    _assert_one_clean_line(*_build(text.encode()))


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash(blob):
    """Every problem is one line naming the file (several faults: several lines)."""
    code, stderr, wrote = _build(blob)
    if code == 0:  # a valid spec by chance
        return
    assert code == 2 and "Traceback" not in stderr and not wrote, stderr
    assert all(line.startswith("fuzz.yaml: ") for line in stderr.strip("\n").split("\n")), stderr

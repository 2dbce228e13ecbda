"""Emit: golden files, determinism, black-clean output, headers, and that every
spec field visibly changes the generated kernel."""

import ast
import copy
import difflib
import subprocess
import sys

import black
import pytest
import yaml

from specgen.plan import make_plan
from specgen.render import BLACK_MODE, HEADER_RE, hand_edited, render, template_hash
from specgen.spec import validate_spec

from .helpers import ROOT, SPECS, SPEC_NAMES, generated_module


def _render_shipped(path):
    plan = make_plan(validate_spec(yaml.safe_load(path.read_text()), path))
    return render(plan, f"specs/{path.name}").text


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_generated_matches_fresh_render(path):
    fresh = _render_shipped(path)
    committed_path = ROOT / "generated" / f"{path.stem}.py"
    committed = committed_path.read_text() if committed_path.exists() else ""
    if fresh != committed:
        diff = "".join(
            difflib.unified_diff(
                committed.splitlines(True), fresh.splitlines(True),
                f"generated/{path.stem}.py (committed)", "fresh render",
            )
        )
        pytest.fail(
            f"generated/{path.stem}.py is stale:\n{diff}\n"
            "update it with: specgen build specs --no-compile"
        )


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_render_is_deterministic(path):
    assert _render_shipped(path) == _render_shipped(path)


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_generated_is_black_clean(name):
    text = (ROOT / "generated" / f"{name}.py").read_text()
    assert black.format_str(text, mode=BLACK_MODE) == text


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_header_carries_version_path_and_hashes(name):
    from specgen import __version__

    text = (ROOT / "generated" / f"{name}.py").read_text()
    match = HEADER_RE.match(text)
    assert match, text[:400]
    assert match["version"] == __version__
    assert match["spec_path"] == f"specs/{name}.yaml"
    assert match["template_sha"] == template_hash()
    assert not hand_edited(text)
    assert hand_edited(text + "# tweak\n")
    # The header is exactly the five matched lines: no timestamp or host name.
    assert text[match.end() :].startswith('"""')


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_module_imports_only_math_torch_cuda_tile(name):
    tree = ast.parse((ROOT / "generated" / f"{name}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported == {"math", "torch", "cuda.tile"}


def test_every_generated_module_imports_without_gpu_or_specgen():
    code = (
        "import sys\n"
        f"for name in {SPEC_NAMES!r}:\n"
        "    mod = __import__('generated.' + name, fromlist=['attention'])\n"
        "    assert callable(mod.attention) and mod.SPEC['name'] == name\n"
        "bad = [m for m in sys.modules if m == 'specgen' or m.startswith('specgen.')]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "HOME": str(ROOT)},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_module_exposes_spec_and_configs(path):
    spec = validate_spec(yaml.safe_load(path.read_text()), path)
    mod = generated_module(path.stem)
    assert mod.SPEC == spec.model_dump(mode="json")
    assert mod.CONFIGS == {k: v.model_dump() for k, v in spec.targets.items()}
    kernel_name = make_plan(spec).kernel_name
    assert hasattr(mod, kernel_name)


BASE = yaml.safe_load((ROOT / "specs" / "fmha_gqa_causal.yaml").read_text())


def _variant(path, value):
    data = copy.deepcopy(BASE)
    node = data
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    if path == "causal":
        data["block_remap"] = False
    return render(make_plan(validate_spec(data)), "specs/variant.yaml").text


# Each field's change, and a line of source that shows it (present or absent).
VISIBLE = [
    ("name", "renamed", "renamed: causal prefill", True),
    ("dtype", "bfloat16", "DTYPE = torch.bfloat16", True),
    ("head_dim", 64, "HEAD_DIM = 64", True),
    ("gqa_ratio", 8, "GROUP_SIZE = 8", True),
    ("causal", False, "visible = keys <= rows", False),
    ("fast_math.exp2", False, "p = ct.exp(s * scale - m_new)", True),
    ("fast_math.flush_to_zero", False, "flush_to_zero=True", False),
    ("fast_math.approx_div", False, "rounding_mode=ct.RoundingMode.APPROX", False),
    ("loop_split", False, "for j in range(0, num_n):", True),
    ("block_remap", False, "tile_idx = ct.bid(0)", True),
    ("loads.k_transposed", False, "k_t = ct.permute(k, (1, 0))", True),
    ("loads.k_latency", None, "latency=2", False),
    ("loads.v_latency", 7, "latency=7", True),
    ("targets.sm_90", {"tile_m": 128, "tile_n": 32, "occupancy": 1},
     '"sm_90": {"tile_m": 128, "tile_n": 32, "occupancy": 1}', True),
    ("targets.sm_100", {"tile_m": 128, "tile_n": 128, "occupancy": 3},
     "sm_100=3", True),
    ("compile_for", ["sm_90"], '"compile_for": ["sm_90"]', True),
]


@pytest.mark.parametrize("path,value,line,present", VISIBLE, ids=[v[0] for v in VISIBLE])
def test_every_field_visibly_changes_the_module(path, value, line, present):
    base = render(make_plan(validate_spec(BASE)), "specs/variant.yaml").text
    variant = _variant(path, value)
    assert variant != base
    assert (line in variant) is present
    assert (line in base) is not present
    compile(variant, "variant.py", "exec")  # still valid Python


def test_fast_math_off_keeps_natural_exp_and_plain_division():
    data = copy.deepcopy(BASE)
    data["fast_math"] = {"exp2": False, "flush_to_zero": False, "approx_div": False}
    text = render(make_plan(validate_spec(data)), "specs/v.yaml").text
    assert "INV_LN2" not in text and "ct.exp2" not in text
    assert "out = ct.truediv(acc, l_i)" in text

"""Compile: every shipped spec AOT-compiles for sm_90 and sm_100 without a GPU."""

import pytest
import yaml

from specgen.compile import cache_key, compile_target, signatures, toolchain_versions
from specgen.errors import CompileError
from specgen.plan import make_plan
from specgen.render import render
from specgen.spec import validate_spec

from .helpers import SPECS


def _plan_and_source(path):
    plan = make_plan(validate_spec(yaml.safe_load(path.read_text()), path))
    return plan, render(plan, f"specs/{path.name}").text


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_spec_compiles(path, target):
    plan, source = _plan_and_source(path)
    result = compile_target(plan, source, f"generated/{path.stem}.py", target)
    data = result.path.read_bytes()
    assert data[:4] == b"\x7fELF" and len(data) == result.size > 10_000
    again = compile_target(plan, source, f"generated/{path.stem}.py", target)
    assert again.cached and again.path == result.path


def test_cache_key_depends_on_source_target_and_toolchain():
    plan, source = _plan_and_source(SPECS[0])
    key = cache_key(plan, source, "sm_90")
    assert key == cache_key(plan, source, "sm_90")
    assert key != cache_key(plan, source + "\n", "sm_90")
    assert key != cache_key(plan, source, "sm_100")
    assert set(toolchain_versions()) == {"cuda-tile", "tileiras"}
    assert toolchain_versions()["cuda-tile"] != "unknown"


def test_signatures_follow_the_plan():
    for path in SPECS:
        plan, _ = _plan_and_source(path)
        sigs = signatures(plan, "sm_90")
        assert len(sigs) == (2 if plan.even_n_param else 1)


def test_broken_source_is_a_compile_error_naming_module_and_target():
    plan, source = _plan_and_source(SPECS[0])
    broken = source.replace("acc = acc * alpha", "acc = acc * undefined_name", 1)
    with pytest.raises(CompileError) as info:
        compile_target(plan, broken, "generated/broken.py", "sm_90")
    assert f"{plan.module_name}: sm_90:" in str(info.value)

"""The prefill kernel's argument list is written once (specgen.plan.abi): the
generated signature, the launcher's tuple and the AOT signatures all follow it."""

import ast

import pytest

from specgen.compile.export import signatures
from specgen.plan import make_plan
from specgen.spec import load_spec

from .helpers import ROOT, SPECS

PREFILL = [p.stem for p in SPECS if load_spec(p).family == "prefill"]


@pytest.mark.parametrize("name", PREFILL)
def test_signature_launch_tuple_and_export_follow_the_parameter_list(name):
    plan = make_plan(load_spec(ROOT / "specs" / f"{name}.yaml"))
    tree = ast.parse((ROOT / "generated" / f"{name}.py").read_text())
    kernel = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == plan.kernel_name)
    assert [a.arg for a in kernel.args.args] == [p.name for p in plan.params]
    launches = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "args" for t in n.targets)
                and isinstance(n.value, ast.Tuple) and len(n.value.elts) == len(plan.params)]
    assert [ast.unparse(e) for e in launches[0].value.elts] == [ast.unparse(ast.parse(p.launch).body[0].value) for p in plan.params]
    target = plan.targets[-1].name if plan.targets[-1].name != "default" else "sm_90"
    for sig in signatures(plan, target):
        assert len(sig.parameters) == len(plan.params)

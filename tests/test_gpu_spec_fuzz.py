"""Random valid specs on the GPU: the render fuzzer's strategies (tests/test_fuzz.py)
drawn afresh in each of 8 streams, each spec's module compiled by cuTile's JIT and
run on a ragged case (chunked prefill; packed or paged batches for varlen and decode
specs) against the fp64 reference, gradients included for backward: true. The same
check runs emulated on the CPU in tests/test_emulate.py; here it is the compiled
kernel's arithmetic, tiles and hints that are checked."""

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specgen.check.runner import Case, case_verdict, run_case  # noqa: E402
from specgen.compile.export import load_module_from_source  # noqa: E402
from specgen.errors import SpecError  # noqa: E402
from specgen.spec import validate_spec  # noqa: E402

from .helpers import render_spec_data  # noqa: E402
from .test_fuzz import decode_specs, prefill_specs  # noqa: E402

pytestmark = pytest.mark.gpu

# Specs per stream (each costs a JIT compile of its kernels, seconds each).
EXAMPLES = int(os.environ.get("SPECGEN_GPU_SPEC_FUZZ_EXAMPLES", "5"))
# Stream i draws from seed SEED + i: another SEED draws other specs.
SEED = int(os.environ.get("SPECGEN_GPU_SPEC_FUZZ_SEED", "1000"))


def _case(spec: dict) -> Case:
    if spec["family"] == "decode":
        q_len = spec.get("max_q_len", 1)
        return Case(4, 2, q_len, 0, decode_lens=(17, q_len, 300, 64 + q_len))
    if spec["varlen"]:
        return Case(3, 2, 0, 0, lengths=((5, 300), (128, 200), (1, 1)))
    return Case(1, 2, 130, 300, 170)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stream", range(8))
def test_random_valid_specs_match_the_reference_on_the_gpu(stream):
    drawn, ran = [0], [0]

    @seed(SEED + stream)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(st.one_of(prefill_specs(), decode_specs()))
    def check(data):
        # A name of its own: a training spec registers a custom op under its name.
        drawn[0] += 1
        data = {**data, "name": f"fz{stream}_{drawn[0]}_{data['name']}"[:100]}
        try:
            validate_spec(data, "fuzz.yaml")
        except SpecError:
            assume(False)
        ran[0] += 1
        plan, source = render_spec_data(data, "specs/fuzz.yaml")
        module = load_module_from_source(f"gpu_fuzz_{plan.module_name}", source,
                                         f"gpu_fuzz_{plan.module_name}.py")
        case = _case(module.SPEC)
        row = run_case(torch, module, case, torch.Generator(device="cuda").manual_seed(stream))
        assert row["ok"], f"{data}\n{case.label(module.SPEC['gqa_ratio'])}: {case_verdict(row)}"

    check()
    assert ran[0] >= EXAMPLES, f"only {ran[0]} of {EXAMPLES} drawn specs were valid and ran"

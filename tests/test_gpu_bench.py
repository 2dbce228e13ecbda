"""Smoke test of `specgen bench` on a GPU: each suite on one small shape, the
generated kernel next to SDPA's cuDNN backend, written and read back through
the result schema. Modules are rendered into a temporary folder, so the
checkout's generated/ is never written.

    python -m pytest -q -m gpu tests/test_gpu_bench.py
"""

import importlib.util
import math
import subprocess
import sys
import textwrap

import pytest

from specgen.bench import run_suite
from specgen.bench.core import PENDING, SCHEMA_VERSION, load_result, result_paths

from .helpers import ROOT

pytestmark = pytest.mark.gpu

# suite -> (spec, the one shape, the largest |baseline - specgen| that is still
# "the same function": the committed H200 results show 0.016 (prefill), 0.06
# (backward gradients) and 2.4e-4 (decode) at larger shapes).
CASES = {
    "prefill": ("fmha_gqa8_bf16", (1, 8, 512), 0.05),
    "decode": ("fmha_decode_gqa4_bf16", (1, 8, 4096), 0.01),
    "backward": ("fmha_train_gqa_causal", (1, 8, 512), 0.25),
}


def _check_rows(stem, suite: str, spec: str, baselines: tuple, tolerance: float):
    paths = result_paths(stem)
    assert paths["json"].name == f"{spec}-{suite}.json" and paths["md"].is_file()
    result = load_result(paths["json"])
    assert result.schema_version == SCHEMA_VERSION and result.suite == suite
    assert result.baselines == list(baselines) and len(result.rows) == 1
    row = result.rows[0]
    assert set(row.timings) == {"specgen", *baselines} and set(row.speedup) == set(baselines)
    ours = row.timings["specgen"]
    assert ours.error is None and ours.ms and ours.ms > 0, ours
    if suite == "decode":
        assert row.bytes and ours.tbps and ours.pct_of_copy and ours.ms_one_call >= ours.ms * 0.5
        assert result.copy_tbps and result.copy_tbps > 0.5
    else:
        assert row.flops and ours.tflops and ours.pct_of_matmul and result.matmul_tflops > 50
        # The one-call CUDA graph: for the backward, a graph of torch.autograd.grad.
        assert ours.ms_one_call and 0 < ours.ms_one_call < 2 * ours.ms, ours
    for name in baselines:
        t = row.timings[name]
        assert t.error != PENDING
        if t.ms is None:  # not run here: the row says why, in one line
            assert t.error and "\n" not in t.error and row.speedup[name] is None
            continue
        assert t.ms > 0 and row.speedup[name] == pytest.approx(t.ms / ours.ms)
        assert math.isfinite(t.max_abs_diff_vs_specgen) and t.max_abs_diff_vs_specgen <= tolerance, (name, t)
    return result


@pytest.mark.parametrize("suite", sorted(CASES))
def test_each_suite_runs_one_shape_against_cudnn(suite, tmp_path):
    spec, shape, tolerance = CASES[suite]
    stems = run_suite(suite, [str(ROOT / "specs" / f"{spec}.yaml")], results=tmp_path / "results",
                      gen=tmp_path / "gen", baselines=("cudnn",), shapes=[shape])
    assert len(stems) == 1
    result = _check_rows(stems[0], suite, spec, ("cudnn",), tolerance)
    assert result.rows[0].timings["cudnn"].ms, result.rows[0].timings["cudnn"]  # cuDNN runs these
    assert result_paths(stems[0])["png"].is_file() == (
        suite != "decode" and importlib.util.find_spec("matplotlib") is not None)


@pytest.mark.skipif(not any(importlib.util.find_spec(n) for n in ("fa3_fwd_interface", "tilegym")),
                    reason="neither fa3-fwd nor tilegym is installed")
def test_opt_in_baselines_run_after_specgen_in_their_own_process(tmp_path):
    """fa3 and tilegym through the registry. tilegym's import patches
    cuda.tile.launch for the process, so this runs in a subprocess: the late pass
    must time it after specgen's kernel, and nothing may launch specgen after it."""
    spec, shape, tolerance = CASES["prefill"]
    code = textwrap.dedent(f"""
        from specgen.bench import run_suite
        stems = run_suite("prefill", [{str(ROOT / 'specs' / f'{spec}.yaml')!r}],
                          results={str(tmp_path / 'results')!r}, gen={str(tmp_path / 'gen')!r},
                          baselines=("cudnn", "fa3", "tilegym"), shapes=[{shape!r}])
        print("STEM", stems[0])
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    stem = next(line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("STEM "))
    from pathlib import Path

    result = _check_rows(Path(stem), "prefill", spec, ("cudnn", "fa3", "tilegym"), tolerance)
    for name, module in (("fa3", "fa3_fwd_interface"), ("tilegym", "tilegym")):
        if importlib.util.find_spec(module):  # installed: it ran, or says in one line why not
            timing = result.rows[0].timings[name]
            assert timing.ms or timing.error, (name, timing)


@pytest.mark.parametrize("spec,baseline", [("fmha_train_varlen_llama", "flex"),
                                           ("fmha_train_vit_dropout", "cudnn")])
def test_the_backward_suite_times_varlen_and_dropout_specs(spec, baseline, tmp_path):
    """Varlen: the packed batch's leaves, and Flex on the same packed leaves (its
    gradients must agree with specgen's). Dropout: SDPA with its own dropout (another
    RNG: the same work, other gradients, so only the timing is checked)."""
    stems = run_suite("backward", [str(ROOT / "bench" / "train" / f"{spec}.yaml")],
                      results=tmp_path / "results", gen=tmp_path / "gen", baselines=(baseline,),
                      shapes=[(2, 8, 512)])
    tolerance = 0.25 if baseline == "flex" else math.inf
    result = _check_rows(stems[0], "backward", spec, (baseline,), tolerance)
    timing = result.rows[0].timings[baseline]
    assert timing.ms, timing
    if spec == "fmha_train_varlen_llama":  # a packed batch of 256 + 512 tokens, S/2 and S
        assert result.rows[0].flops == 2.5 * 2 * 8 * 128 * (256 * 256 + 512 * 512)

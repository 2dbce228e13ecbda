"""On a GPU: a module built for the device serves its first calls from its AOT
cubins (no compile), with the same results as its JIT path; a training module's
backward kernels and the float8 module's V transpose kernel too (their exported
signatures must match the launches)."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from .helpers import ROOT

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location("first_call", ROOT / "bench" / "first_call.py")
first_call = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(first_call)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import torch

    major, minor = torch.cuda.get_device_capability()
    work = tmp_path_factory.mktemp("aot_gpu")
    shutil.copytree(ROOT / "specs", work / "specs")
    names = ["fmha_gqa_causal", "fmha_decode_gqa8_bf16", "fmha_gqa8_bf16", "fmha_decode_chunked_local",
             "fmha_train_gqa_causal", "fmha_fp8_llama"]
    done = subprocess.run(
        [sys.executable, "-m", "specgen", "build", *[f"specs/{n}.yaml" for n in names],
         "--targets", f"sm_{major}{minor}", "--out", "gen"],
        cwd=work, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr
    return {n: str(work / "gen" / f"{n}.py") for n in names}


@pytest.mark.parametrize("name", ["fmha_gqa_causal", "fmha_decode_gqa8_bf16", "fmha_gqa8_bf16",
                                  "fmha_decode_chunked_local", "fmha_train_gqa_causal", "fmha_fp8_llama"])
def test_first_call_is_served_from_the_aot_cubins(built, name):
    with tempfile.TemporaryDirectory() as cache:
        aot = first_call.child(built[name], cache, aot=True)
    with tempfile.TemporaryDirectory() as cache:
        jit = first_call.child(built[name], cache, aot=False)
    assert aot["aot_reason"] is None
    assert aot["aot_hits"] >= 1 and aot["jit_compiles"] == 0, aot
    assert jit["aot_hits"] == 0 and jit["jit_compiles"] >= 1, jit
    if aot["max_abs_err_vs_sdpa"] is not None:
        # float8: P is rounded to e4m3 for the P V product (SDPA gets the same float8
        # values in float32 and keeps P exact).
        bound = 1e-1 if name == "fmha_fp8_llama" else 2e-2  # float8 measured 0.057 (H100)
        assert aot["max_abs_err_vs_sdpa"] < bound and jit["max_abs_err_vs_sdpa"] < bound

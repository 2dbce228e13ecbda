"""Context parallelism on GPUs with the generated kernels, over NCCL: every GPU of
the machine is a rank (world size 1 on a one-GPU machine, 2 on the 2-GPU one).
Outputs and gradients are checked against the same spec's kernel on the whole
sequence in one process and against the float64 reference (FlashAttention's rule)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import parallel_worker
from tests.helpers import ROOT

pytestmark = pytest.mark.gpu

# A non-causal training spec, rendered for the test (no shipped training spec is
# non-causal): MHA, head_dim 64, float16.
NONCAUSAL = textwrap.dedent("""\
    name: cp_noncausal_f16
    dtype: float16
    head_dim: 64
    gqa_ratio: 1
    causal: false
    backward: true
""")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_specs")
    spec = out / "cp_noncausal_f16.yaml"
    spec.write_text(NONCAUSAL)
    subprocess.run([sys.executable, "-m", "specgen", "build", str(spec), "--no-compile", "--out", str(out)],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
    return str(out)


def _cases(rendered):
    return [
        dict(module="generated.fmha_train_gqa_causal", mode="ring", layout="zigzag", shape=(2, 8, 2, 1000)),
        dict(module="generated.fmha_train_gqa_causal", mode="ring", layout="contiguous", shape=(1, 8, 2, 777)),
        dict(module="generated.fmha_train_gqa_causal", mode="ulysses", layout="zigzag", shape=(1, 8, 2, 640)),
        dict(module="generated.fmha_train_gemma2", mode="ring", layout="zigzag", shape=(1, 4, 2, 2600)),
        dict(module="cp_noncausal_f16", path=rendered, mode="ring", layout="zigzag", shape=(2, 4, 4, 333)),
    ]


def test_context_parallel_spec_kernels(rendered, tmp_path):
    world = torch.cuda.device_count()
    results = parallel_worker.spawn(world, "nccl", "spec", tmp_path, {"cases": _cases(rendered)})
    for rank, result in enumerate(results):
        for row in result["rows"]:
            for name in ("out", "dq", "dk", "dv"):
                assert row["vs_fp64"][name] <= row["allowed"][name], (rank, name, row)
                # The same kernels, with the merge in float32: within bf16/fp16 rounding.
                assert row["vs_single"][name] <= max(2 * row["single_vs_fp64"][name], 1e-2), (rank, name, row)

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


# A packed-batch training spec (varlen with backward kernels).
VARLEN = textwrap.dedent("""\
    name: cp_varlen_train
    dtype: bfloat16
    head_dim: 128
    gqa_ratio: 4
    causal: true
    varlen: true
    backward: true
""")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_specs")
    for name, text in (("cp_noncausal_f16", NONCAUSAL), ("cp_varlen_train", VARLEN)):
        spec = out / f"{name}.yaml"
        spec.write_text(text)
        subprocess.run([sys.executable, "-m", "specgen", "build", str(spec), "--no-compile", "--out", str(out)],
                       check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
    return str(out)


def _cases(rendered):
    return [
        dict(module="generated.fmha_train_gqa_causal", mode="ring", layout="zigzag", shape=(2, 8, 2, 1000)),
        dict(module="generated.fmha_train_gqa_causal", mode="ring", layout="contiguous", shape=(1, 8, 2, 777)),
        dict(module="generated.fmha_train_gqa_causal", mode="ulysses", layout="zigzag", shape=(1, 8, 2, 640)),
        dict(module="generated.fmha_train_gemma2", mode="ring", layout="zigzag", shape=(1, 4, 2, 2600)),
        # batch × heads past the grid's y limit: the module runs the batch in slices.
        dict(module="generated.fmha_train_gqa_causal", mode="ring", layout="zigzag", shape=(16400, 4, 1, 8)),
        dict(module="cp_noncausal_f16", path=rendered, mode="ring", layout="zigzag", shape=(2, 4, 4, 333)),
        # Packed batches: shard lengths per sequence (times the world size).
        dict(module="cp_varlen_train", path=rendered, mode="ring", layout="zigzag", heads=(8, 2),
             lengths=[700, 129, 1, 2048]),
        dict(module="cp_varlen_train", path=rendered, mode="ring", layout="contiguous", heads=(8, 2),
             lengths=[300, 1000]),
        dict(module="cp_varlen_train", path=rendered, mode="ulysses", layout="contiguous", heads=(8, 2),
             lengths=[513, 64]),
        dict(module="generated.fmha_varlen_llama", mode="ring", layout="zigzag", heads=(8, 2),
             lengths=[900, 77], forward_only=True),
    ]


def test_context_parallel_spec_kernels(rendered, tmp_path):
    world = torch.cuda.device_count()
    results = parallel_worker.spawn(world, "nccl", "spec", tmp_path, {"cases": _cases(rendered)})
    parallel_worker.assert_rows_agree(results)

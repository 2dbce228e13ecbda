"""Generated modules called with tensors on a GPU other than the current one (marked
`gpu`; needs two GPUs). A pipeline-parallel model (transformers' device_map="auto")
runs layers on cuda:1 while cuda:0 stays the current device: the kernels must run on
the tensors' GPU, against the fp64 reference, and leave the current device alone."""

import pytest
import torch

from specgen.check.cases import random_qkv
from specgen.check.runner import case_matrix, run_case

from .helpers import generated_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs"),
]

# One spec of each launcher family: dense prefill, float8 prefill (descales), packed
# varlen, block-sparse documents (its map built on the tensors' GPU), the three
# decode kinds, and a training spec (forward and backward kernels, through autograd).
NAMES = [
    "fmha_gqa8_bf16",
    "fmha_fp8_llama",
    "fmha_varlen_llama",
    "fmha_document_mask",
    "fmha_decode_gqa8_bf16",
    "fmha_decode_gqa8_fp8kv",
    "fmha_decode_mha_paged_f16",
    "fmha_train_gqa_causal",
    "fmha_train_gptoss_sinks",
]


@pytest.mark.parametrize("name", NAMES)
def test_tensors_on_another_gpu(name):
    mod = generated_module(name)
    cases = case_matrix(False, mod.SPEC)[:3]
    with torch.cuda.device(0):
        for index, case in enumerate(cases):
            generator = torch.Generator(device="cuda:1").manual_seed(index)
            row = run_case(torch, mod, case, generator, device="cuda:1")
            assert row["ok"], row
            assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)


def test_tensors_on_two_gpus_are_refused_before_launch():
    mod = generated_module("fmha_gqa8_bf16")
    q, k, v = random_qkv(mod.SPEC, 1, 1, 64, 64, device="cuda:1")
    with pytest.raises(ValueError, match="cuda:1"):
        mod.attention(q, k.to("cuda:0"), v)

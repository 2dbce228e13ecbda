"""The forward-only modules under torch.compile on the GPU (marked `gpu`): inductor
traces attention() as the module's custom op with fullgraph=True, and the compiled
calls give the eager call's bits; decode under reduce-overhead (CUDA graphs)
replays against the fp64 reference."""

import pytest
import torch

from specgen.check.cases import (
    compare,
    decode_reference,
    feature_inputs,
    random_decode,
    random_packed,
    random_qkv,
    shape_dims,
)

from .helpers import generated_module, same_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _inputs(mod, gen):
    """(args, kwargs) of one call of ``mod.attention``."""
    spec = mod.SPEC
    if spec["family"] == "decode":
        q_len = spec.get("max_q_len", 1)
        batch = random_decode(spec, [700, q_len, 1500], 2, q_len, gen)
        return batch.args(), feature_inputs(spec, batch.dims(), gen)
    if spec["varlen"]:
        batch = random_packed(spec, [(300, 700), (129, 129)], 2, gen)
        extra = feature_inputs(spec, {"batch": 2, "heads": batch.q.shape[1], "kv_heads": 2}, gen)
        # under torch.compile the longest lengths must be given
        return (batch.q, batch.k, batch.v), dict(batch.kwargs(), max_seqlen_q=300,
                                                 max_seqlen_k=700, **extra)
    q, k, v = random_qkv(spec, 2, 2, 333, 1000, generator=gen, layout="transposed")
    extra = feature_inputs(spec, shape_dims(q, k), gen)
    if hasattr(mod, "make_block_map"):
        tensors = {n: extra[n] for n in spec.get("tensors") or {}}
        extra["block_map"] = mod.make_block_map(2, q.shape[1], 333, 1000, q_offset=667,
                                                **tensors)
    return (q, k, v), dict(q_offset=667, **extra)


@pytest.mark.parametrize("name", ["fmha_gqa8_bf16", "fmha_fp8_llama", "fmha_varlen_llama",
                                  "fmha_document_mask", "fmha_gptoss_sinks",
                                  "fmha_decode_gqa8_bf16", "fmha_decode_gqa8_fp8kv",
                                  "fmha_decode_paged_mtp", "fmha_decode_chunked_local"])
def test_inductor_compiles_forward_only_modules_without_a_graph_break(name):
    mod = generated_module(name)
    gen = torch.Generator(device="cuda").manual_seed(11)
    args, kwargs = _inputs(mod, gen)
    if "k_descale" in kwargs:  # one descale as a device tensor, one as a number
        kwargs["k_descale"] = torch.tensor([kwargs["k_descale"]], device="cuda")

    def layer(*args):
        return mod.attention(*args, **kwargs)

    def layer_out(out, *args):
        result = mod.attention(*args, out=out, **kwargs)
        return result[0] if isinstance(result, tuple) else result

    torch._dynamo.reset()
    eager = mod.attention(*args, **kwargs)
    compiled = torch.compile(layer, fullgraph=True)(*args)
    assert same_tensors(compiled, eager)
    first = eager[0] if isinstance(eager, tuple) else eager
    out = torch.full_like(first, float("nan"))
    written = torch.compile(layer_out, fullgraph=True)(out, *args)
    assert torch.equal(out, first) and written.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("name", ["fmha_decode_gqa8_bf16", "fmha_decode_gqa8_fp8kv",
                                  "fmha_decode_mha_paged_f16"])
def test_decode_under_reduce_overhead_replays_new_steps(name):
    """mode="reduce-overhead": the compiled step runs as a CUDA graph. Steps with new
    tokens and longer sequences, at two batch sizes (two graphs, each with its own
    workspace), match the fp64 reference and the eager call."""
    mod = generated_module(name)
    gen = torch.Generator(device="cuda").manual_seed(12)

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def step(*args, **extra):
        return mod.attention(*args, **extra) * 1.0

    torch._dynamo.reset()
    for lens in ([300, 1200], [1500, 33], [40, 7, 900], [1024, 2, 5]):
        batch = random_decode(mod.SPEC, lens, 2, mod.SPEC.get("max_q_len", 1), gen)
        extra = feature_inputs(mod.SPEC, batch.dims(), gen)
        assert set(extra) <= {"k_descale", "v_descale"}
        args = batch.args()
        for _ in range(3):  # warm-up, capture, replay
            got = step(*args, **extra).clone()
        ref = decode_reference(mod.SPEC, batch, extra)
        eager = mod.attention(*args, **extra)
        assert torch.equal(got, eager)
        assert compare(got, ref, mod.SPEC["dtype"]).ok

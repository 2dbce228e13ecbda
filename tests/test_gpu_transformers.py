"""The transformers backend end to end on a GPU (marked `gpu`): a small, randomly
initialised Qwen2-style model built from a config (no weights downloaded), with
attn_implementation="specgen" against the same weights with "sdpa"."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specgen.integrations.transformers import register  # noqa: E402

pytestmark = pytest.mark.gpu


def qwen2(implementation: str, dtype, seed: int = 0):
    """Hq8/Hkv2 (GQA 4:1), head_dim 128, two layers: the shape of the shipped specs."""
    config = transformers.Qwen2Config(
        vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
        initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation, dtype=dtype)
    return model.to("cuda")


def logits_close(ours, theirs, dtype) -> tuple[bool, float, float]:
    """Logits within the dtype's tolerance, relative to the logits' scale."""
    tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    err = (ours.float() - theirs.float()).abs().max().item()
    scale = theirs.float().abs().max().item()
    return err <= tol * scale, err, scale


def test_transformers_logits_and_greedy_generation_match_sdpa():
    function = register("generated.fmha_gqa_causal", name="specgen-e2e")
    ours = qwen2("specgen-e2e", torch.float16).eval()
    sdpa = qwen2("sdpa", torch.float16).eval()
    ids = torch.randint(0, 2048, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        a, b = ours(ids).logits, sdpa(ids).logits
    ok, err, scale = logits_close(a, b, torch.float16)
    print(f"prefill logits: max abs diff {err:.3e}, logit scale {scale:.3e}")
    assert ok, (err, scale)
    assert function.stats == {"kernel": 2, "fallback": 0}

    prompt = ids[:1, :64]
    with torch.no_grad():
        gen_a = ours.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        gen_b = sdpa.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    new_a, new_b = gen_a[0, 64:].tolist(), gen_b[0, 64:].tolist()
    print(f"greedy tokens, specgen: {new_a}\ngreedy tokens, sdpa:    {new_b}")
    assert len(new_a) == 32 and new_a == new_b
    # Prefill (1 call per layer) and 31 one-token decode steps, all on the kernel.
    assert function.stats["fallback"] == 0 and function.stats["kernel"] == 2 + 2 * 32


def test_transformers_padded_batch_falls_back_and_matches():
    function = register("generated.fmha_gqa_causal", name="specgen-e2e-pad")
    ours = qwen2("specgen-e2e-pad", torch.float16).eval()
    sdpa = qwen2("sdpa", torch.float16).eval()
    ids = torch.randint(0, 2048, (2, 96), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :17] = 0
    with pytest.warns(UserWarning, match="runs transformers' sdpa instead"), torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
    with torch.no_grad():
        b = sdpa(ids, attention_mask=mask).logits
    assert logits_close(a, b, torch.float16)[0]
    assert function.stats == {"kernel": 0, "fallback": 2}


def test_transformers_training_step_gradients_match_sdpa():
    """The backward: true spec trains: the loss and the gradients of every weight
    match the sdpa model's within bf16 tolerance."""
    function = register("generated.fmha_train_gqa_causal", name="specgen-e2e-train")
    ours = qwen2("specgen-e2e-train", torch.bfloat16).train()
    sdpa = qwen2("sdpa", torch.bfloat16).train()
    ids = torch.randint(0, 2048, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    for model in (ours, sdpa):
        model(ids, labels=ids).loss.backward()
    assert function.stats["kernel"] == 2
    worst = 0.0
    for (name, p), (_, r) in zip(ours.named_parameters(), sdpa.named_parameters()):
        rel = ((p.grad.float() - r.grad.float()).norm() / r.grad.float().norm().clamp_min(1e-12)).item()
        worst = max(worst, rel)
        assert rel < 3e-2, (name, rel)
    print(f"worst relative gradient difference over {len(list(ours.parameters()))} weights: {worst:.2e}")

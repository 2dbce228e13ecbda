"""The transformers backend end to end on a GPU (marked `gpu`): a small, randomly
initialised Qwen2-style model built from a config (no weights downloaded), with
attn_implementation="specgen" against the same weights with "sdpa"."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specgen.integrations.transformers import register  # noqa: E402
from .helpers import qwen2_model  # noqa: E402

pytestmark = pytest.mark.gpu


def qwen2(implementation: str, dtype, seed: int = 0):
    """Hq8/Hkv2 (GQA 4:1), head_dim 128, two layers: the shape of the shipped specs."""
    return qwen2_model(implementation, "small", dtype, device="cuda", seed=seed)


def logits_close(ours, theirs, dtype) -> tuple[bool, float, float]:
    """Logits within the dtype's tolerance, relative to the logits' scale."""
    tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    err = (ours.float() - theirs.float()).abs().max().item()
    scale = theirs.float().abs().max().item()
    return err <= tol * scale, err, scale


def check_against_float32(losses, reference, ours, sdpa, label):
    """The training tests' rule: specgen's loss within twice sdpa's distance of the
    float32 run's (or 1e-2), and every weight's gradient as close to the float32 run's
    as sdpa's (1.5x, or 1e-2 relative); the worst printed."""
    print(f"loss: float32 {losses[0].item():.5f}, specgen {label} {losses[1].item():.5f}, "
          f"sdpa {label} {losses[2].item():.5f}")
    assert abs(losses[1].item() - losses[0].item()) <= max(2 * abs(losses[2].item() - losses[0].item()), 1e-2)
    worst = (0.0, 0.0, "")
    for (name, r), (_, p), (_, s) in zip(reference.named_parameters(), ours.named_parameters(),
                                         sdpa.named_parameters()):
        norm = r.grad.norm().clamp_min(1e-12)
        ours_err = ((p.grad.float() - r.grad).norm() / norm).item()
        sdpa_err = ((s.grad.float() - r.grad).norm() / norm).item()
        assert ours_err <= max(1.5 * sdpa_err, 1e-2), (name, ours_err, sdpa_err)
        worst = max(worst, (ours_err, sdpa_err, name))
    print(f"worst relative gradient error against float32: specgen {worst[0]:.2e}, sdpa {worst[1]:.2e} ({worst[2]})")


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
    """The backward: true spec trains. The same weights run one step three ways:
    bf16 with specgen, bf16 with sdpa and float32 with sdpa (the reference). For
    every weight, specgen's bf16 gradient is as close to the float32 one as
    sdpa's bf16 gradient is (two bf16 runs differ from each other by more than
    either differs from float32, so they are not compared with each other)."""
    function = register("generated.fmha_train_gqa_causal", name="specgen-e2e-train")
    reference = qwen2("sdpa", torch.float32).train()
    ours = qwen2("specgen-e2e-train", torch.bfloat16).train()
    sdpa = qwen2("sdpa", torch.bfloat16).train()
    for model in (ours, sdpa):
        model.load_state_dict(reference.state_dict())  # the same weights, rounded to bf16
    ids = torch.randint(0, 2048, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    losses = [model(ids, labels=ids).loss for model in (reference, ours, sdpa)]
    for loss in losses:
        loss.backward()
    assert function.stats["kernel"] == 2
    check_against_float32(losses, reference, ours, sdpa, "bf16")


def test_transformers_model_compiles_with_the_kernel():
    """torch.compile of the whole model (inductor): the generated module's attention
    is its custom op in the compiled graphs, and the logits are the eager model's."""
    register("generated.fmha_gqa_causal", name="specgen-e2e-compile")
    ours = qwen2("specgen-e2e-compile", torch.float16).eval()
    ids = torch.randint(0, 2048, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    torch._dynamo.reset()
    compiled = torch.compile(ours)
    with torch.no_grad():
        eager = ours(ids).logits
        got = compiled(ids).logits
    ok, err, scale = logits_close(got, eager, torch.float16)
    print(f"compiled logits: max abs diff {err:.3e}, logit scale {scale:.3e}")
    assert ok, (err, scale)


def test_transformers_mixed_precision_training_with_checkpointing_matches_sdpa():
    """The usual training set-up: float32 weights under torch.autocast(bfloat16) (q
    and k reach attention in float32 after the rotary embeddings, v in bfloat16),
    with gradient checkpointing (use_reentrant=True recomputes each layer). The kernel
    serves every call, and its gradients are as close to a float32 run's as sdpa's
    are under the same autocast."""
    function = register("generated.fmha_train_gqa_causal", name="specgen-e2e-amp")
    reference = qwen2("sdpa", torch.float32).train()
    ours = qwen2("specgen-e2e-amp", torch.float32).train()
    sdpa = qwen2("sdpa", torch.float32).train()
    for model in (ours, sdpa):
        model.load_state_dict(reference.state_dict())
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, 2048, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    losses = [reference(ids, labels=ids).loss]
    for model in (ours, sdpa):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses.append(model(ids, labels=ids).loss)
    for loss in losses:
        loss.backward()
    assert function.stats == {"kernel": 4, "fallback": 0}  # two layers, each recomputed once
    check_against_float32(losses, reference, ours, sdpa, "autocast")
    assert all(p.grad.dtype == torch.float32 for p in ours.parameters())

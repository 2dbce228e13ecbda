"""Shared test helpers: the shipped specs, their generated modules, and a small
randomly initialised Qwen2 model for the transformers tests."""

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
SPEC_NAMES = [p.stem for p in SPECS]
# Specs whose attention takes [B, H, S, D] tensors (the rest are varlen: packed).
DECODE_SPEC_NAMES = [p.stem for p in SPECS if "\nfamily: decode" in p.read_text()]
VARLEN_SPEC_NAMES = [p.stem for p in SPECS if "\nvarlen: true" in p.read_text()]
DENSE_SPEC_NAMES = [n for n in SPEC_NAMES if n not in DECODE_SPEC_NAMES + VARLEN_SPEC_NAMES]
TRAINING_SPEC_NAMES = [p.stem for p in SPECS if "\nbackward: true" in p.read_text()]


def kernel_source(text: str, prefix: str, after: int = 0) -> str:
    """The source of the first function of a module's ``text`` (from ``after`` on) whose
    name starts with ``prefix``: from its def to the blank lines after it."""
    start = text.index(f"def {prefix}", after)
    return text[start:text.index("\n\n\n", start)]


def generated_module(name: str):
    return importlib.import_module(f"generated.{name}")


def prefill_variant_data(name: str, overrides: dict) -> dict:
    """The variant tests' prefill spec: fmha_gqa_causal with ``overrides``, its
    targets the overrides' own or one 64x64 default config."""
    import yaml

    data = yaml.safe_load((ROOT / "specs" / "fmha_gqa_causal.yaml").read_text())
    data.update(overrides, name=f"variant_{name}")
    data["targets"] = overrides.get("targets", {"default": {"tile_m": 64, "tile_n": 64}})
    return data


def decode_variant_data(name: str, overrides: dict) -> dict:
    """The variant tests' decode spec: bf16, head_dim 128, with ``overrides``."""
    return {"name": f"decode_{name}", "family": "decode", "dtype": "bfloat16", "head_dim": 128,
            **overrides}


def _forward_only_prefill_specs() -> list[str]:
    """Shipped prefill specs without a backward, float8 aside (it has none)."""
    import yaml

    names = []
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if (isinstance(data, dict) and "name" in data and data.get("family", "prefill") == "prefill"
                and data.get("dtype") != "float8_e4m3fn" and not data.get("backward")):
            names.append(path.stem)
    return names


FORWARD_ONLY_PREFILL_SPECS = _forward_only_prefill_specs()


def trained_spec_data(name: str) -> dict:
    """The shipped spec ``name`` with backward: true (and a name of its own)."""
    import yaml

    data = yaml.safe_load((ROOT / "specs" / f"{name}.yaml").read_text())
    data.update(backward=True, name=f"{name}_trained")
    return data


def render_spec_data(data: dict, spec_path: str = "specs/variant.yaml", *, formatted: bool = True):
    """(plan, module source) of a spec given as data. ``formatted=False``: the
    template's output before black, for a module that is only run (black changes
    layout, not code, and takes most of a render's time); the tests of what a user
    reads (golden renders, black-clean output, the fuzzed renders) format."""
    from specgen.emit.render import render, render_raw
    from specgen.plan.make import make_plan
    from specgen.spec import validate_spec

    plan = make_plan(validate_spec(data))
    return plan, render(plan, spec_path).text if formatted else render_raw(plan)


def same_tensors(a, b) -> bool:
    """Whether two outputs (a tensor, or a tuple of them) agree bit for bit, in shape
    and in strides."""
    import torch

    if isinstance(a, tuple):
        return all(same_tensors(x, y) for x, y in zip(a, b, strict=True))
    return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def emulated_module(name: str, tag: str, source: str | None = None):
    """The generated module ``name`` (or ``source``, rendered in its place) with its
    kernels emulated on the CPU, loaded afresh under the module name
    ``_{tag}_{name}``."""
    from specgen.check import emulate

    return emulate.load_module(ROOT / "generated" / f"{name}.py", source=source, name=f"_{tag}_{name}")


def launch_grids(module, monkeypatch) -> list:
    """The grid of each of ``module``'s launches from now on, recorded as they
    launch (its ``_launch`` wrapped for the test)."""
    grids, launch = [], module._launch

    def spy(device, grid, *args, **options):
        grids.append(grid)
        return launch(device, grid, *args, **options)

    monkeypatch.setattr(module, "_launch", spy)
    return grids


def emulated_spec_module(data: dict, tag: str):
    """The module of a spec given as data, rendered (unformatted) and emulated (see
    emulated_module)."""
    plan, source = render_spec_data(data, formatted=False)
    return emulated_module(plan.module_name, tag, source)


# The Qwen2-style models of the transformers tests, built from a config (no weights
# downloaded). "tiny": the CPU tests (Hq4/Hkv2, head_dim 32, the stand-in module's
# shape); "small": the GPU tests (Hq8/Hkv2, GQA 4:1, head_dim 128, the shipped
# specs' shape).
QWEN2_SIZES = {
    "tiny": dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2),
    "small": dict(vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.1),
}


def expected_full_run(listed_full: list) -> int:
    """A block map row's run count for its listed full tiles: the first of them where
    they are consecutive (0 where there are none), else -1."""
    first = min(listed_full, default=0)
    return first if sorted(listed_full) == list(range(first, first + len(listed_full))) else -1


def qwen2_model(implementation: str, size: str, dtype, device: str = "cpu", seed: int = 0):
    """A two-layer Qwen2 model of ``size`` with attn_implementation ``implementation``;
    the same seed gives the same weights whatever the implementation."""
    import torch
    import transformers

    config = transformers.Qwen2Config(num_hidden_layers=2, tie_word_embeddings=False,
                                      **QWEN2_SIZES[size])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation, dtype=dtype)
    return model.to(device)


def unknown_kernel_names(text: str, tensors) -> set:
    """Names the kernels of module source ``text`` take or read that a hook tensor's
    kernel parameter could spell (no underscore, not lowercase: parameters, array
    slices, module-level names) and that KERNEL_NAMES lacks, apart from the spec's
    own hook tensors (``tensors``: their names) and their gradients."""
    import ast

    from specgen.spec.fields import KERNEL_NAMES, kernel_param

    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and any("ernel" in ast.unparse(d) for d in node.decorator_list):
            args = node.args
            names |= {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    hooks = {kernel_param(n) for n in tensors} | {"D" + kernel_param(n) for n in tensors}
    return {n for n in names if "_" not in n and not n.islower()} - KERNEL_NAMES - hooks

"""`specgen bench --variants` without a GPU: every variant is validated and
rendered before anything runs; bad files and bad variants exit 2 in one line."""


import pytest

from specgen.errors import UsageError
from specgen.commands.explore import VariantsResult, VariantTiming, format_markdown, load_variants

from .helpers import ROOT, unknown_kernel_names
from .test_cli import specgen


VARIANT_FILES = sorted((ROOT / "bench" / "variants").glob("*.yaml"))


def test_variant_files_are_shipped():
    assert VARIANT_FILES


@pytest.mark.parametrize("path", VARIANT_FILES, ids=lambda p: p.stem)
def test_shipped_variant_files_all_render(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    config, plans, sources = load_variants(path.relative_to(ROOT))
    assert set(plans) == set(config.variants) == set(sources)
    assert len(set(sources.values())) == len(sources), f"{path.name}: two variants render alike"
    for label, text in sources.items():  # a hook tensor's parameter may not take these names
        missing = unknown_kernel_names(text, plans[label].spec.tensors)
        assert not missing, f"{path.name} {label}: add {sorted(missing)} to KERNEL_NAMES"


def test_a_variant_changes_only_what_it_sets(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "v.yaml"
    path.write_text("spec: specs/fmha_gqa_causal.yaml\nvariants:\n  base: []\n"
                    "  split off: [loop_split=false]\n")
    _, plans, sources = load_variants(path)
    assert plans["base"].loop_split and not plans["split off"].loop_split
    assert "No loop split" in sources["split off"] and "No loop split" not in sources["base"]


@pytest.mark.parametrize("text,message", [
    ("spec: specs/fmha_gqa_causal.yaml\nvariants: {}\n", "variants:"),
    ("spec: specs/fmha_gqa_causal.yaml\nvariants:\n  x: [targets.sm_90.tile_m=100]\n",
     "variant 'x': targets.sm_90.tile_m: must be a power of two in [16, 256], got 100"),
    ("spec: specs/fmha_gqa_causal.yaml\nvariants:\n  x: [loop_split]\n", "expected key.path=value"),
    ("spec: specs/fmha_gqa_causal.yaml\nbogus: 1\nvariants:\n  x: []\n", "bogus"),
    ("spec: [\n", "invalid YAML"),
    # duplicate keys, as in a spec file
    ("spec: specs/fmha_gqa_causal.yaml\nvariants:\n  a: []\n  a: [prescale_q=true]\n",
     "invalid YAML: line 4, column 3: duplicate key 'a'"),
    # an assignment's error names the file and the variant, not --set
    ("spec: specs/fmha_gqa_causal.yaml\nvariants:\n  x: [nokey]\n",
     "v.yaml: variant 'x': expected key.path=value (names joined by dots), got 'nokey'"),
    # a shared assignment's error is the base's, and a bad spec path names the field
    ("spec: specs/fmha_gqa_causal.yaml\nbase: [nokey]\nvariants:\n  x: []\n",
     "v.yaml: base: expected key.path=value (names joined by dots), got 'nokey'"),
    ("spec: specs/nowhere.yaml\nvariants:\n  x: []\n",
     "v.yaml: spec: specs/nowhere.yaml: cannot read: No such file or directory"),
    # what would be timed on another call than the first variant's
    ("spec: specs/fmha_decode_gqa8_bf16.yaml\nvariants:\n  x: []\n",
     "variant 'x': bench --variants times dense prefill calls; a decode spec"),
    ("spec: specs/fmha_varlen_llama.yaml\nvariants:\n  x: []\n", "variant 'x': bench --variants "
     "times dense prefill calls; varlen"),
    ("spec: specs/fmha_gqa_causal.yaml\nvariants:\n  a: []\n  b: [gqa_ratio=1, head_dim=64]\n",
     "variant 'b': changes head_dim, gqa_ratio from variant 'a'"),
    ("spec: specs/fmha_gqa_causal.yaml\nvariants:\n  a: []\n  b: [dtype=bfloat16]\n",
     "variant 'b': changes dtype from variant 'a'"),
    ("spec: specs/fmha_gqa_causal.yaml\nvariants:\n  a|b: []\n", "variant 'a|b': a label is"),
    # shapes the suite could not run
    ("spec: specs/fmha_gqa_causal.yaml\nshapes: {seqs: [0]}\nvariants:\n  x: []\n",
     "shapes.seqs[0]: must be at least 1, got 0"),
    ("spec: specs/fmha_gqa_causal.yaml\nshapes: {seqs: [10000000000]}\nvariants:\n  x: []\n",
     "shapes.seqs[0]: must be at most 1048576, got 10000000000"),
    # in the words of a spec's errors: what is allowed, and what was given
    ("spec: specs/fmha_gqa_causal.yaml\nfoo: 1\nvariants: {a: []}\n",
     "foo: unknown key; allowed keys: spec, base, shapes, timing, variants"),
    ("spec: specs/fmha_gqa_causal.yaml\ntiming: foo\nvariants: {a: []}\n",
     "timing: must be one of 'eager' or 'graph', got \"foo\""),
    ("spec: specs/fmha_gqa_causal.yaml\nvariants: {}\n", "variants: must not be empty"),
    ("spec: specs/fmha_gqa_causal.yaml\nshapes: {seqs: [2048, 8192, 2048]}\nvariants: {a: []}\n",
     "shapes.seqs: lists 2048 twice; give each length once"),
    ("name: x\nhead_dim: 64\n", "a spec file, not a variants file"),
    ("spec: specs/fmha_gqa_causal.yaml\nvariants: {a: [targets.sm_90.by_seq_k.0.tile_m=64]}\n",
     "variant 'a': targets.sm_90.by_seq_k.0.tile_m: by_seq_k is a list, not a mapping"),
    ("spec: specs/fmha_gqa_causal.yaml\nshapes: {heads: 3}\nvariants:\n  x: []\n",
     "shapes.heads: 3 query heads are not a multiple of gqa_ratio 4"),
    ("spec: specs/fmha_document_mask.yaml\nvariants:\n  x: []\n",
     "variant 'x': the cuDNN baseline of bench --variants cannot run it (SDPA cuDNN has no mask_mod)"),
    ("spec: specs/fmha_gqa_causal.yaml\nvariants:\n  x: [softcap=30.0]\n",
     "(SDPA cuDNN has no softcap); time the spec with specgen bench"),
])
def test_bad_variant_files_are_usage_errors(tmp_path, monkeypatch, text, message):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "v.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=None) as info:
        load_variants(path)
    assert message in str(info.value)


def test_a_variants_file_with_several_problems_names_each(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "v.yaml"
    path.write_text("spec: specs/fmha_gqa_causal.yaml\nbogus: 1\nshapes: {batch: 0}\ntiming: x\nvariants: {}\n")
    with pytest.raises(UsageError) as info:
        load_variants(path)
    lines = str(info.value).splitlines()
    assert len(lines) == 4 and all(line.startswith(f"{path}: ") for line in lines), lines
    assert {line.split(": ")[1] for line in lines} == {"bogus", "shapes.batch", "timing", "variants"}


def test_bench_variants_cli_errors():
    both = specgen("bench", "specs/fmha_gqa_causal.yaml", "--variants", "x.yaml", cwd=ROOT)
    assert both.returncode == 2 and "not both" in both.stderr
    neither = specgen("bench", cwd=ROOT)
    assert neither.returncode == 2 and "at least one SPEC" in neither.stderr
    missing = specgen("bench", "--variants", "no/such.yaml", cwd=ROOT)
    assert missing.returncode == 2 and "no/such.yaml: cannot read" in missing.stderr


@pytest.mark.parametrize("args,message", [
    (["--suite", "decode"], "--suite decode does not apply to --variants"),
    (["--suite", "bogus"], "--suite bogus does not apply to --variants"),
    (["--suite", "prefill"], "--suite prefill does not apply to --variants"),
    (["--gen", "README.md"], "--gen does not apply to --variants"),
    (["--gen", "generated"], "--gen does not apply to --variants"),
    (["--baselines", ""], "--baselines: expected comma-separated names"),
    (["--baselines", ","], "--baselines: expected comma-separated names"),
])
def test_bench_variants_refuses_options_it_would_ignore(capsys, monkeypatch, args, message):
    from specgen.commands.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["bench", "--variants", "bench/variants/hopper_causal.yaml", *args]) == 2
    assert message in capsys.readouterr().err


def test_markdown_table_has_one_row_per_variant_and_the_cudnn_row():
    result = VariantsResult(
        file="v.yaml", spec="specs/s.yaml", created="2026-11-21", device={"name": "GPU"},
        shapes={"batch": 1, "heads": 2, "seqs": [2048]}, variants={"a": [], "b": ["x=1"]},
        max_rel_err={"a": 1e-4, "b": None},
        rows=[VariantTiming(variant="a", seq=2048, ms=1.0, tflops=500.0, cudnn_ms=1.1,
                            cudnn_tflops=455.0, vs_cudnn=1.1),
              VariantTiming(variant="b", seq=2048, error="incorrect or failed")],
    )
    table = format_markdown(result)
    assert "| a | 1.0e-04 | 500 (1.10×) |" in table
    assert "| b | – | incorrect or failed |" in table
    assert "| cuDNN (same run) | | 455 |" in table


def test_markdown_table_gives_each_other_baseline_a_ratio_and_a_row():
    result = VariantsResult(
        file="v.yaml", spec="specs/s.yaml", created="2026-11-25", device={"name": "GPU"},
        shapes={"batch": 1, "heads": 2, "seqs": [1024, 2048]}, variants={"a": []},
        max_rel_err={"a": 1e-4}, baselines=["fa3", "flex"], skipped={"flex": "Flex not here"},
        rows=[VariantTiming(variant="a", seq=1024, ms=1.0, tflops=400.0, cudnn_ms=1.0, cudnn_tflops=400.0,
                            vs_cudnn=1.0, baseline_ms={"fa3": 0.8}, baseline_tflops={"fa3": 500.0},
                            speedup={"fa3": 0.8}),
              VariantTiming(variant="a", seq=2048, ms=1.0, tflops=600.0, cudnn_ms=1.2, cudnn_tflops=500.0,
                            vs_cudnn=1.2)],
    )
    table = format_markdown(result)
    assert "| a | 1.0e-04 | 400 (1.00×) 0.80× FA3 | 600 (1.20×) |" in table
    assert "| FA3 (same run) | | 500 | – |" in table
    assert "| FlexAttention | | Flex not here | Flex not here |" in table


def test_variants_refuse_a_baseline_that_patches_cuda_tile(monkeypatch):
    from specgen.commands.explore import run_variants

    monkeypatch.chdir(ROOT)
    with pytest.raises(UsageError, match="tilegym cannot be timed beside the variants"):
        run_variants(ROOT / "bench" / "variants" / "hopper_qk_ahead.yaml", ROOT / "bench" / "results",
                     baselines=("cudnn", "tilegym"))


def test_a_variants_file_picks_graph_timing_and_the_table_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "v.yaml"
    path.write_text("spec: specs/fmha_gqa_causal.yaml\ntiming: graph\nvariants:\n  base: []\n")
    config, _, _ = load_variants(path)
    assert config.timing == "graph"
    path.write_text("spec: specs/fmha_gqa_causal.yaml\ntiming: cuda\nvariants:\n  base: []\n")
    with pytest.raises(UsageError, match="timing"):
        load_variants(path)
    result = VariantsResult(
        file="v.yaml", spec="specs/s.yaml", created="2026-11-25", device={"name": "GPU"},
        shapes={"batch": 1, "heads": 2, "seqs": [1024]}, timing="graph", variants={"a": []},
        max_rel_err={"a": 1e-4}, rows=[],
    )
    assert "Sq=Skv; CUDA graphs of one call." in format_markdown(result)

"""What a new user meets at the command line: a copied spec cannot silently replace
another spec's module, written files get normal permissions, a build says that it
is compiling, and every validation error of a spec comes in one run."""

import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from .helpers import ROOT
from .test_cli import specgen


@pytest.fixture
def project(tmp_path):
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    return tmp_path


def _copied_spec(project):
    """fmha_gqa_causal built from specs/, and mine.yaml: a copy of its spec, changed,
    that kept its name. Returns the module and its bytes."""
    assert specgen("build", "specs/fmha_gqa_causal.yaml", "--no-compile", cwd=project).returncode == 0
    module = project / "generated" / "fmha_gqa_causal.py"
    spec = (project / "specs" / "fmha_gqa_causal.yaml").read_text()
    (project / "mine.yaml").write_text(spec.replace("dtype: float16", "dtype: bfloat16"))
    return module, module.read_bytes()


def test_a_copied_spec_that_kept_its_name_is_refused_without_force(project):
    module, before = _copied_spec(project)
    result = specgen("build", "mine.yaml", "--no-compile", cwd=project)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "mine.yaml: name: 'fmha_gqa_causal' would overwrite generated/fmha_gqa_causal.py, made from "
        "specs/fmha_gqa_causal.yaml; rename the spec's name, or pass --force"]
    assert module.read_bytes() == before
    # The same spec file rebuilds as usual; --force replaces the module.
    assert specgen("build", "specs/fmha_gqa_causal.yaml", "--no-compile", cwd=project).returncode == 0
    assert specgen("build", "mine.yaml", "--no-compile", "--force", cwd=project).returncode == 0
    assert "from mine.yaml" in module.read_text().splitlines()[0]


def test_test_refuses_to_overwrite_another_specs_module(project):
    """`specgen test` renders stale modules as build does, and refuses as build does."""
    module, before = _copied_spec(project)
    result = specgen("test", "mine.yaml", "--emulate", "--fuzz-case", "0:0", cwd=project)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "mine.yaml: name: 'fmha_gqa_causal' would overwrite generated/fmha_gqa_causal.py, made from "
        "specs/fmha_gqa_causal.yaml; rename the spec's name, or replace it with `specgen build --force` first"]
    assert module.read_bytes() == before


def test_generated_files_get_the_mode_open_would_give(project):
    old = os.umask(0o022)
    try:
        assert specgen("build", "specs/fmha_gqa_causal.yaml", "--no-compile", cwd=project).returncode == 0
    finally:
        os.umask(old)
    for path in (project / "generated").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_a_build_says_that_it_compiles_before_the_first_cubin_is_done(project):
    result = specgen("build", "specs/fmha_gqa_causal.yaml", "--targets", "sm_90", cwd=project)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("compiling 1 module-target pair"))
    done = next(i for i, line in enumerate(lines) if line.startswith("[1/1] fmha_gqa_causal"))
    assert start < done


def test_a_bad_templates_setting_is_bad_input(project, monkeypatch):
    """SPECGEN_TEMPLATES pointing at no templates, or at a folder with the family
    template but not the ones it includes, is the user's setting: exit 2 and one line
    naming it (it exited 1, as for a broken install)."""
    (project / "partial").mkdir()
    shutil.copy(ROOT / "templates" / "fmha_prefill.py.jinja", project / "partial")
    for folder, missing in (("nowhere", "fmha_prefill.py.jinja"), ("partial", "_aot.jinja")):
        monkeypatch.setenv("SPECGEN_TEMPLATES", str(project / folder))
        result = specgen("build", "specs/fmha_gqa_causal.yaml", "--no-compile", cwd=project)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            f"SPECGEN_TEMPLATES={project / folder}: no {missing} there; point it at a folder of "
            "specgen's templates, or unset it to use the installed ones"]
        assert not (project / "generated" / "fmha_gqa_causal.py").exists()


def test_a_renamed_spec_file_takes_over_its_module(project):
    """mv x.yaml y.yaml, then build y.yaml: the module's spec is gone, so the module is
    y.yaml's (the build refused it as another spec's, and asked for --force)."""
    assert specgen("build", "specs/fmha_gqa_causal.yaml", "--no-compile", cwd=project).returncode == 0
    (project / "specs" / "fmha_gqa_causal.yaml").rename(project / "specs" / "renamed.yaml")
    result = specgen("build", "specs/renamed.yaml", "--no-compile", cwd=project)
    assert result.returncode == 0, result.stderr
    module = project / "generated" / "fmha_gqa_causal.py"
    assert "from specs/renamed.yaml" in module.read_text().splitlines()[0]
    assert specgen("build", "--check", "--no-compile", "specs/renamed.yaml", cwd=project).returncode == 0


@pytest.mark.parametrize("text,tag", [
    ("name: x\ncausal: !!python/object:os.system [echo]\n", "!!python/object:os.system"),
    ("name: !mine x\n", "!mine"),
])
def test_a_yaml_tag_is_named_in_one_line(project, text, tag):
    """A tag PyYAML has no constructor for is refused in the words the other tags
    get (it printed "could not determine a constructor for the tag
    'tag:yaml.org,2002:python/object:os.system'")."""
    (project / "tagged.yaml").write_text(text)
    result = specgen("build", "tagged.yaml", "--no-compile", cwd=project)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("tagged.yaml: invalid YAML: line ")
    assert line.endswith(f": the tag {tag} is not allowed in a spec")
    assert not (project / "generated").exists()


@pytest.mark.parametrize("args", [[], ["specs/fmha_gqa_causal.yaml"]])
def test_diff_with_too_few_paths_names_all_three_forms(project, args):
    result = specgen("diff", *args, cwd=project)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "specgen diff: give two specs or modules (A B), one with --set key=value, or "
        "--templates [SPEC...] to compare generated/ with the templates"]


def test_the_context_parallel_example_says_what_it_needs_without_gpus(tmp_path):
    """docs/examples/context_parallel.py run where torch sees no GPU: one line and exit 2
    (it failed with an AttributeError from torch.cuda.set_device on a CPU build)."""
    example = ROOT / "docs" / "examples" / "context_parallel.py"
    result = subprocess.run([sys.executable, str(example)], cwd=tmp_path, capture_output=True,
                            text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "context_parallel.py: needs CUDA GPUs (NCCL), and torch.cuda.is_available() is False "
        f"(torch {torch.__version__}); without GPUs, tests/test_parallel.py runs the ring over "
        "gloo on the CPU"]


def test_a_missing_aot_folder_says_a_build_writes_it(tmp_path):
    """`specgen build --check` (compiling) in a fresh checkout: git ignores the .aot
    folders, so each module's is missing; the line says what makes it."""
    from specgen.compile.aot import folder_problem

    module = tmp_path / "generated" / "x.py"
    assert folder_problem(module, "", []) == (
        f"{tmp_path / 'generated' / 'x.aot'}: missing (no manifest.json); `specgen build` writes it "
        "(git ignores the .aot folders, so a fresh checkout has none)")


def test_docs_run_inside_a_checkout_names_the_checkout(project):
    """`specgen docs` from a checkout's docs/ folder: the line says which --root to pass."""
    (project / "bench" / "results").mkdir(parents=True)
    (project / "docs").mkdir()
    result = specgen("docs", "--check", cwd=project / "docs")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "specgen docs: . is not a checkout of specgen (it has no specs/ or bench/results/): "
        "`specgen docs` regenerates specgen's own docs/ pages, not a page of your specs; "
        "pass --root .., the checkout that holds it"]

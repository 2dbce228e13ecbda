"""What a new user meets at the command line: a copied spec cannot silently replace
another spec's module, written files get normal permissions, a build says that it
is compiling, and every validation error of a spec comes in one run."""

import os
import shutil
import stat

import pytest

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

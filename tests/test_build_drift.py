"""Drift detection and determinism edge cases of `specgen build` found by a probe:
modules with CRLF line ends still count as specgen's for the foreign-module guard and
the leftover check, editor files in the templates folder are not templates, a stale
module's drift line says which input changed, `--check` says "in step" only when it
is, and SIGTERM while modules are written leaves no temporary file."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from specgen.compile import jobs
from specgen.emit.render import template_hash

from .helpers import ROOT
from .test_cli import specgen


@pytest.fixture
def project(tmp_path):
    (tmp_path / "specs").mkdir()
    for name in ("fmha_mha_bf16", "fmha_alibi"):
        shutil.copy(ROOT / "specs" / f"{name}.yaml", tmp_path / "specs")
    assert specgen("build", "specs", "--no-compile", cwd=tmp_path).returncode == 0
    return tmp_path


def _crlf(path):
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))


def test_a_crlf_module_of_another_spec_is_not_overwritten_without_force(project):
    """git's autocrlf (or an editor) converts a module's line ends: it is still the
    module another spec made, and a copied spec that kept its name may not replace it."""
    module = project / "generated" / "fmha_alibi.py"
    _crlf(module)
    before = module.read_bytes()
    (project / "copy").mkdir()
    copy = project / "copy" / "alibi_copy.yaml"
    copy.write_text((project / "specs" / "fmha_alibi.yaml").read_text().replace(
        "head_dim: 128", "head_dim: 64"))
    result = specgen("build", "copy/alibi_copy.yaml", "--no-compile", cwd=project)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "would overwrite generated/fmha_alibi.py, made from specs/fmha_alibi.yaml" in result.stderr
    assert module.read_bytes() == before


def test_a_crlf_module_whose_spec_is_gone_is_drift(project):
    _crlf(project / "generated" / "fmha_alibi.py")
    (project / "specs" / "fmha_alibi.yaml").unlink()
    check = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert check.returncode == 1
    assert "generated/fmha_alibi.py: its spec specs/fmha_alibi.yaml is gone" in check.stderr


def test_check_tells_to_build_only_where_a_build_fixes_the_drift(project):
    """A module whose spec is gone is drift that a build leaves (it deletes nothing):
    its line says to delete it, and no closing line says that a build fixes it."""
    (project / "specs" / "fmha_alibi.yaml").unlink()
    check = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert check.returncode == 1
    assert "generated/fmha_alibi.py: its spec specs/fmha_alibi.yaml is gone (delete the module" in check.stderr
    assert "run `specgen build`" not in check.stderr, check.stderr
    spec = project / "specs" / "fmha_mha_bf16.yaml"
    spec.write_text(spec.read_text().replace("head_dim: 64", "head_dim: 128"))
    check = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert check.returncode == 1
    assert "generated/fmha_mha_bf16.py: stale against" in check.stderr
    assert "run `specgen build` to regenerate" in check.stderr, check.stderr


def test_hidden_editor_files_are_not_templates(tmp_path):
    """An Emacs lock link (.#x.jinja, to nowhere) or a hidden backup copy beside the
    templates neither stops a build nor reads as a template change."""
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", templates)
    before = template_hash(templates)
    os.symlink("user@host.1234:1700000000", templates / ".#fmha_prefill.py.jinja")
    shutil.copy(templates / "fmha_prefill.py.jinja", templates / ".fmha_prefill.py.jinja")
    assert template_hash(templates) == before


def test_a_stale_module_names_what_changed(project):
    spec = project / "specs" / "fmha_mha_bf16.yaml"
    spec.write_text(spec.read_text() + "loop_split: false\n")
    check = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert check.returncode == 1
    assert ("generated/fmha_mha_bf16.py: stale against specs/fmha_mha_bf16.yaml or the templates "
            "(the spec changed: spec-sha256 differs)") in check.stderr


def test_check_says_in_step_only_when_the_aot_folders_are_too(project, monkeypatch):
    """A module in step with a stale AOT folder is drift (exit 1): no line may say
    that everything is in step."""
    monkeypatch.setattr(jobs, "compile_jobs", lambda *a, **k: ([], ["generated/x.aot: missing"]))
    out, err = [], []
    monkeypatch.chdir(project)
    code = jobs.run_build(["specs"], project / "generated", check=True, log=out.append, err=err.append)
    assert code == 1 and err == ["generated/x.aot: missing"]
    assert not any("in step" in line for line in out), out


_TERM_DURING_WRITE = textwrap.dedent('''
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from specgen.commands.cli import main

    fsync = os.fsync
    def fsync_then_term(fd):  # SIGTERM arrives while a module's temporary file is open
        fsync(fd)
        os.kill(os.getpid(), signal.SIGTERM)
    os.fsync = fsync_then_term
    sys.exit(main(["build", "specs", "--gen", "out", "--no-compile"]))
''')


def test_sigterm_while_modules_are_written_leaves_no_temporary_file(project):
    script = project / "term.py"
    script.write_text(_TERM_DURING_WRITE.format(root=str(ROOT)))
    result = subprocess.run([sys.executable, str(script)], cwd=project, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 130, (result.returncode, result.stderr)
    assert sorted(p.name for p in (project / "out").iterdir() if p.name.startswith(".")) == []


def test_an_aot_folder_whose_module_is_gone_is_drift(project, monkeypatch):
    """A module deleted (its spec gone or renamed) leaves its .aot folder behind:
    --check names it, as it names a module left behind."""
    monkeypatch.setattr(jobs, "compile_jobs", lambda *a, **k: ([], []))
    (project / "generated" / "fmha_old_name.aot").mkdir()
    (project / "generated" / "fmha_old_name.aot" / "manifest.json").write_text("{}\n")
    out, err = [], []
    monkeypatch.chdir(project)
    code = jobs.run_build(["specs"], project / "generated", check=True, log=out.append, err=err.append)
    assert code == 1
    assert any("fmha_old_name.aot: the AOT folder of fmha_old_name.py, which is gone" in line
               for line in err), err

    # A module its spec still makes is missing, not gone: its folder is left to the build.
    (project / "generated" / "fmha_alibi.py").unlink()
    (project / "generated" / "fmha_alibi.aot").mkdir(exist_ok=True)
    err.clear()
    assert jobs.run_build(["specs"], project / "generated", check=True, log=out.append,
                          err=err.append) == 1
    assert not any("fmha_alibi.aot" in line for line in err), err
    assert any("fmha_alibi.py" in line for line in err), err


def test_templates_with_crlf_line_ends_hash_as_they_render(tmp_path):
    """git's autocrlf gives a Windows checkout CRLF templates: Jinja reads them as LF
    and renders the same module, so their hash (in every header) is the same too."""
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", templates)
    for file in templates.glob("*.jinja"):
        file.write_bytes(file.read_bytes().replace(b"\n", b"\r\n"))
    assert template_hash(templates) == template_hash(ROOT / "templates")


def test_a_spec_path_with_undecodable_bytes_is_named_as_such():
    """A name the file system's encoding cannot decode (surrogate escapes) is not a
    "control character": the line says what it is."""
    from specgen.emit.render import unnameable_path

    line = unnameable_path("sp\udcc3\udca9cs/x.yaml")
    assert line and "not text in the file system's encoding" in line and "control" not in line
    assert "control character" in unnameable_path("specs/a\x1bb.yaml")


def test_a_linked_output_folder_gives_the_same_module(tmp_path):
    """generated/ as a symbolic link to a folder elsewhere (a build or cache disk):
    the header names the spec from the project that holds the link, so the module is
    byte-identical to the committed one; a module an older specgen wrote through the
    link (its header naming the same spec file by another path) is this spec's own."""
    project = tmp_path / "proj"
    (project / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "specs" / "fmha_alibi.yaml", project / "specs")
    (tmp_path / "disk" / "gen").mkdir(parents=True)
    os.symlink(tmp_path / "disk" / "gen", project / "generated")
    module = project / "generated" / "fmha_alibi.py"
    module.write_text((ROOT / "generated" / "fmha_alibi.py").read_text().replace(
        "from specs/fmha_alibi.yaml.", "from ../proj/specs/fmha_alibi.yaml.", 1))
    assert specgen("build", "specs", "--no-compile", cwd=project).returncode == 0
    assert module.read_bytes() == (ROOT / "generated" / "fmha_alibi.py").read_bytes()
    assert specgen("build", "specs", "--check", "--no-compile", cwd=project).returncode == 0


def test_a_linked_specs_folder_keeps_its_name_in_the_headers(tmp_path):
    """specs/ as a symbolic link to a folder elsewhere (a shared checkout of specs):
    the modules name the spec by the link's path, so they are byte-identical to the
    committed ones and ``build --check`` finds no drift; naming the link's target
    instead names the spec by that path (outside the project), which --check reports."""
    project = tmp_path / "proj"
    project.mkdir()
    (tmp_path / "shared").mkdir()
    shutil.copy(ROOT / "specs" / "fmha_alibi.yaml", tmp_path / "shared")
    os.symlink(tmp_path / "shared", project / "specs")
    assert specgen("build", "specs", "--no-compile", cwd=project).returncode == 0
    module = project / "generated" / "fmha_alibi.py"
    assert module.read_bytes() == (ROOT / "generated" / "fmha_alibi.py").read_bytes()
    assert specgen("build", "specs", "--check", "--no-compile", cwd=project).returncode == 0
    assert specgen("build", "specs/fmha_alibi.yaml", "--check", "--no-compile", cwd=project).returncode == 0
    outside = specgen("build", str(tmp_path / "shared"), "--check", "--no-compile", cwd=project)
    assert outside.returncode == 1 and "fmha_alibi.py" in outside.stdout + outside.stderr


def test_a_dot_dot_after_a_linked_folder_names_the_file_the_system_opens(tmp_path):
    """`specs/../x.yaml` where specs is a symbolic link is the x.yaml beside the
    link's target, as open() reads it. Kept by name, its ".." was dropped by name:
    the build read ./x.yaml (another spec, or "cannot read" where there is none)."""
    project = tmp_path / "proj"
    project.mkdir()
    (tmp_path / "shared" / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "specs" / "fmha_alibi.yaml", tmp_path / "shared" / "x.yaml")
    os.symlink(tmp_path / "shared" / "specs", project / "specs")
    assert jobs.collect_spec_paths([project / "specs" / ".." / "x.yaml"]) == [tmp_path / "shared" / "x.yaml"]
    shutil.copy(ROOT / "specs" / "fmha_mha_bf16.yaml", project / "x.yaml")  # not the one named
    assert specgen("build", "specs/../x.yaml", "--no-compile", cwd=project).returncode == 0
    assert sorted(p.name for p in (project / "generated").glob("*.py")) == ["__init__.py", "fmha_alibi.py"]

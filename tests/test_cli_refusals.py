"""What the command line refuses, and when: test and bench name a module they may not
replace before they ask for a GPU; diff refuses a folder option that its mode would not
read; a variants file given where a spec goes is named as one; schema --file makes no
folder through a dangling link; a reader of the output that went away ends a command
quietly."""

import os
import shutil

import pytest
import torch

from .helpers import ROOT
from .test_cli import specgen

GPU_COMMANDS = [["test"], ["bench"]]


@pytest.fixture
def project(tmp_path):
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    return tmp_path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
@pytest.mark.parametrize("command", GPU_COMMANDS)
def test_a_hand_edited_module_is_named_before_the_gpu(project, command):
    """test and bench refuse to replace a hand-edited module; that is said on any
    machine, not only once a GPU was found (it said "needs a CUDA GPU" here)."""
    assert specgen("build", "specs/fmha_mha_bf16.yaml", "--no-compile", cwd=project).returncode == 0
    module = project / "generated" / "fmha_mha_bf16.py"
    edited = module.read_text() + "# mine\n"
    module.write_text(edited)
    result = specgen(*command, "specs/fmha_mha_bf16.yaml", cwd=project)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "generated/fmha_mha_bf16.py: edited by hand, not overwritten (specgen build --force replaces it)"]
    assert module.read_text() == edited


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
@pytest.mark.parametrize("command", GPU_COMMANDS)
def test_another_specs_module_is_named_before_the_gpu(project, command):
    """A copied spec that kept its name: test and bench would render it over the module
    the original made; they say so before they ask for a GPU."""
    assert specgen("build", "specs/fmha_mha_bf16.yaml", "--no-compile", cwd=project).returncode == 0
    module = project / "generated" / "fmha_mha_bf16.py"
    before = module.read_bytes()
    (project / "mine.yaml").write_text((project / "specs" / "fmha_mha_bf16.yaml").read_text())
    result = specgen(*command, "mine.yaml", cwd=project)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "mine.yaml: name: 'fmha_mha_bf16' would overwrite generated/fmha_mha_bf16.py, made from "
        "specs/fmha_mha_bf16.yaml; rename the spec's name, or replace it with `specgen build --force` "
        "first"]
    assert module.read_bytes() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
@pytest.mark.parametrize("command", GPU_COMMANDS)
def test_a_module_in_step_still_gets_to_the_gpu_check(project, command):
    assert specgen("build", "specs/fmha_mha_bf16.yaml", "--no-compile", cwd=project).returncode == 0
    result = specgen(*command, "specs/fmha_mha_bf16.yaml", cwd=project)
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("args,message", [
    # A and B are the paths given: a --gen there was read by nothing.
    (["specs/fmha_alibi.yaml", "specs/fmha_alibi.yaml", "--no-compile", "--gen", "elsewhere"],
     "specgen diff: --gen applies to --templates only (A and B are read from the paths given)"),
    (["specs/fmha_alibi.yaml", "--set", "causal=false", "--no-compile", "--gen", "generated"],
     "specgen diff: --gen applies to --templates only (A and B are read from the paths given)"),
    # --templates has no performance section: a --results there was read by nothing.
    (["--templates", "specs/fmha_alibi.yaml", "--results", "elsewhere"],
     "specgen diff: --templates and --results cannot be combined (--templates has no performance "
     "section)"),
])
def test_diff_refuses_a_folder_option_it_would_ignore(project, args, message):
    result = specgen("diff", *args, cwd=project)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [message]
    assert not result.stdout


def test_diff_takes_each_folder_option_where_it_is_read(project):
    assert specgen("build", "specs/fmha_alibi.yaml", "--no-compile", "--gen", "mine",
                   cwd=project).returncode == 0
    result = specgen("diff", "--templates", "specs/fmha_alibi.yaml", "--gen", "mine", cwd=project)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("a: mine/fmha_alibi.py (as written)\n")
    result = specgen("diff", "specs/fmha_alibi.yaml", "specs/fmha_alibi.yaml", "--no-compile",
                     "--results", "results", cwd=project)
    assert result.returncode == 0, result.stderr
    # An empty value is still named as one, not taken for the default.
    result = specgen("diff", "specs/fmha_alibi.yaml", "specs/fmha_alibi.yaml", "--no-compile",
                     "--results=", cwd=project)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["specgen diff: --results: expected a folder, got ''"]


VARIANTS_LINE = ("a variants file, not a spec (a spec has name: and the fields of "
                 "docs/spec-reference.md); time its variants with `specgen bench --variants FILE`")


@pytest.mark.parametrize("command", [
    ["build", "--no-compile"], ["test", "--emulate"], ["diff", "specs/fmha_alibi.yaml", "--no-compile"],
    ["tune", "--target", "sm_90"], ["bench"],
])
def test_a_variants_file_where_a_spec_goes_is_named_in_one_line(project, command):
    """As bench --variants names a spec file given to it; each of the file's keys was
    an "unknown key" line of its own, after "name: required field is missing"."""
    shutil.copy(ROOT / "bench" / "variants" / "hopper_causal.yaml", project / "v.yaml")
    args = [command[0], "v.yaml", *command[1:]]
    if command[0] == "diff":  # A is the variants file, B a spec
        args = ["diff", "v.yaml", *command[1:]]
    result = specgen(*args, cwd=project)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"v.yaml: {VARIANTS_LINE}"]
    assert not (project / "generated").exists()


def test_a_folder_with_a_variants_file_names_it_beside_the_specs(project):
    shutil.copy(ROOT / "bench" / "variants" / "hopper_causal.yaml", project / "specs" / "v.yaml")
    result = specgen("build", "specs", "--no-compile", cwd=project)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"specs/v.yaml: {VARIANTS_LINE}"]


def test_schema_file_through_a_dangling_link_makes_no_folder(tmp_path):
    link = tmp_path / "schema.json"
    link.symlink_to(tmp_path / "new" / "sub" / "schema.json")
    result = specgen("schema", "--file", link, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"specgen schema: --file {link}: a symbolic link to {tmp_path / 'new' / 'sub' / 'schema.json'}, "
        f"whose folder {tmp_path / 'new' / 'sub'} does not exist"]
    assert not (tmp_path / "new").exists()
    # A link into a folder that exists is written through, the link kept.
    (tmp_path / "new").mkdir()
    link.unlink()
    link.symlink_to(tmp_path / "new" / "schema.json")
    assert specgen("schema", "--file", link, cwd=tmp_path).returncode == 0
    assert link.is_symlink() and (tmp_path / "new" / "schema.json").is_file()


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("args", [
    ["diff", "specs/fmha_alibi.yaml", "--set", "loop_split=false", "--no-compile"],
    ["build", "--no-compile", "specs/fmha_alibi.yaml"],
    ["--version"],
])
def test_a_reader_that_went_away_ends_the_command_quietly(project, args, unbuffered):
    """`specgen diff ... | head`: the output's reader goes away. The command stops with
    141, as one that SIGPIPE ends, and says nothing: it printed "specgen diff: Broken
    pipe", exit 2, as if the input were bad, or, where the output was still buffered
    at the end, Python's "Exception ignored ... BrokenPipeError", exit 120."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        result = subprocess.run([sys.executable, "-m", "specgen", *args], cwd=project, stdout=write,
                                stderr=subprocess.PIPE, text=True, env={**env, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    if unbuffered and args == ["--version"]:  # argparse drops what it cannot print itself
        assert result.returncode == 0 and result.stderr == ""
        return
    assert result.returncode == 141 and result.stderr == "", result.stderr


def test_a_broken_pipe_elsewhere_is_still_reported(monkeypatch, capsys):
    from specgen.commands import cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe", "some.sock")

    monkeypatch.setattr(cli, "_run", broken)
    assert cli.main(["schema"]) == 2
    assert capsys.readouterr().err == "specgen schema: some.sock: Broken pipe\n"

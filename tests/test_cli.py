"""The CLI: exit codes, one-line errors, nothing overwritten, --check, and a spec
the team never saw building and compiling end to end."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from specgen.commands import cli
from specgen.commands.cli import schema_text

from .helpers import ROOT


def specgen_process(*args, cwd):
    """`python -m specgen ARGS` in a process of its own, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "specgen", *map(str, args)],
        cwd=cwd, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _compiles(argv: list[str]) -> bool:
    """Whether `specgen ARGV` AOT-compiles: build and diff do unless told not to."""
    return bool(argv) and argv[0] in ("build", "diff") and not {"--no-compile", "--templates"} & set(argv)


def specgen(*args, cwd):
    """`specgen ARGS` in ``cwd``: its exit code, stdout and stderr.

    Runs cli.main in this process (what `python -m specgen` calls, and argparse's
    exits caught as theirs), which spares each call a fresh interpreter and its
    imports, about a second and a half of CPU. A command that compiles gets a process
    of its own: its compile workers must not fork a pytest worker. The tests that use
    specgen_process check what only a real process shows (`python -m`, the console
    script, the exit code of a process)."""
    argv = [str(a) for a in args]
    if _compiles(argv):
        return specgen_process(*argv, cwd=cwd)
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as exc:  # argparse: usage errors (2), --version (0)
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["specgen", *argv], code, out.getvalue(), err.getvalue())


@pytest.fixture
def project(tmp_path):
    """A scratch project: specs/ with the shipped specs, generated/ empty."""
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    return tmp_path


def test_bad_spec_exits_2_with_one_line_and_overwrites_nothing(project):
    _keep(project)
    assert specgen("build", "specs", "--no-compile", cwd=project).returncode == 0
    target = project / "generated" / "fmha_gqa_causal.py"
    before = target.read_bytes()
    spec = project / "specs" / "fmha_gqa_causal.yaml"
    spec.write_text(spec.read_text().replace("sm_120: {tile_m: 64", "sm_120: {tile_m: 100"))
    result = specgen("build", "specs", "--no-compile", cwd=project)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "specs/fmha_gqa_causal.yaml: targets.sm_120.tile_m: must be a power of two in "
        "[16, 256], got 100"
    ]
    assert "Traceback" not in result.stderr
    assert target.read_bytes() == before


def test_one_bad_spec_stops_the_whole_build(project):
    (project / "specs" / "zz_bad.yaml").write_text("name: zz_bad\ndtype: int8\n")
    # A process of its own: the exit code 2 a shell sees, not only main's return value.
    result = specgen_process("build", "specs", "--no-compile", cwd=project)
    assert result.returncode == 2
    assert not (project / "generated").exists()


def test_duplicate_names_are_bad_input(project):
    shutil.copy(project / "specs" / "fmha_mha_bf16.yaml", project / "specs" / "copy.yaml")
    result = specgen("build", "specs", "--no-compile", cwd=project)
    assert result.returncode == 2 and "is also the name in" in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["build", "nowhere.yaml"], "nowhere.yaml: no such spec file or directory"),
        (["build", "specs", "--targets", "hopper"], "--targets: 'hopper' must be a GPU target tileiras compiles for"),
        (["build", "specs", "--jobs", "0"], "--jobs: expected a worker count in [1, 64], got 0"),
        (["build", "specs", "--jobs", "100000"], "--jobs: expected a worker count in [1, 64], got 100000"),
        (["build", "specs", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["explode"], "invalid choice: 'explode'"),
    ],
)
def test_usage_errors_exit_2(project, args, message):
    result = specgen(*args, cwd=project)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def _keep(project, names=("fmha_mha_bf16", "fmha_gqa_causal", "fmha_decode_gqa8_bf16")):
    """A folder of three specs (prefill, both masks, decode): the file logic under test
    is per spec, and each extra spec only adds render time."""
    for spec in (project / "specs").glob("*.yaml"):
        if spec.stem not in names:
            spec.unlink()
    return len(names)


def test_build_writes_only_on_change_and_check_detects_drift(project):
    count = _keep(project)
    first = specgen("build", "specs", "--no-compile", cwd=project)
    assert first.returncode == 0 and first.stdout.count(": written") == count
    assert (project / "generated" / "__init__.py").is_file()
    module = project / "generated" / "fmha_mha_bf16.py"
    mtime = module.stat().st_mtime_ns
    second = specgen("build", "specs", "--no-compile", cwd=project)
    assert second.stdout.count(": unchanged") == count and module.stat().st_mtime_ns == mtime
    assert specgen("build", "specs", "--check", "--no-compile", cwd=project).returncode == 0

    spec = project / "specs" / "fmha_mha_bf16.yaml"
    spec.write_text(spec.read_text() + "loop_split: false\n")
    stale = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert stale.returncode == 1
    assert "generated/fmha_mha_bf16.py: stale against specs/fmha_mha_bf16.yaml" in stale.stderr
    assert module.stat().st_mtime_ns == mtime  # --check writes nothing


def test_hand_edits_are_detected_and_refused_without_force(project):
    _keep(project)
    specgen("build", "specs", "--no-compile", cwd=project)
    module = project / "generated" / "fmha_gqa_causal.py"
    edited = module.read_text().replace("occupancy=ct.ByTarget(", "occupancy=ct.ByTarget( ")
    module.write_text(edited)
    check = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert check.returncode == 1 and "fmha_gqa_causal.py: edited by hand" in check.stderr

    refused = specgen("build", "specs", "--no-compile", cwd=project)
    assert refused.returncode == 1 and "specgen build --force replaces it" in refused.stderr
    assert module.read_text() == edited

    forced = specgen("build", "specs", "--no-compile", "--force", cwd=project)
    assert forced.returncode == 0 and module.read_text() != edited


def test_module_bytes_are_checked_not_just_its_text(project):
    """CRLF line ends are drift that build rewrites; undecodable bytes read as a hand
    edit (one line, no traceback); a folder where a module goes stops the build before
    any write."""
    _keep(project, ("fmha_mha_bf16", "fmha_gqa_causal"))
    specgen("build", "specs", "--no-compile", cwd=project)
    module = project / "generated" / "fmha_mha_bf16.py"
    fresh = module.read_bytes()
    module.write_bytes(fresh.replace(b"\n", b"\r\n"))
    check = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert check.returncode == 1 and "fmha_mha_bf16.py: CRLF line ends" in check.stderr
    assert specgen("build", "specs", "--no-compile", cwd=project).returncode == 0
    assert module.read_bytes() == fresh

    module.write_bytes(b"\xff\xfe\x00")
    check = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert check.returncode == 1 and "fmha_mha_bf16.py: edited by hand" in check.stderr
    refused = specgen("build", "specs", "--no-compile", cwd=project)
    assert refused.returncode == 1 and "specgen build --force replaces it" in refused.stderr

    module.unlink()
    (project / "generated" / "fmha_gqa_causal.py").unlink()
    module.mkdir()
    blocked = specgen("build", "specs", "--no-compile", cwd=project)
    assert blocked.returncode == 2 and "fmha_mha_bf16.py: not a file" in blocked.stderr
    assert not (project / "generated" / "fmha_gqa_causal.py").exists()  # nothing written


def test_check_reports_a_module_whose_spec_is_gone(project):
    _keep(project, ("fmha_mha_bf16", "fmha_alibi"))
    specgen("build", "specs", "--no-compile", cwd=project)
    (project / "specs" / "fmha_alibi.yaml").unlink()
    check = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert check.returncode == 1
    assert "generated/fmha_alibi.py: its spec specs/fmha_alibi.yaml is gone" in check.stderr


def test_check_reports_a_module_left_behind_by_a_renamed_spec(project):
    """A spec whose name: changed makes a new module; the old one, still naming the
    spec in its header, is drift (it used to pass the check)."""
    _keep(project, ("fmha_mha_bf16", "fmha_alibi"))
    specgen("build", "specs", "--no-compile", cwd=project)
    spec = project / "specs" / "fmha_alibi.yaml"
    spec.write_text(spec.read_text().replace("name: fmha_alibi", "name: fmha_alibi_renamed", 1))
    build = specgen("build", "specs", "--no-compile", cwd=project)
    assert build.returncode == 0 and build.stderr.splitlines() == [
        "note: generated/fmha_alibi.py: its spec specs/fmha_alibi.yaml now makes "
        "generated/fmha_alibi_renamed.py (delete the module)"], build.stderr
    check = specgen("build", "specs", "--check", "--no-compile", cwd=project)
    assert check.returncode == 1
    assert check.stderr.splitlines()[0] == ("generated/fmha_alibi.py: its spec specs/fmha_alibi.yaml now makes "
                                            "generated/fmha_alibi_renamed.py (delete the module)"), check.stderr
    (project / "generated" / "fmha_alibi.py").unlink()
    assert specgen("build", "specs", "--check", "--no-compile", cwd=project).returncode == 0


def test_a_spec_file_name_with_a_line_break_is_refused(project):
    _keep(project, ("fmha_mha_bf16",))
    spec = project / "specs" / "fmha_mha_bf16.yaml"
    spec.rename(project / "specs" / "x\nprint('ran')\n#.yaml")
    result = specgen("build", "specs", "--no-compile", cwd=project)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "a spec path with a control character" in result.stderr
    assert not (project / "generated").exists()


def test_every_spec_file_name_with_a_control_character_is_named(project):
    """One line per bad file name, beside the other specs' problems, and nothing written."""
    _keep(project, ("fmha_mha_bf16", "fmha_alibi"))
    (project / "specs" / "fmha_mha_bf16.yaml").rename(project / "specs" / "a\nb.yaml")
    (project / "specs" / "fmha_alibi.yaml").rename(project / "specs" / "c\x1b[31m.yaml")
    (project / "specs" / "bad.yaml").write_text("name: bad\nhead_dim: 17\n")
    result = specgen("build", "specs", "--no-compile", cwd=project)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 3, lines
    assert sum("a spec path with a control character" in line for line in lines) == 2
    assert "specs/bad.yaml: head_dim: must be a multiple of 8" in result.stderr
    assert not (project / "generated").exists()


def test_spec_paths_with_other_spaces_and_scripts_are_fine(project):
    _keep(project, ("fmha_mha_bf16",))
    folder = project / "spécs\u00a0à\u3000x"
    folder.mkdir()
    (project / "specs" / "fmha_mha_bf16.yaml").rename(folder / "fmha_mha_bf16.yaml")
    result = specgen("build", folder.name, "--no-compile", cwd=project)
    assert result.returncode == 0, result.stderr
    header = (project / "generated" / "fmha_mha_bf16.py").read_text(encoding="utf-8").splitlines()[0]
    assert f"from {folder.name}/fmha_mha_bf16.yaml." in header


def test_out_dir_and_header_path_are_project_relative(project):
    result = specgen("build", project / "specs" / "fmha_mha_bf16.yaml", "--out",
                     project / "gen", "--no-compile", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    text = (project / "gen" / "fmha_mha_bf16.py").read_text()
    assert text.startswith("# Generated by specgen 0.1.0 from specs/fmha_mha_bf16.yaml.")


UNSEEN = textwrap.dedent(
    """\
    # A spec nobody on the team wrote: bf16, D64, GQA 8:1, causal, custom tiles.
    name: unseen_variant
    dtype: bfloat16
    head_dim: 64
    gqa_ratio: 8
    causal: true
    fast_math: {exp2: true, flush_to_zero: false, approx_div: true}
    loads: {k_transposed: false, k_latency: 3, v_latency: null}
    targets:
      sm_90: {tile_m: 128, tile_n: 32, occupancy: 1}
    compile_for: [sm_90]
    """
)


@pytest.mark.slow
def test_unseen_spec_builds_and_compiles(tmp_path):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "unseen.yaml").write_text(UNSEEN)
    result = specgen("build", "specs/unseen.yaml", "--targets", "sm_90,sm_100", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 2 and all("KiB" in line for line in lines)
    assert "sm_90" in lines[0] + lines[1] and "sm_100" in lines[0] + lines[1]
    again = specgen("build", "specs/unseen.yaml", "--targets", "sm_90", cwd=tmp_path)
    assert again.returncode == 0 and "(cached)" in again.stdout
    check = specgen("build", "specs", "--check", "--no-compile", cwd=tmp_path)
    assert check.returncode == 0, check.stderr


def test_schema_command_matches_shipped_schema(project):
    result = specgen("schema", cwd=project)
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert schema["additionalProperties"] is False and schema["required"] == ["name"]
    assert (ROOT / "specs" / "schema.json").read_text() == result.stdout == schema_text()


def test_schema_accepts_the_shipped_specs_and_knows_sizes_and_names():
    """An editor checking with specs/schema.json accepts every shipped spec and flags
    what the validator refuses by its size or form (head dims, tiles, names)."""
    import yaml

    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads((ROOT / "specs" / "schema.json").read_text()))
    for path in sorted((ROOT / "specs").glob("*.yaml")) + sorted((ROOT / "bench" / "train").glob("*.yaml")):
        assert not list(validator.iter_errors(yaml.safe_load(path.read_text()))), path
    for bad in ({"name": "a", "head_dim": 100}, {"name": "a", "v_head_dim": 264}, {"name": ""},
                {"name": "a", "targets": {"sm_90": {"tile_m": 100, "tile_n": 64}}},
                {"name": "a", "autotune": {"sm_90": {"tile_n": [64, 96]}}}):
        assert list(validator.iter_errors(bad)), bad


@pytest.mark.parametrize("spec", [
    {"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "occupancy": 33}}},
    {"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "occupancy": 0}}},
    {"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "num_ctas": 3}}},
    {"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "num_ctas": 32}}},
    {"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "num_worker_warps": 6}}},
    {"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "num_worker_warps": 16}}},
    {"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "opt_level": 4}}},
    {"loads": {"k_latency": 0}},
    {"loads": {"v_latency": 11}},
    {"autotune": {"sm_90": {"occupancy": [1, 40]}}},
    {"autotune": {"sm_90": {"num_worker_warps": [None, 2]}}},
    {"family": "decode", "paged": {"page_size": 100}},
    {"family": "decode", "paged": {"page_size": 2048}},
    # target names and lists that name a value twice
    {"targets": {"sm_91": {"tile_m": 64, "tile_n": 64}}},
    {"autotune": {"default": {}}},
    {"compile_for": ["sm_91"]},
    {"compile_for": ["sm_90", "sm_90"]},
    {"autotune": {"sm_90": {"tile_m": [64, 64]}}},
    {"autotune": {"sm_90": {"num_ctas": [None, None]}}},
])
def test_schema_bounds_agree_with_the_validator(spec):
    """The schema states the bounds and choices of each scalar (the docs promise an
    editor "keys, types, choices, bounds"): a value the validator refuses for its
    range is flagged by the schema too."""
    from specgen.errors import SpecError
    from specgen.spec.load import validate_spec

    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(schema_text()))
    spec = {"name": "a", **spec}
    with pytest.raises(SpecError):
        validate_spec(spec, "a.yaml")
    assert list(validator.iter_errors(spec)), spec


def test_schema_accepts_every_allowed_hint_value():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(schema_text()))
    for hints in ({"occupancy": 1}, {"occupancy": 32}, {"num_ctas": None}, {"num_ctas": 16},
                  {"num_worker_warps": None}, {"num_worker_warps": 4}, {"num_worker_warps": 8},
                  {"opt_level": None}, {"opt_level": 0}, {"opt_level": 3}):
        spec = {"name": "a", "targets": {"sm_90": {"tile_m": 64, "tile_n": 64, **hints}},
                "loads": {"k_latency": None, "v_latency": 10},
                "autotune": {"sm_90": {key: [value] for key, value in hints.items()}}}
        assert not list(validator.iter_errors(spec)), spec
    assert not list(validator.iter_errors({"name": "a", "family": "decode", "paged": {"page_size": 1024}}))


def test_python_m_and_console_script_agree(project):
    result = specgen_process("--version", cwd=project)
    assert result.returncode == 0 and result.stdout.startswith("specgen ")
    # The script of the environment running the tests: a venv's python run without
    # activating it (`/path/venv/bin/python -m pytest`) found another install's
    # `specgen` on PATH first, and failed with that one's ModuleNotFoundError.
    script = shutil.which("specgen", path=os.path.dirname(sys.executable)) or shutil.which("specgen")
    if script is None:
        pytest.skip("specgen is not installed as a console script (pip install -e .)")
    installed = subprocess.run([script, "--version"], capture_output=True, text=True)
    assert installed.returncode == 0 and installed.stdout == result.stdout


@pytest.mark.parametrize("args,message", [
    (["--suite", "backward", "specs/fmha_gqa_causal.yaml"],
     "--suite backward: fmha_gqa_causal has backward: false; the suite times backward kernels"),
    (["--suite", "nope", "specs/fmha_gqa_causal.yaml"],
     "--suite: unknown 'nope'; allowed: prefill, decode, backward"),
    (["--baselines", "cudnn,xformers", "specs/fmha_gqa_causal.yaml"],
     "--baselines: unknown xformers; allowed: cudnn, flash, flex"),
    ([], "bench: give at least one SPEC path"),
    (["--seqs", "2k", "specs/fmha_gqa_causal.yaml"],
     "--seqs: expected comma-separated lengths in [1, 1048576] like 2048,8192, got '2k'"),
    # a run that would time nothing is refused before the GPU is asked for
    (["--suite", "decode", "specs/fmha_gqa_causal.yaml"],
     "--suite decode: nothing to time: fmha_gqa_causal is not a decode spec (use --suite prefill)"),
    (["specs/fmha_decode_gqa8_bf16.yaml"],
     "--suite prefill: nothing to time: fmha_decode_gqa8_bf16 is a decode spec (use --suite decode)"),
    (["--suite", "decode", "--seqs", "2048", "specs/fmha_gqa_causal.yaml"],
     "bench: --seqs applies to the prefill and backward suites"),
    (["--variants", "bench/variants/hopper_qk_ahead.yaml", "--seqs", "2048"],
     "bench: --seqs does not apply to --variants"),
    # an empty list is not the default suite, nor an empty item a skipped one
    (["--seqs", "", "specs/fmha_gqa_causal.yaml"],
     "--seqs: expected comma-separated lengths in [1, 1048576] like 2048,8192, got ''"),
    (["--seqs", "2048,,4096", "specs/fmha_gqa_causal.yaml"],
     "--seqs: expected comma-separated lengths in [1, 1048576] like 2048,8192, got '2048,,4096'"),
    # an empty path is not the current folder
    ([""], "'': expected a spec file or a folder of specs"),
    # a results folder that could never be made is refused before anything is timed
    (["--results", "specs/fmha_gqa_causal.yaml/out", "specs/fmha_gqa_causal.yaml"],
     "--results specs/fmha_gqa_causal.yaml/out: specs/fmha_gqa_causal.yaml is not a folder"),
])
def test_bench_errors_exit_2_with_one_line(project, args, message):
    result = specgen("bench", *args, "--gen", "generated", cwd=project)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_out_of_gpu_memory_is_one_line_exit_1(monkeypatch, capsys):
    """Sizes that do not fit the GPU (torch.OutOfMemoryError, whatever its module)
    end in one line naming the command, not a traceback; other errors still raise."""
    from specgen.commands import cli

    class OutOfMemoryError(RuntimeError):
        pass

    def oom(args):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 GiB\nmore detail")

    monkeypatch.setattr(cli, "_run", oom)
    assert cli.main(["bench", "specs/fmha_gqa_causal.yaml"]) == 1
    err = capsys.readouterr().err
    assert err == ("specgen bench: out of GPU memory for the sizes asked "
                   "(CUDA out of memory. Tried to allocate 96.00 GiB)\n")

    def bug(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "_run", bug)
    with pytest.raises(ZeroDivisionError):
        cli.main(["bench", "specs/fmha_gqa_causal.yaml"])


def test_backward_suite_without_cuda_exits_2(project):
    result = specgen("bench", "--suite", "backward", "specs/fmha_train_gqa_causal.yaml",
                     "--results", "results", cwd=project)
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr, result.stderr
    assert not (project / "results").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_test_names_a_bad_spec_before_asking_for_a_gpu(project):
    (project / "specs" / "bad.yaml").write_text("name: bad\nhead_dim: 17\n")
    result = specgen("test", "specs/bad.yaml", cwd=project)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["specs/bad.yaml: head_dim: must be a multiple of 8 in [16, 256], got 17"]


@pytest.mark.slow
def test_concurrent_builds_neither_corrupt_modules_nor_the_cubin_cache(project, tmp_path):
    """Three `specgen build` processes at once on the same specs, one output folder
    and one cubin cache: all succeed, the modules equal a fresh render, each cubin
    is written once, whole (one file per kernel) and no temporary file is left."""
    import os

    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECGEN_CACHE_DIR": str(cache)}
    specs = ["specs/fmha_gqa_causal.yaml", "specs/fmha_decode_gqa8_bf16.yaml"]
    procs = [subprocess.Popen([sys.executable, "-m", "specgen", "build", *specs, "--targets", "sm_90"],
                              cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [(p.wait(timeout=600), p.stdout.read() + p.stderr.read()) for p in procs]
    assert all(code == 0 for code, _ in results), results
    check = subprocess.run([sys.executable, "-m", "specgen", "build", *specs, "--check", "--no-compile"],
                           cwd=project, env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    cubins = sorted(cache.rglob("*.cubin"))
    # Each cubin has the sidecar that names its signatures for the AOT manifest.
    assert all(p.with_name(p.name + ".json").is_file() for p in cubins)
    from specgen.compile.export import kernel_builds, target_configs
    from specgen.plan.make import make_plan
    from specgen.spec import load_spec

    plans = [make_plan(load_spec(project / s)) for s in specs]
    expected = sum(len(kernel_builds(plan, config, "sm_90")) for plan in plans
                   for config in target_configs(plan, "sm_90"))
    assert len(cubins) == expected, cubins  # one per kernel and config: none written twice
    for path in cubins:
        data = path.read_bytes()
        assert data.startswith(b"\x7fELF"), path
    # The decode spec's combine kernel has its own file.
    assert any(p.name.endswith(f"-{plans[1].combine_name}.cubin") for p in cubins), cubins
    leftovers = [p for p in list(cache.rglob(".*")) + list((project / "generated").glob(".*")) if p.is_file()]
    assert leftovers == [], leftovers
    # Every process reported each (spec, target), compiled or (another wrote it) cached,
    # on its "[i/n]" line (a slow machine adds "still compiling" lines that name them too).
    for _, stderr in results:
        done = [line for line in stderr.splitlines() if line.startswith("[") and " sm_90 " in line]
        assert len(done) == 2, stderr


def test_a_build_names_an_aot_path_or_cache_it_cannot_write_before_writing_anything(tmp_path, monkeypatch):
    """A file (or link) where a module's .aot folder goes, or a cache folder that is
    a file, used to be found after the module was written and compiled."""
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "fmha_mha_bf16.aot").write_text("not a folder")
    result = specgen("build", ROOT / "specs" / "fmha_mha_bf16.yaml", "--gen", gen, "--targets", "sm_90",
                     cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().endswith(
        "fmha_mha_bf16.aot: a file; the module's AOT folder is written there, remove it"), result.stderr
    assert sorted(p.name for p in gen.iterdir()) == ["fmha_mha_bf16.aot"]
    blocker = tmp_path / "cache-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(blocker / "sub"))
    result = specgen("build", ROOT / "specs" / "fmha_mha_bf16.yaml", "--gen", tmp_path / "gen2",
                     "--targets", "sm_90", cwd=tmp_path)
    assert result.returncode == 2 and "cache-file: not a folder; the cubin cache" in result.stderr, result.stderr
    assert not (tmp_path / "gen2").exists()


_SLOW_POOL = '''
import sys, time
sys.path.insert(0, {root!r})
from types import SimpleNamespace
import specgen.compile.jobs as jobs


def slow(plan, source, origin, target):
    time.sleep(3)
    raise SystemExit("a compile that is not interrupted")


jobs.compile_target = slow  # what the workers run, forked with this module
jobs._origin = lambda plan: "m.py"
job = SimpleNamespace(plan=SimpleNamespace(module_name="m"), rendered=SimpleNamespace(text=""))
try:
    jobs.compile_jobs([job], ["sm_90", "sm_100"], 2, print, write_aot=False)
except KeyboardInterrupt:
    sys.exit(130)
'''


def _stat(pid) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); [] once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _children(pid: int) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _stat(e)[1:2] == [str(pid)]]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for the compile workers")
def test_sigterm_ends_a_parallel_build_with_its_workers(tmp_path):
    """SIGTERM to a build with compile workers ends it as Ctrl-C does (the running
    compiles finish, exit 130); it used to kill the build alone and leave its
    workers running, orphaned (and holding its output pipe open)."""
    import signal
    import time

    script = tmp_path / "pool.py"
    script.write_text(_SLOW_POOL.format(root=str(ROOT)))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(_children(process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = _children(process.pid)
        assert len(workers) >= 2, "the pool did not start"
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)  # orphaned workers held the pipe open: a timeout
        assert process.returncode == 130
        time.sleep(0.5)
        alive = [w for w in workers if _stat(w)[:1] not in ([], ["Z"])]
        assert alive == []
    finally:
        for pid in [process.pid, *_children(process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

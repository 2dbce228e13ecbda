"""Guards of test, tune, bench and diff: an empty --fuzz-case is bad input, a
--results or --gen that cannot be written is refused before any GPU work, tune
--dry-run shows its space without a GPU, bench and tune refuse another spec's module,
and diff's JSON names a field one side lacks apart from a field set to null."""

import json
import os
import shutil

import pytest
import torch

from specgen.commands import cli

from .helpers import ROOT
from .test_cli import specgen


@pytest.fixture
def project(tmp_path):
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    return tmp_path


@pytest.mark.parametrize("extra", [[], ["--fuzz", "3"], ["--quick"]])
def test_an_empty_fuzz_case_is_bad_input(project, extra):
    result = specgen("test", "specs/fmha_gqa4_f16_d64.yaml", "--fuzz-case=", "--emulate", *extra,
                     cwd=project)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == ("specgen test: --fuzz-case: expected SEED:I as a fuzz failure "
                                     "prints it, got ''")
    assert not (project / "generated").exists()  # nothing written, no case run


@pytest.mark.parametrize("command", [
    ["tune", "specs/fmha_gqa_causal.yaml", "--target", "sm_90", "--results"],
    ["bench", "specs/fmha_gqa_causal.yaml", "--results"],
    ["test", "specs/fmha_gqa_causal.yaml", "--emulate", "--gen"],
])
@pytest.mark.parametrize("under", ["", "sub"])
def test_a_folder_option_through_a_broken_link_is_bad_input(project, command, under):
    (project / "dangling").symlink_to(project / "nowhere")
    folder = os.path.join("dangling", under) if under else "dangling"
    result = specgen(*command, folder, cwd=project)
    assert result.returncode == 2, result.stderr
    line, = result.stderr.splitlines()
    assert line == f"specgen {command[0]}: {command[-1]} {folder}: dangling is a broken symbolic link " \
                   f"(to {project / 'nowhere'})"
    assert not (project / "generated").exists()


def test_a_folder_option_that_cannot_be_written_is_bad_input(project, monkeypatch):
    (project / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(cli.os, "access",
                        lambda p, mode: False if os.path.basename(p) == "ro" else real(p, mode))
    result = specgen("bench", "specs/fmha_gqa_causal.yaml", "--results", "ro/new", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == "specgen bench: --results ro/new: ro is not writable"
    # diff only reads its folders: a read-only --results is fine there.
    result = specgen("diff", "specs/fmha_gqa_causal.yaml", "specs/fmha_gqa_causal.yaml",
                     "--no-compile", "--results", "ro", cwd=project)
    assert result.returncode == 0, result.stderr


def test_a_blank_folder_option_names_what_was_given(project):
    result = specgen("bench", "specs/fmha_gqa_causal.yaml", "--results", " ", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == "specgen bench: --results: expected a folder, got ' '"


def test_an_empty_tune_target_asks_for_one_target(project):
    result = specgen("tune", "specs/fmha_gqa_causal.yaml", "--target", "", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == "specgen tune: --target: expected one target such as sm_90, got ''"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_tune_dry_run_lists_its_space_without_a_gpu(project):
    spec = project / "specs" / "fmha_gqa_causal.yaml"
    before = spec.read_bytes()
    runs = [specgen("tune", spec, "--target", "sm_90", "--dry-run", "--seqs", "8192,2048",
                    cwd=project) for _ in range(2)]
    assert runs[0].stderr == runs[1].stderr  # the same space, in the same order
    lines = runs[0].stderr.splitlines()
    assert runs[0].returncode == 2 and lines[-1].startswith("specgen tune: needs a CUDA GPU")
    # The spec's space: tile_m 2 x tile_n 2 x occupancy 2 x num_worker_warps 2 x tile_order 2.
    assert lines[0] == "tuning fmha_gqa_causal for sm_90: 32 configs x 2 lengths (B=4, Hq=32, S=8192,2048)"
    configs = lines[1:-1]
    assert len(configs) == len(set(configs)) == 32
    assert configs[0] == "  64x64 occ1" and configs[-1] == "  128x128 occ2 ww8 global"
    assert spec.read_bytes() == before
    # Without --dry-run, no GPU is one line, as any bad input.
    result = specgen("tune", spec, "--target", "sm_90", cwd=project)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1


def test_tune_says_which_configs_q_subtiles_drops(project):
    spec = project / "specs" / "fmha_gqa_causal.yaml"
    text = spec.read_text().replace("autotune:", "q_subtiles: 2\nautotune:", 1)
    spec.write_text(text.replace("    tile_m: [64, 128]\n", "    tile_m: [16, 64]\n"))
    result = specgen("tune", spec, "--target", "sm_90", "--dry-run", cwd=project)
    assert "autotune.sm_90: 16 of 32 configs skipped, tile_m / q_subtiles 2 below 16 rows" in result.stderr
    assert "16 configs x 5 lengths" in result.stderr


def test_diff_json_tells_an_absent_field_from_a_null_one(project):
    result = specgen("diff", "specs/fmha_chunked_local.yaml", "specs/fmha_decode_gqa4_bf16.yaml",
                     "--no-compile", "--json", cwd=project)
    assert result.returncode == 1
    spec = {c["field"]: c for c in json.loads(result.stdout)["spec"]}
    # Each family lacks the other's fields (causal, block_remap; kv_dtype); the decode
    # spec's mask_mod is null.
    assert spec["causal"] == {"field": "causal", "a": True, "b": None, "absent": "b"}
    assert spec["block_remap"] == {"field": "block_remap", "a": None, "b": None, "absent": "b"}
    assert spec["kv_dtype"] == {"field": "kv_dtype", "a": None, "b": None, "absent": "a"}
    assert spec["mask_mod"] == {"field": "mask_mod", "a": "q_idx // 8192 == kv_idx // 8192", "b": None}


def test_tune_names_an_empty_spec_path(project):
    result = specgen("tune", "", "--target", "sm_90", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == "specgen tune: SPEC: expected a spec file, got ''"


def test_tune_refuses_a_spec_it_could_not_rewrite_before_the_gpu(project, monkeypatch):
    from specgen.commands import tune

    real = os.access
    monkeypatch.setattr(tune.os, "access",
                        lambda p, mode: False if os.path.basename(p) == "specs" else real(p, mode))
    result = specgen("tune", "specs/fmha_gqa_causal.yaml", "--target", "sm_90", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"specs/fmha_gqa_causal.yaml: tune rewrites the spec, and its folder {project / 'specs'} is not "
        "writable (use --dry-run, or tune a copy)")


def test_a_value_that_starts_with_a_dash_gets_a_hint(project):
    result = specgen("test", "specs/fmha_gqa_causal.yaml", "--fuzz-case", "-1:2", "--emulate", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == ("specgen test: error: argument --fuzz-case: expected one argument "
                                     "(a value that starts with '-' goes as --fuzz-case=-1:2)")
    # A forgotten value before another option gets no such hint.
    result = specgen("test", "specs/fmha_gqa_causal.yaml", "--fuzz-case", "--emulate", cwd=project)
    assert result.stderr.strip() == "specgen test: error: argument --fuzz-case: expected one argument"


def test_tune_refuses_to_replace_another_specs_module_before_the_gpu(project):
    """A copied spec that kept its name: tune would search, rewrite the copy, then
    render it over the module the original spec made."""
    assert specgen("build", "specs/fmha_mha_bf16.yaml", "--no-compile", cwd=project).returncode == 0
    module = project / "generated" / "fmha_mha_bf16.py"
    before = module.read_bytes()
    (project / "mine.yaml").write_text((project / "specs" / "fmha_mha_bf16.yaml").read_text())
    result = specgen("tune", "mine.yaml", "--target", "sm_90", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"mine.yaml: name: 'fmha_mha_bf16' would overwrite generated/fmha_mha_bf16.py, made from "
        "specs/fmha_mha_bf16.yaml; rename the spec's name, or replace it with `specgen build --force` "
        "first, or use --dry-run")
    assert module.read_bytes() == before
    # --dry-run writes no module: it may search.
    result = specgen("tune", "mine.yaml", "--target", "sm_90", "--dry-run", cwd=project)
    assert "would overwrite" not in result.stderr


def test_bench_refuses_to_replace_another_specs_module(project, monkeypatch):
    """As test and build refuse it; bench rendered the copy over it before it timed.
    The GPU checks pass here, so that the check before any write is what answers."""
    from specgen.check import gpu

    monkeypatch.setattr(gpu, "require_cuda", lambda command: torch)
    monkeypatch.setattr(gpu, "require_do_bench", lambda command: None)
    assert specgen("build", "specs/fmha_mha_bf16.yaml", "--no-compile", cwd=project).returncode == 0
    module = project / "generated" / "fmha_mha_bf16.py"
    before = module.read_bytes()
    (project / "mine.yaml").write_text((project / "specs" / "fmha_mha_bf16.yaml").read_text()
                                       .replace("dtype: bfloat16", "dtype: float16"))
    result = specgen("bench", "mine.yaml", cwd=project)
    assert result.returncode == 2, result.stderr
    assert "mine.yaml: name: 'fmha_mha_bf16' would overwrite generated/fmha_mha_bf16.py" in result.stderr
    assert module.read_bytes() == before


def test_diff_refuses_stat_with_json(project):
    result = specgen("diff", "specs/fmha_gqa_causal.yaml", "--set", "causal=false", "--no-compile",
                     "--stat", "--json", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == ("specgen diff: --stat and --json cannot be combined "
                                     "(--json carries the whole source diff)")
    assert not result.stdout


def test_build_check_reads_a_folder_it_may_not_write(project, monkeypatch):
    """--check writes nothing: a --gen it may not write (a read-only checkout, CI's
    mount) is compared, not refused. os.access is faked: root may write anywhere."""
    assert specgen("build", "specs/fmha_alibi.yaml", "--no-compile", cwd=project).returncode == 0
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode & os.W_OK else real(p, mode, **kw))
    result = specgen("build", "--check", "specs/fmha_alibi.yaml", "--no-compile", cwd=project)
    assert result.returncode == 0, result.stderr
    refused = specgen("build", "specs/fmha_alibi.yaml", "--no-compile", cwd=project)
    assert refused.returncode == 2 and "is not writable" in refused.stderr


def test_diff_reads_a_module_whose_spec_holds_the_other_familys_fields(project):
    """A module written before SPEC dicts left out the other family's fields (a
    prefill module's "pdl": "auto") still diffs against its spec."""
    module = (ROOT / "generated" / "fmha_alibi.py").read_text()
    spec_at = module.index('    "gqa_ratio": 1,\n')
    old = module[:spec_at] + '    "kv_dtype": None,\n' + module[spec_at:]
    old = old.replace('    "pack_gqa": False,\n', '    "pack_gqa": False,\n    "splits": "auto",\n'
                      '    "pdl": "auto",\n    "v_cache_transposed": False,\n', 1)
    from specgen.emit.render import HEADER_RE, content_hash

    end = HEADER_RE.match(old).end()  # its content hash as specgen wrote it then
    body = old[end:]
    head = old[:end].replace(HEADER_RE.match(old)["content_sha"], content_hash(body))
    (project / "old.py").write_text(head + body)
    result = specgen("diff", "old.py", "specs/fmha_alibi.yaml", "--no-compile", "--json", cwd=project)
    assert result.returncode in (0, 1), result.stderr
    assert json.loads(result.stdout)["spec"] == []


def test_test_serves_fresh_modules_from_a_folder_it_may_not_write(tmp_path, monkeypatch):
    """specgen test writes only stale modules: fresh ones are served from a --gen it
    may not write, and a stale one there is bad input naming the folder."""
    from specgen.check import gpu
    from specgen.errors import UsageError

    spec = str(ROOT / "specs" / "fmha_alibi.yaml")
    gen = tmp_path / "generated"
    assert [job.out_path.name for job in gpu.fresh_jobs([spec], gen, log=lambda line: None)] == [
        "fmha_alibi.py"]

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(gen / "fmha_alibi.py"))

    monkeypatch.setattr(gpu, "write_jobs", refuse)
    with pytest.raises(UsageError, match=r"--gen .*generated: a stale module must be written there"):
        gpu.fresh_jobs([spec], gen, log=lambda line: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize("script", ["ceiling.py", "bwd_ceiling.py", "bwd_tiles.py", "bwd_ab.py",
                                    "decode_ceiling.py", "accuracy.py", "op_overhead.py",
                                    "context_parallel/bench.py"])
def test_the_documented_bench_scripts_refuse_a_machine_without_a_gpu(script):
    """The scripts the docs point to ended in a traceback (triton's import, torch's CUDA
    assertion) without a GPU; now one line naming the script, exit 2."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(ROOT / "bench" / script)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stdout, run.stderr)
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"{ROOT / 'bench' / script}: needs ") and "CUDA GPU" in line and "sees none" in line


def _worker_signals(plan, source, origin, target):
    """A compile that reports how its worker handles SIGINT and SIGTERM."""
    import signal

    from specgen.errors import CompileError

    raise CompileError(f"{signal.getsignal(signal.SIGINT)} {signal.getsignal(signal.SIGTERM)}")


def test_compile_workers_leave_interrupts_to_the_build(monkeypatch):
    """Ctrl-C and `timeout -s INT` signal the whole process group: a worker that took
    the interrupt while it waited for work died holding the pool's queue, and the
    build hung at exit (2 of 10 builds under `timeout -s INT`). Workers ignore it; the
    build ends them."""
    import signal

    from specgen.compile import jobs as build

    monkeypatch.setattr(build, "compile_target", _worker_signals)
    loaded = build.load_jobs([ROOT / "specs" / "fmha_gqa4_f16_d64.yaml"], ROOT / "generated")
    _, failures = build.compile_jobs(loaded, ("sm_90", "sm_100"), 2, lambda line: None, write_aot=False)
    assert failures == [f"{signal.SIG_IGN} {signal.SIG_IGN}"] * 2

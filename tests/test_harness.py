"""The pure parts of `specgen test` and `specgen bench`: FLOP counting, the shape
matrix, the result schema, table rendering, and the no-GPU exit code."""


from pathlib import Path

import pytest

from specgen.check.gpu import device_slug
from specgen.check.runner import case_matrix, case_verdict, format_table

from .helpers import ROOT
from .test_cli import specgen


def test_case_matrix_covers_the_issue_shapes():
    cases = case_matrix()
    assert {(c.batch, c.kv_heads) for c in cases if c.layout == "contiguous"} == {
        (1, 1), (1, 2), (3, 1), (3, 2)
    }
    assert {c.seq_q for c in cases if c.seq_q == c.seq_k} >= {1, 17, 64, 1000, 4096}
    chunked = [c for c in cases if c.seq_q < c.seq_k]
    assert chunked and all(c.q_offset == c.seq_k - c.seq_q for c in chunked)
    assert any(c.layout == "transposed" for c in cases)
    quick = case_matrix(quick=True)
    assert len(quick) < len(cases) and any(c.q_offset for c in quick)


def test_test_table_shows_each_case_and_failures():
    rows = [
        {"shape": "B1 Hq4 Hkv1 Sq17 Skv17", "max_abs_err": 1e-3, "rel_err": 3e-4, "nonfinite": 0, "ok": True},
        {"shape": "B3 Hq8 Hkv2 Sq1000 Skv1000", "max_abs_err": float("inf"), "rel_err": float("inf"),
         "nonfinite": 12, "ok": False},
    ]
    text = format_table("demo", "float16", rows).splitlines()
    assert text[0] == "demo (float16, tolerance rel <= 1e-02)"
    assert text[2].split()[-1] == "ok" and "1.000e-03" in text[2]
    assert text[3].endswith("FAIL  (12 non-finite)")


def test_test_table_shows_the_p_rounding_model_beside_a_float8_kernel():
    rows = [
        {"shape": "B1 Hq8 Hkv1 Sq3 Skv2945", "max_abs_err": 5.6e-3, "rel_err": 3.2e-2,
         "p_model_err": 3.1e-2, "nonfinite": 0, "ok": True},
        {"shape": "B2 Hq8 Hkv1 Sq5 Skv9", "max_abs_err": 0.4, "rel_err": 0.3,
         "p_model_err": 2.0e-2, "nonfinite": 0, "ok": False},
    ]
    text = format_table("fp8", "float8_e4m3fn", rows).splitlines()
    assert text[0] == "fp8 (float8_e4m3fn, tolerance rel <= 5e-02)"
    assert text[1].split()[-2:] == ["err", "pass"] and "P-round err" in text[1]
    assert text[2].split()[-2:] == ["3.100e-02", "ok"]
    assert text[3].split()[-3:] == ["3.000e-01", "2.000e-02", "FAIL"]
    without = [{k: v for k, v in rows[0].items() if k != "p_model_err"}]
    assert "P-round" not in format_table("demo", "float16", without).splitlines()[1]


def test_each_case_verdict_is_one_line_with_its_numbers():
    assert case_verdict({"ok": True, "rel_err": 3.14e-3}) == "ok, rel err 3.1e-03"
    failed = {"ok": False, "rel_err": 2e-2, "nonfinite": 3, "grad_ratio": 1.094}
    assert case_verdict(failed) == "FAIL, rel err 2.0e-02, 3 non-finite, grads 1.09 of FA's allowance"


def test_device_slug():
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"


@pytest.mark.parametrize("command", ["test", "bench"])
def test_gpu_commands_exit_2_without_cuda(command):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    result = specgen(command, "specs", cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"specgen {command}: needs a CUDA GPU")


def test_fuzz_cases_are_valid_replayable_and_varied():
    from specgen.check.runner import FUZZ_MAX_SCORES, fuzz_case

    from .helpers import generated_module

    for name in ("fmha_gqa_causal", "fmha_mistral_window", "fmha_varlen_llama", "fmha_decode_paged_mtp"):
        spec = generated_module(name).SPEC
        cases = [fuzz_case(spec, f"7:{i}") for i in range(200)]
        assert cases == [fuzz_case(spec, f"7:{i}") for i in range(200)]  # a seed replays its case
        assert len(set(cases)) > 150
        for c in cases:
            assert c.kv_heads * spec["gqa_ratio"] <= 32
            if spec.get("family") == "decode":
                assert all(q_len <= n for q_len, n in ((c.seq_q, n) for n in c.decode_lens))
                assert 1 <= c.seq_q <= spec["max_q_len"] and 1 <= len(c.decode_lens) <= 8
            elif spec.get("varlen"):
                assert all(1 <= q and 1 <= k for q, k in c.lengths)
            else:
                assert c.batch * c.kv_heads * spec["gqa_ratio"] * c.seq_q * c.seq_k <= FUZZ_MAX_SCORES
                assert -c.seq_q <= c.q_offset <= c.seq_k + 64 and c.layout in ("contiguous", "transposed", "sliced")
        if not spec.get("family") == "decode" and not spec.get("varlen"):
            assert {c.layout for c in cases} == {"contiguous", "transposed", "sliced"}
            assert any(c.seq_q != c.seq_k for c in cases) and any(c.seq_q == 1 for c in cases)
            # queries before the first key (bottom-right with more queries than keys)
            assert any(c.q_offset < 0 for c in cases) and any(c.q_offset > c.seq_k for c in cases)


@pytest.mark.parametrize("args,message", [
    (["--fuzz", "-1"], "--fuzz: expected a count in [1, 100000], got -1"),
    (["--fuzz", "0"], "--fuzz: expected a count in [1, 100000], got 0"),
    (["--fuzz-case", "²:0"], "--fuzz-case: expected SEED:I"),
    (["--fuzz-case", "1:³"], "--fuzz-case: expected SEED:I"),
    (["--fuzz-case", "7"], "--fuzz-case: expected SEED:I as a fuzz failure prints it, got '7'"),
    (["--fuzz-case", "a:b"], "--fuzz-case: expected SEED:I"),
    (["--fuzz", "8", "-j", "0"], "--jobs: expected a worker count in [1, 64], got 0"),
])
def test_fuzz_arguments_are_checked(args, message):
    result = specgen("test", "specs/fmha_gqa_causal.yaml", *args, cwd=ROOT)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def _fake_worker(module_path, case, generator_seed):
    import time

    time.sleep(0.02 * (3 - case))  # later cases finish first
    return {"case": case, "seed": generator_seed, "module": module_path}


@pytest.mark.parametrize("jobs", [1, 3])
def test_cases_on_workers_keep_their_order_and_inputs(jobs):
    import concurrent.futures

    from specgen.check.runner import case_generator_seed, run_cases

    cases = [0, 1, 2, 3]
    seeds = [case_generator_seed(5, i, None) for i in cases]
    assert len(set(seeds)) == 4 and seeds == [case_generator_seed(5, i, None) for i in cases]
    # A fuzz case's generator depends on its SEED:I only, as --fuzz-case replays it.
    assert case_generator_seed(5, 0, "9:3") == case_generator_seed(0, 7, "9:3")
    reported = []
    rows = run_cases(cases, seeds, "m.py", jobs, lambda i, row: reported.append(i),
                     executor=concurrent.futures.ThreadPoolExecutor(3), worker=_fake_worker)
    assert [r["case"] for r in rows] == cases and [r["seed"] for r in rows] == seeds
    assert sorted(reported) == cases
    if jobs > 1:
        assert reported != cases  # reported as they finish, not in order


def test_non_finite_gradients_fail_and_say_so():
    """A NaN gradient fails the gradient check and the verdict names it: a max()
    over the errors must not drop the NaN and report a small ratio."""
    import torch

    from specgen.check.runner import _fa_rule, case_verdict

    got = [torch.tensor([0.01, 0.01]), torch.tensor([float("nan"), 0.0])]
    exact = [torch.zeros(2, dtype=torch.float64)] * 2
    rough = [torch.full((2,), 0.1, dtype=torch.float64)] * 2
    rule = _fa_rule(torch, got, exact, rough)
    assert not rule["grad_ok"] and not rule["grad_finite"]
    assert rule["grad_ratio"] != rule["grad_ratio"]  # NaN
    row = {"ok": False, "rel_err": 1e-3, **rule}
    assert case_verdict(row).endswith("(non-finite gradients)")


def test_a_non_finite_input_dtype_reference_gives_no_allowance_there():
    """sqrt(abs(log(score + 1.0))): in float16 score + 1 is 1 for a score below its half
    ulp, and the input-dtype reference's slope there is inf * 0 = NaN where the fp64
    one and the kernel are finite. The allowance comes from the other elements; the
    ratio was NaN (a failed check of a correct kernel)."""
    import torch

    from specgen.check.runner import _fa_rule

    got = [torch.tensor([0.01, 0.02])]
    exact = [torch.tensor([0.0, 0.0], dtype=torch.float64)]
    rough = [torch.tensor([0.1, float("nan")], dtype=torch.float64)]
    rule = _fa_rule(torch, got, exact, rough)
    assert rule["grad_ok"] and rule["grad_ratio"] == pytest.approx(0.02 / (0.2 + 1e-5), rel=1e-6)
    # a NaN in the fp64 reference still fails
    rule = _fa_rule(torch, got, [torch.tensor([0.0, float("nan")], dtype=torch.float64)], rough)
    assert not rule["grad_ok"]


def _raising_worker(module_path, case, generator_seed):
    if case == 1:  # as the emulator refuses a kernel's load (or a launcher a valid shape)
        raise ValueError("ct.load of tile (0, 8) lies wholly outside an array")
    return {"shape": str(case), "max_abs_err": 0.0, "rel_err": 0.0, "nonfinite": 0, "ok": True}


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_case_that_raises_fails_alone_and_says_what_it_raised(jobs):
    """The exception of one case is that case's failure: the other cases still run,
    and its row names the error and its line. It ended the run with a traceback,
    without the table or the case's replay line."""
    import concurrent.futures

    from specgen.check.runner import run_cases

    reported = []
    rows = run_cases([0, 1, 2], [0, 0, 0], "m.py", jobs, lambda i, row: reported.append(i),
                     executor=concurrent.futures.ThreadPoolExecutor(3), worker=_raising_worker)
    assert [r["ok"] for r in rows] == [True, False, True] and sorted(reported) == [0, 1, 2]
    error = rows[1]["error"]
    assert error.startswith("ValueError: ct.load of tile (0, 8) lies wholly outside an array "
                            "(at test_harness.py:")
    assert case_verdict(rows[1]).startswith("FAIL, rel err inf, raised ValueError: ct.load")


def test_a_fuzz_case_that_raises_gets_its_row_and_a_replay_with_the_runs_gen(tmp_path, monkeypatch,
                                                                             capsys):
    """run_test over a case that raises: exit 1, a FAIL row saying what was raised,
    and a replay line that names the run's --gen (without it the replay wrote the
    module into ./generated, or was refused where another spec's module lies)."""
    from specgen.check import runner

    def second_raises(module_path, case, generator_seed):
        spec = runner._emulated_module(module_path).SPEC
        second = runner.fuzz_case(spec, "3:1", runner.EMULATED_SCALE)
        return _raising_worker(module_path, 1 if case == second else 0, generator_seed)

    monkeypatch.setattr(runner, "_emulated_case", second_raises)
    gen = tmp_path / "gen"
    code = runner.run_test([str(ROOT / "specs" / "fmha_mha_bf16.yaml")], gen, quick=False,
                           seed=3, fuzz=3, emulate=True)
    out, err = capsys.readouterr()
    assert code == 1
    row = next(line for line in out.splitlines() if line.startswith("  [3:1]"))
    assert "FAIL  raised ValueError: ct.load of tile" in row
    assert "2/3 fuzz cases (3 drawn) passed" in out
    replay = next(line for line in out.splitlines() if "replay:" in line)
    assert replay.startswith("  replay: specgen test ") and "fmha_mha_bf16.yaml" in replay
    assert replay.endswith(f" --fuzz-case=3:1 --emulate --gen {gen}")
    assert f"replay: --fuzz-case=3:1 --emulate --gen {gen}" in err


def _marking_worker(module_path, case, generator_seed):
    """A slow case that leaves a mark in the folder ``module_path`` when it starts."""
    import time

    (Path(module_path) / str(case)).touch()
    time.sleep(0.5)
    return {"shape": str(case), "max_abs_err": 0.0, "rel_err": 0.0, "nonfinite": 0, "ok": True}


_INTERRUPTED_RUN = """
import sys
from specgen.check.runner import run_cases
from tests.test_harness import _marking_worker

try:
    run_cases(list(range(40)), [0] * 40, sys.argv[1], 2, lambda i, row: print(i, flush=True),
              worker=_marking_worker)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM"])
def test_an_interrupted_run_on_workers_stops_its_cases_and_exits(tmp_path, how):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM
    (to the parent alone, as `timeout` or a CI runner sends it) during `specgen test
    -j 2`: the parent exits 130 within seconds, and no case starts after it. Ctrl-C
    hung after 'interrupted' (a worker that took the interrupt died holding the
    queue's lock), or ran every queued case first; SIGTERM left the workers
    running the cases, orphaned."""
    import os
    import signal
    import subprocess
    import sys
    import time

    process = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_RUN, str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for _ in range(3):  # cases have finished: both workers are up and running cases
            assert process.stdout.readline().strip().isdigit()
        if how == "Ctrl-C":
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
        assert process.returncode == 130 and out.splitlines()[-1] == "interrupted", out
        started = len(list(tmp_path.iterdir()))
        time.sleep(1.5)
        assert len(list(tmp_path.iterdir())) == started < 40  # nothing runs on, orphaned
    finally:
        try:  # the run, and any worker left running (they share its process group)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_raising_case_is_placed_in_the_module_named_by_a_relative_path(tmp_path, monkeypatch):
    """run_test names the module as the run does (generated/x.py) while the frames
    name its file as imported (absolute): the error's line is still the module's,
    not that of the library it called last."""
    import importlib.util

    from specgen.check.runner import error_row

    (tmp_path / "mod.py").write_text("import json\n\n\ndef run():\n    return json.loads('no')\n")
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("_error_row_mod", Path("mod.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError) as raised:
        module.run()
    assert error_row(raised.value, "mod.py")["error"].endswith("(at mod.py:5)")


def test_an_interrupt_while_cases_are_submitted_cancels_the_queued_ones(monkeypatch):
    """Ctrl-C while run_cases still submits its cases: the pool is shut down with its
    queued cases cancelled, not left to the pool's exit, which ran every case already
    submitted to its end first."""
    import concurrent.futures

    from specgen.check.runner import run_cases

    class InterruptedPool(concurrent.futures.ThreadPoolExecutor):
        def __init__(self):
            super().__init__(1)
            self.submitted, self.shutdowns = 0, []

        def submit(self, *args, **kwargs):
            self.submitted += 1
            if self.submitted == 3:
                raise KeyboardInterrupt
            return super().submit(*args, **kwargs)

        def shutdown(self, wait=True, *, cancel_futures=False):
            self.shutdowns.append(cancel_futures)
            super().shutdown(wait=wait, cancel_futures=cancel_futures)

    import multiprocessing

    monkeypatch.setattr(multiprocessing, "active_children", lambda: [])  # no process of the test's to stop
    pool = InterruptedPool()
    with pytest.raises(KeyboardInterrupt):
        run_cases([0, 1, 2, 3], [0] * 4, "m.py", 2, lambda i, row: None, executor=pool,
                  worker=_fake_worker)
    assert pool.shutdowns and pool.shutdowns[0] is True

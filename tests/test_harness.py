"""The pure parts of `specgen test` and `specgen bench`: FLOP counting, the shape
matrix, the result schema, table rendering, and the no-GPU exit code."""

import json

import pytest

from specgen.bench.prefill import (
    BenchResult,
    error_line,
    Row,
    Timing,
    attention_flops,
    format_markdown,
    load_result,
    parse_baselines,
    result_paths,
    result_schema,
    speedups,
    tflops,
    write_result,
)
from specgen.bench.decode import (
    DecodeResult,
    DecodeRow,
    DecodeTiming,
    format_decode_markdown,
    graph_time_us,
    rotation_copies,
    steady_calls,
)
from specgen.errors import UsageError
from specgen.check.gpu import device_slug
from specgen.check.runner import case_matrix, format_table

from .helpers import ROOT
from .test_cli import specgen


def test_flops_count_two_matmuls_and_halve_for_causal():
    assert attention_flops(1, 1, 1, 1, 1, False) == 4
    assert attention_flops(4, 32, 8192, 8192, 128, False) == 4 * 4 * 32 * 8192 * 8192 * 128
    assert attention_flops(4, 32, 8192, 8192, 128, True) == 2 * 4 * 32 * 8192 * 8192 * 128
    assert tflops(10**12, 1000.0) == pytest.approx(1.0)
    assert tflops(attention_flops(4, 32, 4096, 4096, 128, True), 1.0) == pytest.approx(
        4 * 32 * 4096 * 4096 * 128 * 2 / 1e-3 / 1e12
    )


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


def _result(with_missing=True):
    timings = {
        "specgen": Timing(ms=2.0, tflops=400.0, pct_of_matmul=60.0),
        "cudnn": Timing(ms=1.8, tflops=444.4, pct_of_matmul=66.7, max_abs_diff_vs_specgen=1e-3),
        "flash": Timing(ms=3.0, tflops=266.7, pct_of_matmul=40.0, max_abs_diff_vs_specgen=1e-3),
        "flex": Timing(error="ImportError: no flex here") if with_missing else Timing(ms=2.5, tflops=320.0),
    }
    row = Row(batch=4, heads_q=32, heads_kv=8, seq_q=4096, seq_k=4096, head_dim=128,
              dtype="float16", causal=True, flops=10**12, timings=timings, speedup=speedups(timings))
    return BenchResult(spec="demo", kernel="fmha_prefill_causal_gqa4_f16_d128", suite="prefill",
                       created="2026-11-21", device={"name": "NVIDIA H200", "driver": "580"},
                       matmul_tflops=666.0, baselines=["cudnn", "flash", "flex"], rows=[row])


def test_speedup_is_baseline_time_over_ours_and_missing_is_none():
    result = _result()
    assert result.rows[0].speedup == {"cudnn": pytest.approx(0.9), "flash": pytest.approx(1.5), "flex": None}


def test_markdown_table_reports_every_kernel_and_missing_baselines():
    text = format_markdown(_result())
    header = next(line for line in text.splitlines() if line.startswith("| S |"))
    assert "SDPA cuDNN" in header and "SDPA FA2" in header and "FlexAttention" in header
    row = next(line for line in text.splitlines() if line.startswith("| 4096 |"))
    assert "400 (2.000)" in row and "0.90×" in row and "1.50×" in row
    assert "n/a (ImportError: no flex here)" in row and row.endswith("60% |")
    assert "666 TFLOPS" in text and "NVIDIA H200" in text


def test_result_json_round_trips_through_the_schema(tmp_path):
    stem = write_result(_result(), tmp_path, log=lambda line: None)
    paths = result_paths(stem)
    assert stem.parent.name == "h200" and paths["json"].name == "demo-prefill.json"
    data = json.loads(paths["json"].read_text())
    assert data["schema_version"] == 1 and data["rows"][0]["timings"]["flex"]["error"]
    assert load_result(paths["json"]) == _result()
    assert paths["md"].read_text() == format_markdown(_result())
    schema = result_schema()
    assert set(schema["required"]) >= {"spec", "kernel", "device", "rows", "matmul_tflops"}
    bad = dict(data, rows=[dict(data["rows"][0], extra=1)])
    with pytest.raises(Exception):
        BenchResult.model_validate(bad)


def test_device_slug():
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"


def test_baseline_names_are_checked():
    assert parse_baselines("cudnn,flex") == ("cudnn", "flex")
    with pytest.raises(UsageError, match="allowed: cudnn, flash, flex"):
        parse_baselines("cudnn,fa3")


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
                assert c.q_offset >= 0 and c.layout in ("contiguous", "transposed", "sliced")
        if not spec.get("family") == "decode" and not spec.get("varlen"):
            assert {c.layout for c in cases} == {"contiguous", "transposed", "sliced"}
            assert any(c.seq_q != c.seq_k for c in cases) and any(c.seq_q == 1 for c in cases)


@pytest.mark.parametrize("args,message", [
    (["--fuzz", "-1"], "--fuzz: expected a count in [0, 100000], got -1"),
    (["--fuzz-case", "7"], "--fuzz-case: expected SEED:I as a fuzz failure prints it, got '7'"),
    (["--fuzz-case", "a:b"], "--fuzz-case: expected SEED:I"),
])
def test_fuzz_arguments_are_checked(args, message):
    import subprocess
    import sys

    from .helpers import ROOT

    result = subprocess.run([sys.executable, "-m", "specgen", "test", "specs/fmha_gqa_causal.yaml", *args],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr, result.stderr


class _FakeCuda:
    """Enough of torch.cuda for rotation_copies: one device with a 60 MiB L2."""

    class _Props:
        L2_cache_size = 60 << 20

    @staticmethod
    def current_device():
        return 0

    @classmethod
    def get_device_properties(cls, index):
        assert index == 0
        return cls._Props()


class _FakeTorch:
    cuda = _FakeCuda


def test_steady_state_rotates_inputs_past_the_l2_cache():
    # B1 Hkv8 L8192 bf16 D128: 32 MiB of K and V, so 8 copies hold 4x a 60 MiB L2.
    assert rotation_copies(_FakeTorch, 32 << 20) == 8
    assert rotation_copies(_FakeTorch, (32 << 20) + 1) == 8
    assert rotation_copies(_FakeTorch, 240 << 20) == 2  # never fewer than two
    assert rotation_copies(_FakeTorch, 4 << 30) == 2
    assert [steady_calls(c) for c in (1, 2, 3, 8, 20)] == [16, 16, 18, 16, 20]
    with pytest.raises(ValueError, match="calls must be at least 1"):
        graph_time_us(_FakeTorch, lambda: None, do_bench=None, calls=0)


def _decode_result():
    timings = {
        "specgen": DecodeTiming(us=16.4, kv_tbps=2.05, pct_of_copy=48.0, us_one_call=22.5),
        "cudnn": DecodeTiming(us=15.9, kv_tbps=2.11, pct_of_copy=49.5, us_one_call=22.0,
                              max_abs_diff_vs_specgen=1e-3),
        "flex": DecodeTiming(error="not compared: window"),
    }
    row = DecodeRow(batch=1, heads_q=64, heads_kv=8, seq_len=8192, q_len=1, kv_bytes=33554432,
                    splits=16, input_copies=8, calls_per_graph=16, timings=timings)
    return DecodeResult(spec="demo_decode", kernel="fmha_decode_gqa8_bf16_d128", created="2026-11-22",
                        device={"name": "NVIDIA H200", "driver": "580"}, copy_tbps=4.26,
                        baselines=["cudnn", "flex"], layout="contiguous KV cache [B, L, Hkv, D]",
                        rows=[row])


def test_decode_markdown_shows_steady_state_and_one_call_tables():
    lines = format_decode_markdown(_decode_result()).splitlines()
    steady = next(line for line in lines if line.startswith("| 1 | 64/8 | 8192 | 16 |"))
    assert "16.4 (2.05)" in steady and "15.9 (2.11)" in steady and "n/a (not compared: window)" in steady
    assert "| 48% |" in steady and "0.97×" in steady
    one = [line for line in lines if line.startswith("| 1 | 64/8 | 8192 |") and line != steady]
    assert one == ["| 1 | 64/8 | 8192 | 22.5 | 22.0 | n/a |"]
    text = "\n".join(lines)
    assert "captured 16 times in one CUDA graph" in text and "4.26 TB/s" in text
    data = json.loads(_decode_result().model_dump_json())
    assert data["schema_version"] == 2 and data["rows"][0]["input_copies"] == 8
    assert DecodeResult.model_validate(data) == _decode_result()


def test_decode_markdown_marks_pdl_launches():
    result = _decode_result()
    assert result.rows[0].pdl is None  # results from before the field still load
    pdl = result.model_copy(update={"rows": [result.rows[0].model_copy(update={"pdl": True})]})
    assert any(line.startswith("| 1 | 64/8 | 8192 | 16, PDL | 16.4 (2.05)")
               for line in format_decode_markdown(pdl).splitlines())


def test_a_failed_baseline_is_reported_by_type_and_first_line():
    assert error_line(RuntimeError("no kernel image\n  traceback detail")) == "RuntimeError: no kernel image"
    assert error_line(ImportError()) == "ImportError: "
    assert len(error_line(ValueError("x" * 1000))) == 300

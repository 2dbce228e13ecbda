"""The parts of `specgen bench` that run without a GPU: the baseline registry and
its support matrix, the result schema (and the upgrade of older files), the
writers, FLOP and byte counting, and the driver's order (late baselines after
every specgen kernel), the last with a fake suite, torch and do_bench."""

import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import pytest

from specgen.bench import SUITES, parse_suite, suite_named
from specgen.bench import core
from specgen.bench.baselines import (
    DEFAULT,
    FEATURES,
    NAMES,
    REGISTRY,
    Baseline,
    features,
    label,
    parse_baselines,
)
from specgen.bench.core import (
    SCHEMA_VERSION,
    BenchResult,
    Row,
    Timing,
    error_line,
    format_markdown,
    graph_time_ms,
    load_result,
    result_paths,
    result_schema,
    result_stem,
    rotation_copies,
    speedups,
    steady_calls,
    tbps,
    tflops,
    timed,
    upgrade,
    write_result,
)
from specgen.bench.backward import BACKWARD_FLOP_FACTOR, backward_flops
from specgen.bench.decode import DECODE_SHAPES, kv_bytes
from specgen.bench.flops import attention_flops, forward_flops, visible_pairs
from specgen.bench.prefill import BATCH, HEADS, SEQS, checked_shapes, suite_heads, varlen_lengths
from specgen.errors import UsageError
from specgen.plan import make_plan
from specgen.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "h200"


def plan_of(name: str):
    path = ROOT / "specs" / f"{name}.yaml"
    if not path.exists():  # the backward suite's training copies
        path = ROOT / "bench" / "train" / f"{name}.yaml"
    return make_plan(load_spec(path))


# --- the registry ----------------------------------------------------------------


def test_registry_names_default_set_and_labels():
    assert NAMES == ("cudnn", "flash", "flex", "fa3", "tilegym")
    assert DEFAULT == ("cudnn", "flash", "flex")  # fa3 and tilegym are opt-in
    assert [label(n) for n in ("specgen",) + NAMES] == [
        "specgen (cuTile)", "SDPA cuDNN", "SDPA FA2", "FlexAttention", "FA3", "TileGym"]
    assert [n for n, b in REGISTRY.items() if b.late] == ["tilegym"]
    assert [n for n, b in REGISTRY.items() if b.expands_kv] == ["cudnn", "flash"]
    for baseline in REGISTRY.values():
        assert set(baseline.supports) <= set(SUITES)
        for supported in baseline.supports.values():
            assert supported <= set(FEATURES)


def test_baseline_names_are_checked():
    assert parse_baselines("cudnn,flex") == ("cudnn", "flex")
    assert parse_baselines(" fa3 , cudnn,fa3") == ("fa3", "cudnn")
    for empty in ("", ",", "fa3,", "cudnn,,flex"):  # an empty item is a typo, not "none"
        with pytest.raises(UsageError, match="--baselines: expected comma-separated names"):
            parse_baselines(empty)
    with pytest.raises(UsageError, match="unknown xformers; allowed: cudnn, flash, flex, fa3, tilegym"):
        parse_baselines("cudnn,xformers")


def test_suite_names_are_checked():
    assert parse_suite("decode") == "decode"
    with pytest.raises(UsageError, match=r"--suite: unknown 'nope'; allowed: prefill, decode, backward"):
        parse_suite("nope")
    with pytest.raises(UsageError, match=r"allowed: prefill$"):
        parse_suite("decode", allowed=("prefill",))
    assert [suite_named(n).name for n in SUITES] == list(SUITES)


def test_features_come_from_the_plan_in_one_order():
    assert features(plan_of("fmha_gqa8_bf16")) == ()
    assert features(plan_of("fmha_gptoss_sinks")) == ("window", "sinks")
    assert features(plan_of("fmha_document_mask")) == ("mask_mod",)
    assert features(plan_of("fmha_varlen_llama")) == ("varlen",)
    assert features(plan_of("fmha_vit_dropout")) == ("dropout",)


# (spec, suite) -> per baseline: None (runs) or a fragment of the reason.
MATRIX = {
    ("fmha_gqa8_bf16", "prefill"): dict(cudnn=None, flash=None, flex=None, fa3=None, tilegym=None),
    ("fmha_gqa_causal", "prefill"): dict(cudnn=None, flex=None, fa3="FA3 takes bfloat16, not float16",
                                         tilegym=None),
    ("fmha_mistral_window", "prefill"): dict(cudnn="SDPA cuDNN has no window",
                                             flash="SDPA FA2 has no window", flex=None,
                                             fa3="FA3 has no window", tilegym="TileGym has no window"),
    ("fmha_gemma_softcap", "prefill"): dict(cudnn="has no softcap", flex=None, fa3=None,
                                            tilegym="has no softcap"),
    ("fmha_gptoss_sinks", "prefill"): dict(cudnn="SDPA cuDNN has no window, sinks",
                                           flex="FlexAttention has no sinks"),
    ("fmha_alibi", "prefill"): dict(cudnn="has no score_mod", flex=None),
    ("fmha_document_mask", "prefill"): dict(flash="has no mask_mod", flex=None, tilegym=None),
    ("fmha_train_document", "backward"): dict(flex=None, tilegym="has no mask_mod"),
    ("fmha_prefix_lm", "prefill"): dict(flex=None, tilegym="runs packed-document masks only"),
    ("fmha_window_document", "prefill"): dict(flex=None, tilegym="TileGym has no window"),
    ("fmha_vit_dropout", "prefill"): dict(cudnn=None, flash=None, flex="FlexAttention has no dropout",
                                          fa3="has no dropout"),
    ("fmha_varlen_llama", "prefill"): dict(cudnn=None, flash=None, flex=None, fa3="has no varlen",
                                           tilegym="has no varlen"),
    ("fmha_fp8_llama", "prefill"): dict(cudnn=None, flex=None, fa3=None, tilegym=None),
    ("fmha_mla_d192", "prefill"): dict(cudnn=None, fa3=None,
                                       tilegym="TileGym takes v_head_dim = head_dim, got 192/128"),
    ("fmha_phi2_d80", "prefill"): dict(cudnn=None,
                                       tilegym="TileGym's fmha takes a power-of-two head_dim, got 80"),
    ("fmha_train_gqa_causal", "backward"): dict(cudnn=None, flash=None, flex=None, tilegym=None,
                                                fa3="FA3 (fa3-fwd) is a forward-only build"),
    ("fmha_train_vit_dropout", "backward"): dict(cudnn=None, flash=None,
                                                 flex="FlexAttention has no dropout"),
    ("fmha_train_varlen_llama", "backward"): dict(cudnn="SDPA cuDNN has no varlen", flex=None,
                                                  tilegym="has no varlen"),
    ("fmha_train_alibi", "backward"): dict(cudnn="has no score_mod", flex=None),
    ("fmha_decode_gqa8_bf16", "decode"): dict(cudnn=None, flash=None, flex=None, fa3=None, tilegym=None),
    ("fmha_decode_gqa8_fp8kv", "decode"): dict(cudnn=None, fa3=None, tilegym=None),
    ("fmha_decode_mha_paged_f16", "decode"): dict(cudnn=None, fa3="FA3 takes bfloat16, not float16",
                                                  tilegym=None),
}


@pytest.mark.parametrize("spec,suite", sorted(MATRIX))
def test_support_matrix_and_reasons(spec, suite):
    plan = plan_of(spec)
    for name, expected in MATRIX[(spec, suite)].items():
        reason = REGISTRY[name].limits(suite, plan)
        if expected is None:
            assert reason is None, f"{name}: {reason}"
        else:
            assert reason and expected in reason, f"{name}: {reason!r}"
            assert "\n" not in reason and len(reason) < 200  # one line, as the row shows it


def test_every_shipped_spec_gets_a_verdict_from_every_baseline():
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        plan = make_plan(load_spec(path))
        suites = ("decode",) if plan.spec.family == "decode" else ("prefill", "backward")
        for suite in suites:
            for baseline in REGISTRY.values():
                reason = baseline.limits(suite, plan)
                assert reason is None or (isinstance(reason, str) and "\n" not in reason)


def test_float8_inputs_go_to_baselines_as_16_bit_copies_except_fa3():
    plan = plan_of("fmha_fp8_llama")
    assert REGISTRY["cudnn"].input_dtype(plan) == "bfloat16"
    assert REGISTRY["fa3"].input_dtype(plan) == "float8_e4m3fn"


def test_reason_is_availability_first_and_never_imports_tilegym():
    plan = plan_of("fmha_mistral_window")
    missing = dataclasses.replace(REGISTRY["fa3"], probe=lambda: "fa3 not available (x)")
    assert missing.reason("prefill", plan) == "fa3 not available (x)"
    present = dataclasses.replace(REGISTRY["fa3"], probe=lambda: None)
    assert present.reason("prefill", plan) == "FA3 has no window"
    REGISTRY["tilegym"].reason("prefill", plan_of("fmha_gqa8_bf16"))
    assert "tilegym" not in sys.modules  # found with find_spec: importing it patches ct.launch


def test_make_returns_the_reason_or_the_builds_error_line_without_a_gpu():
    def explode(torch, suite, plan):
        raise RuntimeError("no kernel image\n  detail")

    fake = Baseline("fake", "Fake", {"prefill": frozenset()}, explode)
    assert fake.make(None, "prefill", plan_of("fmha_mistral_window")) == "Fake has no window"
    assert fake.make(None, "decode", plan_of("fmha_gqa8_bf16")) == "Fake has no decode path"
    assert fake.make(None, "prefill", plan_of("fmha_gqa8_bf16")) == "RuntimeError: no kernel image"
    built = dataclasses.replace(fake, build=lambda torch, suite, plan: (suite, plan.module_name))
    assert built.make(None, "prefill", plan_of("fmha_gqa8_bf16")) == ("prefill", "fmha_gqa8_bf16")


# --- counting ------------------------------------------------------------------------


def test_flops_count_two_matmuls_and_halve_for_causal():
    assert attention_flops(1, 1, 1, 1, 1, False) == 4
    assert attention_flops(4, 32, 8192, 8192, 128, False) == 4 * 4 * 32 * 8192 * 8192 * 128
    assert attention_flops(4, 32, 8192, 8192, 128, True) == 2 * 4 * 32 * 8192 * 8192 * 128
    assert attention_flops(1, 1, 2, 2, 192, False, 128) == 2 * 4 * 320
    assert tflops(10**12, 1000.0) == pytest.approx(1.0)
    assert tbps(10**12, 1000.0) == pytest.approx(1.0)


def test_visible_pairs_follow_the_causal_and_window_rule():
    assert visible_pairs(4, 4, False) == 16
    assert visible_pairs(4, 4, True) == 10
    assert visible_pairs(4, 4, True, (1, None)) == 7  # each row sees itself and one before
    assert visible_pairs(4, 4, False, (0, 1)) == 7
    assert visible_pairs(2, 6, True, None, q_offset=4) == 11


def test_forward_flops_read_the_plan():
    plain = plan_of("fmha_gqa8_bf16")
    assert forward_flops(plain, 4, 32, 4096, 4096) == attention_flops(4, 32, 4096, 4096, 128, True)
    mla = plan_of("fmha_mla_d192")
    assert forward_flops(mla, 1, 1, 64, 64) == attention_flops(1, 1, 64, 64, 192, mla.causal, 128)
    window = plan_of("fmha_mistral_window")  # causal, left 4095
    assert forward_flops(window, 1, 1, 8192, 8192) == 2 * visible_pairs(8192, 8192, True, (4095, None)) * 256
    assert forward_flops(window, 1, 1, 4096, 4096) == 2 * (4096 * 4097 // 2) * 256  # the window spans all
    train = plan_of("fmha_train_gqa_causal")
    assert backward_flops(train, 4, 32, 4096, 4096) == BACKWARD_FLOP_FACTOR * forward_flops(train, 4, 32, 4096, 4096)


def test_decode_counts_kv_bytes():
    assert kv_bytes(1, 8, 8192, 128, 16) == 2 * 8192 * 8 * 128 * 2 == 33554432
    assert kv_bytes(1, 8, 8192, 128, 8) == 16777216  # a float8 cache: half
    assert DECODE_SHAPES == ((1, 8, 8192), (1, 8, 32768), (8, 8, 8192), (64, 8, 4096))


def test_prefill_shapes():
    assert (BATCH, HEADS, SEQS) == (4, 32, (1024, 2048, 4096, 8192, 16384))
    assert suite_heads(32, 8) == 32 and suite_heads(32, 7) == 28 and suite_heads(32, 64) == 64
    assert varlen_lengths(5, 1024) == [512, 1024, 1536, 1024, 512]
    prefill = suite_named("prefill")
    assert prefill.shapes(plan_of("fmha_gqa8_bf16")) == [(4, 32, s) for s in SEQS]
    assert prefill.shapes(plan_of("fmha_gqa8_bf16"), [(1, 8, 256)]) == [(1, 8, 256)]
    with pytest.raises(UsageError, match="6 query heads are not a multiple of fmha_gqa8_bf16's gqa_ratio 8"):
        checked_shapes(plan_of("fmha_gqa8_bf16"), [(1, 6, 256)])
    assert suite_named("backward").shapes(plan_of("fmha_train_gqa_causal")) == [(4, 32, s) for s in SEQS]
    # bench --seqs: lengths only; batch and heads stay the suite's, per spec.
    seqs_only = [(None, None, 2048), (None, None, 8192)]
    assert prefill.shapes(plan_of("fmha_gqa8_bf16"), seqs_only) == [(4, 32, 2048), (4, 32, 8192)]
    assert suite_named("backward").shapes(plan_of("fmha_train_gqa_causal"), seqs_only) == [
        (4, 32, 2048), (4, 32, 8192)]


def test_suites_skip_and_check_what_they_cannot_time():
    decode, prefill, backward = (suite_named(n) for n in ("decode", "prefill", "backward"))
    assert decode.skip(plan_of("fmha_gqa8_bf16")) == "not a decode spec (use --suite prefill)"
    assert prefill.skip(plan_of("fmha_decode_gqa8_bf16")) == "a decode spec (use --suite decode)"
    assert decode.skip(plan_of("fmha_decode_gqa8_bf16")) is None
    with pytest.raises(UsageError, match="--suite backward: fmha_gqa_causal has backward: false"):
        backward.check([plan_of("fmha_gqa_causal")])
    backward.check([plan_of("fmha_train_gqa_causal")])


def test_layouts_say_how_the_inputs_were_laid_out():
    prefill, decode = suite_named("prefill"), suite_named("decode")
    assert prefill.layout(plan_of("fmha_gqa8_bf16")) == "Sq=Skv"
    assert prefill.layout(plan_of("fmha_varlen_llama")).startswith("packed varlen batch")
    assert "bfloat16 copies of the float8 inputs" in prefill.layout(plan_of("fmha_fp8_llama"))
    assert decode.layout(plan_of("fmha_decode_gqa8_bf16")) == "contiguous KV cache [B, L, Hkv, D]"
    assert decode.layout(plan_of("fmha_decode_gqa8_fp8kv")) == (
        "contiguous KV cache [B, L, Hkv, D], V stored keys last, float8_e4m3fn (baselines: the cache "
        "dequantised to bfloat16)")
    assert decode.layout(plan_of("fmha_decode_mha_paged_f16")).startswith("paged KV cache, page_size ")


# --- timing helpers ---------------------------------------------------------------


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

    @staticmethod
    def empty_cache():
        pass


class _FakeTorch:
    cuda = _FakeCuda


def test_steady_state_rotates_inputs_past_the_l2_cache():
    # B1 Hkv8 L8192 bf16 D128: 32 MiB of K and V, so 8 copies hold 4x a 60 MiB L2.
    assert rotation_copies(_FakeTorch, 32 << 20) == 8
    assert rotation_copies(_FakeTorch, (32 << 20) + 1) == 8
    assert rotation_copies(_FakeTorch, 240 << 20) == 2  # never fewer than two
    assert [steady_calls(c) for c in (1, 2, 3, 8, 20)] == [16, 16, 18, 16, 20]
    with pytest.raises(ValueError, match="calls must be at least 1"):
        graph_time_ms(_FakeTorch, lambda: None, do_bench=None, calls=0)


class _RecordingTorch:
    """torch.cuda's stream and graph calls as graph_time_ms makes them, recorded in
    order, with each call tagged by the stream current at the time."""

    def __init__(self):
        self.log = []
        self.current = "default"
        torch = self

        class Stream:
            def __init__(self):
                self.name = "side"

            def wait_stream(self, other):
                torch.log.append(("wait", self.name))

        class _Default:
            name = "default"

            def wait_stream(self, other):
                torch.log.append(("wait", "default"))

        class _StreamContext:
            def __init__(self, stream):
                self.stream, self.saved = stream, None

            def __enter__(self):
                self.saved, torch.current = torch.current, self.stream.name

            def __exit__(self, *exc):
                torch.current = self.saved

        class CUDAGraph:
            def replay(self):
                torch.log.append(("replay", torch.current))

        class _Graph:
            def __init__(self, graph, stream=None):
                self.stream = stream

            def __enter__(self):
                torch.log.append(("capture", self.stream.name if self.stream else "private"))
                self.saved, torch.current = torch.current, self.stream.name if self.stream else "private"

            def __exit__(self, *exc):
                torch.current = self.saved

        class cuda:  # noqa: N801 - torch's name
            pass

        cuda.Stream, cuda.CUDAGraph = Stream, CUDAGraph
        cuda.current_stream = staticmethod(lambda: _Default())
        cuda.stream = staticmethod(_StreamContext)
        cuda.graph = staticmethod(_Graph)
        cuda.synchronize = staticmethod(lambda: None)
        self.cuda = cuda


def test_a_graph_is_captured_on_the_stream_that_ran_the_prepare_step_and_the_warm_up():
    torch = _RecordingTorch()

    def do_bench(fn, warmup, rep, return_mode):
        fn()
        return 2.0

    ms = graph_time_ms(torch, lambda: torch.log.append(("call", torch.current)), do_bench,
                       prepare=lambda: torch.log.append(("prepare", torch.current)))
    assert ms == 2.0
    # The forward of a graphed backward runs first, on the side stream; the capture
    # happens on that same stream, so autograd's backward ops land in the graph.
    assert torch.log == [("wait", "side"), ("prepare", "side"), ("call", "side"), ("call", "side"),
                         ("wait", "default"), ("capture", "side"), ("call", "side"),
                         ("replay", "default")]


def test_a_backward_that_cannot_be_captured_keeps_only_its_eager_time():
    from specgen.bench.backward import grad_graph_ms

    torch = _RecordingTorch()

    def forward():
        raise RuntimeError("operation not permitted when stream is capturing")

    assert grad_graph_ms(torch, None, forward, (), None) is None


def test_a_baselines_backward_reads_its_own_leaves_where_it_reads_k_and_v():
    """Fresh q/k/v leaves per baseline; a baseline that expands K/V gets the
    repeated leaves given (made once per case) as its k/v leaves instead."""
    import types

    import torch

    from specgen.bench.backward import baseline_backward

    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    k_full, v_full = (t.repeat_interleave(2, 1).requires_grad_() for t in (k, v))
    seen = []
    for expands in (False, True):
        forward, leaves = baseline_backward(types.SimpleNamespace(expands_kv=expands), seen.append,
                                            q, k, v, k_full, v_full, {"slopes": 1})
        assert all(t.requires_grad and t.is_leaf for t in leaves) and torch.equal(leaves[0], q)
        assert leaves[0] is not q and (leaves[1] is k_full and leaves[2] is v_full) == expands
        fresh = tuple(t.detach().clone() for t in leaves)
        forward(*fresh)
        x = seen[-1]
        assert x.q is fresh[0] and x.extra == {"slopes": 1}
        if expands:  # the given leaves in k_full/v_full; k/v the baseline's own copies
            assert x.k_full is fresh[1] and x.v_full is fresh[2] and torch.equal(x.k, k)
        else:
            assert x.k is fresh[1] and x.v is fresh[2] and x.k_full is k_full
        forward(*leaves)
        assert seen[-1].cache is x.cache  # one cache per baseline and case


def test_a_failed_kernel_is_reported_by_type_and_first_line():
    assert error_line(RuntimeError("no kernel image\n  traceback detail")) == "RuntimeError: no kernel image"
    assert error_line(ImportError()) == "ImportError: "
    assert len(error_line(ValueError("x" * 1000))) == 300


# --- the schema and the writers ---------------------------------------------------


def _prefill_result(with_missing=True) -> BenchResult:
    timings = {
        "specgen": Timing(ms=2.0, tflops=400.0, pct_of_matmul=60.0),
        "cudnn": Timing(ms=1.8, tflops=444.4, pct_of_matmul=66.7, max_abs_diff_vs_specgen=1e-3),
        "flash": Timing(ms=3.0, tflops=266.7, pct_of_matmul=40.0, max_abs_diff_vs_specgen=1e-3),
        "flex": Timing(error="ImportError: no flex here | twice") if with_missing
        else Timing(ms=2.5, tflops=320.0),
    }
    row = Row(batch=4, heads_q=32, heads_kv=8, seq_q=4096, seq_k=4096, head_dim=128,
              dtype="float16", causal=True, flops=10**12, timings=timings, speedup=speedups(timings))
    return BenchResult(spec="demo", kernel="fmha_prefill_causal_gqa4_f16_d128", suite="prefill",
                       created="2026-11-21", device={"name": "NVIDIA H200", "driver": "580"},
                       matmul_tflops=666.0, baselines=["cudnn", "flash", "flex"], rows=[row])


def _decode_result() -> BenchResult:
    timings = {
        "specgen": Timing(ms=0.0164, tbps=2.05, pct_of_copy=48.0, ms_one_call=0.0225),
        "cudnn": Timing(ms=0.0159, tbps=2.11, pct_of_copy=49.5, ms_one_call=0.0220,
                        max_abs_diff_vs_specgen=1e-3),
        "flex": Timing(error="FlexAttention has no window"),
    }
    row = Row(batch=1, heads_q=64, heads_kv=8, seq_q=1, seq_k=8192, head_dim=128, dtype="bfloat16",
              causal=False, bytes=33554432, splits=16, input_copies=8, calls_per_graph=16,
              timings=timings, speedup=speedups(timings))
    return BenchResult(spec="demo_decode", kernel="fmha_decode_gqa8_bf16_d128", suite="decode",
                       created="2026-11-22", device={"name": "NVIDIA H200", "driver": "580"},
                       copy_tbps=4.26, baselines=["cudnn", "flex"],
                       layout="contiguous KV cache [B, L, Hkv, D]", rows=[row])


def test_speedup_is_baseline_time_over_ours_and_missing_is_none():
    assert _prefill_result().rows[0].speedup == {
        "cudnn": pytest.approx(0.9), "flash": pytest.approx(1.5), "flex": None}
    assert _decode_result().rows[0].speedup == {"cudnn": pytest.approx(0.0159 / 0.0164), "flex": None}
    t = timed(2.0, 10**12, 500.0, max_abs_diff_vs_specgen=0.5)
    assert (t.tflops, t.pct_of_matmul, t.max_abs_diff_vs_specgen) == (pytest.approx(500.0), pytest.approx(100.0), 0.5)


def test_prefill_markdown_reports_every_kernel_and_missing_baselines():
    text = format_markdown(_prefill_result())
    header = next(line for line in text.splitlines() if line.startswith("| S |"))
    assert "SDPA cuDNN TFLOPS (ms)" in header and "SDPA FA2" in header and "FlexAttention" in header
    assert header.endswith("| vs FlexAttention | specgen % of matmul |")
    row = next(line for line in text.splitlines() if line.startswith("| 4096 |"))
    assert "400 (2.000)" in row and "0.90×" in row and "1.50×" in row
    assert "n/a (ImportError: no flex here / twice)" in row and row.endswith("60% |")
    assert row.count("|") == header.count("|")
    assert "666 TFLOPS" in text and "NVIDIA H200" in text and "Suite `prefill`: B=4, Hq=32, Hkv=8" in text
    assert "CUDA graph of one call" not in text  # no row carries graph times


def test_prefill_markdown_adds_the_one_call_graph_table_where_rows_carry_it():
    result = _prefill_result()
    t = result.rows[0].timings
    t["specgen"].ms_one_call, t["cudnn"].ms_one_call = 1.0, 1.25  # 10**12 flops: 1000 and 800 TFLOPS
    lines = format_markdown(result).splitlines()
    start = lines.index("CUDA graph of one call per replay (no host launch path), TFLOPS and ratios:")
    assert lines[start + 2] == ("| S | specgen (cuTile) | SDPA cuDNN | SDPA FA2 | FlexAttention "
                                "| vs SDPA cuDNN | vs SDPA FA2 | vs FlexAttention |")
    assert lines[start + 4] == "| 4096 | 1000 | 800 | n/a | n/a | 1.25× | n/a | n/a |"


def test_decode_markdown_shows_steady_state_and_one_call_tables():
    lines = format_markdown(_decode_result()).splitlines()
    header = next(line for line in lines if line.startswith("| B | Hq/Hkv | L | splits |"))
    steady = next(line for line in lines if line.startswith("| 1 | 64/8 | 8192 | 16 |"))
    assert "16.4 (2.05)" in steady and "15.9 (2.11)" in steady
    assert "n/a (FlexAttention has no window)" in steady
    assert "0.97×" in steady and steady.endswith("| 48% |") and steady.count("|") == header.count("|")
    one = [line for line in lines if line.startswith("| 1 | 64/8 | 8192 |") and line != steady]
    assert one == ["| 1 | 64/8 | 8192 | 22.5 | 22.0 | n/a |"]
    text = "\n".join(lines)
    assert "captured 16 times in one CUDA graph" in text and "4.26 TB/s" in text
    pdl = _decode_result()
    pdl.rows[0].pdl = True
    assert any(line.startswith("| 1 | 64/8 | 8192 | 16, PDL | 16.4 (2.05)")
               for line in format_markdown(pdl).splitlines())


def test_markdown_reports_a_block_maps_build_apart_where_there_is_one():
    assert "Block map" not in format_markdown(_decode_result())
    sparse = _decode_result()
    sparse.rows[0].timings["specgen"].block_map_ms = 0.0059
    sparse.rows[0].timings["specgen"].tiles_visited = 0.25
    lines = format_markdown(sparse).splitlines()
    header = next(line for line in lines if line.endswith("| map build µs | of one call | tiles visited |"))
    assert header.startswith("| B | Hq/Hkv | L | splits |")
    assert "| 1 | 64/8 | 8192 | 16 | 5.9 | 36.0% | 25.0% |" in lines


@pytest.mark.parametrize("make", [_prefill_result, _decode_result])
def test_results_round_trip_through_json_with_a_schema_version(make, tmp_path):
    result = make()
    stem = write_result(result, tmp_path, log=lambda line: None)
    paths = result_paths(stem)
    assert stem.parent.name == "h200" and paths["json"].name == f"{result.spec}-{result.suite}.json"
    data = json.loads(paths["json"].read_text())
    assert data["schema"] == SCHEMA_VERSION == 3 and "schema_version" not in data
    assert load_result(paths["json"]) == result
    assert paths["md"].read_text() == format_markdown(result)
    assert sorted(p.name for p in stem.parent.iterdir() if p.name.startswith(".")) == []  # atomic
    assert BenchResult.model_validate_json(paths["json"].read_text()) == result
    bad = dict(data, rows=[dict(data["rows"][0], extra=1)])
    with pytest.raises(Exception):
        BenchResult.model_validate(bad)
    with pytest.raises(ValueError, match="schema: expected a version from 1 to 3, got 4"):
        upgrade(dict(data, schema=4))


@pytest.mark.parametrize("edit,where", [
    (lambda row: row["timings"]["specgen"].update(ms=float("nan")), "rows.0.timings.specgen.ms"),
    (lambda row: row["timings"]["specgen"].update(ms=float("inf")), "rows.0.timings.specgen.ms"),
    (lambda row: row["timings"]["specgen"].update(ms=0.0), "rows.0.timings.specgen.ms"),
    (lambda row: row["timings"]["specgen"].update(ms="0.09"), "rows.0.timings.specgen.ms"),
    (lambda row: row["timings"]["specgen"].update(tflops=-1.0), "rows.0.timings.specgen.tflops"),
    (lambda row: row.update(batch="4"), "rows.0.batch"),
    (lambda row: row.update(heads_q=0), "rows.0.heads_q"),
    (lambda row: row.update(flops=10**400), "rows.0.flops"),
    (lambda row: row.update(causal="yes"), "rows.0.causal"),
])
def test_a_result_the_pages_could_not_print_as_measured_is_refused(edit, where, tmp_path):
    """What `specgen docs` prints comes from a validated result: JSON numbers, finite,
    times above 0, rates not negative, counts that fit 64 bits."""
    data = json.loads(_prefill_result().model_dump_json(by_alias=True))
    edit(data["rows"][0])
    path = tmp_path / "x-prefill.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"not a bench result of this schema: {re.escape(where)}"):
        load_result(path)


def test_result_files_that_are_not_regular_files_or_json_numbers_are_refused(tmp_path):
    import os

    fifo = tmp_path / "f-prefill.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="f-prefill.json: not a regular file, not a bench result"):
        load_result(fifo)
    huge = tmp_path / "h-prefill.json"
    huge.write_text('{"schema": 1' + "0" * 5000 + "}")
    with pytest.raises(ValueError, match="h-prefill.json: not a bench result \\(Exceeds the limit"):
        load_result(huge)
    data = json.loads(_prefill_result().model_dump_json(by_alias=True))
    data["device"]["name"] = 5
    named = tmp_path / "n-prefill.json"
    named.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="device.name must be the GPU's name"):
        load_result(named)


def test_result_schema_is_exported_with_its_version_key():
    schema = result_schema()
    assert schema["properties"]["schema"]["default"] == SCHEMA_VERSION
    assert set(schema["required"]) >= {"spec", "kernel", "suite", "device", "rows", "baselines"}
    assert "speedup" in schema["$defs"]["Row"]["required"]


def test_a_decode_schema_2_file_upgrades_to_milliseconds_and_gains_speedups():
    old = {"schema_version": 2, "spec": "d", "kernel": "k", "suite": "decode", "created": "2026-11-22",
           "device": {"name": "NVIDIA H200"}, "copy_tbps": 4.2, "baselines": ["cudnn"], "layout": "x",
           "rows": [{"batch": 1, "heads_q": 64, "heads_kv": 8, "seq_len": 8192, "q_len": 1,
                     "kv_bytes": 100, "splits": 16, "pdl": True, "input_copies": 8, "calls_per_graph": 16,
                     "timings": {"specgen": {"us": 10.0, "us_one_call": 20.0, "kv_tbps": 2.0,
                                             "pct_of_copy": 50.0},
                                 "cudnn": {"us": 15.0, "kv_tbps": 1.0, "note": "n"}}}]}
    result = BenchResult.model_validate(upgrade(old))
    row = result.rows[0]
    assert (row.seq_q, row.seq_k, row.bytes, row.splits, row.pdl) == (1, 8192, 100, 16, True)
    assert row.timings["specgen"].ms == pytest.approx(0.010)
    assert row.timings["specgen"].ms_one_call == pytest.approx(0.020)
    assert row.timings["cudnn"].tbps == 1.0 and row.timings["cudnn"].note == "n"
    assert row.speedup == {"cudnn": pytest.approx(1.5)}
    one_call = BenchResult.model_validate(upgrade(dict(old, schema_version=1)))
    assert one_call.rows[0].timings["specgen"].ms is None
    assert one_call.rows[0].timings["specgen"].ms_one_call == pytest.approx(0.010)


def test_every_committed_result_loads_in_the_current_schema():
    files = [p for p in sorted([*RESULTS.glob("*.json"), *RESULTS.glob("*.json.gz")])
             if result_stem(p).name.rsplit("-", 1)[-1] in SUITES]
    if not files:
        pytest.skip(f"no committed results under {RESULTS}")
    suites = set()
    for path in files:
        result = load_result(path)
        suites.add(result.suite)
        assert result.schema_version == SCHEMA_VERSION and result.rows, path.name
        for row in result.rows:
            assert set(row.speedup) == set(result.baselines) and "specgen" in row.timings
        format_markdown(result)  # every suite's table renders
    assert suites == set(SUITES)
    # A decode result written before the schema change (upgraded on load).
    decode = load_result(RESULTS / "fmha_decode_gqa4_bf16-decode.json")
    raw = json.loads((RESULTS / "fmha_decode_gqa4_bf16-decode.json").read_text())["rows"][0]
    assert decode.rows[0].timings["specgen"].ms == pytest.approx(raw["timings"]["specgen"]["us"] / 1000)
    assert decode.rows[0].seq_k == raw["seq_len"]


# --- the driver, with a fake suite, torch and do_bench -------------------------------


class _Suite(core.Suite):
    """Counts calls instead of launching: each case's kernel takes 1 ms, each
    baseline 2 ms, and a late baseline's build is recorded where it happens."""

    name = "prefill"
    report = suite_named("prefill").report

    def __init__(self, events):
        self.events = events

    def yardstick(self, torch, do_bench, log):
        return {"matmul_tflops": 100.0}

    def shapes(self, plan, override=None):
        return list(override or [(1, 8, 128), (1, 8, 256)])

    def case(self, ctx, module, plan, shape):
        batch, heads, seq = shape
        row = dict(batch=batch, heads_q=heads, heads_kv=heads // plan.group_size, seq_q=seq,
                   seq_k=seq, head_dim=plan.head_dim, dtype=plan.dtype, causal=plan.causal, flops=10**9)
        return core.Case(f"S={seq}", row, inputs=seq)

    def time_kernel(self, ctx, module, case):
        self.events.append(("specgen", module.SPEC["name"], case.inputs))
        case.ours = ("ours", case.inputs)
        return core.timed(1.0, case.row["flops"], 100.0)

    def time_baseline(self, ctx, case, baseline, fn):
        self.events.append((baseline.name, case.inputs, fn(case)))
        assert case.ours == ("ours", case.inputs)  # the late pass gets specgen's output back
        return core.timed(2.0, case.row["flops"], 100.0)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    import specgen.check.gpu as gpu
    import torch._dynamo  # noqa: F401 - imported before the stand-in triton, which it would probe

    triton = types.ModuleType("triton")
    testing = types.ModuleType("triton.testing")
    testing.do_bench = lambda fn, **kw: 1.0
    triton.testing = testing
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.testing", testing)
    monkeypatch.setattr(gpu, "require_cuda", lambda command: _FakeTorch)
    monkeypatch.setattr(core, "describe_device", lambda log: {"name": "NVIDIA H200", "driver": "580"})
    monkeypatch.setattr(core, "_PATCHED", [])
    return tmp_path


def test_the_driver_times_late_baselines_after_every_specgen_kernel(fake_gpu, monkeypatch, capsys):
    events = []

    def now(name):
        def build(torch, suite, plan):
            events.append((f"build {name}", plan.module_name))
            if name == "late":
                core.note_launch_patched("late")
            return lambda case: case.inputs
        return build

    monkeypatch.setitem(REGISTRY, "early", Baseline("early", "Early", {"prefill": frozenset()}, now("early")))
    monkeypatch.setitem(REGISTRY, "late", Baseline("late", "Late", {"prefill": frozenset()}, now("late"),
                                                   late=True))
    monkeypatch.setitem(REGISTRY, "never", Baseline("never", "Never", {}, now("never")))
    specs = [str(ROOT / "specs" / "fmha_gqa8_bf16.yaml"), str(ROOT / "specs" / "fmha_mha_bf16.yaml")]
    stems = core.run(_Suite(events), specs, results=fake_gpu / "results", gen=fake_gpu / "gen",
                     baselines=("early", "late", "never"), log=lambda line: None)
    kinds = [e[0] for e in events]
    last_specgen = max(i for i, k in enumerate(kinds) if k == "specgen")
    assert all(i > last_specgen for i, k in enumerate(kinds) if k in ("build late", "late"))
    assert kinds.count("specgen") == 4 and kinds.count("late") == 4 and kinds.count("early") == 4
    assert "build never" not in kinds
    assert [s.name for s in stems] == ["fmha_gqa8_bf16-prefill", "fmha_mha_bf16-prefill"]
    for stem in stems:
        result = load_result(result_paths(stem)["json"])
        for row in result.rows:
            assert row.timings["late"].ms == 2.0 and row.speedup == {"early": 2.0, "late": 2.0, "never": None}
            assert row.timings["never"].error == "Never has no prefill path"
    printed = capsys.readouterr().out.split("### ")[1:]
    assert len(printed) == 4  # each table, then again with the late baseline filled in
    assert all("n/a (not timed" in t for t in printed[:2]) and not any("not timed" in t for t in printed[2:])
    # The late baseline patched the launcher: specgen kernels refuse to run in this process now.
    with pytest.raises(UsageError, match="late was imported in this process and patched cuda.tile.launch"):
        core.run(_Suite([]), specs, results=fake_gpu / "results", gen=fake_gpu / "gen",
                 baselines=("early",), log=lambda line: None)


def test_the_backward_suite_refuses_forward_only_specs_before_asking_for_a_gpu(tmp_path):
    from specgen.bench import run_suite

    with pytest.raises(UsageError, match="fmha_gqa_causal has backward: false"):
        run_suite("backward", [str(ROOT / "specs" / "fmha_gqa_causal.yaml")], results=tmp_path / "r",
                  gen=tmp_path / "gen", baselines=DEFAULT)
    assert not (tmp_path / "r").exists() and not (tmp_path / "gen").exists()


def test_a_gzipped_result_loads_and_a_new_run_replaces_it(tmp_path):
    """Committed results may be kept as <stem>.json.gz: load_result reads them, and a
    bench run that writes <stem>.json removes the stale gzipped copy."""
    import gzip

    source = RESULTS / "fmha_decode_gqa4_bf16-decode.json"
    packed = tmp_path / "fmha_decode_gqa4_bf16-decode.json.gz"
    packed.write_bytes(gzip.compress(source.read_bytes()))
    assert result_stem(packed) == tmp_path / "fmha_decode_gqa4_bf16-decode" == result_stem(tmp_path / source.name)
    assert load_result(packed).rows == load_result(source).rows
    assert core.find_result(result_stem(packed)) == packed
    core.write_report(result_stem(packed), source.read_text(), "table\n")
    assert not packed.exists() and core.find_result(result_stem(packed)) == tmp_path / source.name

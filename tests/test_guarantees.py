"""Promises of docs/guarantees.md, each held by a test of its own.

Each test fails on a deliberately broken version of the code it guards (named in
its docstring)."""

import contextlib
import hashlib
import io
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from specgen.commands import cli
from specgen.errors import UsageError

from .helpers import ROOT


def _build(spec: Path, out: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["build", str(spec), "--no-compile", "--out", str(out)])
    return code, err.getvalue()


def test_a_spec_over_1_mib_is_one_line_and_nothing_is_written(tmp_path):
    """Files over 1 MiB get their own line (guarantees.md, bad input). Broken by
    dropping read_spec_text's size checks: the padded spec is valid and builds."""
    spec = tmp_path / "big.yaml"
    spec.write_text("name: big\n" + "#" * (1 << 20) + "\n")
    out = tmp_path / "gen"
    code, stderr = _build(spec, out)
    assert code == 2, stderr
    assert stderr.splitlines() == [f"{spec}: file is larger than 1048576 bytes"]
    assert not out.exists() or not any(out.iterdir())
    # Exactly at the limit it is read (and, a valid spec, built).
    spec.write_bytes(b"name: big\n" + b"#" * ((1 << 20) - 11) + b"\n")
    assert spec.stat().st_size == 1 << 20
    assert _build(spec, out)[0] == 0


def test_concurrent_compiles_of_one_kernel_export_it_once(tmp_path, monkeypatch):
    """Cubin writes hold a file lock, so concurrent builds compile each cubin once.
    The slow three-process test counts cubin files, which a double compile (same
    name, os.replace) leaves at one each; this counts the exports. Broken by
    replacing compile_target's FileLock with a null context: 3 exports per kernel."""
    from specgen.compile import export
    from specgen.plan.make import make_plan
    from specgen.spec import load_spec

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    plan = make_plan(load_spec(ROOT / "specs" / "fmha_mha_bf16.yaml"))
    source = (ROOT / "generated" / "fmha_mha_bf16.py").read_text()
    calls, lock = [], threading.Lock()

    def fake_export(plan, kernel, target, config, sigs=None):
        with lock:
            calls.append((getattr(kernel, "__name__", str(kernel)), config.tile_m, config.tile_n))
        time.sleep(0.3)  # long enough for the other builds to reach the same cubin
        return b"\x7fELF" + repr(calls[-1]).encode()

    monkeypatch.setattr(export, "_export", fake_export)
    monkeypatch.setattr(export, "aot_entries", lambda module, kernel, name, target, sigs: [
        {"kernel": name, "sm": target, "hints": {}, "signature": "s", "symbol": name}])
    monkeypatch.setattr(export, "load_module_from_source", lambda *a: type(
        "M", (), {n: object() for n, _ in
                  (b for c in export.target_configs(plan, "sm_90") for b in export.kernel_builds(plan, c, "sm_90"))}))
    errors = []

    def build():
        try:
            export.compile_target(plan, source, "<audit>", "sm_90")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    expected = sum(len(export.kernel_builds(plan, c, "sm_90")) for c in export.target_configs(plan, "sm_90"))
    assert len(calls) == expected, calls
    cubins = sorted((tmp_path / "cache").rglob("*.cubin"))
    assert len(cubins) == expected and all(export.cached_entries(p) for p in cubins)


def test_tune_validates_the_edited_text_before_it_replaces_the_file(tmp_path):
    """`specgen tune` validates the edited text before it replaces the file. Broken by
    dropping write_back's validate_spec: the file then takes tile_m 24."""
    from specgen.commands.tune import rewrite_spec_file, write_back

    path = tmp_path / "tuned.yaml"
    text = "# keep me\nname: tuned\ncausal: true\ntargets:\n  sm_90: {tile_m: 64, tile_n: 64}\n"
    path.write_text(text)
    bad = {"tile_m": 24, "tile_n": 64, "occupancy": 1}  # not a power of two: the spec refuses it
    with pytest.raises(UsageError, match="tune produced an invalid spec, file left unchanged"):
        rewrite_spec_file(path, lambda t: write_back(t, str(path), "sm_90", bad, []))
    assert path.read_text() == text
    good = {"tile_m": 128, "tile_n": 64, "occupancy": 1}
    assert rewrite_spec_file(path, lambda t: write_back(t, str(path), "sm_90", good, []))
    assert path.read_text().startswith("# keep me\nname: tuned\n")


@pytest.mark.parametrize("name, sliced", [("fmha_mha_bf16", True), ("fmha_train_gqa_causal", True),
                                          ("fmha_varlen_llama", True), ("fmha_train_gptoss_sinks", False),
                                          ("fmha_train_document", False)])
def test_prefill_never_launches_a_grid_y_past_65535(name, sliced, monkeypatch):
    """batch × heads past 65535 blocks on y run as slices of the batch (of
    cu_seqlens for varlen), or as one launch whose config puts the tiles on y, or are
    a ValueError before any launch: no launch's y passes the limit. Broken by raising
    MAX_GRID_Y in a generated prefill module (the launch is reached with a larger y)."""
    from specgen.check import emulate

    mod = emulate.load_module(ROOT / "generated" / f"{name}.py", name=f"_audit_{name}")
    ratio, dim = mod.SPEC["gqa_ratio"], mod.SPEC["head_dim"]
    batch = 65536 // ratio + 1
    launched = []
    extra = {"sinks": torch.zeros(ratio)} if mod.SPEC.get("sinks") else {}
    if mod.SPEC.get("mask_mod"):
        extra["doc"] = torch.zeros(batch, 1, dtype=torch.int32)
    with monkeypatch.context() as patch, emulate.emulating():
        patch.setattr(mod.ct, "launch", lambda stream, grid, *a, **k: launched.append(grid))
        if mod.SPEC.get("varlen"):
            cu = torch.arange(batch + 1, dtype=torch.int32)
            q = torch.zeros(batch, ratio, dim, dtype=torch.bfloat16)
            k = torch.zeros(batch, 1, dim, dtype=torch.bfloat16)
            call = lambda: mod.attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu)  # noqa: E731
        else:
            q = torch.zeros(1, ratio, 1, dim, dtype=torch.bfloat16).expand(batch, -1, -1, -1)
            k = torch.zeros(1, 1, 1, dim, dtype=torch.bfloat16).expand(batch, -1, -1, -1)
            call = lambda: mod.attention(q, k, k, **extra)  # noqa: E731
        if sliced:
            call()
            assert len(launched) >= 2 and sum(grid[1] for grid in launched) == batch * ratio
        else:
            # A config may put the tiles on y (tile_order: global) and launch as one.
            try:
                call()
            except ValueError as exc:
                assert "at most" in str(exc) and not launched
    assert all(grid[1] <= 65535 for grid in launched)


def test_the_header_spec_hash_is_the_canonical_specs():
    """The header carries the sha256 of the canonical spec; test_render checks the
    version, path and templates' hash only, and the golden files are rendered by the
    same code. Broken by hashing anything else in spec_hash (e.g. without compact
    separators): a fresh render's header no longer names the canonical spec."""
    import yaml

    from specgen.emit.render import HEADER_RE, render
    from specgen.plan.make import make_plan
    from specgen.spec import spec_to_dict, validate_spec

    for stem in ("fmha_mha_bf16", "fmha_decode_gqa8_bf16", "fmha_train_document"):
        path = ROOT / "specs" / f"{stem}.yaml"
        spec = validate_spec(yaml.safe_load(path.read_text()), path)
        canonical = json.dumps(spec_to_dict(spec), sort_keys=True, separators=(",", ":")).encode()
        header = HEADER_RE.match(render(make_plan(spec), f"specs/{stem}.yaml").text)
        assert header["spec_sha"] == hashlib.sha256(canonical).hexdigest(), stem


def _backward_variants() -> dict:
    from . import test_gpu

    return {**test_gpu.BACKWARD_VARIANTS, **test_gpu.VARLEN_BACKWARD_VARIANTS}


@pytest.mark.parametrize("variant", sorted(_backward_variants()))
def test_gpu_backward_variants_train_when_emulated(variant):
    """guarantees.md: every template variant of the gpu tests runs through the CPU
    emulator; test_emulate takes the forward and decode variants only. Broken by
    dropping WINDOW_RIGHT from the dK/dV kernel's first query tile: only
    non_causal_window_left_right_f16_d64 (no shipped spec has a right window) fails."""
    import torch

    from specgen.check import emulate
    from specgen.check.runner import Case, case_matrix, case_verdict, run_case

    from .helpers import prefill_variant_data, render_spec_data

    plan, source = render_spec_data(prefill_variant_data(variant, _backward_variants()[variant]),
                                    "specs/variant.yaml", formatted=False)
    module = emulate.load_module(ROOT / "generated" / f"{plan.module_name}.py", source=source,
                                 name=f"_audit_backward_{variant}")
    case = case_matrix(True, module.SPEC)[2] if module.SPEC["varlen"] else Case(1, 1, 150, 150, 0)
    with emulate.emulating():
        row = run_case(torch, module, case, torch.Generator().manual_seed(3), device="cpu")
    assert row["ok"] and row.get("grad_ok"), f"{variant}: {case_verdict(row)}"


def test_a_fuzz_case_replayed_alone_draws_the_same_shapes_and_inputs(tmp_path, monkeypatch, capsys):
    """Each case owns its seed S:I and `--fuzz-case S:I` replays it alone; the
    existing test checks only the printed command. Broken by seeding a case's input
    generator from its position (case_generator_seed ignoring the fuzz seed) or by
    drawing the shape from anything but S:I."""
    from specgen.check import runner

    seen = []

    def record(module_path, case, generator_seed):
        seen.append((case, generator_seed))
        return {"shape": "x", "max_abs_err": 0.0, "rel_err": 0.0, "nonfinite": 0, "ok": True}

    monkeypatch.setattr(runner, "_emulated_case", record)
    spec = str(ROOT / "specs" / "fmha_mha_bf16.yaml")
    assert runner.run_test([spec], tmp_path, quick=False, seed=5, fuzz=4, emulate=True) == 0
    drawn = list(seen)
    assert len({case for case, _ in drawn}) > 1  # the cases differ
    for i in (1, 3):
        seen.clear()
        assert runner.run_test([spec], tmp_path, quick=False, seed=0, fuzz_case_seed=f"5:{i}", emulate=True) == 0
        assert seen == [drawn[i]]
    capsys.readouterr()

"""`specgen diff`: every section, --set, --templates, --stat, --json and exit codes."""

import json
import re
import shutil

import pytest

from specgen.commands.diff import pair_kernels

from .helpers import ROOT
from .test_cli import specgen


def diff(*args, cwd=ROOT):
    return specgen("diff", *args, cwd=cwd)


def test_set_gives_one_spec_line_and_the_source_hunk():
    result = diff("specs/fmha_gqa_causal.yaml", "--set", "loop_split=false", "--no-compile")
    assert result.returncode == 1, result.stderr
    out = result.stdout
    spec = out.split("1. Spec\n")[1].split("\n\n")[0].splitlines()
    assert spec == ["  loop_split: true → false"]
    plan = out.split("2. Plan\n")[1].split("\n\n")[0]
    assert "even_n_param: true → false" in plan
    assert "-    for j in range(mask_start, num_n):" in out
    assert "+    # No loop split: every key tile is masked." in out
    assert "4. Compiled" not in out and "\x1b[" not in out  # no colour off a TTY


def test_set_values_are_yaml_and_nested():
    result = diff("specs/fmha_gqa_causal.yaml", "--set", "fast_math.exp2=false",
                  "--set", "targets.sm_100.tile_m=128", "--no-compile", "--stat")
    spec = result.stdout.split("1. Spec\n")[1].split("\n\n")[0].splitlines()
    assert spec == ["  fast_math.exp2: true → false", "  targets.sm_100.tile_m: 256 → 128"]
    assert 'tiles.sm_100: "256x128, occupancy 1" → "128x128, occupancy 1"' in result.stdout
    assert "exp_fn: \"ct.exp2\" → \"ct.exp\"" in result.stdout
    assert "\n--- " not in result.stdout  # --stat: counts only
    assert "3. Source: +" in result.stdout


@pytest.mark.parametrize("sets,message", [
    (["head_dim=64", "head_dim=96"], "specgen diff: --set: head_dim is given twice; give each key once"),
    (["fast_math.exp2=false", "fast_math={exp2: true}"],
     "specgen diff: --set: fast_math would replace fast_math.exp2, given before it; give fast_math first"),
])
def test_set_refuses_a_key_given_twice(sets, message):
    """No assignment silently undoes another (a key inside one given after it, as
    in fast_math={...} --set fast_math.exp2=..., refines it)."""
    result = diff("specs/fmha_gqa_causal.yaml", *[arg for s in sets for arg in ("--set", s)], "--no-compile")
    assert result.returncode == 2 and result.stderr.splitlines() == [message], result.stderr


def test_a_module_side_is_never_run_unless_it_is_specgen_output(tmp_path):
    """The compiled section imports a module side: a hand-edited module (its hash no
    longer matches) or a file without specgen's header is refused, and its code
    never runs."""
    marker = tmp_path / "ran"
    edited = tmp_path / "edited.py"
    edited.write_text((ROOT / "generated" / "fmha_gqa_causal.py").read_text()
                      + f"\nopen({str(marker)!r}, 'w').close()\n")
    result = diff("generated/fmha_gqa_causal.py", str(edited), "--stat")
    assert result.returncode == 2 and not marker.exists()
    assert result.stderr.splitlines() == [f"{edited}: edited by hand (its content no longer matches its "
                                          "header's hash); diff its spec, or rebuild the module"]
    plain = tmp_path / "plain.py"
    plain.write_text("SPEC = {'name': 'x'}\n")
    result = diff(str(plain), "generated/fmha_gqa_causal.py", "--stat")
    assert result.returncode == 2 and result.stderr.splitlines() == [f"{plain}: not a generated module (no specgen header)"]


def test_identical_is_exit_0_and_generated_module_side():
    result = diff("specs/fmha_mha_bf16.yaml", "generated/fmha_mha_bf16.py", "--no-compile")
    assert result.returncode == 0, result.stderr
    assert "1. Spec\n  identical" in result.stdout and "+0 -0 lines" in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["specs/fmha_gqa_causal.yaml"], "give two specs or modules"),
        (["specs/nope.yaml", "specs/fmha_mha_bf16.yaml"], "no such spec file"),
        (["specs/fmha_gqa_causal.yaml", "--set", "loop_split"], "expected key.path=value"),
        (["specs/fmha_gqa_causal.yaml", "--set", "targets.sm_90.tile_m=100"],
         "targets.sm_90.tile_m: must be a power of two in [16, 256], got 100"),
        (["specs/fmha_gqa_causal.yaml", "--set", "bogus=1"], "bogus: unknown key"),
    ],
)
def test_bad_input_exits_2(args, message):
    result = diff(*args, "--no-compile")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_json_has_all_sections_including_performance():
    result = diff("specs/fmha_seed_baseline.yaml", "specs/fmha_gqa_causal.yaml", "--json",
                  "--no-compile")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert set(report) == {"a", "b", "spec", "plan", "source", "compiled", "performance"}
    fields = {c["field"] for c in report["spec"]}
    assert {"name", "loop_split", "fast_math.exp2", "loads.k_latency"} <= fields
    assert report["source"]["added"] > 0 and report["source"]["diff"].startswith("--- ")
    perf = report["performance"][0]
    assert perf["device"] == "NVIDIA H200" and perf["suite"] == "prefill"
    row = perf["rows"][0]
    assert row["ratio"] == pytest.approx(row["b_tflops"] / row["a_tflops"])


def test_performance_section_only_with_results(tmp_path):
    result = diff("specs/fmha_seed_baseline.yaml", "specs/fmha_gqa_causal.yaml", "--no-compile",
                  "--results", str(tmp_path))
    assert "5. Performance" not in result.stdout
    result = diff("specs/fmha_seed_baseline.yaml", "specs/fmha_gqa_causal.yaml", "--no-compile")
    assert "5. Performance" in result.stdout and "S=16384:" in result.stdout


@pytest.mark.slow
def test_compiled_section_reports_cubins_and_resources():
    result = diff("specs/fmha_gqa_causal.yaml", "--set", "loop_split=false", "--json")
    report = json.loads(result.stdout)
    rows = {row["target"]: row for row in report["compiled"]}
    assert set(rows) == {"sm_90", "sm_100", "sm_120"}
    a, b = rows["sm_90"]["a"], rows["sm_90"]["b"]
    assert a["cubin_bytes"] > b["cubin_bytes"] > 0  # two EVEN_N variants vs one
    if shutil.which("cuobjdump") is None and a["kernels"] is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    # sm_90: a seq_k bucket and the target's own config, each a cubin; EVEN_N
    # doubles the kernels of each where the loop is split.
    assert len(a["kernels"]) == 4 and len(b["kernels"]) == 2
    # The short-sequence bucket (64 rows) launches in the global tile order.
    assert {k["kernel"] for k in a["kernels"]} == {
        f"TILE_M={m} TILE_N=128 EVEN_N={even} TILES_OUTER={m == 64}"
        for m in (64, 128) for even in (True, False)}
    assert all(k["registers"] > 0 and k["shared"] > 0 for k in a["kernels"] + b["kernels"])
    text = diff("specs/fmha_gqa_causal.yaml", "--set", "loop_split=false").stdout
    assert "4. Compiled\n  sm_90: cubin" in text and "reg 128 → 128" in text


def test_pair_kernels_matches_labels_then_order():
    a = [{"kernel": "X EVEN_N=False", "registers": 1}, {"kernel": "X EVEN_N=True", "registers": 2}]
    b = [{"kernel": "X EVEN_N=True", "registers": 3}, {"kernel": "X", "registers": 4}]
    pairs = pair_kernels(a, b)
    assert [(p[0].get("registers"), p[1].get("registers")) for p in pairs] == [(2, 3), (1, 4)]


def test_pair_kernels_pairs_variants_by_their_constants():
    """b has fewer variants of the kernel (loop_split: false drops EVEN_N): each b
    variant pairs with the a variant of its tile, the others are absent in b."""
    a = [{"kernel": f"TILE_M={m} TILE_N=128 EVEN_N={e} TILES_OUTER={m == 64}", "registers": (m, e)}
         for m in (64, 128) for e in (True, False)]
    b = [{"kernel": f"TILE_M={m} TILE_N=128 TILES_OUTER={m == 64}", "registers": m} for m in (64, 128)]
    pairs = pair_kernels(a, b)
    assert [(p[0].get("registers"), p[1].get("registers")) for p in pairs] == [
        ((64, True), 64), ((128, True), 128), ((64, False), None), ((128, False), None)]


def test_pair_kernels_keeps_each_kernels_variants_together():
    """A leftover variant pairs with a leftover of its own kernel before any other
    (a packed backward's dQ kernel changes its tile and the map kernel its rows: the
    dQ variants must not pair with a map variant); kernels renamed by a flag still
    pair in order."""
    a = [{"kernel": "map (16, 64, False, 4)", "registers": 1}, {"kernel": "dq (64, 64)", "registers": 2},
         {"kernel": "dkdv_causal (64, 64)", "registers": 5}]
    b = [{"kernel": "dq (128, 64)", "registers": 3}, {"kernel": "map (128, 64, False)", "registers": 4},
         {"kernel": "dkdv (64, 64)", "registers": 6}]
    pairs = pair_kernels(a, b)
    assert [(p[0].get("registers"), p[1].get("registers")) for p in pairs] == [(1, 4), (2, 3), (5, 6)]


def test_templates_mode_diffs_working_tree_against_generated(tmp_path):
    (tmp_path / "specs").mkdir()
    names = ("fmha_mha_bf16", "fmha_gqa_causal", "fmha_decode_gqa8_bf16")  # (each spec is alike here)
    for name in names:
        shutil.copy(ROOT / "specs" / f"{name}.yaml", tmp_path / "specs")
    assert specgen("build", "specs", "--no-compile", cwd=tmp_path).returncode == 0
    clean = specgen("diff", "--templates", cwd=tmp_path)
    assert clean.returncode == 0 and clean.stdout.count("+0 -0 lines") == len(names)
    module = tmp_path / "generated" / "fmha_mha_bf16.py"
    module.write_text(module.read_text().replace("MAX_GRID_Y = 65535", "MAX_GRID_Y = 1"))
    changed = specgen("diff", "--templates", "specs/fmha_mha_bf16.yaml", cwd=tmp_path)
    assert changed.returncode == 1
    assert "-MAX_GRID_Y = 1\n+MAX_GRID_Y = 65535" in changed.stdout
    # A header alone out of date (a template edit that renders nothing but changes
    # the templates' hash): the body is identical, the module still stale.
    assert specgen("build", "specs", "--no-compile", "--force", cwd=tmp_path).returncode == 0
    text = module.read_text()
    old_sha = re.search(r"# template-sha256: ([0-9a-f]{64})", text)[1]
    module.write_text(text.replace(old_sha, "0" * 64))
    header = specgen("diff", "--templates", "specs/fmha_mha_bf16.yaml", cwd=tmp_path)
    assert header.returncode == 1 and "+0 -0 lines" in header.stdout
    assert f"  header template-sha256: {'0' * 64} → {old_sha}" in header.stdout
    assert specgen("build", "--check", "--no-compile", "specs", cwd=tmp_path).returncode == 1
    as_json = json.loads(specgen("diff", "--templates", "--json", "specs/fmha_mha_bf16.yaml", cwd=tmp_path).stdout)
    assert as_json[0]["header"] == [{"field": "template-sha256", "a": "0" * 64, "b": old_sha}]


def test_decode_specs_diff_without_tracebacks():
    """Decode specs diff like prefill ones; their bench results (µs rows, not
    TFLOPS tables) are read without a traceback."""
    result = diff("specs/fmha_decode_gqa8_bf16.yaml", "specs/fmha_decode_gqa4_bf16.yaml", "--no-compile",
                  "--stat")
    assert result.returncode == 1, result.stderr
    assert "group_size: 8 → 4" in result.stdout and "Traceback" not in result.stderr


@pytest.mark.slow
def test_compiled_section_lists_every_kernel_of_a_decode_spec():
    """Each kernel has its own cubin, so the combine kernel's resources are read too
    (one file holding both images showed only the first)."""
    result = diff("specs/fmha_decode_gqa8_bf16.yaml", "--set", "targets.sm_90.tile_n=64", "--json")
    rows = {row["target"]: row for row in json.loads(result.stdout)["compiled"]}
    a, b = rows["sm_90"]["a"], rows["sm_90"]["b"]
    if a["kernels"] is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    for side, tile_n in ((a, 128), (b, 64)):
        labels = [k["kernel"] for k in side["kernels"]]
        # pdl: auto launches (so compiles) the PDL kernels on sm_90.
        assert {f"TILE_N={tile_n} SINGLE_SPLIT={s} PDL=True" for s in (True, False)
                } == {label for label in labels if label.startswith("TILE_N=")}
        # The combine, once per padded split count 2..64 (MAX_SPLITS).
        assert sorted(label for label in labels if label.startswith("fmha_decode_combine_")) == sorted(
            f"fmha_decode_combine_gqa8_bf16_d128 ({n}, True)" for n in (2, 4, 8, 16, 32, 64))


def test_decode_performance_compares_steady_state_microseconds(tmp_path):
    result = diff("specs/fmha_decode_gqa4_bf16.yaml", "specs/fmha_decode_paged_mtp.yaml", "--json",
                  "--no-compile")
    block = json.loads(result.stdout)["performance"][0]
    from specgen.bench.core import find_result, read_result_text

    committed = {name: json.loads(read_result_text(find_result(ROOT / f"bench/results/h200/{name}-decode")))
                 for name in ("fmha_decode_gqa4_bf16", "fmha_decode_paged_mtp")}
    assert block["suite"] == "decode" and block["unit"] == "µs"
    first = block["rows"][0]
    a_us = committed["fmha_decode_gqa4_bf16"]["rows"][0]["timings"]["specgen"]["us"]
    b_us = committed["fmha_decode_paged_mtp"]["rows"][0]["timings"]["specgen"]["us"]
    assert (first["a_us"], first["b_us"]) == (a_us, b_us)
    assert first["ratio"] == pytest.approx(a_us / b_us)
    text = diff("specs/fmha_decode_gqa4_bf16.yaml", "specs/fmha_decode_paged_mtp.yaml", "--no-compile").stdout
    assert f"B1 Hkv8 L8192: {a_us:.1f} → {b_us:.1f} µs" in text
    # Results kept gzipped (.json.gz) compare the same.
    import gzip

    (tmp_path / "h200").mkdir()
    for name, data in committed.items():
        (tmp_path / "h200" / f"{name}-decode.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    packed = diff("specs/fmha_decode_gqa4_bf16.yaml", "specs/fmha_decode_paged_mtp.yaml", "--json",
                  "--no-compile", "--results", str(tmp_path))
    assert json.loads(packed.stdout)["performance"][0]["rows"] == block["rows"]
    # A result of the one-call schema (1) is not compared with a steady-state one.
    for name, data in committed.items():
        (tmp_path / "h200" / f"{name}-decode.json.gz").unlink()
        data = dict(data, schema_version=1) if name == "fmha_decode_paged_mtp" else data
        (tmp_path / "h200" / f"{name}-decode.json").write_text(json.dumps(data))
    old = diff("specs/fmha_decode_gqa4_bf16.yaml", "specs/fmha_decode_paged_mtp.yaml", "--json",
               "--no-compile", "--results", str(tmp_path))
    assert json.loads(old.stdout)["performance"] == []


def overlaps(loop: str) -> bool:
    """A schedule issues an MMA before an exponential, both before the loop's first
    wait after its head: the tensor cores run while the softmax does."""
    events = loop.split()
    head = 1 if events[0].startswith("W") else 0
    window = events[head:events.index("W", head)] if "W" in events[head:] else events[head:]
    mmas = [i for i, e in enumerate(window) if e.startswith("Q")]
    exps = [i for i, e in enumerate(window) if e.startswith("E")]
    return bool(mmas and exps and mmas[0] < exps[-1])


def test_overlap_reading_of_schedules():
    assert overlaps("W2 Q2 E3 Q1 E13 Q1 E2 W P8 W")
    assert not overlaps("W Q8 W E66 P8 W") and not overlaps("W2 E66 Q8 W P8 W")


@pytest.mark.slow
def test_compiled_section_shows_what_qk_ahead_does_to_the_loop_schedule(tmp_path):
    """sm_90, one 128x128 config: the plain loop waits for S before its exponentials
    (W Q.. W E..); with qk_ahead (Q in shared memory) the next tile's MMAs are issued
    among this tile's exponentials and waited for after them."""
    import yaml

    data = yaml.safe_load((ROOT / "specs" / "fmha_gqa8_bf16.yaml").read_text())
    data.update(name="qk_probe", prescale_q=False, compile_for=["sm_90"], autotune={},
                targets={"sm_90": {"tile_m": 128, "tile_n": 128, "occupancy": 1, "num_worker_warps": 8}})
    spec = tmp_path / "qk_probe.yaml"
    spec.write_text(yaml.safe_dump(data))
    result = diff(spec, "--set", "qk_ahead=true", "--json")
    rows = {row["target"]: row for row in json.loads(result.stdout)["compiled"]}
    kernels = rows["sm_90"]["a"]["kernels"], rows["sm_90"]["b"]["kernels"]
    if kernels[0] is None or kernels[0][0].get("loops") is None:
        pytest.skip("cuobjdump/nvdisasm not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    plain = [loop for k in kernels[0] for loop in k["loops"]]
    ahead = [loop for k in kernels[1] for loop in k["loops"]]
    assert plain and all(loop.split()[:4] == ["W", "Q8", "W", "E66"] for loop in plain), plain
    for loop in ahead:
        assert overlaps(loop), loop
    assert not any(overlaps(loop) for loop in plain)
    text = diff(spec, "--set", "qk_ahead=true").stdout
    assert "      loops: W Q8 W E66 P8 W" in text
    # What a step issues, per side: the instruction mix of each inner loop.
    assert "      a step: " in text and " instructions: " in text
    mixes = [m for k in kernels[0] for m in k["loop_mix"]]
    assert mixes and all(m["mma"] > 0 and m["exp"] > 0 for m in mixes), mixes


def test_a_field_that_becomes_a_section_is_one_change():
    """A field null on one side and a dict on the other (window: null against
    {left: 4095}) read as `window: null -> (absent)` and `window.left: (absent) ->
    4095`, backwards; it is now one change holding the whole dict, and a section
    only one side has is one line too. Sections on both sides still diff by key."""
    from specgen.commands.diff import _changes

    changes = _changes({"window": None, "targets": {"sm_90": {"tile_m": 64, "tile_n": 64}},
                        "autotune": {"sm_90": {"tile_m": [64]}}},
                       {"window": {"left": 4095, "right": None},
                        "targets": {"sm_90": {"tile_m": 128, "tile_n": 64}}})
    assert [(c["field"], c["a"], c["b"]) for c in changes if "absent" not in c] == [
        ("window", None, {"left": 4095, "right": None}), ("targets.sm_90.tile_m", 64, 128)]
    (gone,) = [c for c in changes if "absent" in c]
    assert gone["field"] == "autotune" and gone["absent"] == "b"
    assert gone["a"] == {"sm_90": {"tile_m": [64]}}


def test_set_on_a_stale_module_shows_the_fields_change_alone(tmp_path, monkeypatch):
    """A module written by other templates, diffed against itself with --set: both
    sides are its spec rendered with the installed templates, so the source section
    holds what the fields change and nothing of the templates' drift (a --set that
    changes nothing printed the drift as a difference, exit 1)."""
    (tmp_path / "specs").mkdir()
    shutil.copy(ROOT / "specs" / "fmha_mha_bf16.yaml", tmp_path / "specs")
    assert specgen("build", "specs", "--no-compile", cwd=tmp_path).returncode == 0
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", templates)
    prefill = templates / "fmha_prefill.py.jinja"
    prefill.write_text(prefill.read_text().replace("generated by specgen. The module is",
                                                   "generated by specgen, now. The module is", 1))
    monkeypatch.setenv("SPECGEN_TEMPLATES", str(templates))
    assert specgen("build", "--check", "--no-compile", "specs", cwd=tmp_path).returncode == 1  # stale
    module = "generated/fmha_mha_bf16.py"
    same = specgen("diff", module, "--set", "causal=false", "--no-compile", cwd=tmp_path)
    assert same.returncode == 0, same.stdout
    assert "+0 -0 lines in 0 hunk(s)" in same.stdout
    assert same.stdout.startswith(f"a: {module} (re-rendered with the installed templates)\n"
                                  f"b: {module} with causal=false\n")
    assert same.stderr.splitlines() == [
        f"note: {module} is stale against the installed templates (`specgen diff --templates` shows "
        "how); a is its spec rendered with them, so that only the --set fields differ"]
    changed = specgen("diff", module, "--set", "loop_split=false", "--no-compile", cwd=tmp_path)
    assert changed.returncode == 1
    assert "now. The module is" not in changed.stdout  # the templates' edit is on both sides
    assert "+    # No loop split: every key tile is masked." in changed.stdout
    # Two paths compare what is written: the module as it is against the spec now.
    both = specgen("diff", module, "specs/fmha_mha_bf16.yaml", "--no-compile", cwd=tmp_path)
    assert both.returncode == 1 and "+Kernel ``" in both.stdout and not both.stderr


def test_set_variant_has_no_performance_section():
    """A --set variant was never benchmarked: --set name=<another spec> compared that
    spec's committed results with a's, as if they were the variant's."""
    result = diff("specs/fmha_gqa_causal.yaml", "--set", "name=fmha_seed_baseline", "--json",
                  "--no-compile")
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["performance"] == []


def test_performance_leaves_out_a_result_of_another_kernel(tmp_path):
    """A result whose kernel is not its side's (the spec changed since the run) is
    left out with a note, not compared as the spec's."""
    spec = (ROOT / "specs" / "fmha_seed_baseline.yaml").read_text()
    assert "\ndtype: float16" in spec
    changed = tmp_path / "fmha_seed_baseline.yaml"
    changed.write_text(spec.replace("\ndtype: float16", "\ndtype: bfloat16"))
    result = diff("specs/fmha_gqa_causal.yaml", str(changed), "--json", "--no-compile")
    assert result.returncode == 1
    assert json.loads(result.stdout)["performance"] == []
    assert result.stderr.splitlines() == [
        "note: bench/results/h200/fmha_seed_baseline-prefill.json.gz times "
        "fmha_prefill_causal_gqa4_f16_d128, not fmha_prefill_causal_gqa4_bf16_d128 (its spec changed "
        "since the run): suite prefill on NVIDIA H200 left out of the performance section"]


@pytest.mark.parametrize("a,b,unit", [
    ("fmha_train_gqa_causal", "fmha_train_gemma2", "TFLOPS"),  # H200: a timed 2 lengths, b 5
    ("fmha_decode_gqa8_bf16", "fmha_decode_chunked_local", "µs"),  # b times 2 shapes more
])
def test_performance_rows_do_not_depend_on_the_order_of_a_and_b(a, b, unit):
    """Rows only b timed are listed too (they were dropped, so `diff A B` and `diff B A`
    showed different rows)."""
    def blocks(x, y):
        report = json.loads(diff(f"specs/{x}.yaml", f"specs/{y}.yaml", "--json", "--no-compile").stdout)
        return {(blk["device"], blk["suite"]): blk for blk in report["performance"]}

    forward, backward = blocks(a, b), blocks(b, a)
    assert forward and set(forward) == set(backward)
    key = "seq" if unit == "TFLOPS" else "shape"
    a_t, b_t = ("a_tflops", "b_tflops") if unit == "TFLOPS" else ("a_us", "b_us")
    for name, block in forward.items():
        assert block["unit"] == unit
        there = {row[key]: (row[a_t], row[b_t]) for row in block["rows"]}
        back = {row[key]: (row[b_t], row[a_t]) for row in backward[name]["rows"]}
        assert there == back
    assert any(row[a_t] is None and row[b_t] for blk in forward.values() for row in blk["rows"])


def test_decode_result_of_schema_1_under_its_schema_key_is_not_compared(tmp_path):
    """A schema-1 decode result (one call per graph) whose version is under "schema"
    (as bench writes it) showed a block of n/a rows; it is left out, as one under
    "schema_version" is."""
    from specgen.bench.core import find_result, read_result_text

    (tmp_path / "h200").mkdir()
    for name in ("fmha_decode_gqa4_bf16", "fmha_decode_paged_mtp"):
        data = json.loads(read_result_text(find_result(ROOT / f"bench/results/h200/{name}-decode")))
        if name == "fmha_decode_paged_mtp":
            data.pop("schema_version", None)
            data["schema"] = 1
        (tmp_path / "h200" / f"{name}-decode.json").write_text(json.dumps(data))
    result = diff("specs/fmha_decode_gqa4_bf16.yaml", "specs/fmha_decode_paged_mtp.yaml", "--json",
                  "--no-compile", "--results", str(tmp_path))
    assert result.returncode == 1 and json.loads(result.stdout)["performance"] == []


def test_results_of_one_device_folder_are_read():
    """--results bench/results/h200 (a device's folder, not their parent) showed no
    performance section, without a word."""
    whole = json.loads(diff("specs/fmha_seed_baseline.yaml", "specs/fmha_gqa_causal.yaml", "--json",
                            "--no-compile").stdout)["performance"]
    one = json.loads(diff("specs/fmha_seed_baseline.yaml", "specs/fmha_gqa_causal.yaml", "--json",
                          "--no-compile", "--results", "bench/results/h200").stdout)["performance"]
    assert one and one == [block for block in whole if block["device"] == "NVIDIA H200"]


def test_templates_takes_a_module_for_its_spec(tmp_path):
    """--templates generated/x.py read the module as YAML ("invalid YAML: ..."); a
    module now stands for the spec its header names."""
    (tmp_path / "specs").mkdir()
    shutil.copy(ROOT / "specs" / "fmha_mha_bf16.yaml", tmp_path / "specs")
    assert specgen("build", "specs", "--no-compile", cwd=tmp_path).returncode == 0
    by_module = specgen("diff", "--templates", "generated/fmha_mha_bf16.py", cwd=tmp_path)
    assert by_module.returncode == 0 and by_module.stdout == specgen(
        "diff", "--templates", "specs/fmha_mha_bf16.yaml", cwd=tmp_path).stdout
    (tmp_path / "notes.py").write_text("x = 1\n")
    refused = specgen("diff", "--templates", "notes.py", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        "specgen diff: --templates takes specs or folders of specs; notes.py is not a generated "
        "module whose header names its spec"]
    (tmp_path / "specs" / "fmha_mha_bf16.yaml").unlink()
    gone = specgen("diff", "--templates", "generated/fmha_mha_bf16.py", cwd=tmp_path)
    assert gone.returncode == 2 and "made from specs/fmha_mha_bf16.yaml, which is gone" in gone.stderr


def test_templates_takes_a_module_in_a_linked_output_folder(tmp_path):
    """generated/ as a symbolic link to a folder elsewhere: the header names the spec
    from the project that holds the link (jobs.project_dir), and --templates looks it
    up there. It looked beside the link's target ("... which is gone")."""
    project = tmp_path / "proj"
    (project / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "specs" / "fmha_mha_bf16.yaml", project / "specs")
    (tmp_path / "disk" / "gen").mkdir(parents=True)
    (project / "generated").symlink_to(tmp_path / "disk" / "gen")
    assert specgen("build", "specs", "--no-compile", cwd=project).returncode == 0
    by_module = specgen("diff", "--templates", "generated/fmha_mha_bf16.py", cwd=project)
    assert by_module.returncode == 0, by_module.stderr
    assert by_module.stdout == specgen("diff", "--templates", "specs/fmha_mha_bf16.yaml", cwd=project).stdout

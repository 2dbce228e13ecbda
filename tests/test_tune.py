"""`specgen tune` without a GPU: the search space, the choice of configs and
buckets, the write-back into the YAML (comments kept), and the CLI's errors."""

import pytest
import yaml

from specgen.errors import UsageError
from specgen.spec import AutotuneSpace, load_spec, validate_spec
from specgen.commands.tune import Timed, choose, finalists, parse_seqs, search_space, write_back

from .helpers import ROOT
from .test_cli import specgen

A = {"tile_m": 64, "tile_n": 128, "occupancy": 2, "num_ctas": None, "num_worker_warps": None,
     "opt_level": None, "tile_order": "per_head"}
B = {**A, "tile_m": 128, "occupancy": 1, "num_worker_warps": 8}
C = {**A, "tile_n": 64}


def test_search_space_is_the_product_minus_what_the_kernel_cannot_take():
    space = AutotuneSpace(tile_m=[16, 64], tile_n=[64], occupancy=[1, 2], num_worker_warps=[None, 8])
    assert space.size() == 8 and len(search_space(space)) == 8
    halves = search_space(space, q_subtiles=2)  # 16 rows cannot be split in two tiles of >= 16
    assert len(halves) == 4 and all(c["tile_m"] == 64 for c in halves)


def test_choose_keeps_a_bucket_only_where_it_wins_by_min_gain():
    results = {
        1024: [Timed(A, 90.0), Timed(B, 100.0)],
        2048: [Timed(A, 280.0), Timed(B, 290.0)],
        8192: [Timed(B, 3400.0), Timed(A, 3600.0)],
        16384: [Timed(B, 14800.0), Timed(A, 16000.0)],
    }
    own, buckets = choose(results, seq_buckets=True, min_gain=0.02)
    assert own == B
    assert buckets == [{"max_seq_k": 2048, **A}]  # 1024 and 2048 merge into one bucket
    # 2048's win is 3.4%: under a 5% threshold that length goes back to the own config,
    # and 1024 (10% faster) keeps its bucket.
    own, buckets = choose(results, seq_buckets=True, min_gain=0.05)
    assert buckets == [{"max_seq_k": 1024, **A}]
    assert choose(results, seq_buckets=False, min_gain=0.0) == (B, [])


def test_choose_makes_contiguous_buckets():
    # A wins at 1k, B (the own config) at 2k, C at 4k: 2k must get an explicit
    # bucket, or the 4k bucket would catch it.
    results = {
        1024: [Timed(A, 1.0), Timed(B, 2.0)],
        2048: [Timed(B, 1.0), Timed(A, 2.0)],
        4096: [Timed(C, 1.0), Timed(B, 2.0)],
        8192: [Timed(B, 1.0), Timed(C, 2.0)],
    }
    own, buckets = choose(results, seq_buckets=True, min_gain=0.02)
    assert own == B
    assert [b["max_seq_k"] for b in buckets] == [1024, 2048, 4096]
    assert [b["tile_n"] for b in buckets] == [128, 128, 64]


SPEC_TEXT = """\
# A tuned spec keeps this comment.
name: tuned   # and this one
causal: true
targets:
  default: {tile_m: 64, tile_n: 64, occupancy: 2}
  sm_90:   {tile_m: 64, tile_n: 64, occupancy: 2, num_ctas: 2}   # before tuning
  sm_100:  {tile_m: 128, tile_n: 128, occupancy: 1}
autotune:
  sm_90: {tile_m: [64, 128]}
"""


def test_write_back_updates_the_target_and_keeps_comments_and_order():
    text = write_back(SPEC_TEXT, "t.yaml", "sm_90", B, [{"max_seq_k": 2048, **A}])
    assert text.startswith("# A tuned spec keeps this comment.\nname: tuned   # and this one\n")
    assert "autotune:\n  sm_90: {tile_m: [64, 128]}\n" in text
    keys = [line.split(":")[0].strip() for line in text.splitlines() if line.startswith("  ") and ":" in line]
    assert keys.index("default") < keys.index("sm_90") < keys.index("sm_100")
    spec = validate_spec(yaml.safe_load(text))
    sm90 = spec.targets["sm_90"]
    assert (sm90.tile_m, sm90.occupancy, sm90.num_worker_warps, sm90.num_ctas) == (128, 1, 8, None)
    assert [(b.max_seq_k, b.tile_m, b.tile_n) for b in sm90.by_seq_k] == [(2048, 64, 128)]
    # Tuning again without buckets removes them and keeps one line.
    again = write_back(text, "t.yaml", "sm_90", A, [])
    assert validate_spec(yaml.safe_load(again)).targets["sm_90"].by_seq_k == []
    assert "sm_90: {tile_m: 64, tile_n: 128, occupancy: 2}" in again


def test_write_back_writes_the_global_tile_order_only_where_chosen():
    text = write_back(SPEC_TEXT, "t.yaml", "sm_90", B, [{"max_seq_k": 2048, **A, "tile_order": "global"}])
    assert "tile_order: per_head" not in text and text.count("tile_order: global") == 1
    sm90 = validate_spec(yaml.safe_load(text)).targets["sm_90"]
    assert sm90.tile_order == "per_head" and sm90.by_seq_k[0].tile_order == "global"


def test_search_space_includes_both_tile_orders_when_declared():
    space = AutotuneSpace(tile_m=[64], tile_n=[64], occupancy=[1], tile_order=["per_head", "global"])
    orders = [c["tile_order"] for c in search_space(space)]
    assert orders == ["per_head", "global"]
    from specgen.commands.tune import describe
    assert describe(search_space(space)[1]) == "64x64 occ1 global"


def test_finalists_are_the_fastest_plus_the_long_sequence_winner():
    timed = [Timed(A, 90.0), Timed(B, 120.0), Timed(C, 80.0)]
    assert finalists(timed, 2, None) == [C, A]
    assert finalists(timed, 2, B) == [C, A, B]  # own config re-timed so choose() can weigh it
    assert finalists(timed, 2, A) == [C, A]
    assert finalists(timed, 5, B) == [C, A, B]
    assert finalists([Timed(A, 1.0)], 1, C) == [A]  # own did not run at this length


def test_write_back_adds_a_missing_target():
    text = write_back(SPEC_TEXT, "t.yaml", "sm_120", A, [])
    assert validate_spec(yaml.safe_load(text)).targets["sm_120"].tile_n == 128


def test_parse_seqs():
    assert parse_seqs("8192, 2048,2048") == [2048, 8192]
    assert parse_seqs(None) is None
    assert parse_seqs(" 1 ,1048576") == [1, 1 << 20]
    for bad in ("", "a,b", "0,1024", "1_024", "+8", "\u00b2", "1048577", "99999999999999"):
        with pytest.raises(UsageError, match="--seqs"):
            parse_seqs(bad)


def test_shipped_optimised_specs_declare_an_sm_90_space():
    for name in ("fmha_gqa_causal", "fmha_gqa8_bf16", "fmha_mha_bf16", "fmha_mha_f16_d128",
                 "fmha_gqa4_f16_d64"):
        spec = load_spec(ROOT / "specs" / f"{name}.yaml")
        assert spec.autotune["sm_90"].size() >= 8


@pytest.mark.parametrize("args,message", [
    (["specs/fmha_seed_baseline.yaml", "--target", "sm_90"],
     "specs/fmha_seed_baseline.yaml: autotune.sm_90: no search space for sm_90"),
    (["specs/fmha_gqa_causal.yaml", "--target", "hopper"], "--target: 'hopper' must be a GPU target tileiras compiles for"),
    (["specs/fmha_gqa_causal.yaml", "--target", "sm_90", "--seqs", "x"], "--seqs: expected"),
    (["specs/fmha_gqa_causal.yaml", "--target", "sm_90", "--confirm", "-1"], "--confirm: expected a count"),
    (["specs/fmha_gqa_causal.yaml", "--target", "sm_90", "--confirm", "\u00b2"],
     "--confirm: expected a count in [0, 64], got '\u00b2'"),
    (["specs/fmha_gqa_causal.yaml", "--target", "sm_90", "--suite", "nope"], "--suite: unknown"),
])
def test_tune_errors_exit_2_with_one_line(args, message):
    result = specgen("tune", *args, cwd=ROOT)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_tune_without_cuda_exits_2_and_leaves_the_spec(tmp_path):
    spec = tmp_path / "t.yaml"
    spec.write_text(SPEC_TEXT)
    result = specgen("tune", str(spec), "--target", "sm_90", "--gen", str(tmp_path / "gen"),
                     cwd=tmp_path)
    assert result.returncode == 2 and "CUDA" in result.stderr, result.stderr
    assert spec.read_text() == SPEC_TEXT


GRID_CASES = {
    "packed block map": ("fmha_document_mask", {}),
    "packed, global order": ("fmha_gqa_causal", {"pack_gqa": True}),
    "per-length tile order": ("fmha_gqa_causal", {}),
    "persistent": ("fmha_gqa_causal", {"targets": {"sm_90": {"tile_m": 128, "tile_n": 128, "occupancy": 1,
                                                              "num_worker_warps": 8, "persistent": True}}}),
}


@pytest.mark.parametrize("case", sorted(GRID_CASES))
@pytest.mark.parametrize("seq", [300, 1000])
def test_tune_launches_the_grid_the_generated_launcher_launches(case, seq):
    """tune launches the kernel itself: its grid must be the one the module's own
    launcher computes (recorded from an emulated call), for packed tiles, tile orders
    and persistent launches."""
    import torch
    import yaml

    from specgen.check import emulate
    from specgen.check.cases import feature_inputs, random_qkv, shape_dims
    from specgen.commands.tune import launch_grid

    from .helpers import ROOT, render_spec_data

    name, overrides = GRID_CASES[case]
    data = {**yaml.safe_load((ROOT / "specs" / f"{name}.yaml").read_text()), **overrides}
    plan, source = render_spec_data(data, f"specs/{name}.yaml")
    module = emulate.load_module(ROOT / "generated" / f"{name}.py", source=source,
                                 name=f"_test_tune_grid_{case.replace(' ', '_')}_{seq}")
    launches = []
    module.ct.launch = lambda stream, grid, kernel, args: launches.append((kernel._pyfunc.__name__, grid))
    g = torch.Generator().manual_seed(1)
    q, k, v = random_qkv(module.SPEC, 2, 2, seq, seq, generator=g, device="cpu")
    extra = feature_inputs(module.SPEC, shape_dims(q, k), g, device="cpu")
    with emulate.emulating():
        module.attention(q, k, v, **extra)
    config, _ = module._launch_config(q.device, seq)
    grids = [grid for kernel, grid in launches if kernel == plan.kernel_name]
    assert grids == [tuple(launch_grid(plan, config, seq, q.shape[0] * q.shape[1], 132))], (launches, config)



@pytest.mark.parametrize("bom,newline", [("", "\n"), ("", "\r\n"), ("\ufeff", "\r\n"), ("\ufeff", "\n")])
def test_a_tuned_spec_keeps_its_byte_order_mark_and_line_endings(tmp_path, bom, newline):
    from specgen.commands.tune import rewrite_spec_file
    from specgen.spec import load_spec

    path = tmp_path / "t.yaml"
    path.write_bytes((bom + SPEC_TEXT.replace("\n", newline)).encode())
    assert rewrite_spec_file(path, lambda text: write_back(text, "t.yaml", "sm_90", B, []))
    raw = path.read_bytes().decode()
    assert raw.startswith(bom) and raw.count("\n") == raw.count(newline) > 0
    assert "\r\n" not in raw or newline == "\r\n"
    assert load_spec(path).targets["sm_90"].tile_m == B["tile_m"]
    before = path.read_bytes()
    assert not rewrite_spec_file(path, lambda text: text) and path.read_bytes() == before


def test_tune_refuses_a_hand_edited_module_before_searching(tmp_path):
    """Found after the search, it left the spec rewritten and the module stale."""
    (tmp_path / "specs").mkdir()
    (tmp_path / "generated").mkdir()
    spec = (ROOT / "specs" / "fmha_gqa_causal.yaml").read_text()
    (tmp_path / "specs" / "fmha_gqa_causal.yaml").write_text(spec)
    module = (ROOT / "generated" / "fmha_gqa_causal.py").read_text()
    (tmp_path / "generated" / "fmha_gqa_causal.py").write_text(module + "# my change\n")
    result = specgen("tune", "specs/fmha_gqa_causal.yaml", "--target", "sm_90", cwd=tmp_path)
    assert result.returncode == 2 and "generated/fmha_gqa_causal.py: edited by hand" in result.stderr, \
        result.stderr
    assert (tmp_path / "specs" / "fmha_gqa_causal.yaml").read_text() == spec


def test_a_space_of_configs_the_spec_refuses_is_named_before_a_gpu_is_asked_for(tmp_path):
    """Each config must be a valid targets entry of the spec (a block-sparse spec
    launches one CTA per query tile: no persistent grid); a space with none is bad
    input, named before the GPU check."""
    text = (ROOT / "specs" / "fmha_document_mask.yaml").read_text()
    spec = tmp_path / "sparse.yaml"
    spec.write_text(text + "autotune:\n  sm_90: {tile_m: [64], tile_n: [64], persistent: [true]}\n")
    result = specgen("tune", spec, "--target", "sm_90", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"{spec}: autotune.sm_90: no config of the space is a valid target "
                                     "(targets.sm_90.persistent: block_sparse launches one CTA per query "
                                     "tile; use null or false, got true)")


SECTIONED = """\
name: tuned
causal: true
targets:
  sm_90:
    tile_m: 64
    tile_n: 64
    num_ctas: 2   # a cluster
    by_seq_k: [{max_seq_k: 1024, tile_m: 64, tile_n: 64}]   # short keys

  sm_100: {tile_m: 128, tile_n: 128, occupancy: 1}   # not tuned here

# ---- search space ----
autotune:
  sm_90: {tile_m: [64, 128]}
"""


@pytest.mark.parametrize("buckets", [[], [{"max_seq_k": 2048, **A}]])
def test_write_back_keeps_the_blank_lines_and_comments_after_the_target(buckets):
    """ruamel.yaml keeps them on the target's last value: they went with a replaced
    key or bucket, or moved inside the target."""
    text = write_back(SECTIONED, "t.yaml", "sm_90", B, buckets)
    assert "\n\n  sm_100: {tile_m: 128, tile_n: 128, occupancy: 1}   # not tuned here\n" \
           "\n# ---- search space ----\nautotune:\n" in text, text
    last = write_back(text.replace("\n\n  sm_100: {tile_m: 128, tile_n: 128, occupancy: 1}   # not tuned here", ""),
                      "t.yaml", "sm_90", A, buckets)
    assert "\n\n# ---- search space ----\nautotune:\n" in last, last
    assert validate_spec(yaml.safe_load(text)).targets["sm_90"].tile_m == 128


def test_write_back_keeps_a_comment_at_the_end_of_the_file():
    text = "name: tuned\ncausal: true\ntargets:\n  sm_90:\n    tile_m: 64\n    tile_n: 64\n" \
           "    by_seq_k:\n      - {max_seq_k: 1024, tile_m: 64, tile_n: 64}\n# the end\n"
    for buckets in ([], [{"max_seq_k": 2048, **A}]):
        assert write_back(text, "t.yaml", "sm_90", B, buckets).endswith("\n# the end\n")


def test_write_back_keeps_a_block_target_with_comments_a_block():
    """Made one line, its comments landed inside the flow mapping:
    ``{tile_m: 128 # occ`` then a line that starts with a comma."""
    text = "name: tuned\ncausal: true\ntargets:\n  sm_90:\n    # tuned by hand\n    tile_m: 64\n" \
           "    tile_n: 64\n    occupancy: 2   # two per SM\n"
    out = write_back(text, "t.yaml", "sm_90", B, [])
    assert out == ("name: tuned\ncausal: true\ntargets:\n  sm_90:\n    # tuned by hand\n    tile_m: 128\n"
                   "    tile_n: 128\n    occupancy: 1   # two per SM\n    num_worker_warps: 8\n"), out


def test_write_back_keeps_nulls_quotes_and_sequence_indentation_as_written():
    """ruamel.yaml wrote every null as nothing (``window: null`` became ``window:``) and
    re-indented every block sequence of the file to its own style."""
    text = ("name: tuned\ncausal: true\nwindow: null\nscore_mod: ~\ncompile_for:\n- sm_90\n- sm_100\n"
            "targets:\n  sm_90: {tile_m: 64, tile_n: 128, num_ctas: null, tile_order: \"global\"}\n"
            "autotune:\n  sm_90:\n    tile_m:\n    - 64\n    - 128\n")
    out = write_back(text, "t.yaml", "sm_90", {**A, "tile_order": "global"}, [])
    assert out == text.replace('"global"}', '"global", occupancy: 2}'), out
    with_buckets = write_back(text, "t.yaml", "sm_90", B, [{"max_seq_k": 2048, **A}])
    assert "compile_for:\n- sm_90\n- sm_100\n" in with_buckets and "window: null\nscore_mod: ~\n" in with_buckets
    assert "    by_seq_k:\n    - {max_seq_k: 2048" in with_buckets, with_buckets


def test_a_space_that_spells_one_launch_twice_is_searched_once(tmp_path):
    """null and its meaning (opt_level 3, persistent false, v_transposed the spec's
    default) launch the same kernel: each launch was timed twice, and a bucket could
    hold the own config's launch under the other spelling."""
    from specgen.commands.tune import distinct_launches

    space = AutotuneSpace(tile_m=[64], tile_n=[64], occupancy=[2], opt_level=[None, 3, 2],
                          persistent=[None, False], v_transposed=[None, False, True])
    configs = distinct_launches(search_space(space), v_default=False)
    assert [(c["opt_level"], c["persistent"], c["v_transposed"]) for c in configs] == [
        (None, None, None), (None, None, True), (2, None, None), (2, None, True)]
    assert len(distinct_launches(search_space(space), v_default=True)) == 4
    spec = tmp_path / "t.yaml"
    spec.write_text(SPEC_TEXT.replace("{tile_m: [64, 128]}", "{tile_m: [64], persistent: [null, false]}"))
    result = specgen("tune", spec, "--target", "sm_90", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2 and "CUDA" in result.stderr, result.stderr
    assert ("autotune.sm_90: 4 of 8 configs skipped, the same launch as an earlier one" in result.stderr
            and "4 configs x 5 lengths" in result.stderr), result.stderr


ALIGNED = """\
name:      aligned   # values aligned after the colon
causal:    true
head_dim:  128
targets:
  default: {tile_m: 64,  tile_n: 64, occupancy: 2}
  sm_90:   {tile_m: 64,  tile_n: 64, occupancy: 2}   # before tuning
  sm_100:  {tile_m: 128, tile_n: 128, occupancy: 1}
"""


def test_write_back_keeps_the_spaces_that_align_values():
    """ruamel.yaml writes one space after a colon: every aligned line of the file lost
    its alignment, the tuned target's own line too."""
    text = write_back(ALIGNED, "t.yaml", "sm_100", A, [])
    old, new = ALIGNED.splitlines(), text.splitlines()
    assert new[:6] == old[:6]  # every other line as written, spaces and all
    assert new[6] == "  sm_100:  {tile_m: 64, tile_n: 128, occupancy: 2}"
    assert yaml.safe_load(text)["targets"]["sm_100"] == {"tile_m": 64, "tile_n": 128, "occupancy": 2}
    assert yaml.safe_load(text)["targets"]["sm_90"] == yaml.safe_load(ALIGNED)["targets"]["sm_90"]
    # A target that becomes a block (buckets) is written as ruamel.yaml writes it.
    text = write_back(ALIGNED, "t.yaml", "sm_90", B, [{"max_seq_k": 2048, **A}])
    assert text.splitlines()[:5] == old[:5] and text.splitlines()[-1] == old[-1]
    assert yaml.safe_load(text)["targets"]["sm_90"]["by_seq_k"][0]["max_seq_k"] == 2048


@pytest.mark.parametrize("mode", [0o640, 0o600, 0o755])
def test_a_tuned_spec_keeps_its_mode_and_its_link(tmp_path, mode):
    """The rewrite replaces the file, not its permissions (0640 came back 0644,
    readable by everyone) nor a link to it."""
    import os
    import stat

    from specgen.commands.tune import rewrite_spec_file

    path, link = tmp_path / "t.yaml", tmp_path / "link.yaml"
    path.write_text(SPEC_TEXT)
    path.chmod(mode)
    link.symlink_to(path.name)
    assert rewrite_spec_file(link, lambda text: write_back(text, "link.yaml", "sm_90", B, []))
    assert link.is_symlink() and os.readlink(link) == path.name
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert load_spec(path).targets["sm_90"].tile_m == B["tile_m"]


def test_a_spec_edited_during_the_search_is_not_written(tmp_path):
    """tune read the spec at its start and wrote the configs searched for it into
    whatever the file held minutes later: an edit made meanwhile (another tile, a
    changed feature) got configs never timed for it. The write-back now refuses a file
    that changed, naming where the choice was kept."""
    from specgen.commands.tune import rewrite_spec_file

    path = tmp_path / "t.yaml"
    path.write_text(SPEC_TEXT)
    read = path.read_bytes()
    path.write_text(SPEC_TEXT.replace("causal: true", "causal: false"))  # edited meanwhile
    with pytest.raises(UsageError, match=r"t.yaml: changed since tune read it, .* not written into it; "
                                         r"the choice is in r.json"):
        rewrite_spec_file(path, lambda text: write_back(text, "t.yaml", "sm_90", B, []), expected=read,
                          kept="; the choice is in r.json")
    assert "causal: false" in path.read_text() and "num_worker_warps" not in path.read_text()
    path.write_bytes(read)  # as read: written
    assert rewrite_spec_file(path, lambda text: write_back(text, "t.yaml", "sm_90", B, []), expected=read)

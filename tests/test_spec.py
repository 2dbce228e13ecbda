"""Spec validation: defaults, every rule, and the one-line messages users see."""

import pytest

from specgen.errors import SpecError
from specgen.spec import Spec, load_spec, parse_spec_text, validate_spec

from .helpers import ROOT, SPECS


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_specs_are_valid(path):
    spec = load_spec(path)
    assert spec.name == path.stem
    assert "default" in spec.targets


def test_two_line_spec_gets_sensible_defaults():
    spec = validate_spec(parse_spec_text("name: tiny\ncausal: true\n"), "t.yaml")
    assert spec.family == "prefill" and spec.dtype == "float16" and spec.head_dim == 128
    assert spec.gqa_ratio == 1 and spec.loop_split and spec.use_block_remap
    assert spec.fast_math.exp2 and spec.loads.k_transposed and spec.loads.k_latency == 2
    assert spec.targets["default"].tile_m == 64 and spec.targets["default"].occupancy == 2
    assert spec.compile_for == ["sm_90", "sm_100"]


def test_block_remap_null_follows_causal():
    assert not validate_spec({"name": "a"}).use_block_remap
    assert validate_spec({"name": "a", "causal": True}).use_block_remap
    assert not validate_spec({"name": "a", "causal": True, "block_remap": False}).use_block_remap


def test_missing_default_target_is_filled_in():
    spec = validate_spec({"name": "a", "targets": {"sm_90": {"tile_m": 128, "tile_n": 64}}})
    assert list(spec.targets) == ["default", "sm_90"]
    assert spec.targets["sm_90"].occupancy == 2


def _error(data, path="specs/bad.yaml"):
    with pytest.raises(SpecError) as info:
        validate_spec(data, path)
    return info.value.lines()


BAD = [
    # (overrides, expected line)
    ({"targets": {"sm_90": {"tile_m": 100, "tile_n": 64}}},
     "specs/bad.yaml: targets.sm_90.tile_m: must be a power of two in [16, 256], got 100"),
    ({"targets": {"default": {"tile_m": 64, "tile_n": 512}}},
     "specs/bad.yaml: targets.default.tile_n: must be a power of two in [16, 256], got 512"),
    ({"targets": {"default": {"tile_m": 8, "tile_n": 64}}},
     "specs/bad.yaml: targets.default.tile_m: must be a power of two in [16, 256], got 8"),
    ({"targets": {"default": {"tile_m": 64, "tile_n": 64, "occupancy": 0}}},
     "specs/bad.yaml: targets.default.occupancy: must be an integer in [1, 32], got 0"),
    ({"targets": {"sm_9": {"tile_m": 64, "tile_n": 64}}},
     "specs/bad.yaml: targets.sm_9: unknown target; allowed: 'default' or sm_80, sm_86, sm_87, "
     "sm_88, sm_89, sm_90, sm_100, sm_103, sm_107, sm_110, sm_120, sm_121, got \"sm_9\""),
    ({"targets": {"default": {"tile_m": 64}}},
     "specs/bad.yaml: targets.default.tile_n: required field is missing"),
    ({"dtype": "float8_e4m3fn", "head_dim": 72},
     "specs/bad.yaml: head_dim: must be a multiple of 16 with dtype float8_e4m3fn (16-byte aligned "
     "rows of 1-byte elements), got 72"),
    ({"dtype": "float8_e4m3fn", "prescale_q": True},
     "specs/bad.yaml: prescale_q: true needs a 16-bit dtype (a pre-scaled Q would be rounded back "
     "to float8); use false, got true"),
    ({"out_dtype": "float32"},
     "specs/bad.yaml: out_dtype: must be one of 'float16' or 'bfloat16', got \"float32\""),
    ({"varlen": True, "dropout": True},
     "specs/bad.yaml: varlen: true does not support dropout yet (the reference's b and positions "
     "would be per sequence); use a padded batch, or a document mask_mod instead of varlen, got true"),
    ({"dtype": "float32"},
     "specs/bad.yaml: dtype: must be one of 'float16', 'bfloat16' or 'float8_e4m3fn', got \"float32\""),
    ({"head_dim": 100}, "specs/bad.yaml: head_dim: must be a multiple of 8 in [16, 256], got 100"),
    ({"head_dim": 264}, "specs/bad.yaml: head_dim: must be a multiple of 8 in [16, 256], got 264"),
    ({"v_head_dim": 12}, "specs/bad.yaml: v_head_dim: must be a multiple of 8 in [16, 256], got 12"),
    ({"head_dim": 80, "loads": {"check_bounds": "masked"}},
     "specs/bad.yaml: loads.check_bounds: 'masked' needs power-of-two head dims (head dim 80 is "
     "padded, so every tile reads past the array's last axis); use 'all'"),
    ({"gqa_ratio": 0}, "specs/bad.yaml: gqa_ratio: must be an integer in [1, 128], got 0"),
    ({"gqa_ratio": 2.5}, "specs/bad.yaml: gqa_ratio: must be an integer, got 2.5"),
    ({"causal": "yes"}, "specs/bad.yaml: causal: must be true or false, got \"yes\""),
    ({"family": "encode"}, "specs/bad.yaml: family: must be one of 'prefill' or 'decode', got \"encode\""),
    ({"family": "decode", "varlen": True},
     "specs/bad.yaml: varlen: a prefill field, not supported by family decode"),
    ({"family": "decode", "gqa_ratio": 8, "max_q_len": 4, "targets": {"sm_90": {"tile_m": 16, "tile_n": 64}}},
     "specs/bad.yaml: targets.sm_90.tile_m: a decode tile packs gqa_ratio x max_q_len = 32 query rows, "
     "padded to 32; set tile_m: 32 (or leave targets out), got 16"),
    ({"family": "decode", "paged": {"page_size": 32}, "targets": {"sm_90": {"tile_m": 16, "tile_n": 64}}},
     "specs/bad.yaml: targets.sm_90.tile_n: must be at most paged.page_size 32 (a key tile must lie in one "
     "page), got 64"),
    ({"family": "decode", "paged": {"page_size": 48}},
     "specs/bad.yaml: paged.page_size: must be a power of two in [16, 1024], got 48"),
    ({"max_q_len": 2}, "specs/bad.yaml: max_q_len: a decode field, not supported by family prefill"),
    ({"family": "decode", "splits": 65}, "specs/bad.yaml: splits: must be 'auto' or an integer in [1, 64], got 65"),
    ({"family": "decode", "pdl": "yes"}, "specs/bad.yaml: pdl: must be 'auto', true or false, got \"yes\""),
    ({"family": "decode", "pdl": 1}, "specs/bad.yaml: pdl: must be 'auto', true or false, got 1"),
    ({"family": "decode", "pdl": "true"}, "specs/bad.yaml: pdl: must be 'auto', true or false, got \"true\""),
    ({"pdl": True}, "specs/bad.yaml: pdl: a decode field, not supported by family prefill"),
    # Written at its default, a field of the other family is still refused: a prefill
    # spec's `pdl: auto` reads as a request family prefill would ignore.
    ({"pdl": "auto"}, "specs/bad.yaml: pdl: a decode field, not supported by family prefill"),
    ({"family": "decode", "backward": False},
     "specs/bad.yaml: backward: a prefill field, not supported by family decode"),
    ({"family": "decode", "dtype": "bfloat16", "kv_dtype": "float16"},
     "specs/bad.yaml: kv_dtype: must be null, bfloat16 (the dtype) or float8_e4m3fn, got \"float16\""),
    ({"family": "decode", "kv_dtype": "int8"},
     "specs/bad.yaml: kv_dtype: must be one of 'float16', 'bfloat16' or 'float8_e4m3fn', got \"int8\""),
    ({"family": "decode", "kv_dtype": "float8_e4m3fn", "head_dim": 72},
     "specs/bad.yaml: head_dim: family decode needs a power of two (16, 32, 64, 128 or 256; the prefill pads "
     "other sizes), got 72"),
    # The decode kernels' tiles are head_dim wide: 80 rendered, emulated right, and
    # failed to compile ("Result tile shape must be power of 2").
    ({"family": "decode", "head_dim": 80},
     "specs/bad.yaml: head_dim: family decode needs a power of two (16, 32, 64, 128 or 256; the prefill pads "
     "other sizes), got 80"),
    ({"kv_dtype": "float8_e4m3fn"}, "specs/bad.yaml: kv_dtype: a decode field, not supported by family prefill"),
    ({"v_cache_transposed": True},
     "specs/bad.yaml: v_cache_transposed: a decode field, not supported by family prefill"),
    ({"family": "decode", "v_cache_transposed": "keys_last"},
     "specs/bad.yaml: v_cache_transposed: must be true or false, got \"keys_last\""),
    ({"backward": True, "dtype": "float8_e4m3fn"},
     "specs/bad.yaml: backward: true does not support dtype float8_e4m3fn yet; the backward kernels cover "
     "causal/non-causal, windows, soft-cap, score_mod/mask_mod hooks, sinks, dropout, varlen, GQA, any "
     "head_dim and v_head_dim, got true"),
    ({"tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
      "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
     "specs/bad.yaml: tensors.slope.learnable: true needs backward: true (a gradient comes from the "
     "backward kernels)"),
    # Decode has no backward: "needs backward: true" sent the writer to a field decode refuses.
    ({"family": "decode", "tensors": {"w": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
      "mask_mod": "w[h] > 0.5"},
     "specs/bad.yaml: tensors.w.learnable: family decode has no backward, so no tensor gets a gradient; "
     "use false"),
    ({"backward": True, "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"], "learnable": True}},
      "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]"},
     "specs/bad.yaml: tensors.doc.learnable: true needs dtype float32 (an int32 tensor has no gradient)"),
    ({"backward": True, "tensors": {"w": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
      "mask_mod": "w[h] > 0.5"},
     "specs/bad.yaml: tensors.w.learnable: true needs the tensor in score_mod (a mask_mod gives it no "
     "gradient)"),
    ({"backward": True, "tensors": {"w": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
      "score_mod": "where(w[h] > 0.5, score, 2.0 * score)"},
     "specs/bad.yaml: tensors.w.learnable: true needs score_mod's value to vary with w (it is read only "
     "where the value does not depend on it, such as a condition: its gradient is 0); drop learnable"),
    ({"backward": True, "deterministic": True,
      "tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
      "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
     "specs/bad.yaml: tensors.slope.learnable: true cannot be combined with deterministic: true (its "
     "gradient is accumulated with atomic adds)"),
    ({"deterministic": True}, "specs/bad.yaml: deterministic: true needs backward: true"),
    ({"family": "decode", "deterministic": True},
     "specs/bad.yaml: deterministic: a prefill field, not supported by family decode"),
    ({"family": "decode", "backward": True},
     "specs/bad.yaml: backward: a prefill field, not supported by family decode"),
    ({"block_remap": True},
     "specs/bad.yaml: block_remap: true needs causal: true (non-causal query tiles all "
     "do the same work); use false or null, got true"),
    ({"loads": {"k_latency": 11}},
     "specs/bad.yaml: loads.k_latency: must be an integer in [1, 10] or null, got 11"),
    ({"loads": {"v_latency": 0}},
     "specs/bad.yaml: loads.v_latency: must be an integer in [1, 10] or null, got 0"),
    ({"fast_math": {"exp3": True}},
     "specs/bad.yaml: fast_math.exp3: unknown key (did you mean exp2?); allowed keys: exp2, flush_to_zero, approx_div"),
    ({"bogus": 1},
     "specs/bad.yaml: bogus: unknown key; allowed keys: name, family, dtype, out_dtype, kv_dtype, head_dim, v_head_dim, "
     "gqa_ratio, max_q_len, paged, causal, window, softcap, tensors, score_mod, mask_mod, skip_masked_tiles, block_sparse, dropout, varlen, sinks, return_lse, fast_math, loop_split, block_remap, loads, targets, prescale_q, "
     "q_subtiles, qk_ahead, head_dim_split, pack_gqa, splits, pdl, v_cache_transposed, backward, deterministic, context_parallel, compile_for, autotune"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "warps": 4}}},
     "specs/bad.yaml: targets.sm_90.warps: unknown key (did you mean num_worker_warps?); allowed keys: tile_m, tile_n, occupancy, "
     "num_ctas, num_worker_warps, opt_level, tile_order, v_transposed, persistent, by_seq_k"),
    ({"compile_for": []}, "specs/bad.yaml: compile_for: must not be empty, got []"),
    ({"compile_for": ["sm_90", "sm_90"]},
     "specs/bad.yaml: compile_for: lists sm_90 twice, got [\"sm_90\", \"sm_90\"]"),
    ({"compile_for": ["hopper"]},
     "specs/bad.yaml: compile_for[0]: must be a GPU target tileiras compiles for: sm_80, sm_86, "
     "sm_87, sm_88, sm_89, sm_90, sm_100, sm_103, sm_107, sm_110, sm_120, sm_121, got \"hopper\""),
    ({"fast_math": True}, "specs/bad.yaml: fast_math: must be a mapping, got true"),
    ({"head_dim_split": True},
     "specs/bad.yaml: head_dim_split: true needs a head_dim or v_head_dim that splits into two "
     "power-of-two tiles narrower than one padded tile (such as 80, 96, 160 or 192), got 128/128; "
     "use auto or false"),
    ({"head_dim_split": True, "head_dim": 112},
     "specs/bad.yaml: head_dim_split: true needs a head_dim or v_head_dim that splits into two "
     "power-of-two tiles narrower than one padded tile (such as 80, 96, 160 or 192), got 112/112; "
     "use auto or false"),
    ({"head_dim_split": True, "head_dim": 80, "dtype": "float8_e4m3fn"},
     "specs/bad.yaml: head_dim_split: true needs a 16-bit dtype (float8 pads its head dims); use auto or false"),
    ({"family": "decode", "head_dim_split": False},
     "specs/bad.yaml: head_dim_split: a prefill field, not supported by family decode"),
    ({"head_dim_split": "yes"},
     "specs/bad.yaml: head_dim_split: must be 'auto', true or false, got \"yes\""),
    ({"gqa_ratio": 10**40},
     "specs/bad.yaml: gqa_ratio: must be an integer in [1, 128], got " + str(10**40)),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[str(list(o)[0]) for o, _ in BAD])
def test_bad_fields_name_file_field_value_and_rule(overrides, expected):
    assert _error({"name": "ok", **overrides}) == [expected]


@pytest.mark.parametrize("name", ["class", "match", "_private", "has space", "a;b", "x'y",
                                  "two\nlines", "1abc", "ünï", ""])
def test_bad_names(name):
    (line,) = _error({"name": name})
    assert line.startswith("specs/bad.yaml: name: must be a Python identifier")
    assert "\n" not in line


def test_missing_name():
    assert _error({"causal": True}) == ["specs/bad.yaml: name: required field is missing"]


def test_several_errors_are_all_reported():
    lines = _error({"name": "ok", "dtype": "int8", "head_dim": 7})
    assert [line.split(":")[1].strip() for line in lines] == ["dtype", "head_dim"]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("", "a spec must be a YAML mapping, got empty"),
        ("- a\n- b\n", "a spec must be a YAML mapping, got a list"),
        ("name: a\nname: b\n", "invalid YAML: line 2, column 1: duplicate key 'name'"),
        ("name: [unclosed\n", "invalid YAML: line 2, column 1:"),
        ("!!python/object:os.system {}\n", "invalid YAML: line 1, column 1:"),
    ],
)
def test_bad_yaml_is_one_clear_line(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (line,) = info.value.lines()
    assert line.startswith(f"{path}: ") and expected in line


def test_unreadable_file(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "absent.yaml")
    assert "cannot read" in str(info.value)


def test_spec_is_immutable():
    spec = validate_spec({"name": "a"})
    with pytest.raises(Exception):
        spec.causal = True  # type: ignore[misc]
    assert isinstance(spec, Spec)


NEW_FIELDS_BAD = [
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "num_ctas": 3}}},
     "specs/bad.yaml: targets.sm_90.num_ctas: must be a power of two in [1, 16] or null (auto), got 3"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "num_worker_warps": 64}}},
     "specs/bad.yaml: targets.sm_90.num_worker_warps: must be 4 or 8 or null (auto) (tileiras 13.4 "
     "compiles no other), got 64"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "opt_level": 4}}},
     "specs/bad.yaml: targets.sm_90.opt_level: must be an integer in [0, 3] or null (the compiler's "
     "3), got 4"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "by_seq_k": [
        {"max_seq_k": 4096, "tile_m": 64, "tile_n": 64},
        {"max_seq_k": 2048, "tile_m": 64, "tile_n": 64}]}}},
     "specs/bad.yaml: targets.sm_90.by_seq_k: max_seq_k must increase from bucket to bucket, "
     "got 4096 then 2048"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "by_seq_k": [{"tile_m": 64, "tile_n": 64}]}}},
     "specs/bad.yaml: targets.sm_90.by_seq_k[0].max_seq_k: required field is missing"),
    ({"q_subtiles": 2, "targets": {"default": {"tile_m": 16, "tile_n": 64}}},
     "specs/bad.yaml: q_subtiles: 2 needs tile_m >= 32 in every target, got tile_m 16 in "
     "targets.default"),
    ({"q_subtiles": 2, "targets": {"default": {"tile_m": 64, "tile_n": 64, "by_seq_k": [
        {"max_seq_k": 2048, "tile_m": 16, "tile_n": 64}]}}},
     "specs/bad.yaml: q_subtiles: 2 needs tile_m >= 32 in every target, got tile_m 16 in "
     "targets.default.by_seq_k[0]"),
    ({"q_subtiles": 3}, "specs/bad.yaml: q_subtiles: must be one of 1 or 2, got 3"),
    ({"loop_split": False, "loads": {"check_bounds": "masked"}},
     "specs/bad.yaml: loads.check_bounds: 'masked' needs loop_split: true"),
    ({"autotune": {"sm_90": {"tile_m": [64, 64]}}},
     "specs/bad.yaml: autotune.sm_90.tile_m: lists a value twice, got [64, 64]"),
    ({"autotune": {"sm_90": {"occupancy": []}}},
     "specs/bad.yaml: autotune.sm_90.occupancy: must not be empty, got []"),
    ({"autotune": {"default": {}}},
     "specs/bad.yaml: autotune.default: must be a GPU target tileiras compiles for: sm_80"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "tile_order": "lpt"}}},
     "specs/bad.yaml: targets.sm_90.tile_order: must be one of 'per_head' or 'global', got \"lpt\""),
    ({"varlen": True, "targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "v_transposed": True}}},
     "specs/bad.yaml: targets.sm_90.v_transposed: varlen reads V as given; use null or false, got true"),
    ({"family": "decode", "targets": {"sm_90": {"tile_m": 16, "tile_n": 64, "v_transposed": True}}},
     "specs/bad.yaml: targets.sm_90.v_transposed: family decode reads V as given; use null or false, got true"),
    ({"varlen": True, "targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "persistent": True}}},
     "specs/bad.yaml: targets.sm_90.persistent: varlen launches one CTA per work item; use null or false, got true"),
    ({"family": "decode", "targets": {"sm_90": {"tile_m": 16, "tile_n": 64, "tile_order": "global"}}},
     "specs/bad.yaml: targets.sm_90.tile_order: family decode has no query tiles to launch in another "
     "order; use per_head, got \"global\""),
    ({"family": "decode", "autotune": {"sm_90": {"tile_n": [64, 128]}}},
     "specs/bad.yaml: autotune: family decode takes no search space (specgen tune searches prefill specs; "
     "set tile_n and occupancy under targets and time them with specgen bench), got sm_90"),
    ({"family": "decode", "targets": {"sm_90": {"tile_m": 16, "tile_n": 64, "persistent": True}}},
     "specs/bad.yaml: targets.sm_90.persistent: family decode launches one CTA per work item; "
     "use null or false, got true"),
    ({"varlen": True, "targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "by_seq_k": [
        {"max_seq_k": 64, "tile_m": 32, "tile_n": 32, "persistent": True}]}}},
     "specs/bad.yaml: targets.sm_90.by_seq_k[0].persistent: varlen launches one CTA per work item; "
     "use null or false, got true"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "persistent": 1}}},
     "specs/bad.yaml: targets.sm_90.persistent: must be true or false, got 1"),
    ({"targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "v_transposed": "yes"}}},
     "specs/bad.yaml: targets.sm_90.v_transposed: must be true or false, got \"yes\""),
    ({"window": {}}, "specs/bad.yaml: window: set left or right (or both); without either, drop window"),
    ({"window": {"left": -1}}, "specs/bad.yaml: window.left: must be an integer in [0, 536870912], got -1"),
    ({"window": {"right": 2**31 - 1}}, "specs/bad.yaml: window.right: must be at most 2**29 (536870912); for a "
     "window without this bound use null, got 2147483647"),
    ({"window": {"left": 10, "size": 3}}, "specs/bad.yaml: window.size: unknown key; allowed keys: left, right"),
    ({"causal": True, "window": {"left": 10, "right": 4}},
     "specs/bad.yaml: window.right: 4 needs causal: false (a causal kernel never sees keys after the "
     "query); use null or 0"),
    ({"softcap": 0.0}, "specs/bad.yaml: softcap: must be a number in [0.01, 1000000.0], got 0.0"),
    ({"softcap": 1e-300}, "specs/bad.yaml: softcap: must be a number in [0.01, 1000000.0], got 1e-300"),
    ({"softcap": "high"}, "specs/bad.yaml: softcap: must be a finite number, got \"high\""),
    ({"sinks": "yes"}, "specs/bad.yaml: sinks: must be true or false"),
    ({"return_lse": True, "q_subtiles": 2},
     "specs/bad.yaml: q_subtiles: 2 does not support return_lse yet; use 1"),
    ({"autotune": {"sm_90": {"tile_order": ["global", "global"]}}},
     "specs/bad.yaml: autotune.sm_90.tile_order: lists a value twice"),
    ({"qk_ahead": True, "q_subtiles": 2},
     "specs/bad.yaml: qk_ahead: true cannot be combined with q_subtiles 2 (their key loops skip "
     "tiles or split the query tile); use false"),
    ({"qk_ahead": True, "mask_mod": "q_idx >= kv_idx", "block_sparse": True},
     "specs/bad.yaml: qk_ahead: true cannot be combined with block_sparse"),
    ({"qk_ahead": True, "mask_mod": "q_idx >= kv_idx", "skip_masked_tiles": True},
     "specs/bad.yaml: qk_ahead: true cannot be combined with skip_masked_tiles"),
    ({"qk_ahead": True, "family": "decode"},
     "specs/bad.yaml: qk_ahead: a prefill field, not supported by family decode"),
    ({"qk_ahead": "yes"}, "specs/bad.yaml: qk_ahead: must be true or false"),
    ({"pack_gqa": True}, "specs/bad.yaml: pack_gqa: true needs gqa_ratio a power of two >= 2"),
    ({"pack_gqa": True, "gqa_ratio": 4, "sinks": True},
     "specs/bad.yaml: pack_gqa: true cannot be combined with sinks (a packed tile mixes query heads)"),
    ({"pack_gqa": True, "gqa_ratio": 4, "tensors": {"slope": {"dtype": "float32", "shape": ["heads"]}},
      "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
     "specs/bad.yaml: pack_gqa: true cannot be combined with a score_mod that reads h"),
    ({"pack_gqa": True, "gqa_ratio": 32, "targets": {"sm_90": {"tile_m": 16, "tile_n": 64}}},
     "specs/bad.yaml: targets.sm_90.tile_m: pack_gqa needs tile_m >= gqa_ratio 32"),
    ({"pack_gqa": True, "gqa_ratio": 4, "targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "persistent": True}}},
     "specs/bad.yaml: targets.sm_90.persistent: pack_gqa launches one CTA per query tile"),
    ({"pack_gqa": True, "family": "decode"}, "specs/bad.yaml: pack_gqa: a prefill field, not supported by family decode"),
    ({"pack_gqa": "yes"}, "specs/bad.yaml: pack_gqa: must be true or false"),
]


@pytest.mark.parametrize("overrides,expected", NEW_FIELDS_BAD, ids=[e.split(": ")[1] for _, e in NEW_FIELDS_BAD])
def test_tuning_fields_errors_name_the_field(overrides, expected):
    lines = _error({"name": "ok", **overrides})
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_spec_to_dict_round_trips_and_leaves_out_auto_hints():
    from specgen.spec import spec_to_dict

    spec = validate_spec({"name": "ok", "targets": {"sm_90": {
        "tile_m": 128, "tile_n": 64, "num_worker_warps": 8,
        "by_seq_k": [{"max_seq_k": 2048, "tile_m": 64, "tile_n": 64}]}}})
    data = spec_to_dict(spec)
    assert data["targets"]["sm_90"] == {
        "tile_m": 128, "tile_n": 64, "occupancy": 2, "num_worker_warps": 8,
        "by_seq_k": [{"tile_m": 64, "tile_n": 64, "occupancy": 2, "max_seq_k": 2048}]}
    assert "autotune" not in data
    assert validate_spec(data) == spec


def test_spec_to_dict_leaves_out_the_default_tile_order():
    from specgen.spec import spec_to_dict

    spec = validate_spec({"name": "ok", "causal": True, "targets": {"sm_90": {
        "tile_m": 128, "tile_n": 64, "tile_order": "per_head",
        "by_seq_k": [{"max_seq_k": 2048, "tile_m": 64, "tile_n": 64, "tile_order": "global"}]}}})
    data = spec_to_dict(spec)
    assert "tile_order" not in data["targets"]["sm_90"]
    assert data["targets"]["sm_90"]["by_seq_k"][0]["tile_order"] == "global"
    assert validate_spec(data) == spec


def test_cross_field_problems_all_come_in_one_run():
    data = {"name": "ok", "family": "decode", "gqa_ratio": 8, "paged": {"page_size": 16},
            "varlen": True,
            "targets": {"sm_90": {"tile_m": 64, "tile_n": 128,
                                  "by_seq_k": [{"max_seq_k": 64, "tile_m": 16, "tile_n": 16}]}}}
    assert _error(data) == [
        "specs/bad.yaml: varlen: a prefill field, not supported by family decode",
        "specs/bad.yaml: targets.sm_90.tile_m: a decode tile packs gqa_ratio x max_q_len = 8 query "
        "rows, padded to 16; set tile_m: 16 (or leave targets out), got 64",
        "specs/bad.yaml: targets.sm_90.tile_n: must be at most paged.page_size 16 (a key tile must "
        "lie in one page), got 128",
        "specs/bad.yaml: targets.sm_90.by_seq_k: decode specs take one config per target",
    ]


def test_the_order_of_targets_in_the_file_does_not_change_the_module():
    """Targets (and autotune spaces) come out default first, then by architecture,
    whatever order the file lists them in: the same spec gives the same bytes."""
    from .helpers import render_spec_data

    text = (ROOT / "specs" / "fmha_gemma_softcap.yaml").read_text()
    data = parse_spec_text(text, "specs/fmha_gemma_softcap.yaml")
    shuffled = {**data, "targets": dict(reversed(list(data["targets"].items())))}
    assert list(shuffled["targets"]) != list(data["targets"])
    assert list(validate_spec(shuffled).targets) == ["default", "sm_90", "sm_100"]
    assert render_spec_data(shuffled)[1] == render_spec_data(data)[1]
    spaces = {"sm_100": {"tile_m": [64, 128]}, "sm_90": {"tile_m": [64, 128]}}
    assert list(validate_spec({"name": "x", "autotune": spaces}).autotune) == ["sm_90", "sm_100"]


@pytest.mark.parametrize("fields, message", [
    ({"causal": False}, "causal: a prefill field, not supported by family decode, which is always "
                        "causal (each new token sees the cache and the new tokens before it); "
                        "remove the field, got false"),
    ({"causal": True}, "not supported by family decode, which is always causal"),
    ({"loads": {"check_bounds": "masked"}}, "loads.check_bounds: family decode checks every load's "
                                            "bounds"),
])
def test_decode_refuses_fields_it_would_ignore(fields, message):
    """A decode spec with causal: false built a causal kernel (the field was read as
    given and ignored); check_bounds: masked changed nothing either."""
    data = {"name": "d", "family": "decode", "dtype": "bfloat16", "head_dim": 64, "gqa_ratio": 4,
            **fields}
    with pytest.raises(SpecError) as caught:
        validate_spec(data, "d.yaml")
    lines = caught.value.lines()
    assert len(lines) == 1 and message in lines[0], lines


def test_float16_prescale_refuses_a_softcap_beyond_its_range():
    """Q * scale / softcap in float16 fell below its normal range (softcap 1e5, D64:
    output error 2e-2, LSE 2.4e-2, gradients 1.7e-2, against 2.6e-4 without prescale_q)."""
    base = {"name": "s", "dtype": "float16", "head_dim": 64, "causal": True, "prescale_q": True}
    with pytest.raises(SpecError) as caught:
        validate_spec({**base, "softcap": 100000.0}, "s.yaml")
    assert caught.value.lines() == [
        "s.yaml: prescale_q: true with float16 needs softcap <= 1000 (Q is pre-multiplied by "
        "scale / softcap in float16, and softcap 100000 takes it below float16's normal range, "
        "where its digits are lost); use false, or bfloat16, got true"]
    validate_spec({**base, "softcap": 1000.0}, "s.yaml")
    validate_spec({**base, "dtype": "bfloat16", "softcap": 100000.0}, "s.yaml")
    validate_spec({**base, "prescale_q": False, "softcap": 100000.0}, "s.yaml")


def test_a_tile_the_compiler_cannot_place_is_refused():
    """256 x 256 at D256 with 4 warps (1024 float32 values of S and the accumulator per
    thread) validated and then failed to compile for sm_90 with no message; 8 warps
    compile (512), as do 768 (256 x 256 at D128)."""
    base = {"name": "t", "dtype": "bfloat16", "head_dim": 256, "causal": True}
    big = {"tile_m": 256, "tile_n": 256, "occupancy": 1}
    with pytest.raises(SpecError) as caught:
        validate_spec({**base, "targets": {"default": big}}, "t.yaml")
    assert caught.value.lines() == [
        "t.yaml: targets.default.tile_m: tile_m x (tile_n + head dim 256) / (32 x 4 warps, as null "
        "counts) must "
        "be at most 768 float32 values per thread, which the compiler can place; use "
        "num_worker_warps: 8 or smaller tiles, got 256 x (256 + 256) / 128 = 1024"]
    with pytest.raises(SpecError, match=r"targets\.sm_90\.by_seq_k\[0\]\.tile_m"):
        validate_spec({**base, "targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "by_seq_k": [
            {"max_seq_k": 2048, **big}]}}}, "t.yaml")
    validate_spec({**base, "targets": {"default": {**big, "num_worker_warps": 8}}}, "t.yaml")
    validate_spec({**base, "head_dim": 128, "targets": {"default": big}}, "t.yaml")


def test_an_unknown_target_is_one_problem_whatever_its_value():
    """The unknown key and its value's shape were two lines for one problem."""
    with pytest.raises(SpecError) as caught:
        validate_spec({"name": "x", "targets": {"bogus": 1, "sm_90": {"tile_m": 100}}}, "x.yaml")
    lines = caught.value.lines()
    assert len(lines) == 3, lines  # bogus; sm_90's tile_m and its missing tile_n
    assert lines[0].startswith("x.yaml: targets.bogus: unknown target; allowed: 'default' or sm_80")
    assert any(line.startswith("x.yaml: targets.sm_90.tile_m: must be a power of two") for line in lines)


@pytest.mark.parametrize("key, hint", [
    ("scale", "(the softmax scale is an argument of the call: attention(q, k, v, scale=...))"),
    ("sliding_window", "(did you mean window? It takes {left: sliding_window - 1})"),
    ("num_kv_heads", "(heads come from the tensors; the spec takes gqa_ratio, query heads per KV head)"),
    ("causl", "(did you mean causal?)"),
    ("dropout_p", "(the dropout rate is an argument of the call, attention(..., dropout_p=...); "
                  "dropout: true builds it in)"),
])
def test_an_unknown_key_says_what_to_write_instead(key, hint):
    with pytest.raises(SpecError) as caught:
        validate_spec({"name": "x", key: 1}, "x.yaml")
    assert caught.value.lines() == [f"x.yaml: {key}: unknown key {hint}; allowed keys: "
                                    + ", ".join(Spec.model_fields)]


def test_a_tile_field_named_as_other_tools_name_it_is_pointed_at():
    with pytest.raises(SpecError) as caught:
        validate_spec({"name": "x", "targets": {"sm_90": {"tile_m": 64, "tile_n": 64, "num_warps": 8}}},
                      "x.yaml")
    assert caught.value.lines()[0].startswith(
        "x.yaml: targets.sm_90.num_warps: unknown key (did you mean num_worker_warps?); allowed keys:")


@pytest.mark.parametrize("family", ["prefill", "decode"])
def test_spec_to_dict_holds_only_its_own_familys_fields(family):
    from specgen.spec import spec_to_dict
    from specgen.spec.model import FAMILY_ONLY

    spec = validate_spec({"name": "ok", "family": family})
    data = spec_to_dict(spec)
    other = "prefill" if family == "decode" else "decode"
    assert not [name for name in data if FAMILY_ONLY.get(name) == other]
    assert [name for name in FAMILY_ONLY if FAMILY_ONLY[name] == family and name in data]
    assert validate_spec(data) == spec

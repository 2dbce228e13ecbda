"""Specs without `targets:` get the shipped table's measured configs."""

import pytest

from specgen.errors import SpecError
from specgen.spec import defaults
from specgen.spec import TargetConfig, decode_rows, spec_to_dict, validate_spec

from .helpers import ROOT, render_spec_data

QWEN2 = {"name": "qwen2", "dtype": "bfloat16", "head_dim": 128, "gqa_ratio": 7, "causal": True}
KEY_FIELDS = {"family", "target", "dtype", "head_dim", "masked", "extras"}
SOURCE_FIELDS = {"how", "spec", "device", "date", "shapes", "log"}


def test_every_entry_is_a_valid_config_with_its_provenance():
    seen = set()
    for entry in defaults.table():
        assert set(entry["key"]) - {"split"} == KEY_FIELDS and entry["key"].get("split", True) is True
        assert set(entry["source"]) == SOURCE_FIELDS and all(entry["source"].values())
        key = tuple(sorted(entry["key"].items()))
        assert key not in seen, f"two entries for {key}"
        seen.add(key)
        config = dict(entry["config"])
        config.setdefault("tile_m", 16)  # decode entries take tile_m from the spec
        TargetConfig.model_validate(config)


def test_a_spec_without_targets_gets_the_measured_config_of_its_class():
    spec = validate_spec(QWEN2)
    entry = defaults.lookup(defaults.key_of(QWEN2), "sm_90")
    assert "fmha_gqa8_bf16" in entry["source"]["spec"]
    assert spec_to_dict(spec)["targets"]["sm_90"] == entry["config"]
    assert spec_to_dict(spec)["targets"]["default"] == defaults.PORTABLE
    # An empty targets mapping means the same as none.
    assert validate_spec({**QWEN2, "targets": {}}) == spec


def test_written_targets_are_kept_as_written():
    mine = {"default": {"tile_m": 32, "tile_n": 32, "occupancy": 1}}
    spec = validate_spec({**QWEN2, "targets": mine})
    assert set(spec.targets) == {"default"}
    assert spec.targets["default"].tile_m == 32


def test_the_filled_spec_round_trips_and_is_deterministic():
    first = spec_to_dict(validate_spec(QWEN2))
    assert validate_spec(first) == validate_spec(QWEN2)
    assert spec_to_dict(validate_spec(dict(QWEN2))) == first


@pytest.mark.parametrize("fields, bucket_key", [
    ({"head_dim": 64}, {"head_dim": 64, "masked": True}),
    ({"head_dim": 80}, {"head_dim": 128, "split": True}),
    ({"head_dim": 80, "head_dim_split": False}, {"head_dim": 128}),
    ({"head_dim": 192, "v_head_dim": 128}, {"head_dim": 256}),
    ({"causal": False}, {"masked": False}),
    ({"causal": False, "window": {"left": 7, "right": 7}}, {"masked": True}),
    ({"softcap": 50.0}, {"extras": True}),
    ({"dtype": "float16"}, {"dtype": "16-bit"}),
    ({"dtype": "float8_e4m3fn"}, {"dtype": "float8_e4m3fn"}),
])
def test_the_key_names_what_decides_a_config(fields, bucket_key):
    key = defaults.key_of({**QWEN2, **fields})
    assert {k: key[k] for k in bucket_key} == bucket_key


def test_a_split_head_dim_takes_its_own_entry_then_the_padded_buckets():
    split = validate_spec({**QWEN2, "head_dim": 80})
    assert defaults.lookup(defaults.key_of({**QWEN2, "head_dim": 80}), "sm_90")["key"].get("split")
    assert split.targets["sm_90"].tile_n == 64 and split.targets["sm_90"].occupancy == 2
    padded = validate_spec({**QWEN2, "head_dim": 80, "head_dim_split": False})
    assert padded.targets["sm_90"] == validate_spec(QWEN2).targets["sm_90"]
    assert "split" not in defaults.key_of({**QWEN2, "head_dim": 112})  # 64 + 64: padded
    # No split entry for the 256 bucket: the padded bucket's entry.
    mla = {**QWEN2, "head_dim": 192, "v_head_dim": 128}
    assert defaults.key_of(mla)["split"] and not defaults.lookup(defaults.key_of(mla), "sm_90")["key"].get("split")


def test_extras_fall_back_to_the_plain_entry_and_unknown_classes_to_portable():
    soft = validate_spec({**QWEN2, "softcap": 30.0})
    plain = validate_spec(QWEN2)
    assert soft.targets["sm_90"] == plain.targets["sm_90"]
    # float8 at D64 has its own entry (measured beside the portable default).
    fp8_d64 = validate_spec({**QWEN2, "dtype": "float8_e4m3fn", "head_dim": 64})
    assert (fp8_d64.targets["sm_90"].tile_m, fp8_d64.targets["sm_90"].tile_n) == (64, 128)
    # A decode at D64 has its own (256 keys a tile); a target the table does not know
    # (every row is sm_90's) runs the portable default.
    decode_d64 = validate_spec({"name": "dec", "family": "decode", "head_dim": 64, "gqa_ratio": 8})
    assert decode_d64.targets["sm_90"].tile_n == 256
    assert set(decode_d64.targets) == {"default", "sm_90"}
    assert (decode_d64.targets["default"].tile_n, decode_d64.targets["default"].occupancy) == (64, 2)


@pytest.mark.parametrize("gqa, q_len, rows", [(8, 1, 16), (1, 4, 16), (4, 4, 16), (16, 2, 32), (64, 2, 128)])
def test_decode_derives_tile_m_from_the_packed_query_tile(gqa, q_len, rows):
    spec = validate_spec({"name": "dec", "family": "decode", "dtype": "bfloat16",
                          "gqa_ratio": gqa, "max_q_len": q_len})
    assert rows == decode_rows(gqa, q_len)
    assert {cfg.tile_m for cfg in spec.targets.values()} == {rows}
    assert spec.targets["sm_90"].tile_n == 128


def test_decode_keeps_a_key_tile_inside_one_page():
    spec = validate_spec({"name": "dec", "family": "decode", "gqa_ratio": 4,
                          "paged": {"page_size": 32}})
    assert {cfg.tile_n for cfg in spec.targets.values()} == {32}


def test_decode_float8_cache_uses_its_own_entry():
    spec = validate_spec({"name": "dec", "family": "decode", "dtype": "bfloat16",
                          "kv_dtype": "float8_e4m3fn", "gqa_ratio": 8})
    assert spec.targets["sm_90"].num_worker_warps == 8


def test_a_bad_spec_without_targets_still_reports_its_own_error():
    with pytest.raises(SpecError, match="gqa_ratio"):
        validate_spec({**QWEN2, "gqa_ratio": 0}, "x.yaml")


def test_the_module_names_the_run_behind_each_measured_default():
    from specgen.emit.render import render
    from specgen.plan import make_plan

    text = render(make_plan(validate_spec(QWEN2)), "specs/qwen2.yaml").text
    assert "measured defaults of the spec's class" in text
    assert "fmha_gqa8_bf16" in text and "NVIDIA H200" in text
    mine = {"sm_90": {"tile_m": 64, "tile_n": 64, "occupancy": 2}}
    text = render(make_plan(validate_spec({**QWEN2, "targets": mine})), "specs/qwen2.yaml").text
    assert "measured defaults" not in text


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_decode_rows_of_other_head_dims_match_the_reference_emulated(kv_dtype, head_dim):
    """A decode at D64 (key tiles of 256) or D256 written without targets, its sm_90
    config from the table, run in the emulator against fp64: lengths that end inside
    a key tile, one shorter than a tile, several splits."""
    import torch

    from specgen.check import emulate
    from specgen.check.runner import Case, run_case

    data = {"name": f"dec_rows_d{head_dim}_{kv_dtype or 'bf16'}", "family": "decode",
            "dtype": "bfloat16", "head_dim": head_dim, "gqa_ratio": 8}
    if kv_dtype:
        data.update(kv_dtype=kv_dtype, v_cache_transposed=True)
    plan, source = render_spec_data(data, formatted=False)
    assert plan.spec.targets["sm_90"].tile_n == (256 if head_dim == 64 else 64)
    module = emulate.load_module(ROOT / "generated" / f"{plan.module_name}.py", source=source,
                                 name=f"_dec_rows_{head_dim}_{kv_dtype}")
    with emulate.emulating():
        row = run_case(torch, module, Case(2, 1, 1, 0, decode_lens=(300, 1100)),
                       torch.Generator().manual_seed(0), device="cpu")
    assert row["ok"], row


@pytest.mark.parametrize("head_dim", [64, 256])
def test_float8_prefill_rows_match_the_reference_emulated(head_dim):
    """A float8 prefill at D64 or D256 written without targets gets its 64x128 row on
    sm_90; emulated against fp64 at lengths that end inside a tile."""
    import torch

    from specgen.check import emulate
    from specgen.check.runner import Case, run_case

    plan, source = render_spec_data({"name": f"fp8_rows_d{head_dim}", "dtype": "float8_e4m3fn",
                                     "head_dim": head_dim, "gqa_ratio": 2, "causal": True}, formatted=False)
    assert (plan.spec.targets["sm_90"].tile_m, plan.spec.targets["sm_90"].tile_n) == (64, 128)
    module = emulate.load_module(ROOT / "generated" / f"{plan.module_name}.py", source=source,
                                 name=f"_fp8_rows_{head_dim}")
    with emulate.emulating():
        row = run_case(torch, module, Case(1, 1, 70, 150, 80), torch.Generator().manual_seed(0),
                       device="cpu")
    assert row["ok"], row

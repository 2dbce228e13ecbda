"""Compile: every shipped spec AOT-compiles for sm_90 and sm_100 without a GPU."""

import re

import pytest
import yaml

from specgen.compile.export import (
    cache_key,
    compile_target,
    decode_signatures,
    load_module_from_source,
    load_module_renamed,
    rename_op,
    pdl_value,
    signatures,
    target_configs,
    toolchain_versions,
)
from specgen.errors import CompileError
from specgen.plan.make import make_plan
from specgen.emit.render import render
from specgen.spec import validate_spec

from .helpers import ROOT, SPECS, kernel_source


def _plan_and_source(path):
    plan = make_plan(validate_spec(yaml.safe_load(path.read_text()), path))
    return plan, render(plan, f"specs/{path.name}").text


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_spec_compiles(path, target):
    plan, source = _plan_and_source(path)
    result = compile_target(plan, source, f"generated/{path.stem}.py", target)
    # One cubin per kernel of each distinct launch config (by_seq_k buckets and the
    # own config): decode adds its combine, backward: true its two kernels (dQ,
    # which also forms D, and dK/dV). block_sparse adds the map kernel (decode: its
    # two, classifying and listing). A module with v_transposed configs has one V
    # transpose kernel per target.
    per_config = ((2 if plan.spec.family == "decode" else 3 if plan.backward else 1)
                  + plan.block_sparse * (2 if plan.spec.family == "decode" else 1))
    assert len(result.paths) == per_config * len(target_configs(plan, target)) + plan.v_layout_param
    assert len(set(result.paths)) == len(result.paths)
    sizes = [p.stat().st_size for p in result.paths]
    assert all(p.read_bytes()[:4] == b"\x7fELF" for p in result.paths)
    assert sum(sizes) == result.size and min(sizes) > 10_000
    again = compile_target(plan, source, f"generated/{path.stem}.py", target)
    assert again.cached and again.paths == result.paths


def test_cache_key_depends_on_source_target_and_toolchain():
    plan, source = _plan_and_source(SPECS[0])
    key = cache_key(plan, source, "sm_90")
    assert key == cache_key(plan, source, "sm_90")
    assert key != cache_key(plan, source + "\n", "sm_90")
    assert key != cache_key(plan, source, "sm_100")
    assert set(toolchain_versions()) == {"cuda-tile", "tileiras"}
    assert toolchain_versions()["cuda-tile"] != "unknown"


def test_signatures_follow_the_plan():
    for path in SPECS:
        plan = make_plan(validate_spec(yaml.safe_load(path.read_text()), path))  # no render needed
        sigs = signatures(plan, "sm_90")
        assert len(sigs) == (2 if plan.even_n_param else 1)


def test_broken_source_is_a_compile_error_naming_module_and_target():
    plan, source = _plan_and_source(SPECS[0])
    broken = source.replace("acc = acc * alpha", "acc = acc * undefined_name", 1)
    with pytest.raises(CompileError) as info:
        compile_target(plan, broken, "generated/broken.py", "sm_90")
    assert f"{plan.module_name}: sm_90 (" in str(info.value)


def test_bucketed_target_compiles_each_distinct_config_once():
    data = yaml.safe_load(SPECS[0].read_text())
    data["targets"] = {"sm_90": {
        "tile_m": 64, "tile_n": 64, "occupancy": 2,
        "by_seq_k": [{"max_seq_k": 512, "tile_m": 32, "tile_n": 32, "occupancy": 1},
                     {"max_seq_k": 1024, "tile_m": 32, "tile_n": 32, "occupancy": 1},
                     {"max_seq_k": 2048, "tile_m": 64, "tile_n": 64, "occupancy": 2}],
    }}
    plan = make_plan(validate_spec(data))
    configs = target_configs(plan, "sm_90")
    assert [(c.tile_m, c.extra_hints) for c in configs] == [(32, {"occupancy": 1}), (64, {})]
    source = render(plan, "specs/b.yaml").text
    keys = {cache_key(plan, source, "sm_90", c) for c in configs}
    assert len(keys) == 2


def test_global_tile_order_is_a_kernel_constant_compiled_per_config():
    data = yaml.safe_load(SPECS[0].read_text())
    data["targets"] = {"sm_90": {
        "tile_m": 64, "tile_n": 64, "occupancy": 2,
        "by_seq_k": [{"max_seq_k": 2048, "tile_m": 64, "tile_n": 64, "occupancy": 2,
                      "tile_order": "global"}],
    }}
    plan = make_plan(validate_spec(data))
    assert plan.tile_order_param and plan.kernel_constants[-1] == "TILES_OUTER"
    # Same tiles and options, another order: two builds, told apart by TILES_OUTER.
    configs = target_configs(plan, "sm_90")
    assert [c.tile_order for c in configs] == ["global", "per_head"]
    assert [s.parameters[-1].value for c in configs for s in signatures(plan, "sm_90", c)] == [
        True, True, False, False]  # per EVEN_N value
    source = render(plan, "specs/order.yaml").text
    assert len({cache_key(plan, source, "sm_90", c) for c in configs}) == 2
    result = compile_target(plan, source, "generated/order.py", "sm_90")
    assert len(result.paths) == 2 and all(p.stat().st_size > 0 for p in result.paths)
    # A spec that never asks for the global order has no such argument.
    assert not make_plan(validate_spec(yaml.safe_load(SPECS[0].read_text()))).tile_order_param


def test_v_transposed_is_a_kernel_constant_compiled_per_config():
    data = yaml.safe_load(SPECS[0].read_text())
    data["targets"] = {"sm_90": {
        "tile_m": 64, "tile_n": 64, "occupancy": 2, "v_transposed": True,
        "by_seq_k": [{"max_seq_k": 2048, "tile_m": 64, "tile_n": 64, "occupancy": 2}],
    }}
    plan = make_plan(validate_spec(data))
    assert plan.v_layout_param and plan.kernel_constants[-1] == "V_TRANSPOSED"
    configs = target_configs(plan, "sm_90")
    assert [c.v_transposed for c in configs] == [False, True]
    # The transposed V's last axis is the key axis: no head-dim divisibility assumed.
    sig_v = [s.parameters[2] for c in configs for s in signatures(plan, "sm_90", c)]
    assert {v.shape_divisible_by[-1] for v in sig_v[:2]} == {16}
    assert {v.shape_divisible_by[-1] for v in sig_v[2:]} == {1}
    source = render(plan, "specs/vt.yaml").text
    assert "order=(0, 1, 3, 2)" in source.split("if V_TRANSPOSED:")[1].split("else:")[0]
    assert len({cache_key(plan, source, "sm_90", c) for c in configs}) == 2
    result = compile_target(plan, source, "generated/vt.py", "sm_90")
    # Both configs' kernels and one V transpose kernel (no tiles of the configs).
    assert len(result.paths) == 3 and all(p.stat().st_size > 0 for p in result.paths)
    assert sum(plan.v_transpose_kernel_name in p.name for p in result.paths) == 1


def test_persistent_configs_share_one_kernel_in_the_work_item_loop_form():
    data = yaml.safe_load(SPECS[0].read_text())
    data["targets"] = {"sm_90": {
        "tile_m": 64, "tile_n": 64, "occupancy": 2, "persistent": True,
        "by_seq_k": [{"max_seq_k": 2048, "tile_m": 64, "tile_n": 64, "occupancy": 2}],
    }}
    plan = make_plan(validate_spec(data))
    assert plan.persistent_loop
    assert [c.persistent for c in plan.target("sm_90").configs] == [False, True]
    # The launch differs, the kernel does not: one build serves both configs.
    configs = target_configs(plan, "sm_90")
    assert len(configs) == 1
    source = render(plan, "specs/persistent.yaml").text
    assert "for work in range(ct.bid(0), num_tiles * batch_heads, ct.num_blocks(0)):" in source
    assert "grid = (min(work, _sm_count(q.device) * config[\"occupancy\"]), 1, 1)" in source
    assert '"persistent": True' in source
    result = compile_target(plan, source, "generated/persistent.py", "sm_90")
    assert len(result.paths) == 1 and result.paths[0].stat().st_size > 0
    # A spec with no persistent config keeps the 2-D grid and one item per CTA.
    plain = make_plan(validate_spec(yaml.safe_load(SPECS[0].read_text())))
    assert not plain.persistent_loop
    assert "for work in range" not in render(plain, "specs/x.yaml").text


@pytest.mark.parametrize("dims,wide", [((128, None), False), ((80, None), False),
                                       ((256, None), True), ((192, 128), False), ((128, 256), True),
                                       ((192, 128, False), True), ((224, None), True)])
def test_backward_tiles_follow_the_padded_head_dim(dims, wide):
    """256-wide tiles (padded 129-256, or 224's 128 + 128) take the wide tiles; 192
    split into 128 + 64 keeps D128's, padded to 256 (head_dim_split: false) the wide."""
    data = yaml.safe_load(SPECS[0].read_text())
    data.update(backward=True, head_dim=dims[0], targets={})
    if dims[1]:
        data["v_head_dim"] = dims[1]
    if len(dims) > 2:
        data["head_dim_split"] = dims[2]
    plan = make_plan(validate_spec(data))
    assert (plan.bwd_tile, plan.bwd_dq_tile) == (((64, 64), (64, 64)) if wide else ((64, 64), (128, 64)))
    source = render(plan, "specs/wide.yaml").text
    dkdv = "@AotKernel(occupancy=ct.ByTarget(sm_90=1), num_worker_warps=ct.ByTarget(sm_90=8))\ndef " + plan.bwd_names[0]
    assert (dkdv in source) == wide
    assert (f"@AotKernel(occupancy=ct.ByTarget(sm_90=2))\ndef {plan.bwd_names[0]}" in source) == (not wide)
    assert not plan.bwd_pack


@pytest.mark.parametrize("changes,packed", [({}, True), ({"gqa_ratio": 8}, True), ({"head_dim": 256}, True),
                                            ({"pack_gqa": False}, False), ({"block_sparse": False}, False)])
def test_the_backward_packs_gqa_with_a_block_map(changes, packed):
    """pack_gqa on a block-sparse training spec packs the backward too: 64-row dQ tiles
    at two CTAs per SM (D <= 128), maps at the tiles' positions; without a block map
    (or without pack_gqa) the backward keeps its per-head kernels."""
    data = yaml.safe_load((ROOT / "specs" / "fmha_train_document.yaml").read_text())
    data.update(changes)
    plan = make_plan(validate_spec(data))
    assert plan.bwd_pack == packed
    source = render(plan, "specs/fmha_train_document.yaml").text
    assert ("BWD_DQ_TILE_P = BWD_DQ_TILE_M // GROUP_SIZE" in source) == packed
    assert ("for g in range(GROUP_SIZE):" in source) == (not packed)
    wide = changes.get("head_dim") == 256
    if packed:
        group = plan.group_size
        dq, kv = plan.bwd_map_shapes()
        assert dq[:3] == (plan.bwd_dq_tile[0] // group, plan.bwd_dq_tile[1], False)
        assert kv[:3] == (plan.bwd_tile[0] // group, plan.bwd_tile[1], True)
        assert plan.bwd_dq_tile == (64, 64)
        assert ("@AotKernel(occupancy=ct.ByTarget(sm_90=2))\ndef " + plan.bwd_names[1] in source) == (not wide)


@pytest.mark.parametrize("extra,pre", [({}, "qk_scale * INV_LN2"), ({"softcap": 30.0}, "qk_scale / SOFTCAP"),
                                       ({"score_mod": "score * 0.5"}, "qk_scale")])
def test_backward_scores_use_q_as_the_forward_prescaled_it(extra, pre):
    """With prescale_q the backward's scores come from Q * pre rounded once, the Q
    the forward's scores came from, and dK is scaled back by post = qk_scale / pre;
    where pre is qk_scale itself (a score_mod's natural-log scores) post is 1, and
    neither the scores nor dK are multiplied by it."""
    data = yaml.safe_load(next(p for p in SPECS if p.stem == "fmha_gqa_causal").read_text())
    data.update(backward=True, prescale_q=True, targets={}, **extra)
    plan = make_plan(validate_spec(data))
    assert plan.bwd_prescale == pre
    source = render(plan, "specs/pre.yaml").text
    if pre == "qk_scale":
        assert plan.bwd_post_is_one and "post" not in re.sub(r"#.*", "", source.split("def _backward(")[0])
        assert source.count("natural-log units (Q arrives as Q * qk_scale)") >= 2
    else:
        assert source.count(f"post = qk_scale / ({pre})") == 2  # the dK/dV and dQ kernels
        assert "dk = dk * post" in source
    # The dQ kernel forms Q * pre from Q (its launch passes q, then q_s and pre) and
    # stores it in q_s, which the dK/dV kernel reads; no pass over Q of its own.
    assert "q_s = q * pre" not in source and "q_s = torch.empty_like(q)" in source
    dq = kernel_source(source, "fmha_bwd_dq_")
    assert "q = (q.astype(ct.float32) * q_pre).astype(Q.dtype)" in dq
    assert re.search(r"ct\.store\(\s*QS,", dq)
    assert len(re.findall(r"\(\s*q_s,\s*k,\s*v,", source)) == 1  # the dK/dV launch
    assert len(re.findall(r"\(\s*q,\s*k,\s*v,\s*dout,\s*out,(.|\n)*?q_s,\s*pre,", source)) == 1  # dQ's
    # pre in float32 on the host (tests/test_backward_render.py checks its values)
    host = "_float32(scale)" if pre == "qk_scale" else f"_float32(_float32(scale) {pre.split()[1]} _float32({pre.split()[2]}))"
    assert plan.bwd_prescale_host == host and f"pre = {host}" in source
    # Without prescale_q the backward reads Q as given.
    data["prescale_q"] = False
    plain = render(make_plan(validate_spec(data)), "specs/pre.yaml").text
    assert "q_s = " not in plain and "dk = dk * qk_scale" in plain and "QS" not in plain
    # Packed sequences: each sequence's rows, in its view of the packed arrays.
    data.update(prescale_q=True, varlen=True)
    data.pop("score_mod", None)  # (varlen takes no score_mod)
    varlen = render(make_plan(validate_spec(data)), "specs/pre.yaml").text
    dq = kernel_source(varlen, "fmha_bwd_dq_")
    assert "QSs = QS.slice(axis=0, start=q_start, stop=q_start + seq_q)" in dq
    assert re.search(r"ct\.store\(\s*QSs,\s*index=\(tile, head, 0\)", dq)


def test_float8_prefill_reads_v_transposed_by_default():
    fp8 = next(p for p in SPECS if p.stem == "fmha_fp8_llama")
    plan, source = _plan_and_source(fp8)
    assert plan.v_layout_param
    assert all(c.v_transposed for t in plan.targets for c in t.configs)
    assert '"v_transposed": True' in source and f"def {plan.v_transpose_kernel_name}(V, VT" in source
    # The copy in every call, unless the caller hands over transposed_v's V.
    assert "copy_v = read_vt and not v_transposed" in source
    assert "v_arg = _transpose_v(v) if copy_v else v" in source
    # 16-bit specs keep V as given, and their kernels have no V_TRANSPOSED argument.
    assert not make_plan(validate_spec(yaml.safe_load(SPECS[0].read_text()))).v_layout_param


@pytest.mark.parametrize("pdl,target,expected", [
    ("auto", "sm_90", True),  # auto: Hopper, where PDL was measured
    ("auto", "sm_100", False),
    ("auto", "sm_80", False),  # no programmatic dependent launch before sm_90
    (True, "sm_90", True),
    (True, "sm_100", True),
    (True, "sm_80", False),
    (False, "sm_120", False),
])
def test_decode_kernels_compile_the_pdl_value_the_launcher_picks(pdl, target, expected):
    data = yaml.safe_load(open("specs/fmha_decode_gqa8_bf16.yaml").read())
    plan = make_plan(validate_spec({**data, "pdl": pdl}))
    config = plan.target(target).configs[-1]
    sigs = decode_signatures(plan, config, target)
    split_sigs, combine_sigs = sigs[plan.kernel_name], sigs[plan.combine_name]
    # The split kernel: both SINGLE_SPLIT values; the combine: every padded split count.
    assert [(s.parameters[-2].value, s.parameters[-1].value) for s in split_sigs] == [
        (single, expected) for single in (True, False)]
    tiles = sorted({s.parameters[-2].value for s in combine_sigs})
    assert tiles == [2, 4, 8, 16, 32, 64]
    assert [s.parameters[-1].value for s in combine_sigs] == [expected] * len(tiles)


def test_a_block_map_of_a_mask_read_through_a_subscript_compiles():
    """ids[b, ids[b, q_idx] % 40]: the map kernel's span step named the outer operand
    as its one-tile loop does, and cuTile refused a local of two shapes (the emulator,
    which keeps no types, ran it)."""
    data = {"name": "nested_mask_map", "dtype": "bfloat16", "head_dim": 16, "gqa_ratio": 2, "backward": True,
            "block_sparse": True, "tensors": {"ids": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
            "mask_mod": "ids[b, ids[b, q_idx] % 40] <= kv_idx + 3",
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    plan = make_plan(validate_spec(data))
    source = render(plan, "specs/nested_mask_map.yaml").text
    result = compile_target(plan, source, "generated/nested_mask_map.py", "sm_90")
    assert len(result.paths) == 4  # forward, map, dK/dV, dQ


def test_a_decode_spec_of_one_split_compiles_without_a_combine():
    """splits: 1 never launches the combine kernel: the build compiled it with the
    split kernel's signatures instead, and failed (SPLIT_TILE not a constant)."""
    data = yaml.safe_load(open("specs/fmha_decode_paged_mtp.yaml").read())
    plan = make_plan(validate_spec({**data, "name": "one_split", "splits": 1}))
    sigs = decode_signatures(plan, plan.target("sm_90").configs[-1], "sm_90")
    assert list(sigs) == [plan.kernel_name] and [s.parameters[-2].value for s in sigs[plan.kernel_name]] == [True]
    source = render(plan, "specs/one_split.yaml").text
    result = compile_target(plan, source, "generated/one_split.py", "sm_90")
    assert len(result.paths) == len(target_configs(plan, "sm_90"))


@pytest.mark.parametrize("pdl", ["auto", True, False])
def test_decode_build_compiles_the_pdl_value_the_generated_launcher_picks(pdl):
    """The policy lives twice, in the build (pdl_value) and in the module (use_pdl):
    they agree on every architecture."""
    data = yaml.safe_load(open("specs/fmha_decode_gqa8_bf16.yaml").read())
    plan = make_plan(validate_spec({**data, "name": f"pdl_policy_{str(pdl).lower()}", "pdl": pdl}))
    module = load_module_from_source(plan.module_name, render(plan, "specs/v.yaml").text, "v.py")
    for target in ("sm_80", "sm_86", "sm_90", "sm_100", "sm_120"):
        assert pdl_value(plan, target) is module.use_pdl(int(target[3:-1])), target


def test_known_targets_are_the_installed_tileiras_targets():
    """The spec refuses targets outside KNOWN_TARGETS (written out from `tileiras
    --help`); a tileiras that lists others must update that list, not go unnoticed."""
    import subprocess

    from cuda.tile._compile import _find_compiler_bin

    from specgen.spec.fields import KNOWN_TARGETS

    try:
        binary = _find_compiler_bin().path
    except Exception as exc:  # noqa: BLE001 - no compiler: nothing to compare with
        pytest.skip(f"no tileiras found: {exc}")
    text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    section = text.split("--gpu-name=", 1)[-1].split("\n  -", 1)[0]
    listed = tuple(re.findall(r"^\s+=(sm_\d+)\s", section, re.M))
    assert listed, f"no --gpu-name values found in `{binary} --help`"
    assert listed == KNOWN_TARGETS, (
        f"{binary} compiles for {listed}; specgen.spec.fields.KNOWN_TARGETS says {KNOWN_TARGETS}")


def _jit_like(constraint):
    """An array constraint as the JIT specialises one for torch's tensors of these
    shapes: every extent and row stride divisible by 16, a 256-byte aligned base."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint

    if not isinstance(constraint, ArrayConstraint):
        return constraint
    n = constraint.ndim
    return ArrayConstraint(constraint.dtype, n, index_dtype=ct.int32, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False,
                           stride_constant=(None,) * (n - 1) + (1,),
                           stride_divisible_by=(16,) * (n - 1) + (1,),
                           shape_divisible_by=(16,) * n, base_addr_divisible_by=256)


def test_learnable_tables_at_d128_compile_as_the_jit_specialises_them(tmp_path):
    """A relative-position table and a per-key bias, learnable, at D128: with their
    element-wise atomic adds in the dQ kernel, tileiras failed (exit 5) on the
    signature the JIT forms for S 2048 (the AOT one compiled). They are added by the
    dK/dV kernel, and both kernels compile for either signature. The adds are relaxed
    reductions (REDG), with no fence around each: cuTile's default acq_rel order puts
    a MEMBAR.ALL.GPU and an L1 invalidation around every ATOMG, 2.5-2.8x the backward's
    time on an H200."""
    import io

    from specgen.compile.sass import sass_functions

    from cuda.tile.compilation import KernelSignature, export_kernel

    from specgen.compile.export import backward_signatures

    from .helpers import render_spec_data

    data = {"name": "tables_d128", "dtype": "bfloat16", "head_dim": 128, "gqa_ratio": 4,
            "causal": True, "backward": True,
            "tensors": {"rel": {"dtype": "float32", "shape": ["heads", 8192], "learnable": True},
                        "colb": {"dtype": "float32", "shape": ["seq_k"], "learnable": True}},
            "score_mod": "score + rel[h, q_idx - kv_idx] + 0.5 * colb[kv_idx]"}
    plan, source = render_spec_data(data)
    assert [t.where for t in plan.dkdv_tensor_grads] == ["keys", "keys"] and not plan.dq_tensor_grads
    module = load_module_from_source("tables_d128", source, "generated/tables_d128.py")
    for name, sigs in backward_signatures(plan).items():
        jit = [KernelSignature([_jit_like(p) for p in s.parameters], s.calling_convention) for s in sigs]
        buffer = io.BytesIO()
        export_kernel(getattr(module, name), jit, buffer, gpu_code="sm_90", output_format="cubin")
        assert buffer.getvalue()[:4] == b"\x7fELF", name
        cubin = tmp_path / f"{name}.cubin"
        cubin.write_bytes(buffer.getvalue())
        functions = sass_functions(cubin)
        if functions is None:
            continue  # no cuobjdump: the render check below still holds
        text = "\n".join(i for body in functions.values() for _, i in body)
        assert "MEMBAR.ALL.GPU" not in text and "CCTL.IVALL" not in text, name
        if name.startswith("fmha_bwd_dkdv"):
            assert text.count("REDG.E.ADD.F32") >= 16, name
    adds = []
    for start in (m.end() for m in re.finditer(r"ct\.atomic_add\(", source)):
        depth, end = 1, start
        while depth:
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        adds.append(source[start:end])
    assert len(adds) == 2 and all("memory_order=ct.MemoryOrder.RELAXED" in a for a in adds), adds


def test_a_module_loaded_renamed_registers_an_op_of_its_own(tmp_path):
    """Two modules of one spec in one process (an old build beside the new) must not
    share a custom op, and so kernels: the loaded copy's op takes the suffix."""
    path = ROOT / "generated" / "fmha_train_gemma2.py"
    shipped = re.search(r'^OP_NAME = "(.+)"$', path.read_text(), re.M).group(1)
    module = load_module_renamed(path, "old")
    assert module.OP_NAME == f"{shipped}_old"
    assert module.__file__ == str(path.resolve())  # its .aot folder is found beside it
    stranger = tmp_path / "plain.py"
    stranger.write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"plain.py: no OP_NAME line to rename"):
        load_module_renamed(stranger, "old")
    inference = load_module_renamed(ROOT / "generated" / "fmha_document_mask.py", "old")
    inference_op = re.search(r'^OP_NAME = "(.+)"$',
                             (ROOT / "generated" / "fmha_document_mask.py").read_text(), re.M).group(1)
    assert inference.OP_NAME == f"{inference_op}_old" and str(inference._OUT_OP).endswith("_old_out")


@pytest.mark.parametrize("name", ["fmha_train_document", "fmha_document_mask", "fmha_decode_paged_mtp"])
def test_rename_op_renames_every_modules_op(name):
    """The bench scripts' rename of a module's ops from its source: the op takes the
    suffix (the name carries the spec hash, so a replace of the bare spec name would
    miss it)."""
    source = (ROOT / "generated" / f"{name}.py").read_text()
    shipped = re.search(r'^OP_NAME = "(.+)"$', source, re.M).group(1)
    renamed = rename_op(source, "variant")
    assert re.search(r'^OP_NAME = "(.+)"$', renamed, re.M).group(1) == f"{shipped}_variant"
    assert renamed.replace(f"{shipped}_variant", shipped) == source


def test_rename_op_refuses_an_op_without_an_op_name_line():
    """A source that registers an op without an OP_NAME line is refused; one without
    an op (a module of an older specgen) passes unless an op is required."""
    assert rename_op("x = 1\n", "v") == "x = 1\n"
    with pytest.raises(ValueError, match=r"<x>: no OP_NAME line to rename"):
        rename_op("import torch\ntorch.library.custom_op('a::b', f)\n", "v", "<x>")
    with pytest.raises(ValueError, match=r"<x>: no OP_NAME line to rename"):
        rename_op("import torch\nlib = torch.library.Library('a', 'FRAGMENT')\n", "v", "<x>")

"""The generated kernels run on the CPU through specgen.check.emulate, against the
fp64 reference: every shipped spec's forward (and its gradients where it has a
backward), with the checks `specgen test` makes on a GPU. The emulator's own
semantics (tile spaces, padding, undefined behaviour) and the kernel bugs it must
catch are tested beside them."""

import math
import os
import types

import pytest
import torch

from specgen.check import emulate, runner
from specgen.check.cases import reference_for
from specgen.check.runner import Case, case_verdict, run_case

from .helpers import (
    DECODE_SPEC_NAMES,
    FORWARD_ONLY_PREFILL_SPECS,
    ROOT,
    SPEC_NAMES,
    VARLEN_SPEC_NAMES,
    decode_variant_data,
    prefill_variant_data,
    render_spec_data,
    trained_spec_data,
)


def _cases(spec: dict) -> list[Case]:
    """Ragged shapes: chunked prefill, more queries than keys (rows before the first
    key), a strided layout, one key; decode: ragged and single-token lengths;
    varlen: uneven sequences, one of length 1."""
    if spec["family"] == "decode":
        q_len = spec.get("max_q_len", 1)
        return [Case(4, 2, q_len, 0, decode_lens=(17, q_len, 300, 64 + q_len)),
                Case(1, 1, 1, 0, decode_lens=(1000,))]
    if spec["varlen"]:
        return [Case(3, 2, 0, 0, lengths=((5, 300), (128, 200), (1, 1)))]
    return [Case(1, 1, 130, 300, 170), Case(2, 2, 257, 129, -128, "transposed"), Case(1, 2, 1, 1)]


def _module(name: str, source: str | None = None):
    return emulate.load_module(ROOT / "generated" / f"{name}.py", source=source,
                               name=f"_test_emulated_{name}_{hash(source)}")


def _emulated(data: dict, label: str, spec_path: str = "specs/variant.yaml"):
    """The module of a spec given as data, rendered (unformatted) and emulated."""
    plan, source = render_spec_data(data, spec_path, formatted=False)
    return emulate.load_module(ROOT / "generated" / f"{plan.module_name}.py", source=source,
                               name=f"_test_emulated_{label}")


def _shipped_data(name: str) -> dict:
    """A shipped spec's data as written (to vary a field of it)."""
    import yaml

    return yaml.safe_load((ROOT / "specs" / f"{name}.yaml").read_text(encoding="utf-8"))


def _run(module, case: Case, seed: int = 3) -> dict:
    with emulate.emulating():
        return run_case(torch, module, case, torch.Generator().manual_seed(seed), device="cpu")


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_shipped_kernels_match_the_fp64_reference_when_emulated(name):
    module = _module(name)
    for case in _cases(module.SPEC):
        row = _run(module, case)
        assert row["ok"], f"{name} {case.label(module.SPEC['gqa_ratio'])}: {case_verdict(row)}"
        if module.SPEC.get("backward") and name not in VARLEN_SPEC_NAMES:
            assert "grad_ratio" in row  # the gradients were checked too


def test_every_family_is_covered():
    assert DECODE_SPEC_NAMES and VARLEN_SPEC_NAMES
    assert any("train" in n for n in SPEC_NAMES)


# A kernel bug must fail the emulated check: each edit below breaks one thing the
# kernels get right (text of fmha_gqa8_bf16's kernel).
MUTATIONS = {
    "causal mask off by one": ("visible = keys <= rows", "visible = keys < rows"),
    "V padding left undetermined": ("            latency=4,\n            padding_mode=ct.PaddingMode.ZERO,",
                                    "            latency=4,"),
    "one unmasked key tile skipped": ("    for j in range(0, mask_start):",
                                      "    for j in range(0, mask_start - 1):"),
    "no final normalisation": ("    l_div = ct.where(l_i == 0.0, 1.0, l_i)", "    l_div = ct.where(l_i == 0.0, 1.0, 1.0)"),
}


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_a_broken_kernel_fails_the_emulated_check(what):
    old, new = MUTATIONS[what]
    source = (ROOT / "generated" / "fmha_gqa8_bf16.py").read_text()
    assert source.count(old) == 1, what
    broken = _module("fmha_gqa8_bf16", source.replace(old, new))
    rows = [_run(broken, case) for case in (Case(1, 1, 130, 300, 170), Case(1, 1, 200, 200))]
    assert not all(row["ok"] for row in rows), what


def _own_op(source: str, module_name: str, suffix: str) -> str:
    """A training module's text with its custom op renamed. A module registers its op
    once per process under its spec's name and hash, and a second module of that
    spec with other kernels would run the first one's op, and so its kernels."""
    import re

    op = re.compile(rf'OP_NAME = "specgen::{module_name}_([0-9a-f]+)"')
    assert len(op.findall(source)) == 1
    return op.sub(rf'OP_NAME = "specgen::{module_name}_\1_{suffix}"', source)


# The same for the backward (text of fmha_train_gqa_causal's dQ kernel, which forms D
# and Q * pre for the dK/dV kernel launched after it).
BACKWARD_MUTATIONS = {
    "D not stored for dK/dV": ("    ct.store(Delta, index=(batch, head, tile), tile=delta.reshape((1, 1, TILE_M)))\n"
                               "    # prescale_q", "    # prescale_q"),
    "Q * pre not stored for dK/dV": ("    ct.store(QS, index=(batch, head, tile, 0), tile=q.reshape((1, 1, TILE_M, HEAD_DIM)))\n",
                                     ""),
    "Q used as given, not Q * pre": ("    q = (q.astype(ct.float32) * q_pre).astype(Q.dtype)\n", ""),
}


@pytest.mark.parametrize("what", sorted(BACKWARD_MUTATIONS))
def test_a_broken_backward_fails_the_emulated_gradient_check(what):
    old, new = BACKWARD_MUTATIONS[what]
    source = (ROOT / "generated" / "fmha_train_gqa_causal.py").read_text()
    assert source.count(old) == 1, what
    source = _own_op(source, "fmha_train_gqa_causal", f"broken_{sorted(BACKWARD_MUTATIONS).index(what)}")
    broken = _module("fmha_train_gqa_causal", source.replace(old, new))
    rows = [_run(broken, case) for case in (Case(1, 1, 130, 300, 170), Case(1, 1, 200, 200))]
    assert all("grad_ok" in row for row in rows)
    assert not all(row["ok"] and row["grad_ok"] for row in rows), what


def test_a_wrong_kv_head_reads_outside_its_array():
    source = (ROOT / "generated" / "fmha_gqa8_bf16.py").read_text()
    broken = _module("fmha_gqa8_bf16", source.replace("kv_head = head // GROUP_SIZE",
                                                      "kv_head = head % GROUP_SIZE"))
    with pytest.raises(emulate.EmulationError, match="wholly outside"):
        _run(broken, Case(1, 2, 130, 300, 170))


def test_loads_follow_cutile_tile_spaces():
    a = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).reshape(2, 3, 5, 4)
    # index in tiles, order permutes the array's axes first (K^T as the kernels load it)
    t = emulate.load(a, (1, 2, 0, 1), (1, 1, 4, 2), order=(0, 1, 3, 2))
    assert torch.equal(t[0, 0], a[1, 2, 2:4, :].T)
    # a partial tile: padding undetermined (NaN here) unless asked for
    edge = emulate.load(a, (0, 0, 1, 0), (1, 1, 4, 4))
    assert torch.equal(edge[0, 0, :1], a[0, 0, 4:5]) and edge[0, 0, 1:].isnan().all()
    zero = emulate.load(a, (0, 0, 1, 0), (1, 1, 4, 4), padding_mode=emulate._ct.PaddingMode.ZERO)
    assert (zero[0, 0, 1:] == 0).all()
    with pytest.raises(emulate.EmulationError, match="wholly outside"):
        emulate.load(a, (0, 0, 2, 0), (1, 1, 4, 4))
    with pytest.raises(emulate.EmulationError, match="check_bounds=False"):
        emulate.load(a, (0, 0, 1, 0), (1, 1, 4, 4), check_bounds=False)
    # a one-element load, and stores that keep to the array
    assert emulate.load(a[0, 0, 0], (3,), shape=()).item() == 3.0
    out = torch.zeros(5, 4)
    emulate.store(out, (1, 0), torch.ones(4, 4))
    assert out[:4].sum() == 0 and out[4].sum() == 4


def test_gather_scatter_and_slices():
    a = torch.arange(10, dtype=torch.int32)
    idx = torch.tensor([-1, 0, 9, 10], dtype=torch.int32)
    assert emulate.gather(a, idx).tolist() == [0, 0, 9, 0]  # outside: the padding value
    emulate.scatter(a, idx, torch.full((4,), 7, dtype=torch.int32))
    assert a[0] == 7 and a[9] == 7
    with emulate.emulating():
        assert a.slice(axis=0, start=2, stop=5).tolist() == [2, 3, 4]
        with pytest.raises(emulate.EmulationError, match="start < N"):
            a.slice(axis=0, start=10, stop=10)
        assert torch.ones(2).astype(emulate._ct.int32).dtype == torch.int32
    assert not hasattr(torch.Tensor, "astype") or torch.Tensor.astype is not emulate._tile_astype


def test_a_launch_outside_emulating_says_where_it_runs():
    """A module from load_module called outside emulating(): one clear error, where
    the kernel's first .astype raised "'Tensor' object has no attribute 'astype'"."""
    m = _module("fmha_gqa_causal")
    q = torch.randn(1, 4, 16, 128, dtype=torch.float16)
    k = v = torch.randn(1, 1, 16, 128, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"only inside specgen\.check\.emulate\.emulating\(\)"):
        m.attention(q, k, v)
    with emulate.emulating():
        assert m.attention(q, k, v).shape == q.shape


def test_uint32_tiles_wrap_as_the_gpu_does():
    from specgen.check.reference import _mul32

    x = emulate.astype(torch.tensor([1, 2**31 + 5, 2**32 - 1], dtype=torch.int64), emulate._ct.uint32)
    y = (x * 0x85EBCA77) ^ (x >> 13)
    want = _mul32(torch.tensor([1, 2**31 + 5, 2**32 - 1]), 0x85EBCA77) ^ (
        torch.tensor([1, 2**31 + 5, 2**32 - 1]) >> 13)
    assert y.as_subclass(torch.Tensor).tolist() == want.tolist()
    assert ((x >> 8) >= 3).dtype == torch.bool


def test_left_shifts_drop_the_bits_past_the_width():
    """int32 << wraps into the sign bit and drops higher bits, as the GPU's SHL does
    (the exponent-bits trick of a software exp2 relies on it); uint32 stays unsigned."""
    x = torch.tensor([1, 0x4B400000 - 127, -1, 3], dtype=torch.int32)
    got = emulate.bitwise_lshift(x, 23).tolist()
    assert got == [1 << 23, (385 << 23) - 2**32, -(1 << 23), 3 << 23]
    u = emulate.astype(torch.tensor([2**31 + 1], dtype=torch.int64), emulate._ct.uint32)
    assert emulate.bitwise_lshift(u, 1).as_subclass(torch.Tensor).tolist() == [2]


def test_scalar_defaults_and_builtin_max():
    assert emulate.where(torch.tensor([True, False]), 2, 0).dtype == torch.int32
    assert emulate.where(torch.tensor([True]), 1.5, -math.inf).dtype == torch.float32
    assert emulate._builtin_max(3, 5) == 5
    assert emulate._builtin_max(torch.tensor([1.0, 4.0]), torch.tensor([2.0, 3.0])).tolist() == [2.0, 4.0]
    assert emulate.cdiv(7, 2) == 4 and emulate.cdiv(8, 2) == 4


def test_specgen_test_emulate_runs_without_a_gpu(tmp_path):
    from .test_cli import specgen

    result = specgen("test", ROOT / "specs" / "fmha_mistral_window.yaml", "--emulate",
                     "--gen", tmp_path, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "kernels emulated on the CPU" in result.stderr
    assert "cases passed" in result.stdout and "FAIL" not in result.stdout
    fuzz = specgen("test", ROOT / "specs" / "fmha_decode_gqa8_bf16.yaml", "--emulate", "--fuzz", "3",
                   "--seed", "5", "--gen", tmp_path, cwd=ROOT)
    assert fuzz.returncode == 0, fuzz.stderr[-2000:]
    assert "3/3 fuzz cases (3 drawn) passed" in fuzz.stdout


def test_specgen_test_names_a_hand_edited_module_before_writing_any(tmp_path):
    """A hand-edited module among stale ones is exit 2 with nothing written (the
    other modules used to be written first)."""
    from .test_cli import specgen

    specs, gen = tmp_path / "specs", tmp_path / "gen"
    specs.mkdir()
    for name in ("fmha_alibi", "fmha_mha_bf16"):
        (specs / f"{name}.yaml").write_text((ROOT / "specs" / f"{name}.yaml").read_text())
    built = specgen("build", specs, "--no-compile", "--gen", gen, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    edited = gen / "fmha_mha_bf16.py"
    edited.write_text(edited.read_text() + "# edit\n")
    (gen / "fmha_alibi.py").unlink()
    result = specgen("test", specs, "--emulate", "--gen", gen, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"{edited}: edited by hand, not overwritten (specgen build --force replaces it)"]
    assert not (gen / "fmha_alibi.py").exists()


@pytest.mark.parametrize("label,window,causal,backward", [
    ("right", {"right": 2**29}, False, False),
    ("left", {"left": 2**29}, False, True),
    ("both", {"left": 2**29, "right": 2**29}, False, True),
    ("causal_left", {"left": 2**29}, True, False),
])
def test_the_widest_windows_keep_int32_positions_at_the_extreme_offsets(label, window, causal, backward):
    """Windows up to 2**29 at query positions near -2**30 and 2**30: the kernels add
    a window to an int32 position and a tile, which must not wrap (a window of
    2**31 - 1 wrapped, and rows that see every key stored zeros)."""
    data = {"name": f"wide_{label}", "dtype": "bfloat16", "head_dim": 32, "causal": causal,
            "window": window, "backward": backward}
    module = _emulated(data, f"wide_{label}")
    offsets = (-2**30, -2**29 - 2, -3, 2**29 - 20, 2**30 - 24)
    for q_offset in offsets:
        case = Case(1, 1, 24, 40, q_offset)
        row = _run(module, case)
        assert row["ok"], f"{label} q_offset {q_offset}: {case_verdict(row)}"


QK_AHEAD_SPECS = ["fmha_gqa8_bf16", "fmha_mistral_window", "fmha_fp8_llama", "fmha_varlen_llama",
                  "fmha_gemma_softcap", "fmha_train_gqa_causal", "fmha_mha_bf16"]


@pytest.mark.parametrize("name", QK_AHEAD_SPECS)
def test_qk_ahead_gives_the_plain_kernels_results(name):
    """qk_ahead only moves each S = Q K^T a step earlier: emulated, the output is
    the plain kernel's errors exactly (and gradients), and passes the fp64 check."""
    data = _shipped_data(name)
    ahead = _emulated({**data, "qk_ahead": True}, f"qk_ahead_{name}", f"specs/{name}.yaml")
    plain = _module(name)
    for case in _cases(ahead.SPEC):
        rows = [_run(module, case, seed=11) for module in (plain, ahead)]
        assert rows[1]["ok"], case_verdict(rows[1])
        assert rows[0]["rel_err"] == rows[1]["rel_err"] and rows[0]["max_abs_err"] == rows[1]["max_abs_err"]
        assert rows[0].get("grad_ratio") == rows[1].get("grad_ratio")


@pytest.mark.parametrize("stem", ["hopper_qk_ahead", "hopper_qk_ahead_fp8", "hopper_qk_ahead_noncausal"])
def test_variants_to_be_timed_pass_the_fp64_check_when_emulated(stem, monkeypatch):
    """Each variant of these files passes, emulated, the check the GPU run makes
    before timing it, so no device time goes to a variant that is wrong."""
    from specgen.commands.explore import load_variants

    monkeypatch.chdir(ROOT)
    _, plans, sources = load_variants((ROOT / "bench" / "variants" / f"{stem}.yaml").relative_to(ROOT))
    for label, source in sources.items():
        module = emulate.load_module(ROOT / "generated" / f"{plans[label].module_name}.py", source=source,
                                     name=f"_test_variant_{stem}_{len(label)}_{hash(label)}")
        row = _run(module, Case(1, 1, 150, 600, 450))
        assert row["ok"], f"{stem} / {label}: {case_verdict(row)}"


def test_flush_to_zero_is_modelled():
    tiny = torch.tensor([-130.0, -100.0], dtype=torch.float32)
    assert emulate.exp2(tiny).tolist()[0] > 0
    assert emulate.exp2(tiny, flush_to_zero=True).tolist()[0] == 0.0
    assert emulate.exp2(tiny, flush_to_zero=True).tolist()[1] == 2.0 ** -100
    assert emulate.truediv(torch.tensor([2.0 ** -127]), 1.0, flush_to_zero=True).item() == 0.0


def test_a_block_pattern_with_blocks_set_matches_the_reference():
    """The random block flags of the shared cases are mostly all zero at small
    lengths; here a third of the 128x128 blocks are visible, with ragged edges."""
    from specgen.check.cases import compare, random_qkv, reference_for

    module = _module("fmha_block_pattern")
    g = torch.Generator().manual_seed(5)
    q, k, v = random_qkv(module.SPEC, 2, 1, 300, 450, generator=g, device="cpu")
    blocks = (torch.rand(2, 128, 128, generator=g) < 0.35).to(torch.int32)
    blocks[0, 0, 0] = 1
    with emulate.emulating():
        block_map = module.make_block_map(2, q.shape[1], 300, 450, q_offset=0, device=q.device,
                                          blocks=blocks)
        out = module.attention(q, k, v, blocks=blocks, block_map=block_map)
    ref, _ = reference_for(module.SPEC, q, k, v, {"blocks": blocks})
    result = compare(out, ref, "bfloat16")
    assert result.ok and ref.abs().max() > 0.1, result


# The shipped packed specs (documents, window + documents, training documents) run
# packed in the shipped-spec check above; these cover the masks that ship unpacked,
# a tile of 4 positions per head, and gqa_ratio 8 (8 positions a backward tile), each
# with the packed backward's gradients.
PACKED_SPARSE_CASES = [("fmha_chunked_local", 64, 64, 4), ("fmha_prefix_lm", 64, 64, 4),
                       ("fmha_document_mask", 16, 32, 4), ("fmha_window_document", 16, 32, 4),
                       ("fmha_window_document", 64, 64, 8)]


@pytest.mark.parametrize("name,tile_m,tile_n,ratio", PACKED_SPARSE_CASES)
def test_packed_gqa_sparse_specs_match_the_reference_when_emulated(name, tile_m, tile_n, ratio):
    """pack_gqa on a block-sparse spec at the given tile, forward and backward: the
    same shapes as the shipped check. (Each variant its own module name: a custom op
    is registered once per process and name.)"""
    data = _shipped_data(name)
    targets = {"default": {"tile_m": tile_m, "tile_n": tile_n, "occupancy": 2}}
    variant = f"{name}_pack{tile_m}_gqa{ratio}"
    module = _emulated({**data, "name": variant, "pack_gqa": True, "backward": True, "gqa_ratio": ratio,
                        "targets": targets}, variant, f"specs/{variant}.yaml")
    assert module.BWD_DQ_TILE_P == 64 // ratio
    for case in _cases(module.SPEC):
        row = _run(module, case, seed=7)
        assert row["ok"], f"{name} {tile_m}x{tile_n} {case.label(ratio)}: {case_verdict(row)}"
        assert "grad_ratio" in row


def test_a_packed_block_pattern_walks_scattered_full_tiles_masked():
    """A packed kernel walks full tiles unmasked only as one run; where a row's full
    tiles are scattered (a block pattern) they join the masked walk, and the output
    still matches the reference."""
    from specgen.check.cases import compare, random_qkv, reference_for

    data = _shipped_data("fmha_block_pattern")
    module = _emulated({**data, "pack_gqa": True,
                        "targets": {"default": {"tile_m": 64, "tile_n": 32, "occupancy": 2}}},
                       "pack_block_pattern", "specs/fmha_block_pattern.yaml")
    g = torch.Generator().manual_seed(5)
    q, k, v = random_qkv(module.SPEC, 2, 1, 300, 450, generator=g, device="cpu")
    blocks = (torch.rand(2, 128, 128, generator=g) < 0.5).to(torch.int32)
    with emulate.emulating():
        block_map = module.make_block_map(2, q.shape[1], 300, 450, device=q.device, blocks=blocks)
        out = module.attention(q, k, v, blocks=blocks, block_map=block_map)
    assert block_map.tile == (16, 32)
    counts = block_map.counts
    assert ((counts[..., 2] == -1) & (counts[..., 1] > 0)).any(), "no row with scattered full tiles"
    ref, _ = reference_for(module.SPEC, q, k, v, {"blocks": blocks})
    result = compare(out, ref, "bfloat16")
    assert result.ok and ref.abs().max() > 0.1, result


# The block-sparse backward of the masks that ship unpacked (bench/train/): the
# chunked mask cut to 400 positions, so that rows cross chunks at these shapes; the
# non-causal prefix-LM; a block pattern, whose scattered full tiles take the list.
UNPACKED_SPARSE_BACKWARD = {
    "chunked": ("fmha_train_chunked_local", {"mask_mod": "q_idx // 400 == kv_idx // 400"}),
    "prefix_lm": ("fmha_train_prefix_lm", {}),
    "block_pattern": ("fmha_train_block_pattern", {}),
}


def _unpacked_sparse_backward(label: str, edit=None):
    import yaml

    name, changes = UNPACKED_SPARSE_BACKWARD[label]
    # Its own module name per variant: the custom op is registered once per process and name.
    data = {**yaml.safe_load((ROOT / "bench" / "train" / f"{name}.yaml").read_text()), **changes,
            "name": f"{name}_{label}_{'mutated' if edit else 'cpu'}",
            "targets": {"default": {"tile_m": 64, "tile_n": 64, "occupancy": 2}}}
    plan, source = render_spec_data(data, f"specs/{data['name']}.yaml")
    assert not plan.bwd_pack
    if edit:
        assert edit[0] in source
        source = source.replace(*edit)
    tag = f"unpacked_{label}_{'mutated' if edit else 'shipped'}"
    return emulate.load_module(ROOT / "generated" / f"{plan.module_name}.py", source=source,
                               name=f"_test_emulated_{tag}")


def _sparse_gradients(module, seed: int):
    """dq, dk, dv of the emulated module and of fp64 autograd on one ragged shape
    (rows cross tile borders; a block pattern gets a checkerboard of blocks, so that
    rows with two or more full blocks have them apart), with the maps."""
    from specgen.check.cases import random_qkv, reference_for

    g = torch.Generator().manual_seed(seed)
    q, k, v = random_qkv(module.SPEC, 1, 1, 560, 600, generator=g, device="cpu")
    tensors = {}
    if "prefix" in module.SPEC["tensors"]:  # a bidirectional prefix of 300 positions
        tensors["prefix"] = torch.tensor([300], dtype=torch.int32)
    if "blocks" in module.SPEC["tensors"]:
        parity = torch.arange(128)[:, None] + torch.arange(128)[None, :]
        tensors["blocks"] = (parity % 2 == 0).to(torch.int32).expand(1, 128, 128).contiguous()
    dout = torch.randn(q.shape, generator=g).to(q.dtype)
    with emulate.emulating():
        block_map = module.make_block_map(1, q.shape[1], 560, 600, q_offset=40, device=q.device,
                                          backward=True, **tensors)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = module.attention(*leaves, q_offset=40, block_map=block_map, **tensors)
        grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_for(module.SPEC, *ref_leaves, tensors, q_offset=40)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    return block_map, grads, ref_grads


def _gradient_errors(grads, ref_grads) -> dict:
    """{"dq": .., "dk": .., "dv": ..}: each gradient's largest difference from fp64 over
    the fp64 gradient's largest value."""
    return {f"d{name}": (got.double() - want).abs().max().item() / want.abs().max().item()
            for name, got, want in zip("qkv", grads, ref_grads)}


@pytest.mark.parametrize("label", sorted(UNPACKED_SPARSE_BACKWARD))
def test_unpacked_sparse_backward_walks_full_runs_by_index(label):
    """The unpacked block-sparse dK/dV and dQ kernels walk a row's full tiles by index
    where they are one run, and from the list where they are scattered: gradients
    within 2% of fp64 (bfloat16 inputs) either way, and a run walk that stops one tile
    short is caught."""
    module = _unpacked_sparse_backward(label)
    block_map, grads, ref_grads = _sparse_gradients(module, seed=11)
    dq_counts, kv_counts = block_map.grads[0], block_map.grads[2]  # by query tile, by key tile
    for counts in (dq_counts, kv_counts):
        runs, fulls = counts[..., 2], counts[..., 1]
        if label == "block_pattern":
            assert ((runs == -1) & (fulls > 1)).any(), "no row of scattered full tiles"
        else:
            assert ((runs >= 0) & (fulls > 1)).any(), "no run of full tiles"
    for name, err in _gradient_errors(grads, ref_grads).items():
        assert err < 2e-2, f"{name}: {err:.3g} of its largest value from fp64"
    # The mutation: the dK/dV kernel's run walk (or, for the block pattern, its list
    # walk of the full tiles) stops one tile short.
    short = (("for e in range(MapIdx.shape[3] - num_full, MapIdx.shape[3]):",
              "for e in range(MapIdx.shape[3] - num_full + 1, MapIdx.shape[3]):") if label == "block_pattern"
             else ("for i in range(full_run, full_run + num_full):",
                   "for i in range(full_run, full_run + num_full - 1):"))
    _, bad, _ = _sparse_gradients(_unpacked_sparse_backward(label, short), seed=11)
    worst = max(_gradient_errors(bad, ref_grads).values())
    assert worst > 5e-2, f"a walk of the full tiles one tile short went unnoticed ({worst:.3g})"


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gemma2"])
def test_causal_backward_launch_orders_give_the_same_gradients(name, monkeypatch):
    """The causal backward's grids launch across heads or head by head (heaviest tile
    first either way, BWD_GLOBAL_ORDER_WAVES): both orders give bitwise the same
    gradients (each CTA's sums are its own), within 2% of fp64. (_backward is called
    directly: the custom op may belong to another instance of the module.)"""
    from specgen.check.cases import feature_inputs, random_qkv, reference_for, shape_dims

    module = _module(name)
    g = torch.Generator().manual_seed(13)
    q, k, v = random_qkv(module.SPEC, 2, 2, 300, 330, generator=g, device="cpu")
    extra = feature_inputs(module.SPEC, shape_dims(q, k), g, device="cpu")
    dout = torch.randn(q.shape, generator=g).to(q.dtype)
    scale = 1.0 / math.sqrt(module.SPEC["head_dim"])
    grads = {}
    for label, waves in (("across heads", 10**6), ("head by head", 0)):
        monkeypatch.setattr(module, "BWD_GLOBAL_ORDER_WAVES", waves)
        decisions = []
        real = module._global_order

        def spy(ctas, per_sm, device, real=real, decisions=decisions):
            decisions.append(real(ctas, per_sm, device))
            return decisions[-1]

        monkeypatch.setattr(module, "_global_order", spy)
        with emulate.emulating():
            out, lse = module._forward(q, k, v, scale=scale, q_offset=30, **extra)
            grads[label] = module._backward(q, k, v, out, lse, dout, scale, 30, *extra.values())[:3]
        assert decisions == [bool(waves)] * 2, decisions
    for a, b in zip(*grads.values()):
        assert torch.equal(a, b)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_for(module.SPEC, *leaves, extra, q_offset=30)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    for name_, err in _gradient_errors(grads["across heads"], ref_grads).items():
        assert err < 2e-2, f"{name_}: {err:.3g} of its largest value from fp64"


def test_an_emulated_fuzz_failure_prints_an_emulated_replay(tmp_path, monkeypatch, capsys):
    from specgen.check import runner

    def failing(module_path, case, generator_seed):
        return {"shape": "x", "max_abs_err": 1.0, "rel_err": 1.0, "nonfinite": 0, "ok": False}

    monkeypatch.setattr(runner, "_emulated_case", failing)
    code = runner.run_test([str(ROOT / "specs" / "fmha_mha_bf16.yaml")], tmp_path, quick=False,
                           seed=3, fuzz=2, emulate=True)
    out, err = capsys.readouterr()
    assert code == 1
    assert "--fuzz-case=3:0 --emulate" in out and "replay: --fuzz-case=3:1 --emulate" in err


def _gpu_variants() -> dict:
    from . import test_gpu

    return {**test_gpu.VARIANTS, **test_gpu.VARLEN_VARIANTS, **test_gpu.FEATURE_VARIANTS}


@pytest.mark.parametrize("variant", sorted(_gpu_variants()))
def test_gpu_template_variants_pass_when_emulated(variant):
    """The prefill variants of the GPU tests (tiles, loads, sub-tiles, V layout,
    persistent launches, buckets, qk_ahead, varlen, windows, soft-cap, sinks, hooks,
    float8, dropout), each on ragged shapes: rows past the keys, a partial last half."""
    from specgen.check.runner import case_matrix

    module = _emulated(prefill_variant_data(variant, _gpu_variants()[variant]), f"variant_{variant}")
    cases = ([case_matrix(True, module.SPEC)[2]] if module.SPEC["varlen"]
             else [Case(2, 1, 128, 600, 472), Case(1, 2, 77, 77), Case(1, 1, 100, 300, 450)])
    for case in cases:
        row = _run(module, case)
        assert row["ok"], f"{variant} {case.label(module.SPEC['gqa_ratio'])}: {case_verdict(row)}"


def _decode_variants() -> dict:
    from . import test_gpu

    return test_gpu.DECODE_VARIANTS


@pytest.mark.parametrize("variant", sorted(_decode_variants()))
def test_gpu_decode_variants_pass_when_emulated(variant):
    """The decode variants of the GPU tests (paged, float8 caches, V keys last,
    windows, sinks, splits, masks and block maps) on the quick decode batches."""
    from specgen.check.runner import case_matrix

    module = _emulated(decode_variant_data(variant, _decode_variants()[variant]), f"decode_{variant}",
                       "specs/v.yaml")
    for i, case in enumerate(case_matrix(True, module.SPEC)[:4]):
        row = _run(module, case, seed=i)
        assert row["ok"], f"{variant} {case.label(module.SPEC['gqa_ratio'])}: {case_verdict(row)}"


# The AOT cubins serve a call only where their signature covers it: a launcher that
# passes what the exported signature does not describe (an argument more, a float for an
# int, an array of another rank, a stride the cubin assumes away) would fall back to the
# JIT on every first call, silently. Every backward launch of an emulated run is checked
# here against the signatures `specgen build` exports, argument by argument.
AOT_BACKWARD_CASES = {
    "fmha_train_gqa_causal": None,  # prescale_q: the dQ kernel takes QS and pre
    "fmha_train_document": None,  # packed GQA, a block map
    "fmha_train_gptoss_sinks": None,
    "fmha_train_gemma2": None,
    "varlen_prescaled": {"varlen": True, "backward": True, "prescale_q": True},
    "dropout_learnable": {"backward": True, "dropout": True,
                          "tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
                          "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
    # learnable subscripts that vary with the key: added by the dK/dV kernel
    "table_learnable": {"backward": True,
                        "tensors": {"rel": {"dtype": "float32", "shape": ["heads", 2048], "learnable": True},
                                    "colb": {"dtype": "float32", "shape": ["seq_k"], "learnable": True}},
                        "score_mod": "score + rel[h, q_idx - kv_idx] + 0.5 * colb[kv_idx]"},
    # sinks in packed sequences: the dQ kernel's own D, stored through the sequence's view
    "varlen_sinks_lse_window": {"varlen": True, "backward": True, "sinks": True, "return_lse": True,
                                "window": {"left": 60}},
    # the dQ kernel takes the sink logits for a learnable tensor's D
    "sinks_learnable_lse": {"backward": True, "sinks": True, "return_lse": True,
                            "tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
                            "score_mod": "score - slope[h] * (q_idx - kv_idx)"},
}


def _meets(constraint, arg) -> str | None:
    """Why ``arg`` breaks ``constraint`` (an exported parameter), or None."""
    from cuda.tile.compilation import ArrayConstraint, ConstantConstraint, ScalarConstraint

    if isinstance(constraint, ConstantConstraint):
        return None if arg == constraint.value else f"constant {constraint.value} got {arg!r}"
    if isinstance(constraint, ScalarConstraint):
        want = constraint.dtype.name
        ok = (isinstance(arg, float) if want.startswith("float")
              else isinstance(arg, int) and not isinstance(arg, bool) and -2**31 <= arg < 2**31)
        return None if ok else f"{want} scalar got {arg!r}"
    assert isinstance(constraint, ArrayConstraint)
    if not isinstance(arg, torch.Tensor):
        return f"array got {type(arg).__name__}"
    if (emulate.torch_dtype(constraint.dtype), constraint.ndim) != (arg.dtype, arg.dim()):
        return f"{constraint.dtype.name} {constraint.ndim}-D got {arg.dtype} {arg.dim()}-D"
    if arg.data_ptr() % constraint.base_addr_divisible_by:
        return f"base not {constraint.base_addr_divisible_by}-byte aligned"
    for i in range(arg.dim()):
        stride, size = arg.stride(i), arg.shape[i]
        if constraint.stride_constant[i] not in (None, stride):
            return f"axis {i}: stride {stride}, cubin assumes {constraint.stride_constant[i]}"
        if size > 1 and stride % constraint.stride_divisible_by[i]:
            return f"axis {i}: stride {stride} not a multiple of {constraint.stride_divisible_by[i]}"
        if size % constraint.shape_divisible_by[i]:
            return f"axis {i}: size {size} not a multiple of {constraint.shape_divisible_by[i]}"
    return None


@pytest.mark.parametrize("name", sorted(AOT_BACKWARD_CASES))
def test_backward_launches_are_covered_by_the_exported_aot_signatures(name):
    from specgen.compile.export import backward_signatures
    from specgen.plan import make_plan
    from specgen.spec import load_spec

    overrides = AOT_BACKWARD_CASES[name]
    if overrides is None:
        plan = make_plan(load_spec(ROOT / "specs" / f"{name}.yaml"))
        source = (ROOT / "generated" / f"{name}.py").read_text()
    else:
        plan, source = render_spec_data(prefill_variant_data(name, overrides))
    source = _own_op(source, plan.module_name, "aot_check")
    module = emulate.load_module(ROOT / "generated" / f"{plan.module_name}.py", source=source,
                                 name=f"_test_emulated_aot_{name}")
    exported = backward_signatures(plan)
    launches, run = [], module.ct.launch

    def record(stream, grid, kernel, args, **options):
        launches.append((getattr(kernel, "_pyfunc", kernel).__name__, args))
        run(stream, grid, kernel, args, **options)

    module.ct.launch = record
    case = (Case(2, 1, 0, 0, lengths=((70, 130), (1, 1))) if module.SPEC["varlen"]
            else Case(1, 1, 130, 200, 70))
    row = _run(module, case)
    assert row["ok"] and row.get("grad_ok"), case_verdict(row)
    backward = [(n, a) for n, a in launches if n in plan.bwd_names]
    assert sorted({n for n, _ in backward}) == sorted(plan.bwd_names)
    for kernel_name, args in backward:
        reasons = []
        for sig in exported[kernel_name]:
            if len(sig.parameters) != len(args):
                reasons.append(f"{len(sig.parameters)} parameters, {len(args)} arguments")
                continue
            broken = [f"#{i}: {why}" for i, (c, a) in enumerate(zip(sig.parameters, args))
                      if (why := _meets(c, a))]
            if not broken:
                break
            reasons.append("; ".join(broken))
        else:
            pytest.fail(f"{kernel_name}: no exported signature covers the launch: {reasons}")


def test_float8_prefill_descales_are_made_once_and_applied():
    """Float descales (the same three every call) become one [3] tensor per device and
    values, so a call launches nothing for them; one-element tensors are read as
    given (no host sync); each descale reaches the output; bad ones are refused."""
    module = _module("fmha_fp8_llama")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 70, 128, generator=gen).to(torch.float8_e4m3fn)
    k, v = (torch.randn(1, 1, 90, 128, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    device = torch.device("cpu")
    first = module._descales(device, True, q_descale=0.5, k_descale=1.0, v_descale=2.0)
    assert first is module._descales(device, True, q_descale=0.5, k_descale=1.0, v_descale=2.0)
    assert first.tolist() == [0.5, 1.0, 2.0] and first.dtype == torch.float32
    mixed = module._descales(device, True, q_descale=torch.tensor([0.5], dtype=torch.bfloat16), k_descale=1.0,
                             v_descale=torch.tensor(2.0))
    assert mixed.tolist() == [0.5, 1.0, 2.0] and mixed is not first
    with pytest.raises(ValueError, match="k_descale must be a positive float"):
        module._descales(device, True, q_descale=1.0, k_descale=-1.0, v_descale=1.0)
    # 0 and inf in float32: NaN out, or a RuntimeError from the fill
    for bad in (1e-50, 1e39):
        with pytest.raises(ValueError, match="q_descale must be a positive float in float32's normal range"):
            module._descales(device, True, q_descale=bad, k_descale=1.0, v_descale=1.0)
    with pytest.raises(ValueError, match="v_descale must be a positive float or a one-element float tensor on"):
        module._descales(device, True, q_descale=1.0, k_descale=1.0, v_descale=torch.ones(2))
    with emulate.emulating():
        base = module.attention(q, k, v).float()
        scaled = module.attention(q, k, v, q_descale=0.5, k_descale=1.0, v_descale=2.0).float()
        by_tensor = module.attention(q, k, v, v_descale=torch.tensor([2.0])).float()
    ref, _ = reference_for(module.SPEC, q.double(), k.double(), v.double(), {})
    ref_scaled, _ = reference_for(module.SPEC, q.double() * 0.5, k.double(), v.double() * 2.0, {})
    assert (base - ref).abs().max() < 2e-2 * ref.abs().max()
    assert (scaled - ref_scaled).abs().max() < 2e-2 * ref_scaled.abs().max()
    assert torch.allclose(by_tensor, 2 * base, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("label", ["float8", "padded_v_head_dim"])
def test_the_v_transpose_kernel_copies_v_exactly(label):
    """transposed_v (the kernel configs with v_transposed read V through) is V's exact
    transpose on ragged key counts and strided views, [B, Hkv, Dv, Skv] with rows of
    16 elements; bad input is a ValueError."""
    if label == "float8":
        module = _module("fmha_fp8_llama")
        dtype, width = torch.float8_e4m3fn, 128
    else:
        data = prefill_variant_data("v_transpose", {
            "head_dim": 96, "v_head_dim": 80, "prescale_q": False,
            "targets": {"default": {"tile_m": 64, "tile_n": 64, "v_transposed": True}}})
        module = _emulated(data, "v_transpose")
        dtype, width = torch.float16, 80
    gen = torch.Generator().manual_seed(5)
    for batch, heads, keys in ((1, 1, 1), (2, 3, 67), (1, 2, 200)):
        full = torch.randn(batch, heads, keys + 5, width + 8, generator=gen).to(dtype)
        v = full[:, :, 5:, 8:]  # strided: rows of width + 8, an offset base
        with emulate.emulating():
            v_t = module.transposed_v(v)
        assert v_t.shape == (batch, heads, width, keys)
        assert v_t.stride(2) % 16 == 0 and v_t.stride(3) == 1
        assert torch.equal(v_t.float(), v.transpose(2, 3).float())
    # The launch a contiguous V makes is one the exported AOT signature covers.
    from specgen.compile.export import v_transpose_signatures

    launches, run = [], module.ct.launch

    def record(stream, grid, kernel, args, **options):
        launches.append(args)
        run(stream, grid, kernel, args, **options)

    module.ct.launch = record
    try:
        with emulate.emulating():
            module.transposed_v(torch.randn(2, 2, 77, width, generator=gen).to(dtype))
    finally:
        module.ct.launch = run
    from specgen.plan import make_plan
    from specgen.spec import validate_spec

    (sig,) = v_transpose_signatures(make_plan(validate_spec(module.SPEC))).popitem()[1]
    (args,) = launches
    assert len(sig.parameters) == len(args)
    assert not [why for c, a in zip(sig.parameters, args) if (why := _meets(c, a))]
    with emulate.emulating():
        with pytest.raises(ValueError, match=r"v must be a \[B, Hkv, Skv, "):
            module.transposed_v(torch.zeros(1, 1, 4, width + 1).to(dtype))
        with pytest.raises(ValueError, match="v must be a"):
            module.transposed_v(torch.zeros(1, 1, 4, width))  # float32
        with pytest.raises(ValueError, match="v must be a"):
            module.transposed_v(torch.zeros(1, 1, width, 4).to(dtype).transpose(2, 3))


@pytest.mark.parametrize("label", ["float8", "float16_by_seq_k"])
def test_a_v_made_by_transposed_v_is_read_as_it_is(label):
    """attention(..., v_transposed=True) takes transposed_v's [B, Hkv, Dv, Skv] (made
    once where a cache is written) and launches no copy: the same bits as V as given,
    eagerly and through the op. A config that reads V as given (float16 here, keys up
    to 64) copies it back. A V of another layout, or rows not 16-byte aligned, is a
    ValueError."""
    if label == "float8":
        module = _module("fmha_fp8_llama")
        dtype, width, kv_heads = torch.float8_e4m3fn, 128, 1
    else:
        data = prefill_variant_data("v_pre", {
            "head_dim": 96, "v_head_dim": 80, "prescale_q": False, "gqa_ratio": 2,
            "targets": {"default": {"tile_m": 64, "tile_n": 64, "v_transposed": True,
                                    "by_seq_k": [{"max_seq_k": 64, "tile_m": 64, "tile_n": 64,
                                                  "v_transposed": False}]}}})
        module = _emulated(data, "v_pre")
        dtype, width, kv_heads = torch.float16, 80, 2
    hq, d = kv_heads * module.SPEC["gqa_ratio"], module.SPEC["head_dim"]
    gen = torch.Generator().manual_seed(8)
    launches, run = [], module.ct.launch

    def record(stream, grid, kernel, args, **options):
        launches.append(getattr(kernel, "__name__", str(kernel)))
        run(stream, grid, kernel, args, **options)

    for keys in (40, 131):  # the float16 variant reads V as given up to 64 keys
        q = torch.randn(1, hq, 50, d, generator=gen).to(dtype)
        k = torch.randn(1, kv_heads, keys, d, generator=gen).to(dtype)
        v = torch.randn(1, kv_heads, keys, width, generator=gen).to(dtype)
        with emulate.emulating():
            v_t = module.transposed_v(v)
            module.ct.launch = record
            try:
                want = module.attention(q, k, v)
                as_given = len(launches)
                got = module.attention(q, k, v_t, v_transposed=True)
            finally:
                module.ct.launch = run
            assert torch.equal(got, want), keys
            # V as given: the copy and the attention where the config reads V
            # transposed; the V that transposed_v made: the attention alone.
            reads_vt = module._launch_config(q.device, keys)[0].get("v_transposed")
            assert (as_given, len(launches) - as_given) == (2 if reads_vt else 1, 1), (keys, launches)
            launches.clear()
            original = module._eager
            module._eager = lambda values: False
            try:
                assert torch.equal(module.attention(q, k, v_t, v_transposed=True), want)
            finally:
                module._eager = original
    with emulate.emulating():
        with pytest.raises(ValueError, match="v_transposed must be True or False"):
            module.attention(q, k, v_t, v_transposed=1)
        with pytest.raises(ValueError, match=r"v with v_transposed=True must be transposed_v\(v\)'s"):
            module.attention(q, k, v, v_transposed=True)  # V as given
        with pytest.raises(ValueError, match="v seen as"):  # another key count
            module.attention(q, k, v_t[..., :-1], v_transposed=True)
        unaligned = torch.zeros(1, kv_heads, width, keys + 1).to(dtype)[..., 1:]
        with pytest.raises(ValueError, match="16-byte aligned, as transposed_v"):
            module.attention(q, k, unaligned, v_transposed=True)
        odd_rows = torch.zeros(1, kv_heads, width, keys).to(dtype)  # 131 keys a row
        with pytest.raises(ValueError, match="16-byte aligned, as transposed_v"):
            module.attention(q, k, odd_rows, v_transposed=True)
        # V as given (v_transposed=False) still needs a contiguous head_dim, as q and k:
        # the copy (transposed_v refuses it) and the kernel read its rows whole.
        strided = odd_rows.transpose(2, 3)  # [B, Hkv, Skv, Dv], head_dim stride Skv
        with pytest.raises(ValueError, match="v must be contiguous in head_dim"):
            module.attention(q, k, strided)
        original = module._eager
        module._eager = lambda values: False
        try:
            with pytest.raises(ValueError, match="v must be contiguous in head_dim"):
                module.attention(q, k, strided)
        finally:
            module._eager = original


# --- backward: true on every shipped prefill spec ------------------------------------



@pytest.mark.parametrize("name", FORWARD_ONLY_PREFILL_SPECS)
def test_every_shipped_prefill_spec_trains_when_emulated(name):
    """Each shipped forward-only prefill spec (float8 aside: it has no backward) with
    backward: true renders a module whose gradients pass FlashAttention's rule
    against fp64 autograd, on a ragged chunked-prefill case."""
    module = _emulated(trained_spec_data(name), f"trained_{name}", f"specs/{name}.yaml")
    case = _cases(module.SPEC)[0]
    row = _run(module, case)
    assert row["ok"] and row.get("grad_ok"), f"{name}: {case_verdict(row)}"


@pytest.mark.parametrize("changes", [
    {"softcap": 2.0},  # a cap near the scores' size: its slope 1 - tanh**2 matters
    {"softcap": 1.5, "sinks": True, "gqa_ratio": 2},
    {"tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
     "score_mod": "where(score > 0, score, 0.5 * score) - slope[h] * (q_idx - kv_idx)"},
], ids=["softcap", "softcap_sinks", "nonlinear_score_mod"])
def test_unmasked_interior_tiles_keep_the_soft_cap_and_score_mod_slopes(changes):
    """Soft-cap, score_mod and sinks run the backward's interior tiles (every pair
    visible) without the mask; those tiles must still chain dS through the soft-cap's
    and score_mod's slopes. Sq = Skv = 300 causal gives both kernels interior tiles
    (the dQ kernel's 128-row tiles see whole 64-key tiles below the diagonal)."""
    data = {"name": "interior_slopes", "dtype": "bfloat16", "head_dim": 32, "gqa_ratio": 1,
            "causal": True, "backward": True, **changes}
    module = _emulated(data, f"interior_{abs(hash(repr(changes)))}")
    from specgen.plan.make import make_plan
    from specgen.spec import validate_spec

    plan = make_plan(validate_spec(data))
    assert plan.bwd_split_dq and plan.bwd_split_dkdv
    for case in (Case(1, 1, 300, 300), Case(1, 1, 200, 400, 200)):
        row = _run(module, case)
        assert row["ok"] and row.get("grad_ok"), case_verdict(row)


# --- random valid specs compute what the reference computes -------------------------

NUMERIC_EXAMPLES = int(os.environ.get("SPECGEN_NUMERIC_FUZZ_EXAMPLES", "12"))


def _random_spec_matches_the_reference(data):
    """A random valid spec (the render fuzzer's strategies), emulated on the CPU on
    one ragged case: out (and gradients, with backward: true) against fp64."""
    from hypothesis import assume

    from specgen.errors import SpecError
    from specgen.spec import validate_spec

    try:
        validate_spec(data, "fuzz.yaml")
    except SpecError:
        assume(False)
    module = _emulated(data, f"numeric_{data['name']}_{abs(hash(repr(data)))}")
    case = _cases(module.SPEC)[0]
    row = _run(module, case, seed=len(repr(data)))
    assert row["ok"], f"{data}\n{case.label(module.SPEC['gqa_ratio'])}: {case_verdict(row)}"


def _numeric(strategy):
    from hypothesis import HealthCheck, given, settings

    return settings(max_examples=NUMERIC_EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])(
        given(strategy)(_random_spec_matches_the_reference))


pytest.importorskip("hypothesis")
from .test_fuzz import decode_specs, prefill_specs  # noqa: E402

test_random_valid_prefill_specs_match_the_reference_when_emulated = _numeric(prefill_specs())
test_random_valid_decode_specs_match_the_reference_when_emulated = _numeric(decode_specs())


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_document", "fmha_varlen_llama"])
def test_a_loss_on_the_returned_lse_reaches_the_gradients(name):
    """return_lse with backward: true returns a differentiable lse. The check's loss
    weighs out and lse by random gradients (check_gradients), so a backward that
    dropped dlse would miss the reference by the lse term; and a loss of lse alone
    gives gradients, not an error."""
    data = _shipped_data(name)
    module = _emulated({**data, "return_lse": True, "backward": True}, f"lse_grad_{name}",
                       f"specs/{name}.yaml")
    for case in _cases(module.SPEC)[:2]:
        row = _run(module, case)
        assert row["ok"] and "grad_ratio" in row, f"{name} {case.label(module.SPEC['gqa_ratio'])}: {case_verdict(row)}"
    if module.SPEC["varlen"]:
        return
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 40, module.SPEC["head_dim"], generator=g).to(torch.bfloat16).requires_grad_()
               for h in (2 * module.SPEC["gqa_ratio"], 2, 2))
    extra = {}
    if "doc" in module.SPEC.get("tensors", {}):
        extra["doc"] = torch.tensor([[0] * 13 + [1] * 27], dtype=torch.int32)
    with emulate.emulating():
        _, lse = module.attention(q, k, v, **extra)
        weight = torch.randn(lse.shape, generator=g)
        got = torch.autograd.grad((lse * weight).sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _, ref_lse = reference_for(module.SPEC, *leaves, extra)
    want = torch.autograd.grad((ref_lse * weight.double()).sum(), leaves, allow_unused=True)
    for name_, a, b in zip("qkv", got, want):
        b = torch.zeros_like(leaves[0 if name_ == "q" else 2]) if b is None else b  # lse reads no v
        assert (a.double() - b).abs().max() <= 0.02 * b.abs().max() + 1e-3, name_


def test_backward_op_fake_outputs_match_the_real_ones_for_strided_learnable_tensors():
    """The backward op's fake implementation (what torch.compile traces) gives its
    outputs the shapes, dtypes and strides the real one returns, also for a learnable
    table passed transposed and bfloat16 sinks (inductor asserts on a mismatch)."""
    data = {"name": "fake_strides", "dtype": "bfloat16", "head_dim": 64, "gqa_ratio": 2,
            "causal": True, "backward": True, "sinks": True,
            "tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True},
                        "rel": {"dtype": "float32", "shape": ["heads", 256], "learnable": True}},
            "score_mod": "score - slope[h] * (q_idx - kv_idx) + rel[h, q_idx - kv_idx]"}
    module = _emulated(data, "fake_strides")
    g = torch.Generator().manual_seed(18)
    q = torch.randn(1, 2, 40, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 1, 40, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    sinks = torch.randn(2, generator=g).to(torch.bfloat16)
    slope, rel = torch.rand(2, generator=g), torch.randn(256, 2, generator=g).t()  # strides (1, 2)
    dout = torch.randn(q.shape, generator=g).to(q.dtype)
    with emulate.emulating():
        out, lse = module._forward(q, k, v, sinks=sinks, slope=slope, rel=rel)
        # The hook tensors in name order, whatever the spec's order.
        args = (q, k, v, out, lse, dout, 0.125, 0, sinks, rel, slope)
        real = module._op_grads(*args)
        fake = module._op_grads_fake(*args)
    for name, r, f in zip(("dq", "dk", "dv", "dsinks", "drel", "dslope"), real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), name


def test_two_specs_of_one_name_keep_their_own_ops():
    """Two training modules of the same name from different specs (causal and not),
    loaded in one process: each attention runs its own kernels."""
    base = {"name": "same_name", "dtype": "bfloat16", "head_dim": 64, "backward": True}
    causal = _emulated({**base, "causal": True}, "same_name_causal")
    full = _emulated({**base, "causal": False}, "same_name_full")
    assert causal.OP_NAME != full.OP_NAME
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 33, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    with emulate.emulating():
        for module in (causal, full):
            out = module.attention(q, k, v)
            ref, _ = reference_for(module.SPEC, q.double(), k.double(), v.double(), {})
            assert (out.double() - ref).abs().max() < 0.03, module.SPEC["causal"]


@pytest.mark.parametrize("lengths", [((20, 30), (0, 70)), ((0, 10), (5, 0)), ((3, 3), (0, 5))],
                         ids=["no-queries-last", "no-keys-last", "no-queries-short"])
def test_varlen_sequences_without_queries_or_keys_at_the_end(lengths):
    """A last sequence with no queries (or no keys) starts at the end of the packed
    array: its views are taken from a start inside the array, as cuTile requires
    (the emulator raises otherwise), and its gradients are zero."""
    data = _shipped_data("fmha_varlen_llama")
    module = _emulated({**data, "backward": True}, "varlen_edges")
    row = _run(module, Case(2, 2, 0, 0, lengths=lengths))
    assert row["ok"] and "grad_ratio" in row, case_verdict(row)


def test_a_head_without_a_sink_and_a_row_without_keys_give_zeros_not_nan():
    """sinks = -inf (a head without a sink) on rows that see no key: zeros and lse
    -inf as the fp64 reference gives, finite gradients (there was 0/0 in the tail)."""
    module = _module("fmha_train_gptoss_sinks")
    g = torch.Generator().manual_seed(3)
    hq, hkv, d = 2 * module.SPEC["gqa_ratio"], 2, module.SPEC["head_dim"]
    q = torch.randn(1, hq, 70, d, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, hkv, 30, d, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    sinks = torch.randn(hq, generator=g)
    sinks[::2] = -math.inf
    sinks.requires_grad_()
    with emulate.emulating():
        out, lse = module.attention(q, k, v, q_offset=-40, sinks=sinks)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v, sinks))
    ref, ref_lse = reference_for(module.SPEC, q.detach().double(), k.detach().double(),
                                 v.detach().double(), {"sinks": sinks.detach().double()}, q_offset=-40)
    assert (out.double() - ref).abs().max() < 0.02
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert all(torch.isfinite(g_).all() for g_ in grads)


def test_a_nan_lse_gradient_on_rows_without_keys_stays_out_of_the_gradients():
    """Merging LSEs through logaddexp hands NaN to a row whose lse is -inf (no key):
    such a row's lse has no gradient, and dq, dk stay finite."""
    data = _shipped_data("fmha_train_gqa_causal")
    module = _emulated({**data, "return_lse": True}, "lse_grad_nan")
    g = torch.Generator().manual_seed(0)
    d = module.SPEC["head_dim"]
    q = torch.randn(1, module.SPEC["gqa_ratio"], 80, d, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 1, 40, d, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    with emulate.emulating():
        out, lse = module.attention(q, k, v, q_offset=-40)
        merged = torch.logaddexp(lse, torch.full_like(lse, -math.inf))
        loss = out.float().sum() + torch.where(torch.isfinite(merged), merged, 0.0).sum()
        grads = torch.autograd.grad(loss, (q, k, v))
    assert torch.isinf(lse).any() and all(torch.isfinite(g_).all() for g_ in grads)


@pytest.mark.parametrize("score_mod", [
    # a condition chosen by another (written as and/or/not for sympy), and a ~ of a
    # condition on the head alone, which the kernel computes on scalars
    "where(score > 0 if h > 0 else score < 0, score, 0.5 * score) - slope[h] * (q_idx - kv_idx)",
    # min of two arguments with slope 1 that tie on the diagonal
    "min(score, score - slope[h] * (q_idx - kv_idx))",
])
def test_hook_derivatives_train_against_fp64_autograd(score_mod):
    """The backward of a training spec whose score_mod sympy used to get wrong
    (a dropped condition, a zero slope at ties), emulated against fp64 autograd of
    the reference, learnable slopes included."""
    data = {"name": "hook_grad", "dtype": "bfloat16", "head_dim": 16, "gqa_ratio": 2,
            "causal": True, "backward": True, "score_mod": score_mod,
            "tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    module = _emulated(data, f"hook_grad_{abs(hash(score_mod))}")
    row = _run(module, Case(1, 2, 40, 50, 10))
    assert row["ok"] and row["grad_ok"], case_verdict(row)


@pytest.mark.parametrize("label,hooks", [
    # The reference differentiated the branch not taken too: 0 times sqrt's
    # derivative at a negative score is NaN, a false failure of a right kernel.
    ("sqrt_branch", {"score_mod": "where(score > 0, sqrt(score), 0.0)"}),
    ("sqrt_ifexp", {"score_mod": "sqrt(score) if score > 0 else score"}),
    # Integer arithmetic past int32 wraps in the kernels; the reference computed it
    # in int64 (relative error 0.49 and 0.83).
    ("wrapping_score", {"score_mod": "score + ((q_idx * 1103515245 + kv_idx * 12345) % 13) * 0.1"}),
    ("wrapping_mask", {"mask_mod": "(q_idx * 1103515245 + kv_idx) % 3 != 0"}),
    # scores that ignore q . k, written as the refusal of one without score says
    ("fixed_pattern", {"score_mod": "score * 0.0 + q_idx * 0.01"}),
])
def test_the_reference_follows_the_kernels_branches_and_int32_arithmetic(label, hooks):
    _small_spec_trains(f"hook_ref_{label}", hooks, batches=(1, 1))


def _small_spec_trains(label: str, fields: dict, batches=(1, 2)) -> None:
    """A bf16 D16 GQA 2 training spec with ``fields``, 16x16 tiles, emulated: its
    output and gradients pass the fp64 check on a chunked-prefill case and on one
    with queries before the first key."""
    data = {"name": label, "dtype": "bfloat16", "head_dim": 16, "gqa_ratio": 2, "backward": True,
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}, **fields}
    module = _emulated(data, label)
    for case in (Case(batches[0], 1, 40, 50, 10), Case(batches[1], 1, 30, 20, -13)):
        row = _run(module, case)
        assert row["ok"] and row["grad_ok"], f"{label} {case}: {case_verdict(row)}"


_TABLE = {"dtype": "float32", "shape": ["heads", 4], "learnable": True}
_IDS = {"dtype": "int32", "shape": ["batch", "seq_k"]}


@pytest.mark.parametrize("label,extra", [
    # A learnable table indexed through an id tensor: its gradient was planned for
    # the ids (the first gather of the subscript), and the call refused the table.
    ("nested_learnable", {"score_mod": "score + tab[h, ids[b, kv_idx] % 4]",
                          "tensors": {"tab": _TABLE, "ids": _IDS}}),
    # A block map's pretest of a mask_mod whose index reads the same tensor: the
    # map kernel read a local it never made (NameError).
    ("nested_mask_map", {"mask_mod": "ids[b, ids[b, q_idx] % 40] <= kv_idx + 3",
                         "tensors": {"ids": _IDS}, "block_sparse": True}),
])
def test_subscripts_inside_subscripts_train_against_fp64(label, extra):
    _small_spec_trains(f"nested_{label}", extra)


def test_decode_windows_of_several_new_tokens_mask_every_tile_before_the_last_tokens_window():
    """Token t's window starts t keys after token 0's: with the first window start
    q_len - 2 keys or fewer before a tile's end, the next tile held keys before the
    later tokens' windows and ran unmasked (errors 0.016 and 0.062 on tokens 2 and 3
    at L 167; every decode spec with a window and max_q_len >= 3)."""
    import math

    from specgen.check.cases import decode_reference, random_decode

    data = {"name": "decode_window_mtp", "family": "decode", "dtype": "bfloat16", "head_dim": 128,
            "gqa_ratio": 4, "max_q_len": 4, "window": {"left": 100}, "sinks": True,
            "targets": {"default": {"tile_m": 16, "tile_n": 64}}}
    module = _emulated(data, "decode_window_mtp")
    # (L - q_len - left) % 64 == 63 for 167 and 231; a sequence of every other phase too.
    lens = [167, 231, 165, 166, 168, 104, 40]
    batch = random_decode(module.SPEC, lens, 1, 4, generator=torch.Generator().manual_seed(1), device="cpu")
    sinks = torch.full((4,), -math.inf)
    with emulate.emulating():
        out = module.attention(*batch.args(), sinks=sinks)
    ref = decode_reference(module.SPEC, batch, {"sinks": sinks})
    errors = (out.double() - ref).abs().amax(dim=(2, 3))  # [B, q_len]
    assert errors.max().item() < 1e-2, errors


_FA_RULE = runner._fa_rule  # before any test patches it


def _gradient_ratio(monkeypatch, module, case: Case, seed: int, index: int) -> tuple[dict, float]:
    """The case's row, and gradient ``index``'s (in the order dq, dk, dv, dsinks,
    learnable tensors) largest error against fp64 over FlashAttention's allowance."""
    ratios = []
    rule = _FA_RULE

    def spy(torch_, got, exact, rough):
        g, e, r = got[index].double(), exact[index], rough[index].double()
        ratios.append((g - e).abs().max().item() / (2 * (r - e).abs().max().item() + 1e-5))
        return rule(torch_, got, exact, rough)

    monkeypatch.setattr(runner, "_fa_rule", spy)
    row = _run(module, case, seed)
    assert len(ratios) == 1
    return row, ratios[0]


def test_a_learnable_slope_gradient_takes_the_delta_of_the_kernels_own_p(monkeypatch):
    """A slope's gradient sums dS * (kv_idx - q_idx) over every pair: weights that do
    not average out over a row, so D = rowsum(dO * O) with O rounded to bfloat16 (the
    D that dq and dk use) left an error of up to 2.8x FlashAttention's allowance on
    long rows. The dQ kernel corrects the sum with the D of its own P and dP."""
    data = {"name": "slope_delta", "dtype": "bfloat16", "head_dim": 16, "gqa_ratio": 4,
            "causal": True, "backward": True,
            "tensors": {"slope": {"dtype": "float32", "shape": ["heads"], "learnable": True}},
            "score_mod": "where(score > 0 if h % 2 == 0 else score < 0, score, 0.5 * score) "
                         "+ min(0.0, 0.0 - slope[h] * (q_idx - kv_idx)) + 0.25 * sqrt(max(score, 0.0) + 1.0)",
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    module = _emulated(data, "slope_delta")
    for seed in (2, 5):  # 0.29 and 2.78 of the allowance with D = dO . O
        row, ratio = _gradient_ratio(monkeypatch, module, Case(1, 1, 8, 512, 504), seed, -1)
        assert row["ok"] and row["grad_ok"] and ratio < 0.05, (case_verdict(row), ratio)


def test_the_sinks_gradient_takes_the_delta_of_the_kernels_own_p(monkeypatch):
    """dsinks = -sum over rows of P_sink * D: with D = rowsum(dO * O) from the output
    rounded to bfloat16 it was 9.2x FlashAttention's allowance on this case (the
    bfloat16 reference forms D from its own P). The dQ kernel stores the D of its own
    P and dP, which the sinks' gradient and the dK/dV kernel read."""
    data = {"name": "sinks_delta", "dtype": "bfloat16", "head_dim": 16, "gqa_ratio": 1,
            "causal": False, "sinks": True, "backward": True,
            "tensors": {"slope": {"dtype": "float32", "shape": ["heads"]}},
            "score_mod": "score - slope[h] * (q_idx - kv_idx)",
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    module = _emulated(data, "sinks_delta")
    row, ratio = _gradient_ratio(monkeypatch, module, Case(1, 1, 8, 512, 504), 5, 3)  # dsinks
    assert row["ok"] and row["grad_ok"] and ratio < 0.05, (case_verdict(row), ratio)


@pytest.mark.parametrize("exact_delta", [True, False])
def test_the_dq_kernel_sums_the_sinks_gradient_of_its_rows(exact_delta):
    """The dQ kernel stores each query tile's share of dsinks, -sum of P_sink * D over
    its rows, and the launcher sums the shares: with exact_delta off (a block of a
    larger attention) D is dO . O, and dsinks is that formula's, in float32, tile
    edges and rows before the first key included."""
    module = _module("fmha_train_gptoss_sinks")
    g = torch.Generator().manual_seed(11)
    hq, d = 2 * module.SPEC["gqa_ratio"], module.SPEC["head_dim"]
    q = torch.randn(2, hq, 150, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 170, d, generator=g).to(torch.bfloat16) for _ in range(2))
    dout = torch.randn(2, hq, 150, d, generator=g).to(torch.bfloat16)
    sinks = torch.randn(hq, generator=g)
    sinks[1] = -math.inf  # a head without a sink
    with emulate.emulating():
        out, lse = module._forward(q, k, v, q_offset=-20, sinks=sinks)
        dq, dk, dv, dsinks = module._backward(q, k, v, out, lse, dout, 0.125, -20, sinks,
                                              exact_delta=exact_delta)
    assert dsinks.shape == sinks.shape and torch.isfinite(dsinks).all() and dsinks[1] == 0
    p_sink = torch.exp(sinks.view(1, -1, 1) - lse).nan_to_num(nan=0.0)
    if exact_delta:  # D' of the kernel's own P: near dO . O, not equal to it
        assert (lse == -math.inf).any()
        ref = _emulated_reference_dsinks(module, q, k, v, dout, sinks)
        assert (dsinks.double() - ref).abs().max() < 2e-2 * ref.abs().max()
    else:
        delta = (dout.float() * out.float()).sum(-1)
        expected = -(p_sink * delta).sum(dim=(0, 2))
        assert (dsinks - expected).abs().max() <= 1e-4 * expected.abs().max()


def _emulated_reference_dsinks(module, q, k, v, dout, sinks):
    """dsinks of the fp64 reference through autograd."""
    sinks64 = sinks.double().requires_grad_()
    ref, _ = reference_for(module.SPEC, q.double(), k.double(), v.double(), {"sinks": sinks64},
                           q_offset=-20)
    (grad,) = torch.autograd.grad(ref, sinks64, dout.double())
    return grad


def test_a_learnable_table_read_by_both_positions_takes_the_kernels_own_delta(monkeypatch):
    """rel[h, (q_idx - kv_idx) // 32] under a window of 2: every key a row sees reads
    rel[h, 0], whose exact gradient is the row's sum of dS, 0. Added in the dQ kernel
    with D = rowsum(dO * O) it was 19.7x FlashAttention's allowance; the dK/dV
    kernel adds it with the dQ kernel's own D."""
    data = {"name": "rel_delta", "dtype": "bfloat16", "head_dim": 16, "gqa_ratio": 2,
            "causal": True, "window": {"left": 2}, "backward": True,
            "tensors": {"rel": {"dtype": "float32", "shape": ["heads", 160], "learnable": True}},
            "score_mod": "score + rel[h, (q_idx - kv_idx) // 32]",
            "targets": {"default": {"tile_m": 16, "tile_n": 16}}}
    module = _emulated(data, "rel_delta")
    row, ratio = _gradient_ratio(monkeypatch, module, Case(1, 1, 77, 77, 0), 3, -1)
    assert row["ok"] and row["grad_ok"] and ratio < 0.05, (case_verdict(row), ratio)


# --- head dims split into two tiles in D ----------------------------------------------

SPLIT_VARIANTS = {
    # 72 = 64 + 16: the rest tile reaches 8 columns past the head dim (zero padding)
    "d72_gqa4_dropout": {"head_dim": 72, "gqa_ratio": 4, "causal": True, "dropout": True},
    "d80_softcap_sinks_window_lse": {"head_dim": 80, "gqa_ratio": 2, "causal": True, "softcap": 30.0,
                                     "sinks": True, "window": {"left": 100}, "return_lse": True},
    "dv80_only": {"head_dim": 128, "v_head_dim": 80, "causal": False, "prescale_q": True},
    "d160_packed_documents": {"head_dim": 160, "gqa_ratio": 4, "causal": True, "pack_gqa": True,
                              "block_sparse": True,
                              "tensors": {"doc_ids": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
                              "mask_mod": "doc_ids[b, q_idx] == doc_ids[b, kv_idx]"},
    "d48_varlen": {"head_dim": 48, "gqa_ratio": 2, "causal": True, "varlen": True},
}


@pytest.mark.parametrize("label", sorted(SPLIT_VARIANTS))
def test_split_head_dims_train_against_fp64_when_emulated(label):
    """A head dim run as two tiles in D (head_dim_split: auto) passes the forward's and
    the gradients' checks, across the features whose loads, products and stores the
    split touches (padded rest tiles, GQA, packed block maps, varlen, sinks, LSE)."""
    data = {"name": f"split_{label}", "dtype": "bfloat16", "backward": True, **SPLIT_VARIANTS[label]}
    module = _emulated(data, f"split_{label}")
    names = set(module.__dict__)
    assert names & {"REST_COL", "V_REST_COL"} and not names & {"HEAD_DIM_TILE", "V_HEAD_DIM_TILE"}
    case = _cases(module.SPEC)[0]
    row = _run(module, case)
    assert row["ok"] and row.get("grad_ok"), f"{label}: {case_verdict(row)}"


@pytest.mark.parametrize("changes", [{"q_subtiles": 2}, {"qk_ahead": True, "loads": {"k_transposed": False}}],
                         ids=["halves", "qk_ahead_k_permuted"])
def test_split_head_dims_in_the_forward_variants_when_emulated(changes):
    """The forward's two query halves and its look-ahead S (with K transposed in
    registers) load, multiply and store both D tiles."""
    module = _emulated({"name": "split_fwd", "dtype": "float16", "head_dim": 96, "gqa_ratio": 2,
                        "causal": True, **changes}, f"split_fwd_{sorted(changes)[0]}")
    for case in _cases(module.SPEC)[:2]:
        row = _run(module, case)
        assert row["ok"], case_verdict(row)


# Each edit drops one half of a split head dim's work (text of fmha_phi2_d80, 80 = 64 + 16).
SPLIT_MUTATIONS = {
    "rest columns of S dropped": ("ct.mma(q_rest, k_t_rest, ct.mma(q, k_t, s))", "ct.mma(q, k_t, s)"),
    "rest columns of the output not stored": (
        "    ct.store(Out, index=(batch, head, tile_idx, REST_COL), tile=out_rest)\n", ""),
}


@pytest.mark.parametrize("what", sorted(SPLIT_MUTATIONS))
def test_a_broken_split_head_dim_fails_the_emulated_check(what):
    old, new = SPLIT_MUTATIONS[what]
    source = (ROOT / "generated" / "fmha_phi2_d80.py").read_text()
    assert source.count(old) >= 1, what
    broken = _module("fmha_phi2_d80", source.replace(old, new))
    row = _run(broken, Case(1, 1, 130, 300, 170))
    assert not row["ok"], what


@pytest.mark.parametrize("name", ["fmha_train_gptoss_sinks", "fmha_vit_dropout"])
def test_eager_path_skips_the_op_and_matches_it_bit_for_bit(name):
    """An eager call with gradients runs _EagerAttention (the op's forward, context
    and backward without the dispatcher), one without gradients calls the forward
    directly; both give the custom op's bits: output, LSE and every gradient
    (learnable sinks, and the ViT spec trained for dropout)."""
    module = _module(name) if name.startswith("fmha_train_") else _emulated(trained_spec_data(name), f"eager_{name}")
    g = torch.Generator().manual_seed(5)
    hq, d = 2 * module.SPEC["gqa_ratio"], module.SPEC["head_dim"]
    q = torch.randn(1, hq, 70, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 90, d, generator=g).to(torch.bfloat16) for _ in range(2))
    extra = {"sinks": torch.randn(hq, generator=g)} if module.SPEC.get("sinks") else {}
    if module.SPEC.get("dropout"):
        extra = {"dropout_p": 0.25, "seed": 11}
    dout = torch.randn(1, hq, 70, d, generator=g).to(torch.bfloat16)

    def leaves():
        return [t.clone().requires_grad_() for t in (q, k, v, *(t for t in extra.values() if isinstance(t, torch.Tensor)))]

    def grads_of(out, inputs):
        out = out[0] if isinstance(out, tuple) else out
        return [out, *torch.autograd.grad(out, inputs, dout)]

    with emulate.emulating():
        eager_inputs = leaves()
        eager_extra = dict(extra, **({"sinks": eager_inputs[3]} if "sinks" in extra else {}))
        eager_out = module.attention(*eager_inputs[:3], **eager_extra)
        assert type((eager_out[0] if isinstance(eager_out, tuple) else eager_out).grad_fn).__name__ == "_EagerAttentionBackward"
        eager = grads_of(eager_out, eager_inputs)
        op_inputs = leaves()
        scalars = (0.25, 11) if module.SPEC.get("dropout") else ()
        op_out = module._OP(*op_inputs[:3], 1.0 / math.sqrt(d), 0, *scalars, *op_inputs[3:])
        op = grads_of(op_out, op_inputs)
        with torch.no_grad():
            plain = module.attention(q, k, v, **extra)
    for got, want in zip(eager, op):
        assert torch.equal(got, want)
    assert torch.equal(plain[0] if isinstance(plain, tuple) else plain, eager[0])


@pytest.mark.parametrize("loss", ["lse", "out_and_lse"])
def test_eager_path_takes_unused_outputs_as_none(loss):
    """The eager path gets None, not zeros made for it, for an output the loss does
    not use: an LSE-only loss has no output gradient (zeros in its place), and an
    output-only loss no LSE gradient (the dQ kernel weights it 0). Both give the
    op's bits, whose autograd makes the zeros."""
    module = _module("fmha_train_gptoss_sinks")
    g = torch.Generator().manual_seed(9)
    hq, d = 2 * module.SPEC["gqa_ratio"], module.SPEC["head_dim"]
    q = torch.randn(1, hq, 70, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 90, d, generator=g).to(torch.bfloat16) for _ in range(2))
    sinks, dout = torch.randn(hq, generator=g), torch.randn(1, hq, 70, d, generator=g).to(torch.bfloat16)
    dlse = torch.randn(1, hq, 70, generator=g)

    def grads(call):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out, lse = call(inputs)
        total = (lse * dlse).sum() + ((out.float() * dout.float()).sum() if loss == "out_and_lse" else 0)
        return torch.autograd.grad(total, inputs)

    with emulate.emulating():
        eager = grads(lambda t: module.attention(*t[:3], sinks=t[3]))
        op = grads(lambda t: module._OP(*t[:3], 1.0 / math.sqrt(d), 0, t[3]))
    assert all(torch.equal(a, b) for a, b in zip(eager, op))
    assert eager[0].abs().max() > 0 and eager[3].abs().max() > 0


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gptoss_sinks"])
def test_an_eager_backward_runs_no_torch_compute_beside_its_kernels(name):
    """The host time of an eager backward is its allocations and launches: no zeros
    filled for the unused LSE's gradient, and the sinks' gradient summed by the
    kernels, not by torch ops after them (launches stubbed out, torch's ops
    recorded by its profiler, which leaves the eager path in place)."""
    from torch.profiler import ProfilerActivity, profile

    module = _module(name)
    g = torch.Generator().manual_seed(4)
    hq, d = 2 * module.SPEC["gqa_ratio"], module.SPEC["head_dim"]
    leaves = [torch.randn(1, hq, 64, d, generator=g).to(torch.bfloat16).requires_grad_()]
    leaves += [torch.randn(1, 2, 64, d, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2)]
    extra = {"sinks": torch.randn(hq, generator=g).requires_grad_()} if module.SPEC.get("sinks") else {}
    with emulate.emulating():
        launch, module.ct.launch = module.ct.launch, lambda *args, **kwargs: None
        try:
            out = module.attention(*leaves, **extra)
            out = out[0] if isinstance(out, tuple) else out
            assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                torch.autograd.grad(out, leaves + list(extra.values()), torch.ones_like(out))
        finally:
            module.ct.launch = launch
    ops = {e.name for e in prof.events() if e.name.startswith("aten::")}
    computing = {op for op in ops if op not in {"aten::empty", "aten::empty_like", "aten::empty_strided",
                                               "aten::detach", "aten::to", "aten::_to_copy", "aten::copy_",
                                               "aten::contiguous", "aten::ones_like", "aten::fill_",
                                               "aten::as_strided", "aten::view", "aten::lift_fresh"}}
    assert not computing, computing
    # the one fill is the test's own ones_like (the output's gradient); none for the LSE
    fills = [e for e in prof.events() if e.name == "aten::fill_"]
    assert len(fills) <= 1, [e.name for e in prof.events()]


def test_launchers_take_the_public_stream_where_torch_has_no_raw_handle():
    """_stream hands ct.launch torch's raw current-stream handle; a torch without
    that private call gives the public stream object's handle, and the launches
    (forward and backward) run the same."""
    module = _module("fmha_train_gqa_causal")
    g = torch.Generator().manual_seed(1)
    d = module.SPEC["head_dim"]
    q = torch.randn(1, module.SPEC["gqa_ratio"], 40, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 1, 40, d, generator=g).to(torch.bfloat16) for _ in range(2))
    streams = []
    with emulate.emulating():
        launch = module.ct.launch

        def spy(stream, *args, **kwargs):
            streams.append(stream)
            return launch(stream, *args, **kwargs)

        module.ct.launch = spy
        try:
            raw = module.attention(q, k, v)
            module._RAW_STREAM, saved = None, module._RAW_STREAM
            module.torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=7)
            try:
                public = module.attention(q, k, v)
            finally:
                module._RAW_STREAM = saved
                del module.torch.cuda.current_stream  # the emulator's own again
        finally:
            module.ct.launch = launch
    assert torch.equal(raw, public) and streams == [0, 7]


def test_tracers_and_tensor_subclasses_see_the_op():
    """make_fx records the custom op (not the kernels' launches, which a trace would
    drop); plain tensors and parameters take the eager path."""
    from torch.fx.experimental.proxy_tensor import make_fx

    module = _module("fmha_train_gqa_causal")
    g = torch.Generator().manual_seed(1)
    d = module.SPEC["head_dim"]
    q = torch.randn(1, module.SPEC["gqa_ratio"], 40, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 1, 40, d, generator=g).to(torch.bfloat16) for _ in range(2))
    with emulate.emulating():
        for mode in ("fake", "real"):
            graph = make_fx(lambda q, k, v: module.attention(q, k, v), tracing_mode=mode)(q, k, v)
            targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
            assert any(module.OP_NAME.replace("::", ".") in t for t in targets), (mode, targets)
        assert module._eager([q, torch.nn.Parameter(k)])
        with torch._subclasses.fake_tensor.FakeTensorMode():
            assert not module._eager([q])


def test_each_emulated_load_traces_its_own_op():
    """A spec loaded again (another sm, or another name) found the first load's op
    registered and reused it: make_fx, torch.compile and opcheck of the sm_100 module
    ran the sm_90 module's functions (its tiles: other grids) and none of its patches."""
    from torch.fx.experimental.proxy_tensor import make_fx

    path = ROOT / "generated" / "fmha_train_document.py"  # sm_90 64x64 tiles, sm_100 128x128
    first = emulate.load_module(path, sm=(9, 0), name="_test_own_op_sm90")
    second = emulate.load_module(path, sm=(10, 0), name="_test_own_op_sm100")
    assert first.OP_NAME != second.OP_NAME and first._OP is not second._OP
    launches = []
    for module, tag in ((first, "sm90"), (second, "sm100")):
        def spy(stream, grid, kernel, args, _tag=tag, _launch=module.ct.launch, **options):
            launches.append((_tag, grid))
            return _launch(stream, grid, kernel, args, **options)
        module.ct.launch = spy
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 200, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 1, 200, 128, generator=g).to(torch.bfloat16)
    doc = torch.zeros(1, 200, dtype=torch.int32)
    with emulate.emulating():
        second.attention(q, k, k, doc=doc)
        eager, launches[:] = list(launches), []
        make_fx(lambda q, k, v: second.attention(q, k, v, doc=doc), tracing_mode="real")(q, k, k)
    assert eager and all(tag == "sm100" for tag, _ in eager)
    assert launches == eager


def test_no_two_emulated_loads_share_an_op():
    """The op suffix was the module's name with \\W replaced and the sm: names that
    differ only in punctuation shared one op, so did one name loaded again with other
    text (a mutated kernel ran the first text's op), and a non-ASCII name failed in
    torch's schema parser (UnicodeDecodeError)."""
    path = ROOT / "generated" / "fmha_train_gqa_causal.py"
    text = path.read_text(encoding="utf-8")
    dashed = emulate.load_module(path, name="_test_op_x-y")
    underscored = emulate.load_module(path, name="_test_op_x_y")
    assert dashed.OP_NAME != underscored.OP_NAME and dashed._OP is not underscored._OP
    first = emulate.load_module(path, name="_test_op_again")
    mutated = emulate.load_module(path, name="_test_op_again", source=text + "\nMUTATED = True\n")
    assert first.OP_NAME != mutated.OP_NAME and first._OP is not mutated._OP
    accented = emulate.load_module(path, name="_test_op_mod\u00e9")
    assert accented.OP_NAME.isascii() and accented._OP is not None


def test_a_second_derivative_through_the_eager_backward_is_refused_not_dropped():
    """create_graph=True on the eager path gave first-order gradients with no graph: a
    loss on dq (a gradient penalty) was silently a constant (dv 96% off the true second
    derivative). They now come from the backward op, whose own backward torch refuses,
    as on the compiled path; first-order gradients are unchanged, bitwise."""
    module = _module("fmha_train_gqa_causal")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 32, 128, generator=g).to(torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(1, 1, 32, 128, generator=g).to(torch.bfloat16).requires_grad_(True)
            for _ in range(2))
    with emulate.emulating():
        loss = module.attention(q, k, v).float().square().sum()
        plain = torch.autograd.grad(loss, (q, k, v), retain_graph=True)
        dq, dk, dv = torch.autograd.grad(loss, (q, k, v), create_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(plain, (dq, dk, dv)))
        assert dq.requires_grad
        with pytest.raises(RuntimeError, match="no autograd formula"):
            torch.autograd.grad(dq.float().square().sum(), v)


def _training_inputs(module, seq, generator):
    """bfloat16 q [1, 2 * gqa_ratio, seq, D] and k, v [1, 2, seq, D] for a training
    module, and its sinks ([Hq] float32) where the spec has them, as a list."""
    hq, d = 2 * module.SPEC["gqa_ratio"], module.SPEC["head_dim"]
    q = torch.randn(1, hq, seq, d, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, seq, d, generator=generator).to(torch.bfloat16) for _ in range(2))
    extra = [torch.randn(hq, generator=generator)] if module.SPEC.get("sinks") else []
    return q, k, v, extra


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gptoss_sinks", "fmha_train_document"])
def test_torch_func_grad_and_vjp_give_the_backward_gradients(name):
    """torch.func.grad and torch.func.vjp through a training module's attention were
    refused in torch's words ("it must override the setup_context staticmethod": the
    op's autograd is an autograd.Function torch.func cannot transform). Under Grad
    transforms only, the call takes _EagerAttention, run on the unwrapped tensors:
    the same bits as loss.backward(); a second derivative is refused."""
    module = _module(name)
    g = torch.Generator().manual_seed(12)
    q, k, v, extra = _training_inputs(module, 40, g)
    doc = {"doc": torch.tensor([[0] * 15 + [1] * 25], dtype=torch.int32)} if name.endswith("document") else {}

    def call(q, k, v, *sinks):
        out = module.attention(q, k, v, **doc, **({"sinks": sinks[0]} if sinks else {}))
        return out if isinstance(out, tuple) else (out,)

    def loss(*inputs):
        return sum(t.float().square().sum() for t in call(*inputs))

    argnums = tuple(range(3 + len(extra)))
    with emulate.emulating():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, *extra)]
        want = torch.autograd.grad(loss(*leaves), leaves)
        got = torch.func.grad(loss, argnums=argnums)(q, k, v, *extra)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        outs, vjp = torch.func.vjp(call, q, k, v, *extra)
        cotangents = tuple(2 * t.float().to(t.dtype) for t in outs)
        assert all(torch.equal(a, b) for a, b in zip(vjp(cotangents), want))
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.func.grad(lambda q: torch.func.grad(loss)(q, k, v, *extra).float().sum())(q)


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gptoss_sinks"])
def test_per_sample_gradients_and_jacrev_run_the_kernels_once_per_entry(name):
    """vmap over grad (per-sample gradients) and jacrev (vmap over vjp) were refused
    in torch's words (no setup_context; no vmap rule for the backward): each entry
    now runs the kernels on its own slice, the same bits as a loop over the entries."""
    module = _module(name)
    g = torch.Generator().manual_seed(21)
    hq, d = 2 * module.SPEC["gqa_ratio"], module.SPEC["head_dim"]
    q = torch.randn(3, 1, hq, 24, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(3, 1, 2, 24, d, generator=g).to(torch.bfloat16) for _ in range(2))
    sinks = [torch.randn(hq, generator=g)] if module.SPEC.get("sinks") else []

    def call(q, k, v, *sinks):  # the output alone where the spec returns the LSE too
        out = module.attention(q, k, v, **({"sinks": sinks[0]} if sinks else {}))
        return out[0] if isinstance(out, tuple) else out

    def loss(q, k, v, *sinks):
        return call(q, k, v, *sinks).float().square().sum()

    argnums = tuple(range(3 + len(sinks)))
    in_dims = (0, 0, 0) + (None,) * len(sinks)
    with emulate.emulating():
        per_sample = torch.func.vmap(torch.func.grad(loss, argnums=argnums), in_dims=in_dims)(q, k, v, *sinks)
        loop = [torch.func.grad(loss, argnums=argnums)(q[i], k[i], v[i], *sinks) for i in range(3)]
        for got, want in zip(per_sample, zip(*loop)):
            assert torch.equal(got, torch.stack(want))
        rows = torch.func.jacrev(lambda q: call(q, k[0], v[0], *sinks)[0, 0, 0, :4].float())(q[0])
        _, vjp = torch.func.vjp(lambda q: call(q, k[0], v[0], *sinks)[0, 0, 0, :4].float(), q[0])
        for i in range(4):
            (want,) = vjp(torch.eye(4)[i])
            assert torch.equal(rows[i], want)


def test_grad_over_vmap_nested_vmap_and_empty_batches_of_the_vmap_rules():
    """The vmap rules ran the kernels themselves, outside any transform around the
    vmap: grad(vmap(f)) gave all-zero gradients (|dq| 0, the loop's 211), jacrev
    over jacrev a zero Hessian rather than the refusal, vmap(vmap(grad)) failed in
    torch's words (inplace arithmetic), and a batch of no entries failed to unpack.
    Each entry now calls the autograd.Function itself."""
    module = _module("fmha_train_gptoss_sinks")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, 16, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 1, 1, 16, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    sinks = torch.randn(8, generator=g)

    def loss(q, k, v, sinks):
        out, lse = module.attention(q, k, v, sinks=sinks)
        return out.float().square().sum() + lse.sum()

    grad = torch.func.grad(loss, argnums=(0, 1, 2, 3))
    with emulate.emulating():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        want = torch.autograd.grad(sum(loss(*(t[i] for t in leaves[:3]), leaves[3]) for i in range(2)), leaves)
        batched = torch.func.vmap(loss, in_dims=(0, 0, 0, None))
        got = torch.func.grad(lambda *a: batched(*a).sum(), argnums=(0, 1, 2, 3))(q, k, v, sinks)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        qs = torch.stack([q, q.flip(0)])
        loop = [[grad(qs[j, i], k[i], v[i], sinks) for i in range(2)] for j in range(2)]
        nested = torch.func.vmap(torch.func.vmap(grad, in_dims=(0, 0, 0, None)), in_dims=(0, None, None, None))(
            qs, k, v, sinks)
        for n, got in enumerate(nested):
            assert torch.equal(got, torch.stack([torch.stack([r[n] for r in row]) for row in loop]))
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.func.jacrev(torch.func.jacrev(lambda s: loss(q[0], k[0], v[0], s)))(sinks)
        empty = torch.func.vmap(grad, in_dims=(0, 0, 0, None))(q[:0], k[:0], v[:0], sinks)
        assert [t.shape for t in empty] == [(0, *q.shape[1:]), (0, *k.shape[1:]), (0, *v.shape[1:]), (0, 8)]


def test_block_map_and_varlen_lengths_under_grad_and_vmap():
    """A hook tensor passed through torch.func.grad (doc, not differentiated) is
    wrapped, with no data pointer: the block map's check of it failed in torch's
    words ("Cannot access data pointer of Tensor that doesn't have storage"), as did
    one that vmap batches, and cu_seqlens that vmap batches without max_seqlen. The
    first is the tensor itself; the others are a ValueError saying what to pass."""
    module = _module("fmha_train_document")
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, 4, 32, 128, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 1, 1, 32, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    doc = torch.tensor([[0] * 10 + [1] * 22], dtype=torch.int32)
    block_map = module.make_block_map(1, 4, 32, 32, doc=doc, backward=True)

    def loss(q, k, v, doc, block_map=None):
        return module.attention(q, k, v, doc=doc, block_map=block_map).float().square().sum()

    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    with emulate.emulating():
        want = torch.func.vmap(grad, in_dims=(0, 0, 0, None))(q, k, v, doc)
        got = torch.func.vmap(grad, in_dims=(0, 0, 0, None, None))(q, k, v, doc, block_map)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with pytest.raises(ValueError, match="block_map cannot be used where torch.func.vmap batches doc"):
            torch.func.vmap(grad, in_dims=(0, 0, 0, 0, None))(q, k, v, doc.expand(2, 1, 32), block_map)
    varlen = _emulated(trained_spec_data("fmha_varlen_llama"), "vmapped_cu_seqlens")
    q = torch.randn(2, 24, 4, 128, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 24, 1, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    cu = torch.tensor([[0, 10, 24], [0, 3, 24]], dtype=torch.int32)

    def packed(q, k, v, cu):
        return varlen.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)[0].float().sum()

    with emulate.emulating(), pytest.raises(ValueError, match="max_seqlen_q must be given when torch.func.vmap batches"):
        torch.func.vmap(torch.func.grad(packed))(q, k, v, cu)


@pytest.mark.parametrize("mode", ["func_jvp", "jacfwd", "forward_ad"])
def test_forward_mode_ad_is_refused_not_a_zero_tangent(mode):
    """The ops have no forward derivative and torch does not refuse one:
    torch.func.jvp gave an all-zero tangent (the true one's norm ~35), and a dual
    tensor's tangent was dropped by the kernels' plain output. Both are a ValueError."""
    import torch.autograd.forward_ad as fwAD

    module = _module("fmha_train_gqa_causal")
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 4, 20, 128, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 1, 20, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    with emulate.emulating(), pytest.raises(ValueError, match="no forward-mode derivative"):
        if mode == "func_jvp":
            torch.func.jvp(lambda q: module.attention(q, k, v), (q,), (torch.ones_like(q),))
        elif mode == "jacfwd":
            torch.func.jacfwd(lambda q: module.attention(q, k, v).float().sum())(q)
        else:
            with fwAD.dual_level():
                module.attention(fwAD.make_dual(q, torch.ones_like(q)), k, v)


def test_a_sparse_or_broadcast_output_gradient():
    """A sparse output gradient reached .contiguous() and failed in torch's words; it is
    a ValueError naming the layout. A broadcast one (stride 0 outside D) is copied
    before the kernels, whose tensor-memory loads take positive strides."""
    module = _module("fmha_train_gqa_causal")
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 16, 128, generator=g).to(torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(1, 1, 16, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    with emulate.emulating():
        out = module.attention(q, k, v)
        with pytest.raises(ValueError, match="the output gradient must be a torch.bfloat16 tensor "
                                             r"of shape \(1, 4, 16, 128\) on cpu, got .*torch.sparse_coo"):
            torch.autograd.grad(out, q, torch.ones_like(out).to_sparse(), retain_graph=True)
        row = torch.randn(128, generator=g).to(torch.bfloat16)
        (broadcast,) = torch.autograd.grad(out, q, row.expand_as(out), retain_graph=True)
        (dense,) = torch.autograd.grad(out, q, row.expand_as(out).contiguous())
    assert torch.equal(broadcast, dense)


@pytest.mark.parametrize("name", ["fmha_train_gqa_causal", "fmha_train_gptoss_sinks"])
def test_batched_output_gradients_run_the_kernels_once_per_entry(name):
    """torch.autograd.grad(..., is_grads_batched=True), and torch.autograd.functional's
    jacobian with vectorize=True, run the backward under torch's legacy vmap, which no
    torch.func interpreter shows: the eager backward handed its batched gradients to
    the kernels, which failed (emulated, a vmap error from inside a tile load). It
    takes the backward op, whose vmap fallback runs it per entry: each entry's bits
    are those of its own backward, the LSE's gradient alone included."""
    module = _module(name)
    g = torch.Generator().manual_seed(14)
    q, k, v, extra = _training_inputs(module, 24, g)
    douts = torch.randn(3, *q.shape, generator=g).to(torch.bfloat16)

    def call(*inputs):
        out = module.attention(*inputs[:3], **({"sinks": inputs[3]} if extra else {}))
        return out if isinstance(out, tuple) else (out,)

    with emulate.emulating():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, *extra)]
        outs = call(*leaves)
        batched = torch.autograd.grad(outs[0], leaves, douts, is_grads_batched=True, retain_graph=True)
        for i in range(3):
            each = torch.autograd.grad(outs[0], leaves, douts[i], retain_graph=True)
            assert all(torch.equal(a[i], b) for a, b in zip(batched, each))
        if extra:  # the LSE alone: no output gradient, batched LSE gradients
            dlse = torch.randn(2, *outs[1].shape, generator=g)
            batched = torch.autograd.grad(outs[1], leaves, dlse, is_grads_batched=True, retain_graph=True)
            for i in range(2):
                each = torch.autograd.grad(outs[1], leaves, dlse[i], retain_graph=True)
                assert all(torch.equal(a[i], b) for a, b in zip(batched, each))

        def corner(x):  # a few outputs: the loop below runs a backward for each
            return call(x, k, v, *extra)[0][:, :, :2, :2]

        vectorized = torch.autograd.functional.jacobian(corner, q, vectorize=True)
        looped = torch.autograd.functional.jacobian(corner, q)
    assert vectorized.shape == (1, q.shape[1], 2, 2, *q.shape) and torch.equal(vectorized, looped)

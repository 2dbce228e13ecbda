"""Emit: golden files, determinism, black-clean output, headers, and that every
spec field visibly changes the generated kernel."""

import ast
import copy
import difflib
import re
import subprocess
import sys

import black
import pytest
import yaml

from specgen.check.cases import output_dtype
from specgen.plan.make import make_plan
from specgen.emit.render import BLACK_MODE, HEADER_RE, hand_edited, render, template_hash
from specgen.spec import spec_to_dict, validate_spec

from .helpers import ROOT, SPECS, SPEC_NAMES, generated_module, kernel_source


def _render_shipped(path):
    plan = make_plan(validate_spec(yaml.safe_load(path.read_text()), path))
    return render(plan, f"specs/{path.name}").text


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_generated_matches_fresh_render(path):
    fresh = _render_shipped(path)
    committed_path = ROOT / "generated" / f"{path.stem}.py"
    committed = committed_path.read_text() if committed_path.exists() else ""
    if fresh != committed:
        diff = "".join(
            difflib.unified_diff(
                committed.splitlines(True), fresh.splitlines(True),
                f"generated/{path.stem}.py (committed)", "fresh render",
            )
        )
        pytest.fail(
            f"generated/{path.stem}.py is stale:\n{diff}\n"
            "update it with: specgen build specs --no-compile"
        )


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_render_is_deterministic(path):
    assert _render_shipped(path) == _render_shipped(path)


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_generated_is_black_clean(name):
    text = (ROOT / "generated" / f"{name}.py").read_text()
    assert black.format_str(text, mode=BLACK_MODE) == text


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_docstring_entries_start_their_own_lines(name):
    """No docstring line runs two entries together ("... in bfloat16).        q_offset:
    ..."): a template block that ends without its newline joins the next entry."""
    for node in ast.walk(ast.parse((ROOT / "generated" / f"{name}.py").read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Module, ast.FunctionDef)) and ast.get_docstring(node):
            for line in ast.get_docstring(node).splitlines():
                assert not re.search(r"\S {4,}[a-z_]+(, [a-z_]+)*: ", line), f"{name}: {line}"


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_header_carries_version_path_and_hashes(name):
    from specgen import __version__

    text = (ROOT / "generated" / f"{name}.py").read_text()
    match = HEADER_RE.match(text)
    assert match, text[:400]
    assert match["version"] == __version__
    assert match["spec_path"] == f"specs/{name}.yaml"
    assert match["template_sha"] == template_hash()
    assert not hand_edited(text)
    assert hand_edited(text + "# tweak\n")
    # The header is exactly the five matched lines: no timestamp or host name.
    assert text[match.end() :].startswith('"""')


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_module_imports_only_the_standard_library_torch_and_cuda_tile(name):
    tree = ast.parse((ROOT / "generated" / f"{name}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    outside = {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names}
    assert {"torch", "cuda.tile"} <= outside
    assert all(m == "torch" or m == "cuda.tile" or m.startswith("cuda.tile.") for m in outside), outside


def test_every_generated_module_imports_without_gpu_or_specgen():
    code = (
        "import sys\n"
        f"for name in {SPEC_NAMES!r}:\n"
        "    mod = __import__('generated.' + name, fromlist=['attention'])\n"
        "    assert callable(mod.attention) and mod.SPEC['name'] == name\n"
        "bad = [m for m in sys.modules if m == 'specgen' or m.startswith('specgen.')]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "HOME": str(ROOT)},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_module_exposes_spec_and_configs(path):
    spec = validate_spec(yaml.safe_load(path.read_text()), path)
    mod = generated_module(path.stem)
    plan = make_plan(spec)
    assert mod.SPEC == spec_to_dict(spec)
    assert validate_spec(mod.SPEC) == spec  # the module's SPEC is the whole spec
    assert mod.CONFIGS == {t.name: tuple(c.as_dict() for c in t.configs) for t in plan.targets}
    for name, cfg in spec.targets.items():  # the target's own config comes last
        assert mod.CONFIGS[name][-1]["max_seq_k"] is None
        assert (mod.CONFIGS[name][-1]["tile_m"], mod.CONFIGS[name][-1]["tile_n"]) == (cfg.tile_m, cfg.tile_n)
        assert [c["max_seq_k"] for c in mod.CONFIGS[name][:-1]] == [b.max_seq_k for b in cfg.by_seq_k]
    kernel_name = plan.kernel_name
    assert hasattr(mod, kernel_name)


BASE = yaml.safe_load((ROOT / "specs" / "fmha_gqa_causal.yaml").read_text())


def _variant(path, value):
    data = copy.deepcopy(BASE)
    node = data
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    if path == "causal":
        data["block_remap"] = False
    return render(make_plan(validate_spec(data)), "specs/variant.yaml").text


# Each field's change, and a line of source that shows it (present or absent).
VISIBLE = [
    ("name", "renamed", "renamed: causal prefill", True),
    ("dtype", "bfloat16", "DTYPE = torch.bfloat16", True),
    ("head_dim", 64, "HEAD_DIM = 64", True),
    ("gqa_ratio", 8, "GROUP_SIZE = 8", True),
    ("causal", False, "visible = keys <= rows", False),
    ("fast_math.exp2", False, "p = ct.exp(s - m_new)", True),
    ("fast_math.flush_to_zero", False, "flush_to_zero=True", False),
    ("fast_math.approx_div", False, "rounding_mode=ct.RoundingMode.APPROX", False),
    ("loop_split", False, "for j in range(0, num_n):", True),
    ("block_remap", False, "tile_idx = tile_bid", True),
    # The shipped spec's short-sequence bucket uses the global tile order: without
    # it the kernel loses its TILES_OUTER argument and the launcher its branch.
    ("targets.sm_90.by_seq_k", [], "if TILES_OUTER:", False),
    ("targets.sm_90.by_seq_k", [{"max_seq_k": 2048, "tile_m": 64, "tile_n": 128}],
     "TILES_OUTER: ConstBool", False),
    ("loads.k_transposed", False, "k_t = ct.permute(k, (1, 0))", True),
    ("loads.k_latency", None, "latency=2", False),
    ("loads.v_latency", 7, "latency=7", True),
    ("targets.sm_90", {"tile_m": 128, "tile_n": 32, "occupancy": 1},
     '{"max_seq_k": None, "tile_m": 128, "tile_n": 32, "occupancy": 1}', True),
    ("targets.sm_90.num_worker_warps", 4, "num_worker_warps=ct.ByTarget(sm_90=4)", True),
    ("targets.sm_90.num_ctas", 2, "num_ctas=ct.ByTarget(sm_90=2)", True),
    ("targets.sm_90.opt_level", 2, "opt_level=ct.ByTarget(sm_90=2, default=3)", True),
    ("targets.sm_90.by_seq_k", [{"max_seq_k": 4096, "tile_m": 64, "tile_n": 32, "occupancy": 3}],
     '"hints": {"occupancy": 3, "num_worker_warps": None}', True),
    ("prescale_q", False, "q = (q.astype(ct.float32) * scale).astype(Q.dtype)", False),
    ("q_subtiles", 2, "SUB_M = TILE_M // 2", True),
    ("loads.check_bounds", "masked", "check_bounds=False", True),
    ("loads.allow_tma", False, "allow_tma=False", True),
    ("autotune", {}, "autotune", False),
    ("targets.sm_100", {"tile_m": 128, "tile_n": 128, "occupancy": 3},
     "sm_100=3", True),
    ("compile_for", ["sm_90"], '"compile_for": ["sm_90"]', True),
    ("window", {"left": 511}, "WINDOW_LEFT = 511", True),
    ("softcap", 30.0, "s = ct.tanh(s) * cap_out", True),
    ("sinks", True, "sink = ct.load(Sinks, index=(head,), shape=(1,))", True),
    ("return_lse", True, "return out, lse", True),
    ("qk_ahead", True, "s_next = ct.mma(q, k_t, ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32))", True),
]


@pytest.mark.parametrize("path,value,line,present", VISIBLE, ids=[v[0] for v in VISIBLE])
def test_every_field_visibly_changes_the_module(path, value, line, present):
    base = render(make_plan(validate_spec(BASE)), "specs/variant.yaml").text
    variant = _variant(path, value)
    assert variant != base
    assert (line in variant) is present
    assert (line in base) is not present
    compile(variant, "variant.py", "exec")  # still valid Python


def test_fast_math_off_keeps_natural_exp_and_plain_division():
    data = copy.deepcopy(BASE)
    data["fast_math"] = {"exp2": False, "flush_to_zero": False, "approx_div": False}
    text = render(make_plan(validate_spec(data)), "specs/v.yaml").text
    assert "INV_LN2" not in text and "ct.exp2" not in text
    assert "out = ct.truediv(acc, l_div)" in text  # (causal rows may be empty: guarded l)


def test_seq_buckets_pick_configs_and_kernel_variants_by_key_length(monkeypatch):
    """The launcher's choice, without a GPU: sm_90 buckets by seq_k, replace_hints
    variants made once, the target's own config past the last bucket."""
    from specgen.compile.export import load_module_from_source

    data = copy.deepcopy(BASE)
    data["targets"]["sm_90"] = {
        "tile_m": 128, "tile_n": 128, "occupancy": 1, "num_worker_warps": 8,
        "by_seq_k": [{"max_seq_k": 1024, "tile_m": 64, "tile_n": 64, "occupancy": 2},
                     {"max_seq_k": 4096, "tile_m": 64, "tile_n": 128, "occupancy": 1,
                      "num_worker_warps": 8}],
    }
    plan = make_plan(validate_spec(data))
    mod = load_module_from_source("buckets", render(plan, "specs/b.yaml").text, "buckets.py")
    monkeypatch.setattr(mod.torch.cuda, "get_device_capability", lambda index: (9, 0))

    class Device:
        index = 0

    picked = {}
    for seq_k in (1, 1024, 1025, 4096, 4097, 100000):
        config, kernel = mod._launch_config(Device(), seq_k)
        picked[seq_k] = (config["tile_m"], config["tile_n"], kernel)
    base_kernel = getattr(mod, plan.kernel_name)
    assert picked[1][:2] == picked[1024][:2] == (64, 64)
    assert picked[1025][:2] == picked[4096][:2] == (64, 128)
    assert picked[4097][:2] == picked[100000][:2] == (128, 128)
    # Own hints: the decorated kernel; other hints: one replace_hints variant each.
    assert picked[100000][2] is base_kernel and picked[4096][2] is base_kernel
    assert picked[1][2] is picked[1024][2] is not base_kernel
    assert mod.CONFIGS["sm_90"][0]["hints"] == {"occupancy": 2, "num_worker_warps": None}
    assert "hints" not in mod.CONFIGS["sm_90"][1]  # same options as the target's own


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_docstring_names_the_output_buffer_shape_and_dtype(name):
    text = (ROOT / "generated" / f"{name}.py").read_text()
    spec = generated_module(name).SPEC
    found = re.findall(r"out: optional \[([^\]]*)\] (\w+) output buffer", text)
    # one entry point, or a training module's attention and the _forward it calls
    assert len(found) == (2 if spec.get("backward") else 1) and len(set(found)) == 1, found
    dims, dtype = found[0]
    assert dtype == output_dtype(spec)
    want_first = "B" if not spec.get("varlen") else "total_q"
    assert dims.split(",")[0] == want_first
    returns = text.split("Returns:")[1].split("Raises:")[0]
    assert f"[{dims}]" in returns and dtype in returns


@pytest.mark.parametrize("name", ["fmha_decode_gqa8_fp8kv", "fmha_decode_chunked_local", "fmha_decode_paged_mtp"])
def test_decode_reduces_the_row_sums_once_after_the_loop(name):
    """The decode kernels keep each row's sum of P per key column and reduce it once,
    after the loops: a step makes one row reduction (the max), not two."""
    text = (ROOT / "generated" / f"{name}.py").read_text()
    kernel = kernel_source(text, "fmha_decode_", text.index("@AotKernel"))
    loops, _, tail = kernel.partition("l_i = ct.sum(l_cols, axis=-1, keepdims=True)")
    assert tail and "ct.sum(p" not in kernel
    assert loops.count("l_cols = l_cols * alpha + p") >= 2  # the unmasked and the masked step
    assert "l_cols = ct.full((TILE_M, TILE_N), 0.0, dtype=ct.float32)" in loops


def test_qk_ahead_forms_each_tile_once_ahead_and_runs_the_last_after_the_loops():
    """Every loop step takes the S formed a step before and forms the next tile's;
    the loops stop before the last tile, which runs after them (masked) on the S
    its predecessor formed; the prologue forms the first, only where the row has a
    key tile."""
    data = copy.deepcopy(BASE)
    data.update(qk_ahead=True, window={"left": 300})
    text = render(make_plan(validate_spec(data)), "specs/variant.yaml").text
    kernel = kernel_source(text, "fmha_prefill")
    loops = kernel.count("for j in range(")
    assert loops == 3 and kernel.count("s = s_next") == loops + 1
    assert kernel.count("j_next = j + 1") == loops
    assert "for j in range(first_n, min(full_start, num_n - 1)):" in kernel
    assert "for j in range(full_start, min(mask_start, num_n - 1)):" in kernel
    assert "for j in range(mask_start, num_n - 1):" in kernel
    assert "    if first_n < num_n:\n        j_next = first_n\n" in kernel
    last = kernel[kernel.index("    if first_n < num_n:\n        # qk_ahead: the last key tile"):]
    assert "j = num_n - 1" in last and "visible = " in last and "s_next" not in last.split("s = s_next")[1]
    assert "s = ct.mma(q, k_t, s)" not in kernel  # no step forms its own S
    # The look-ahead load is bounds-checked even in unmasked steps (the next tile
    # may be the ragged last one).
    data.update(loads={"check_bounds": "masked"})
    masked = kernel_source(render(make_plan(validate_spec(data)), "specs/variant.yaml").text,
                           "fmha_prefill")
    for block in masked.split("j_next = ")[1:]:
        assert "check_bounds=False" not in block[:block.index("s_next")]


# Arrays a kernel launched with programmatic dependent launch may read only after its
# wait: what the grid before it writes. A load of one before
# ct.grid_dependency_control_wait() could read data the previous kernel has not stored.
_DEPENDENT_READ = r"(?:ct\.load|ct\.gather|_rows|_row_values|_packed_rows|_packed_values)\(\s*({names})s?\b"


def _reads_before_wait(kernel: str, names: str) -> list[str]:
    before, wait, _ = kernel.partition("ct.grid_dependency_control_wait()")
    assert wait, "the kernel has no grid_dependency_control_wait()"
    return re.findall(_DEPENDENT_READ.format(names=names), before)


def test_float8_attention_waits_for_the_v_transpose_before_reading_v():
    """The float8 attention grid launches with programmatic dependent launch after
    the V transpose kernel: that kernel lets it launch first thing, and it reads no V
    before its wait."""
    text = (ROOT / "generated" / "fmha_fp8_llama.py").read_text()
    kernel = kernel_source(text, "fmha_prefill_")
    assert not _reads_before_wait(kernel, "V")
    assert "if V_TRANSPOSED:\n        # V comes from transposed_v's kernel" in kernel
    transpose = kernel_source(text, "fmha_transpose_v_")
    assert transpose.split('"""')[2].strip().splitlines()[2].strip() == "ct.grid_dependency_control_launch_dependents()"
    # Only after a copy: a V that transposed_v made (v_transposed=True) launches no kernel before.
    assert "programmatic_dependent_launch=pdl" in text and "pdl = bool(copy_v and V_PDL) and _device_configs(q.device)[1] >= 9" in text
    assert "copy_v = read_vt and not v_transposed" in text


def test_an_opt_level_left_out_is_the_compilers_3_in_a_by_target():
    """cuTile's ct.ByTarget takes a number for opt_level (None crashed the compile of
    the target that left it out, found by the GPU spec fuzzer)."""
    from .helpers import render_spec_data

    data = {"name": "mixed_opt", "targets": {
        "default": {"tile_m": 64, "tile_n": 64, "occupancy": 1, "opt_level": 0},
        "sm_90": {"tile_m": 64, "tile_n": 64, "occupancy": 1}}}
    plan, source = render_spec_data(data)
    assert "opt_level=ct.ByTarget(sm_90=3, default=0)" in plan.kernel_options
    assert "None" not in plan.kernel_options.split("opt_level=")[1]


@pytest.mark.parametrize("dim, parts", [(80, (64, 16)), (96, (64, 32)), (72, (64, 16)), (48, (32, 16)),
                                        (160, (128, 32)), (192, (128, 64)), (112, None), (224, None),
                                        (24, None), (128, None)])
def test_head_dim_parts_are_two_powers_of_two_narrower_than_the_padded_tile(dim, parts):
    from specgen.spec.fields import head_dim_parts

    assert head_dim_parts(dim) == parts
    if parts:
        main, rest = parts
        assert main + rest >= dim and main + rest < 1 << (dim - 1).bit_length() and rest >= 16
        assert main % rest == 0  # the rest tile's offset is a whole number of its tiles


def test_a_split_head_dim_renders_two_tiles_and_false_pads():
    data = {"name": "phi", "dtype": "float16", "head_dim": 80, "causal": True, "backward": True}
    split = render(make_plan(validate_spec(data)), "specs/phi.yaml").text
    assert "HEAD_DIM_MAIN = 64\nHEAD_DIM_REST = 16\n" in split and "HEAD_DIM_TILE" not in split
    assert "s = ct.mma(q_rest, k_t_rest, ct.mma(q, k_t, s))" in split  # the forward's S
    assert "dk_rest = ct.mma(ds_in, q_rest, dk_rest)" in split  # the backward's dK
    padded = render(make_plan(validate_spec({**data, "head_dim_split": False})), "specs/phi.yaml").text
    assert "HEAD_DIM_TILE = 128" in padded and "_rest" not in padded and "REST_COL" not in padded
    # v_head_dim alone split (MLA's transpose: 128 / 80): its own constants.
    mla = render(make_plan(validate_spec({**data, "head_dim": 128, "v_head_dim": 80})), "specs/m.yaml").text
    assert "V_HEAD_DIM_MAIN = 64" in mla and "V_REST_COL" in mla and "\nREST_COL" not in mla
    for text in (split, padded, mla):
        compile(text, "variant.py", "exec")


def test_the_order_of_a_specs_tensors_does_not_change_its_module():
    """Two files that differ only in the order of their tensors had one spec hash and
    one custom-op name but kernels and ops with their parameters in two orders: one
    process holding both would hand each tensor to the other's parameter."""
    def text(order):
        tensors = "\n".join(f"  {n}: {{dtype: float32, shape: [heads]}}" for n in order)
        return ("name: two_tables\ndtype: bfloat16\nhead_dim: 64\ncausal: true\n"
                f"tensors:\n{tensors}\n"
                'score_mod: "score - aa[h] * (q_idx - kv_idx) + bb[h]"\n')

    first, second = (render(make_plan(validate_spec(yaml.safe_load(text(o)), "t.yaml")), "t.yaml").text
                     for o in (("aa", "bb"), ("bb", "aa")))
    assert first == second


def test_a_hook_renders_the_same_however_it_is_spaced():
    """Spaces, extra parentheses, a comment and a YAML block's newline in a hook do
    not change the module (its spec hash and op name included)."""
    from .helpers import render_spec_data

    base = {"name": "spacing", "causal": True, "backward": True,
            "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}}}
    spellings = ["doc[b, q_idx] == doc[b, kv_idx]",
                 "doc[b,q_idx]==doc[b,kv_idx]",
                 "(doc[b, q_idx]) == (doc[b, kv_idx])  # same document\n"]
    texts = {render_spec_data({**base, "mask_mod": m})[1] for m in spellings}
    assert len(texts) == 1
    assert "doc[b, q_idx] == doc[b, kv_idx]" in texts.pop()


def test_the_empty_row_comment_names_what_empties_a_row():
    """The guard of l = 0 names why a row can see no key. A non-causal varlen spec
    (a sequence without keys is its only cause) rendered "A row with no visible key ()"."""
    base = {"name": "render_empty_rows", "dtype": "bfloat16", "head_dim": 64, "gqa_ratio": 1,
            "targets": {"default": {"tile_m": 64, "tile_n": 64}}}
    for fields, causes in (({"causal": False, "varlen": True}, "a sequence without keys"),
                           ({"causal": True, "varlen": True},
                            "causal, before the first key; or a sequence without keys"),
                           ({"causal": True}, "causal, before the first key")):
        text = render(make_plan(validate_spec({**base, **fields})), "specs/x.yaml").text
        assert f"# A row with no visible key ({causes})\n" in text, fields


def test_a_single_token_decode_docstring_claims_every_key_only_without_a_mask():
    """q's docstring said the new token "sees every key j < seq_len" for a decode spec
    whose mask_mod (or window) hides some of them."""
    base = {"name": "render_decode_keys", "family": "decode", "dtype": "bfloat16", "head_dim": 64,
            "gqa_ratio": 4}
    for fields, sees in (({}, "every key j < seq_len"),
                         ({"mask_mod": "q_idx // 64 == kv_idx // 64"}, "the keys j < seq_len that the mask_mod allows"),
                         ({"window": {"left": 127}}, "the keys j < seq_len inside its window")):
        text = render(make_plan(validate_spec({**base, **fields})), "specs/x.yaml").text
        assert f"each sequence (it sees {sees})." in text, fields

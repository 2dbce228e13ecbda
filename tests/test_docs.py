"""The documentation: generated pages match their generator, every spec field is
described, the README stays short and starts with what a newcomer needs, and the
project's history stays in the experiment log."""

import difflib
import gzip
import re
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

from specgen.docs import (
    DESCRIPTIONS,
    FAMILY_ONLY,
    REGENERATE,
    DocsError,
    check_descriptions,
    generated_docs,
    spec_reference_markdown,
    write_docs,
)
from specgen.spec import Spec

from .helpers import ROOT
from .test_readme import _readme_test_command

README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXPERIMENT_LOG = DOCS / "experiments.md"
INSTALL = 'pip install -e ".[dev]"'


@pytest.mark.parametrize("rel", sorted(generated_docs(ROOT)))
def test_generated_docs_are_up_to_date(rel):
    want = generated_docs(ROOT)[rel]
    path = ROOT / rel
    assert path.is_file(), f"{rel} is missing; run `{REGENERATE}`"
    have = path.read_text()
    if have != want:
        diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                            f"{rel} (on disk)", f"{rel} (generated)"))
        pytest.fail(f"{rel} differs from its generator; run `{REGENERATE}`\n{diff[:4000]}")


def test_write_docs_check_reports_drift_and_writes_nothing(tmp_path):
    for rel in ("specs", "bench/results"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).symlink_to(ROOT / rel)
    assert sorted(write_docs(tmp_path, check=True)) == sorted(generated_docs(ROOT))
    assert not (tmp_path / "docs").exists()
    assert sorted(write_docs(tmp_path, check=False)) == sorted(generated_docs(ROOT))
    assert write_docs(tmp_path, check=True) == []


def test_write_docs_takes_pages_that_are_not_utf8_as_stale_and_writes_nothing_it_cannot(tmp_path):
    """A page on disk that is not UTF-8 is out of date (it was a traceback); a page
    path that is a folder is one error, and no other page is written (one used to be
    written before the error)."""
    from specgen.docs import DocsError

    for rel in ("specs", "bench/results"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).mkdir()
    pages = sorted(generated_docs(tmp_path))
    (tmp_path / "docs").mkdir()
    (tmp_path / pages[0]).write_bytes(b"\xff\xfe not text")
    assert pages[0] in write_docs(tmp_path, check=True)
    assert sorted(write_docs(tmp_path, check=False)) == pages
    for rel in pages:
        (tmp_path / rel).unlink()
    (tmp_path / pages[-1]).mkdir()
    with pytest.raises(DocsError, match="exists and is not a regular file"):
        write_docs(tmp_path, check=False)
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == [Path(pages[-1]).name]


def test_every_model_field_has_a_description():
    paths = check_descriptions()  # raises DocsError naming the field otherwise
    assert "window.left" in paths and "targets.<target>.by_seq_k[].max_seq_k" in paths
    assert set(DESCRIPTIONS) <= set(paths)


def test_a_field_without_description_fails_loudly(monkeypatch):
    monkeypatch.delitem(DESCRIPTIONS, "skip_masked_tiles")
    monkeypatch.setattr(Spec.model_fields["skip_masked_tiles"], "description", None)
    with pytest.raises(DocsError, match="skip_masked_tiles"):
        spec_reference_markdown()


def test_a_description_of_no_field_fails_loudly(monkeypatch):
    monkeypatch.setitem(DESCRIPTIONS, "window.middle", "gone")
    with pytest.raises(DocsError, match="window.middle"):
        spec_reference_markdown()


# A value other than the default for each family-only field, valid in its own family.
FAMILY_SAMPLES = {
    "kv_dtype": "float8_e4m3fn", "max_q_len": 2, "paged": {"page_size": 64}, "splits": 4,
    "pdl": True, "out_dtype": "bfloat16", "v_head_dim": 64, "softcap": 30.0,
    "tensors": {"doc": {"dtype": "int32", "shape": ["batch", "seq_k"]}},
    "score_mod": "score * 0.5", "mask_mod": "kv_idx <= q_idx", "skip_masked_tiles": True,
    "block_sparse": True,
    "dropout": True, "varlen": True, "return_lse": True, "loop_split": False,
    "block_remap": False, "prescale_q": True, "q_subtiles": 2, "qk_ahead": True, "backward": True,
    "pack_gqa": True, "head_dim_split": False, "deterministic": True, "context_parallel": "ulysses",
    "v_cache_transposed": True, "causal": False,
}
# Other fields a sample needs to pass its own field's checks, so that the family check
# is the one that refuses it: two query half-tiles need a decode tile of 32 rows.
FAMILY_CONTEXT = {"q_subtiles": {"gqa_ratio": 32}}


@pytest.mark.parametrize("field", sorted(FAMILY_ONLY))
def test_family_column_matches_the_validator(field):
    other = "prefill" if FAMILY_ONLY[field] == "decode" else "decode"
    with pytest.raises(ValidationError) as info:
        Spec.model_validate({"name": "x", "family": other, field: FAMILY_SAMPLES[field],
                             **FAMILY_CONTEXT.get(field, {})})
    assert f"not supported by family {other}" in str(info.value)


def test_spec_reference_counts_the_shipped_specs():
    text = (DOCS / "spec-reference.md").read_text()
    count = len(list((ROOT / "specs").glob("*.yaml")))
    assert f"{count} specs ship in `specs/`" in text
    assert "`decode`" in text.split("| `family` |")[1].split("\n")[0]


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; move reference material to docs/"


def test_readme_first_screen_has_install_and_test_commands():
    first = "\n".join(README.read_text().splitlines()[:25])
    assert INSTALL in first
    assert "torch==2.13.0" in first
    assert "specgen build specs/fmha_gqa_causal.yaml" in first
    assert _readme_test_command() in first


HISTORY = [re.compile(r"\bissue[ -]?#?[0-9]", re.IGNORECASE), re.compile(r"NOTES")]


def _pages():
    return [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("path", [p for p in _pages() if p != EXPERIMENT_LOG],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_history_references_outside_the_experiment_log(path):
    text = path.read_text()
    for pattern in HISTORY:
        found = pattern.search(text)
        assert not found, (f"{path.relative_to(ROOT)}: {found.group(0)!r}: history belongs in "
                           "docs/experiments.md (link to it instead)")


@pytest.mark.parametrize("path", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", path.read_text()):
        assert (path.parent / target).exists(), f"{path.relative_to(ROOT)}: broken link {target}"


def test_spec_comments_list_every_allowed_value():
    # A comment that lists a field's choices ("dtype: float16  # float16 | bfloat16 | ...")
    # lists all the model allows.
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        for line in path.read_text().splitlines():
            found = re.match(r"(\w+):.*#\s*(\w+(?: \| \w+)+)\s*$", line)
            if not found or found.group(1) not in Spec.model_fields:
                continue
            allowed = set(map(str, get_args(Spec.model_fields[found.group(1)].annotation)))
            listed = set(found.group(2).split(" | "))
            assert listed == allowed, f"{path.name}: {line.strip()}: the model allows {sorted(allowed)}"


def test_performance_reads_every_schema_version(tmp_path):
    """Results of the current schema (key ``schema``) and of older ones (prefill v1,
    decode v2) each get their table, with every baseline's column."""
    import json
    import shutil

    from specgen.docs import DocsError, performance_markdown

    h200 = ROOT / "bench" / "results" / "h200"
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    from specgen.bench.core import find_result, read_result_text

    current = json.loads(read_result_text(find_result(h200 / "fa3" / "fmha_gqa8_bf16-prefill")))
    assert current["schema"] == 3 and "fa3" in current["baselines"]
    (folder / "a-prefill.json").write_text(json.dumps(current))
    (folder / "b-prefill.json").write_text(  # schema_version 1
        read_result_text(find_result(h200 / "fmha_gqa8_bf16-prefill")))
    shutil.copy(h200 / "fmha_decode_gqa4_bf16-decode.json", folder / "c-decode.json")  # version 2
    page = performance_markdown(tmp_path / "results")
    assert page.count("#### `fmha_gqa8_bf16`, prefill") == 2
    assert "FlashAttention-3 TFLOPS (ms)" in page and "vs FlashAttention-3" in page
    first = current["rows"][0]["timings"]["fa3"]
    assert f"{first['tflops']:.0f} ({first['ms']:.3f})" in page
    assert "#### `fmha_decode_gqa4_bf16`, decode" in page and "| B | L | splits |" in page
    (folder / "d-prefill.json").write_text(json.dumps(dict(current, schema=99)))
    with pytest.raises(DocsError, match="schema"):
        performance_markdown(tmp_path / "results")


def test_performance_reads_gzipped_bench_results(tmp_path):
    """A bench result kept as <stem>.json.gz gets its table like a plain one, with its
    plot linked beside it (not the bench's markdown table, which the page repeats);
    the same result kept plain and gzipped is refused."""
    import gzip
    import shutil

    from specgen.docs import DocsError, performance_markdown

    h200 = ROOT / "bench" / "results" / "h200"
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    source = h200 / "fmha_chunked_local-prefill.json.gz"
    (folder / "a-prefill.json.gz").write_bytes(gzip.compress(gzip.decompress(source.read_bytes())))
    (folder / "a-prefill.md").write_text("| the bench's own table |\n")
    shutil.copy(h200 / "fmha_chunked_local-prefill.png", folder / "a-prefill.png")
    page = performance_markdown(tmp_path / "results")
    assert "#### `fmha_chunked_local`, prefill" in page
    assert "[JSON](" in page and "a-prefill.json.gz)" in page and "a-prefill.png)" in page
    assert "a-prefill.md" not in page  # the page holds that table itself
    (folder / "a-prefill.json").write_bytes(gzip.decompress(source.read_bytes()))
    with pytest.raises(DocsError, match="kept twice"):
        performance_markdown(tmp_path / "results")


def test_flex_ratios_of_dynamic_shape_runs_are_marked(tmp_path):
    """A Flex timing without the static-shape note (a run that compiled Flex for
    dynamic shapes) gets the dagger in its run table and in the summary; one with
    the note does not."""
    import json

    from specgen.bench.baselines import FLEX_STATIC
    from specgen.docs import DYNAMIC_MARK, performance_markdown

    from specgen.bench.core import read_result_text

    source = json.loads(read_result_text(ROOT / "bench" / "results" / "h200" / "fmha_chunked_local-prefill.json.gz"))
    assert all(r["timings"]["flex"]["note"] == FLEX_STATIC for r in source["rows"])
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    (folder / "a-prefill.json").write_text(json.dumps(source))
    page = performance_markdown(tmp_path / "results")
    assert f"Flex{DYNAMIC_MARK})" not in page and f"×{DYNAMIC_MARK} |" not in page
    for row in source["rows"]:
        row["timings"]["flex"]["note"] = None
    (folder / "a-prefill.json").write_text(json.dumps(source))
    page = performance_markdown(tmp_path / "results")
    ratio = source["rows"][0]["speedup"]["flex"]
    assert f"{ratio:.2f}× Flex{DYNAMIC_MARK})" in page  # the summary
    assert f"{ratio:.2f}×{DYNAMIC_MARK} |" in page  # the run's table


def test_runs_with_graph_times_get_a_second_table_from_them(tmp_path):
    """A backward run whose rows carry one-call CUDA-graph times gets a table of
    TFLOPS and ratios computed from those times, below the eager one; a row where a
    baseline could not be captured shows n/a there."""
    import json

    from specgen.docs import performance_markdown

    from specgen.bench.core import read_result_text

    source = json.loads(read_result_text(ROOT / "bench" / "results" / "h100_80gb_hbm3"
                                         / "fmha_train_gqa_causal-backward.json.gz"))
    first = source["rows"][0]
    assert first["timings"]["specgen"]["ms_one_call"] and first["timings"]["cudnn"]["ms_one_call"]
    first["timings"]["flex"]["ms_one_call"] = None
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    (folder / "a-backward.json").write_text(json.dumps(source))
    lines = performance_markdown(tmp_path / "results").splitlines()
    caption = "CUDA graph of one call per replay (no host launch path), TFLOPS and ratios:"
    start = lines.index(caption)
    assert lines[start + 2] == ("| S | specgen (cuTile) | SDPA cuDNN | FlexAttention | vs SDPA cuDNN | "
                                "vs FlexAttention |")
    ours, cudnn = (first["timings"][n]["ms_one_call"] for n in ("specgen", "cudnn"))
    assert lines[start + 4] == (f"| {first['seq_q']} | {first['flops'] / ours / 1e9:.0f} | "
                                f"{first['flops'] / cudnn / 1e9:.0f} | n/a | {cudnn / ours:.2f}× | n/a |")
    for row in source["rows"]:  # no graph times anywhere: no second table
        for t in row["timings"].values():
            t["ms_one_call"] = None
    (folder / "a-backward.json").write_text(json.dumps(source))
    assert caption not in performance_markdown(tmp_path / "results")


def test_a_folder_of_script_results_is_titled_by_the_gpu_they_name(tmp_path):
    from specgen.docs import performance_markdown
    from specgen.docs.performance import _load_results

    folder = tmp_path / "results" / "h100"
    folder.mkdir(parents=True)
    (folder / "a.json").write_text('{"device": "NVIDIA H100 80GB HBM3", "rows": []}')
    (folder / "b.json").write_text('{"rows": []}')
    (folder / "c.json").write_text("[1, 2]")
    (folder / "e.log").write_text('{"device": "elsewhere"}')
    _, other = _load_results(tmp_path / "results")
    assert other == {folder / "a.json": "NVIDIA H100 80GB HBM3", folder / "b.json": None,
                     folder / "c.json": None}
    titles = [line for line in performance_markdown(tmp_path / "results").splitlines() if line.startswith("## ")]
    assert titles == [f"## NVIDIA H100 80GB HBM3 ([`{tmp_path.name}/results/h100/`](../{tmp_path.name}/results/h100/))"]
    # The experiments' files may be kept gzipped (read once, with the others).
    (folder / "f.json.gz").write_bytes(gzip.compress(b'{"device": "NVIDIA H200"}'))
    assert "## NVIDIA H100 80GB HBM3, NVIDIA H200 (" in performance_markdown(tmp_path / "results")
    # A folder whose files name no GPU is titled by its name.
    (tmp_path / "results" / "misc").mkdir()
    (tmp_path / "results" / "misc" / "b.json").write_text('{"rows": []}')
    assert f"## misc ([`{tmp_path.name}/results/misc/`]" in performance_markdown(tmp_path / "results")


def test_gzipped_script_results_are_listed_with_the_other_files(tmp_path):
    from specgen.docs import performance_markdown

    folder = tmp_path / "results" / "h200"
    folder.mkdir(parents=True)
    (folder / "ceiling-run.json.gz").write_bytes(gzip.compress(b'{"device": "NVIDIA H200", "rows": []}'))
    page = performance_markdown(tmp_path / "results")
    assert "\n## NVIDIA H200 ([`" in page and "/results/h200/`](" in page  # the folder's link
    assert "\n- `ceiling-run.json.gz`\n" in page


def _broken(data: dict, change: str) -> dict:
    import copy

    data = copy.deepcopy(data)
    if change == "no specgen timing":
        del data["rows"][0]["timings"]["specgen"]
    elif change == "rows a string":
        data["rows"] = "x"
    elif change == "device a string":
        data["device"] = "H100"
    elif change == "ms a string":
        data["rows"][0]["timings"]["specgen"]["ms"] = "fast"
    elif change == "unknown key":
        data["bogus"] = 1
    elif change == "schema a bool":
        data["schema"] = True
    elif change == "matmul rate null":
        data["matmul_tflops"] = None
    elif change == "row without causal":
        del data["rows"][0]["causal"]
    elif change == "tflops null":
        data["rows"][0]["timings"]["specgen"]["tflops"] = None
    return data


def _damaged_gzip() -> bytes:
    """A gzip file whose header is whole and whose compressed data is not (zlib's
    error, not gzip's)."""
    import gzip

    data = bytearray(gzip.compress(b'{"schema": 3, "rows": []}' * 200, mtime=0))
    for i in range(20, 60):
        data[i] ^= 0x5A
    return bytes(data)


@pytest.mark.parametrize("name,content,words", [
    ("a-prefill.json", b'{"schema": 3, "rows": [', "not valid JSON (line 1, column 24)"),
    ("a-prefill.json.gz", _damaged_gzip(), "cannot read"),
    ("a-prefill.json", b"", "not valid JSON"),
    ("a-prefill.json", b"\xff\xfe{}", "not UTF-8 text"),
    ("a-prefill.json.gz", b"\x1f\x8b\x08\x00\x00", "cannot read"),
    ("a-prefill.json.gz", b"not gzip at all", "cannot read"),
    ("a-prefill.json", b"[1, 2]", "a bench result is a JSON object"),
] + [("a-prefill.json", change, "not a bench result of this schema") for change in (
    "no specgen timing", "rows a string", "device a string", "ms a string", "unknown key",
    "schema a bool")] + [
    ("a-prefill.json", "matmul rate null", "matmul_tflops: a prefill result needs the run's matmul rate"),
    ("a-prefill.json", "row without causal", "rows.0.causal: a prefill row needs it"),
    ("a-prefill.json", "tflops null", "rows.0.timings.specgen: ms and tflops come together"),
])
def test_a_broken_results_file_is_one_error_naming_it(tmp_path, name, content, words):
    """Truncated, undecodable or wrong-schema results are refused with the file named
    (exit 2 from the CLI), never a traceback; `specgen diff` reads them the same way."""
    import json

    from specgen.bench.core import ResultError, load_result
    from specgen.docs import DocsError, performance_markdown

    from specgen.bench.core import read_result_text

    good = json.loads(read_result_text(ROOT / "bench" / "results" / "h200" / "fa3" / "fmha_gqa8_bf16-prefill.json.gz"))
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    if isinstance(content, str):
        content = json.dumps(_broken(good, content)).encode()
    (folder / name).write_bytes(content)
    with pytest.raises(DocsError, match=re.escape(words)) as info:
        performance_markdown(tmp_path / "results")
    assert str(folder / name) in str(info.value)
    with pytest.raises(ResultError, match=re.escape(words)):
        load_result(folder / name)


def test_strings_and_names_from_result_files_cannot_break_the_page(tmp_path):
    """A result's strings are text on the page: a device name with a pipe, a line
    break or an HTML tag, a baseline's error with backticks, and file names with
    spaces, brackets or backticks keep the tables, code spans and links whole."""
    import json

    from specgen.bench.core import read_result_text
    from specgen.docs import performance_markdown

    source = json.loads(read_result_text(ROOT / "bench" / "results" / "h200" / "fa3" / "fmha_gqa8_bf16-prefill.json.gz"))
    source["device"]["name"] = "GPU | <b>x</b>\nnext"
    source["spec"] = "odd`spec"
    first = source["rows"][0]["timings"]["cudnn"]
    first.update(ms=None, tflops=None, error="failed: `x | y`\n*z*")
    source["rows"][0]["speedup"]["cudnn"] = None
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    (folder / "my run (1)-prefill.json").write_text(json.dumps(source))
    (folder / "ceiling `a`.json").write_text('{"rows": []}')
    page = performance_markdown(tmp_path / "results")
    assert "<b>" not in page and "GPU \\| \\<b\\>x\\</b\\> next" in page
    assert "#### ``odd`spec``, prefill" in page
    assert "n/a: failed: \\`x \\| y\\` \\*z\\*" in page
    assert "[JSON](../results/gpu/my%20run%20%281%29-prefill.json)" in page.replace(f"../{tmp_path.name}/", "../")
    assert "\n- ``ceiling `a`.json``\n" in page
    # Every table row has as many cells as its header: no pipe leaked into a cell.
    header = None
    for line in page.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = len(re.findall(r"(?<!\\)\|", line))
        if header is None:
            header = cells
        assert cells == header, line


def test_a_baseline_name_that_is_not_a_plain_word_is_refused(tmp_path):
    import json

    from specgen.bench.core import read_result_text
    from specgen.docs import DocsError, performance_markdown

    source = json.loads(read_result_text(ROOT / "bench" / "results" / "h200" / "fa3" / "fmha_gqa8_bf16-prefill.json.gz"))
    source["baselines"][0] = "cu|dnn"
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    (folder / "a-prefill.json").write_text(json.dumps(source))
    with pytest.raises(DocsError, match=r"baselines: .*letters, digits.*'cu\|dnn'"):
        performance_markdown(tmp_path / "results")


@pytest.mark.parametrize("content,words", [
    ('{"spec": "x", "rows": [{"seq": 1}]}', "no 'schema' key"),
    ('{"schema": 3}', "no 'rows' key"),
    ('{"device": "NVIDIA H200"}', "no 'schema' and no 'rows' key"),
])
def test_a_file_named_as_a_bench_result_must_be_one(tmp_path, content, words):
    """<spec>-<suite>.json without the keys of a bench result is refused, naming the
    file, rather than listed with the experiments' files."""
    from specgen.docs import DocsError, performance_markdown

    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    (folder / "a-prefill.json").write_text(content)
    with pytest.raises(DocsError, match=re.escape(words)) as info:
        performance_markdown(tmp_path / "results")
    assert str(folder / "a-prefill.json") in str(info.value)


@pytest.mark.parametrize("change,words", [
    (lambda d: d["rows"][0].update(specgen_fwd_ms=float("nan")), "rows.0.specgen_fwd_ms: Input should be a finite number"),
    (lambda d: d["rows"][0].update(specgen_fwd_ms=0.0), "rows.0.specgen_fwd_ms: Input should be greater than 0"),
    (lambda d: d["rows"][0].update(seq="32768"), "rows.0.seq: Input should be a valid integer"),
    (lambda d: d["rows"][0].pop("specgen_fwdbwd_tflops_per_gpu"), "rows.0.specgen_fwdbwd_tflops_per_gpu: Field required"),
    (lambda d: d["rows"][0].pop("torch_cp_fwd_best"), "torch_cp_fwd_ms is given without torch_cp_fwd_best"),
    (lambda d: d["rows"][0].update(efficiency_vs_full_fwd=-0.5), "rows.0.efficiency_vs_full_fwd"),
    (lambda d: d.update(rows=[]), "rows: List should have at least 1 item"),
    (lambda d: d.update(torch=2.11), "torch: Input should be a valid string"),
])
def test_a_broken_context_parallel_result_is_one_error_naming_it(tmp_path, change, words):
    """The context-parallel table's fields are validated like a bench result's:
    numbers that are NaN, not numbers, out of range or missing are named with the
    file, never printed and never a traceback."""
    import json

    from specgen.bench.core import read_result_text
    from specgen.docs import DocsError, performance_markdown

    data = json.loads(read_result_text(ROOT / "bench" / "results" / "h200" / "context_parallel.json.gz"))
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    (folder / "context_parallel.json").write_text(json.dumps(data))
    assert "### Context parallelism" in performance_markdown(tmp_path / "results")
    change(data)
    (folder / "context_parallel.json").write_text(json.dumps(data))
    with pytest.raises(DocsError, match=re.escape(words)) as info:
        performance_markdown(tmp_path / "results")
    assert str(folder / "context_parallel.json") in str(info.value)


def test_a_bad_spec_in_specs_is_one_error_and_specs_ship_by_name(tmp_path):
    """The docs read specs as `specgen build` does: a spec that does not load is one
    DocsError naming it; a spec ships under its name, whatever its file is called."""
    import shutil

    from specgen.docs import DocsError, performance_markdown, spec_reference_markdown

    specs, results = tmp_path / "specs", tmp_path / "bench" / "results" / "gpu"
    specs.mkdir()
    results.mkdir(parents=True)
    shutil.copy(ROOT / "specs" / "fmha_gqa_causal.yaml", specs / "renamed.yml")
    shutil.copy(ROOT / "bench" / "results" / "h200" / "fmha_gqa_causal-prefill.json.gz", results)
    page = performance_markdown(tmp_path / "bench" / "results", specs)
    assert "#### `fmha_gqa_causal`, prefill" in page and "do not ship" not in page
    assert "[`fmha_gqa_causal`](" in spec_reference_markdown(specs)
    (specs / "bad.yaml").write_bytes(b"\xff\xfe")
    with pytest.raises(DocsError, match=re.escape(f"{specs / 'bad.yaml'}: file is not UTF-8 text")):
        spec_reference_markdown(specs)
    (specs / "bad.yaml").write_text("name: x\nbogus: 1\n")
    with pytest.raises(DocsError, match="bogus: unknown key"):
        performance_markdown(tmp_path / "bench" / "results", specs)


def test_specgen_docs_names_each_bad_spec_on_its_own_line_and_refuses_shared_names(tmp_path):
    """Two problems are two lines (they were joined with "; "); two specs of one name
    are refused as `specgen build` refuses them (the reference listed both)."""
    import shutil

    from .test_cli import specgen

    for part in ("specs", "docs", "bench"):
        shutil.copytree(ROOT / part, tmp_path / part)
    (tmp_path / "specs" / "bad.yaml").write_text("name: 1\nhead_dim: 3\n")
    before = (tmp_path / "docs" / "spec-reference.md").read_bytes()
    result = specgen("docs", "--root", tmp_path, cwd=tmp_path)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 2, result.stderr
    assert lines[0].startswith(f"specgen docs: {tmp_path / 'specs' / 'bad.yaml'}: name: must be a string")
    assert lines[1].startswith(f"specgen docs: {tmp_path / 'specs' / 'bad.yaml'}: head_dim:")
    (tmp_path / "specs" / "bad.yaml").unlink()
    shutil.copy(tmp_path / "specs" / "fmha_alibi.yaml", tmp_path / "specs" / "zz_copy.yaml")
    result = specgen("docs", "--root", tmp_path, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"specgen docs: {tmp_path / 'specs' / 'zz_copy.yaml'}: name: 'fmha_alibi' is also the name in "
        f"{tmp_path / 'specs' / 'fmha_alibi.yaml'}; each spec needs its own name"], result.stderr
    assert (tmp_path / "docs" / "spec-reference.md").read_bytes() == before

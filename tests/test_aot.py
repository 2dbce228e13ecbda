"""The AOT folder: `specgen build` leaves <module>.aot/ beside each module, and the
module's AotKernel serves its first calls from it only when a cubin covers them."""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from .helpers import ROOT

SPEC = "fmha_gqa_causal"


def load(path):
    spec = importlib.util.spec_from_file_location(f"aot_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(work):
    result = subprocess.run(
        [sys.executable, "-m", "specgen", "build", f"specs/{SPEC}.yaml", "--targets", "sm_90",
         "--out", "gen"], cwd=work, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """fmha_gqa_causal built for sm_90 into a scratch folder."""
    work = tmp_path_factory.mktemp("aot")
    shutil.copytree(ROOT / "specs", work / "specs")
    _build(work)
    return work / "gen" / f"{SPEC}.py"


def test_build_writes_a_manifest_for_the_module_it_wrote(built):
    folder = built.with_name(f"{SPEC}.aot")
    manifest = json.loads((folder / "manifest.json").read_text())
    import cuda.tile as ct

    assert manifest["format"] == 2 and manifest["cuda_tile"] == ct.__version__
    assert manifest["cubins"] == {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                  for p in folder.glob("*.cubin")}
    assert manifest["source_sha256"] == hashlib.sha256(built.read_bytes()).hexdigest()
    module = load(built)
    kernel = getattr(module, manifest["entries"][0]["kernel"])
    # Each config's compiler options, resolved the way its kernel resolves them at run time.
    expected = [module.aot_hints(kernel.replace_hints(**c["hints"]) if "hints" in c else kernel, "sm_90")
                for c in module.CONFIGS["sm_90"]]
    for entry in manifest["entries"]:
        assert (folder / entry["cubin"]).is_file()
        assert entry["sm"] == "sm_90" and entry["hints"] in expected
        assert isinstance(getattr(module, entry["kernel"]), module.AotKernel)
    # Each exported signature is served by its own entry.
    from cuda.tile.compilation import demangle_kernel_name

    for entry in manifest["entries"]:
        _, sig = demangle_kernel_name(entry["signature"])
        hit = module._AotStore().lookup(entry["kernel"], "sm_90", entry["hints"], sig)
        assert hit is not None and hit[1] == entry["symbol"]


def test_the_module_reads_the_manifest_format_specgen_writes(built):
    """A generated module cannot import specgen: its loader's format and entry fields
    are its own copies of specgen.compile.aot's."""
    from specgen.compile import aot

    module = load(built)
    assert (module.AOT_FORMAT, module.AOT_ENTRY_KEYS) == (aot.AOT_FORMAT, aot.ENTRY_KEYS)


def test_a_rebuild_removes_cubins_it_no_longer_lists(built):
    folder = built.with_name(f"{SPEC}.aot")
    listed = sorted(p.name for p in folder.glob("*.cubin"))
    (folder / "sm_90-stale.cubin").write_bytes(b"old")
    _build(built.parent.parent)  # cached: no compile
    assert sorted(p.name for p in folder.glob("*.cubin")) == listed


def test_a_stale_or_disabled_folder_is_never_used(built, tmp_path, monkeypatch):
    copy = tmp_path / built.name
    shutil.copy(built, copy)
    shutil.copytree(built.with_name(f"{SPEC}.aot"), tmp_path / f"{SPEC}.aot")
    module = load(copy)
    assert module._AotStore()._load(), "an intact copy is used"
    copy.write_text(copy.read_text() + "\n# edited\n")
    store = load(copy)._AotStore()
    assert store._load() == [] and "another version" in store.reason
    monkeypatch.setenv("SPECGEN_AOT", "0")
    store = module._AotStore()
    assert store._load() == [] and store.reason == "SPECGEN_AOT=0"
    monkeypatch.delenv("SPECGEN_AOT")
    shutil.rmtree(tmp_path / f"{SPEC}.aot")
    store = module._AotStore()
    assert store._load() == [] and "specgen build" in store.reason


def _first_entry(module):
    from cuda.tile.compilation import demangle_kernel_name

    store = module._AotStore()
    entry = store._load()[0]
    return entry, demangle_kernel_name(entry["signature"])[1]


@pytest.mark.parametrize("damage", ["cubin gone", "cubin changed", "manifest garbage", "manifest cut",
                                    "entry without a field"])
def test_a_damaged_folder_falls_back_to_the_jit(built, tmp_path, damage):
    """A folder that a crash, a disk or a hand left damaged is ignored (the call
    compiles), never a failed call or a wrong cubin; build --check names it."""
    copy = tmp_path / built.name
    shutil.copy(built, copy)
    folder = tmp_path / f"{SPEC}.aot"
    shutil.copytree(built.with_name(f"{SPEC}.aot"), folder)
    module = load(copy)
    entry, sig = _first_entry(module)
    manifest = folder / "manifest.json"
    if damage == "cubin gone":
        (folder / entry["cubin"]).unlink()
    elif damage == "cubin changed":
        data = bytearray((folder / entry["cubin"]).read_bytes())
        data[100] ^= 0xFF
        (folder / entry["cubin"]).write_bytes(bytes(data))
    elif damage == "manifest garbage":
        manifest.write_text("garbage")
    elif damage == "manifest cut":
        manifest.write_text(manifest.read_text()[:200])
    else:
        data = json.loads(manifest.read_text())
        del data["entries"][0]["symbol"]
        manifest.write_text(json.dumps(data))
    store = module._AotStore()
    assert store.lookup(entry["kernel"], "sm_90", entry["hints"], sig) is None
    assert "specgen build" in store.reason
    from specgen.compile.aot import folder_problem

    assert folder_problem(copy, copy.read_text(), ["sm_90"]) is not None
    assert folder_problem(built, built.read_text(), ["sm_90"]) is None


def test_a_build_without_changes_leaves_the_folder_untouched(built):
    folder = built.with_name(f"{SPEC}.aot")
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in folder.iterdir()}
    _build(built.parent.parent)  # cached: no compile
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in folder.iterdir()} == before


def test_build_check_reads_the_aot_folder(built):
    """--check (unless --no-compile) names a folder that a build would change."""
    work = built.parent.parent

    def check(*extra):
        return subprocess.run(
            [sys.executable, "-m", "specgen", "build", f"specs/{SPEC}.yaml", "--targets", "sm_90",
             "--out", "gen", "--check", *extra], cwd=work, capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})

    assert check().returncode == 0
    folder = built.with_name(f"{SPEC}.aot")
    cubin = next(folder.glob("*.cubin"))
    saved = cubin.read_bytes()
    cubin.unlink()
    try:
        result = check()
        assert result.returncode == 1 and "listed in the manifest but missing" in result.stderr, result.stderr
        assert not cubin.exists()  # --check writes nothing
        assert check("--no-compile").returncode == 0  # modules only
    finally:
        cubin.write_bytes(saved)
    assert check().returncode == 0


def _signature(module, *, base=16, stride=8, last=16, dtype="float16", even=True):
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

    array = ArrayConstraint(getattr(ct, dtype), 4, index_dtype=ct.int32, stride_lower_bound_incl=0,
                            alias_groups=(), may_alias_internally=False,
                            stride_constant=(None, None, None, 1),
                            stride_divisible_by=(stride, stride, stride, 1),
                            shape_divisible_by=(1, 1, 1, last), base_addr_divisible_by=base)
    return KernelSignature([array] * 4 + [ScalarConstraint(ct.float32), ScalarConstraint(ct.int32),
                                          64, 64, even], CallingConvention.cutile_python_v1())


def test_covers_accepts_stronger_calls_and_refuses_everything_else(built):
    module = load(built)
    aot = _signature(module)
    assert module.aot_covers(aot, aot)
    assert module.aot_covers(aot, _signature(module, stride=16, last=16))  # more aligned strides
    assert not module.aot_covers(aot, _signature(module, base=8))  # q at an 8-byte offset
    assert not module.aot_covers(aot, _signature(module, stride=4))
    assert not module.aot_covers(aot, _signature(module, last=8))  # head dim not a multiple of 16
    assert not module.aot_covers(aot, _signature(module, dtype="bfloat16"))
    assert not module.aot_covers(aot, _signature(module, even=False))  # a constant differs

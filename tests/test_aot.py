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

    assert manifest["format"] == 1 and manifest["cuda_tile"] == ct.__version__
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

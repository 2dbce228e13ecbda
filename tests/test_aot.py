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


def test_a_module_keeps_to_the_file_it_was_imported_from(built, tmp_path):
    """A build that replaces a module (and its folder) while a process runs it: that
    process's first calls take neither the new build's cubins nor, through cuTile's
    JIT, the new file's kernels. Read at the first call, the file matched the new
    manifest and the old code was served the new cubins (a softcap of 50 in memory
    ran kernels built for 30), and cuTile parsed the new file at the old line numbers."""
    import inspect

    copy = tmp_path / built.name
    shutil.copy(built, copy)
    folder = tmp_path / f"{SPEC}.aot"
    shutil.copytree(built.with_name(f"{SPEC}.aot"), folder)
    old_text = copy.read_text()
    module = load(copy)
    kernel = getattr(module, _first_entry(module)[0]["kernel"])
    # The rebuild: another module (its lines shifted), and a manifest built from it.
    copy.write_text("# rebuilt\n" + old_text)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["source_sha256"] = hashlib.sha256(copy.read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    store = module._AotStore()
    assert store._load() == [] and "another version" in store.reason
    lines, first = inspect.findsource(kernel._pyfunc)
    assert "".join(lines) == old_text and first + 1 == kernel._pyfunc.__code__.co_firstlineno
    assert load(copy)._AotStore()._load(), "a fresh import of the new file uses the new folder"


def _first_entry(module):
    from cuda.tile.compilation import demangle_kernel_name

    store = module._AotStore()
    entry = store._load()[0]
    return entry, demangle_kernel_name(entry["signature"])[1]


def _results(module_path):
    """The compile results a build of module_path's source for sm_90 makes (cached)."""
    from specgen.compile.export import compile_target
    from specgen.plan.make import make_plan
    from specgen.spec import load_spec

    plan = make_plan(load_spec(ROOT / "specs" / f"{SPEC}.yaml"))
    return [compile_target(plan, module_path.read_text(), module_path.name, "sm_90")]


@pytest.mark.parametrize("damage", ["cubin gone", "cubin changed", "manifest garbage", "manifest cut",
                                    "entry without a field", "signature garbage", "signature a number",
                                    "cubin a number", "cubin a list", "cubins null", "cubins a list",
                                    "cubin outside the folder"])
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
        first = data["entries"][0]
        if damage == "entry without a field":
            del first["symbol"]
        elif damage.startswith("signature"):
            first["signature"] = 5 if damage.endswith("number") else "garbage"
        elif damage == "cubin a number":
            first["cubin"] = 5
        elif damage == "cubin a list":
            first["cubin"] = [1]
        elif damage.startswith("cubins"):
            data["cubins"] = None if damage.endswith("null") else list(data["cubins"])
        else:  # a file outside, with its own sum: never read
            outside = tmp_path / "elsewhere.cubin"
            shutil.copy(folder / first["cubin"], outside)
            data["cubins"]["../elsewhere.cubin"] = data["cubins"][first["cubin"]]
            first["cubin"] = "../elsewhere.cubin"
        manifest.write_text(json.dumps(data))
    store = module._AotStore()
    assert store.lookup(entry["kernel"], "sm_90", entry["hints"], sig) is None
    assert "specgen build" in store.reason
    from specgen.compile.aot import folder_problem

    assert folder_problem(copy, copy.read_text(), _results(built)) is not None
    assert folder_problem(built, built.read_text(), _results(built)) is None


@pytest.mark.parametrize("change", ["symbol", "hints", "extra key", "extra cubin", "cubin a link",
                                    "folder a link"])
def test_build_check_names_any_difference_from_what_the_build_writes(built, tmp_path, change):
    """A manifest whose own sums still agree, but that the build would write
    otherwise, or a folder holding other files or links, is drift."""
    from specgen.compile.aot import folder_problem

    copy = tmp_path / built.name
    shutil.copy(built, copy)
    folder = tmp_path / f"{SPEC}.aot"
    shutil.copytree(built.with_name(f"{SPEC}.aot"), folder)
    manifest = folder / "manifest.json"
    data = json.loads(manifest.read_text())
    name = data["entries"][0]["cubin"]
    if change == "symbol":
        data["entries"][0]["symbol"] = "bogus_symbol"
    elif change == "hints":
        data["entries"][0]["hints"]["occupancy"] = 7
    elif change == "extra key":
        data["extra"] = 1
    elif change == "extra cubin":
        shutil.copy(folder / name, folder / "sm_100-deadbeef.cubin")
    elif change == "cubin a link":
        shutil.move(folder / name, tmp_path / "moved.cubin")
        (folder / name).symlink_to(tmp_path / "moved.cubin")
    else:
        shutil.move(folder, tmp_path / "real.aot")
        folder.symlink_to(tmp_path / "real.aot")
    if change in ("symbol", "hints", "extra key"):
        manifest.write_text(json.dumps(data, indent=1) + "\n")
    assert folder_problem(copy, copy.read_text(), _results(built)) is not None


def test_a_build_replaces_links_in_the_folder_and_refuses_a_linked_folder(built, tmp_path):
    """A build wrote through a cubin or manifest that was a symbolic link (a file
    elsewhere overwritten), and deleted other files through a linked folder."""
    from specgen.compile.aot import folder_problem, write_aot_folder

    copy = tmp_path / built.name
    shutil.copy(built, copy)
    folder = tmp_path / f"{SPEC}.aot"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    results = _results(built)
    name = results[0].paths[0].name
    (folder / name).symlink_to(victim)
    (folder / "manifest.json").symlink_to(victim)
    write_aot_folder(copy, copy.read_text(), results)
    assert victim.read_text() == "keep me"
    assert not (folder / name).is_symlink() and folder_problem(copy, copy.read_text(), results) is None
    shutil.rmtree(folder)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "other.cubin").write_text("another module's")
    folder.symlink_to(shared)
    with pytest.raises(OSError, match="a symbolic link; the module's AOT folder is written there, remove it"):
        write_aot_folder(copy, copy.read_text(), results)
    assert (shared / "other.cubin").is_file()


def test_writers_of_one_folder_wait_for_each_other_whatever_their_caches(built, tmp_path, monkeypatch):
    """The writer's lock is the folder's own: a build with another cubin cache
    waits for the one writing (a lock file in each cache let two builds of other
    targets remove each other's cubins)."""
    import fcntl
    import os
    import threading

    from specgen.compile.aot import folder_problem, write_aot_folder

    copy = tmp_path / built.name
    shutil.copy(built, copy)
    folder = tmp_path / f"{SPEC}.aot"
    folder.mkdir()
    results = _results(built)
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "another-cache"))
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a writer with its own cache holds it
    writer = threading.Thread(target=write_aot_folder, args=(copy, copy.read_text(), results))
    try:
        writer.start()
        writer.join(0.5)
        assert writer.is_alive() and not (folder / "manifest.json").exists()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    writer.join(30)
    assert not writer.is_alive() and folder_problem(copy, copy.read_text(), results) is None


def test_the_cubin_cache_serves_only_whole_entries(tmp_path, monkeypatch):
    """A cached cubin cut short, replaced, or with a record that does not read is
    compiled again, not served (and its damage is not copied into .aot folders)."""
    from specgen.compile.export import aot_entries_path, cached_entries

    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"\x7fELF" + bytes(100))
    record = {"sha256": hashlib.sha256(cubin.read_bytes()).hexdigest(),
              "entries": [{"kernel": "k", "sm": "sm_90", "hints": {}, "signature": "s", "symbol": "k"}]}
    aot_entries_path(cubin).write_text(json.dumps(record))
    assert cached_entries(cubin) == record["entries"]
    cubin.write_bytes(b"\x7fELF")  # cut short
    assert cached_entries(cubin) is None
    cubin.write_bytes(b"\x7fELF" + bytes(100))
    for bad in ("not json{", "[]", json.dumps({**record, "entries": [{"kernel": "x"}]})):
        aot_entries_path(cubin).write_text(bad)
        assert cached_entries(cubin) is None


def test_the_cache_key_names_cuda_tiles_debug_switches(monkeypatch):
    """A debug build (-O0) of cuda.tile made cubins under the release key, which a
    later build served as release cubins."""
    from cuda.tile import _debug

    from specgen.compile.export import cache_key
    from specgen.plan.make import make_plan
    from specgen.spec import load_spec

    plan = make_plan(load_spec(ROOT / "specs" / f"{SPEC}.yaml"))
    source = (ROOT / "generated" / f"{SPEC}.py").read_text()
    release = cache_key(plan, source, "sm_90")
    monkeypatch.setattr(_debug, "EXPERIMENTAL_CUDA_TILE_DEBUG_BUILD", True)
    assert cache_key(plan, source, "sm_90") != release


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

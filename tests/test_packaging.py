"""A wheel of specgen builds modules from any folder: the templates and the table of
measured configs ship inside it."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from .helpers import ROOT

DECODE_WITHOUT_TARGETS = "name: llama3_70b_decode\nfamily: decode\ndtype: bfloat16\ngqa_ratio: 8\n"


def run(*args, cwd=None):
    # Without PYTHONPATH: a checkout on it (PYTHONPATH=. pytest) would give the venv's
    # python the checkout's specgen instead of the wheel's.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _tracked_copy(src: Path) -> Path:
    """A copy of the tracked tree to build from, so nothing of the checkout's (build/,
    caches) leaks in and nothing is written into it."""
    src.mkdir()
    files = run("git", "ls-files", "-z", cwd=ROOT).split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    return src


def test_the_sdist_carries_what_its_tests_read(tmp_path):
    """The sdist is a source tree whose tests pass: the committed modules, the bench
    scripts and results docs/ is made from, and the CI script the README tests read."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout (not an sdist) to copy the tracked files")
    pytest.importorskip("hatchling")
    import tarfile

    src = _tracked_copy(tmp_path / "src")
    run(sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", tmp_path / "dist", cwd=src)
    [sdist] = (tmp_path / "dist").glob("specgen-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in ("generated/fmha_gqa_causal.py", "bench/add_log.py", "bench/results/logs.tar.xz",
                   ".ci/run", "tests/helpers.py", "templates/fmha_prefill.py.jinja",
                   "specs/fmha_gqa_causal.yaml", "docs/performance.md", "README.md"):
        assert needed in names, needed


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """specgen's wheel, installed into a fresh venv that borrows the dependencies."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout (not an sdist) to copy the tracked files")
    base = tmp_path_factory.mktemp("wheel")
    src = _tracked_copy(base / "src")
    dist = base / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "-w", dist, src)
    [wheel] = dist.glob("specgen-*.whl")
    venv = base / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    # The dependencies come from this interpreter's site-packages, appended after the
    # venv's own (a plain path in a .pth file: the .pth files there, such as an
    # editable install's, are not read, so only the wheel can provide specgen).
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    # Every site-packages this interpreter reads: a venv made with
    # --system-site-packages takes its dependencies from the base interpreter's too.
    deps = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
                  | {p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")})
    (Path(purelib) / "_outer_deps.pth").write_text("\n".join(deps) + "\n")
    # --ignore-installed: a specgen of the same version where the dependencies come
    # from (a `pip install .` there, not editable) would make pip skip the wheel.
    run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
        "--ignore-installed", wheel)
    return wheel, python


def test_the_wheel_carries_the_templates_and_the_config_table(wheel_env):
    wheel, _ = wheel_env
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in (ROOT / "templates").glob("*.jinja"):
        assert f"specgen/templates/{template.name}" in names
    assert "specgen/spec/default_configs.json" in names


def test_an_installed_wheel_builds_the_committed_module_outside_the_checkout(wheel_env, tmp_path):
    _, python = wheel_env
    where = run(python, "-c", "import specgen.emit.render as r; print(r.templates_dir())", cwd=tmp_path)
    assert str(python.parent.parent) in where, f"templates not from the wheel: {where}"
    (tmp_path / "specs").mkdir()
    shutil.copy(ROOT / "specs" / "fmha_gqa_causal.yaml", tmp_path / "specs")
    run(python, "-m", "specgen", "build", "specs/fmha_gqa_causal.yaml", "--no-compile",
        "--out", "generated", cwd=tmp_path)
    built = (tmp_path / "generated" / "fmha_gqa_causal.py").read_bytes()
    assert built == (ROOT / "generated" / "fmha_gqa_causal.py").read_bytes()


def test_a_decode_spec_without_targets_builds_the_same_from_the_wheel_and_the_checkout(
        wheel_env, tmp_path):
    _, python = wheel_env
    spec = tmp_path / "specs" / "llama3_70b_decode.yaml"
    spec.parent.mkdir()
    spec.write_text(DECODE_WITHOUT_TARGETS)
    run(python, "-m", "specgen", "build", "specs", "--no-compile", "--out", "from_wheel",
        cwd=tmp_path)
    checkout = subprocess.run(
        [sys.executable, "-m", "specgen", "build", "specs", "--no-compile", "--out", "from_checkout"],
        cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert checkout.returncode == 0, checkout.stderr
    from_wheel = (tmp_path / "from_wheel" / "llama3_70b_decode.py").read_text()
    assert from_wheel == (tmp_path / "from_checkout" / "llama3_70b_decode.py").read_text()
    assert '"tile_m": 16' in from_wheel


def test_the_wheel_metadata_has_the_package_version(wheel_env):
    """One version: the wheel's metadata says what `specgen --version` and the module
    headers say (pyproject.toml reads it from specgen/__init__.py)."""
    wheel, python = wheel_env
    from specgen import __version__

    with zipfile.ZipFile(wheel) as z:
        [metadata] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(metadata).decode().splitlines()
    assert f"Version: {__version__}" in lines
    assert run(python, "-m", "specgen", "--version").strip() == f"specgen {__version__}"

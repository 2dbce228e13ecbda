"""The README's commands are the ones CI runs."""

from .helpers import ROOT


def _readme_test_command():
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("<!-- test-command -->")
    block = lines[start + 1 : start + 4]
    assert block[0] == "```sh" and block[2] == "```", block
    return block[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    marker = ci.index("# test-command (from README.md)")
    assert ci[marker + 1] == _readme_test_command()


def test_ci_installs_cpu_torch_before_the_package():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("torch==2.13.0") < ci.index('-e ".[dev]"')


def test_the_no_deps_install_lists_the_packages_dependencies():
    """The README's install beside a CUDA torch names every dependency but torch
    (cuda-tile without its compiler extra), with pyproject's bounds: under
    --no-deps pip checks nothing, so an unbounded name keeps an old pydantic 1."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("dependencies = [") : text.index("]\n", text.index("dependencies = ["))]
    deps = [d.replace("[tileiras]", "") for d in re.findall(r'^\s+"([^"]+)"', block, re.M)]
    line = next(l for l in (ROOT / "README.md").read_text().splitlines()
                if l.startswith("pip install \"cuda-tile"))
    listed = [w.strip('"') for w in line.split()[2:]]
    assert sorted(listed) == sorted(d for d in deps if not d.startswith("torch")), (listed, deps)


def test_the_no_deps_install_names_the_test_tools_it_leaves_out():
    """Beside a CUDA torch the `dev` extra is not installed, yet the README then runs
    pytest there: its line names the extra's test tools, with pyproject's bounds."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    dev = re.search(r"^dev = \[(.*)\]$", text, re.M).group(1)
    tools = [d for d in re.findall(r'"([^"]+)"', dev)
             if d.startswith(("pytest", "hypothesis", "jsonschema"))]
    line = next(l for l in (ROOT / "README.md").read_text().splitlines()
                if l.startswith('`pip install "pytest'))
    listed = [w.strip('`".') for w in line.split()[2:]]
    assert sorted(listed) == sorted(tools), (listed, tools)

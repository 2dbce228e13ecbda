"""bench/add_log.py keeps the log archive deterministic: the same logs give the same
bytes, a name given again replaces its member, and a name outside bench/results/ is
refused."""

import importlib.util
import re
import tarfile

import pytest

from .helpers import ROOT

spec = importlib.util.spec_from_file_location("add_log", ROOT / "bench" / "add_log.py")
add_log = importlib.util.module_from_spec(spec)
spec.loader.exec_module(add_log)


def _members(archive):
    with tarfile.open(archive, "r:xz") as tar:
        return {info.name: tar.extractfile(info).read() for info in tar.getmembers()}


def test_logs_are_added_replaced_and_written_the_same_way_twice(tmp_path):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text("run 1\n")
    second.write_text("run 2\n")
    archive = tmp_path / "logs.tar.xz"
    add_log.add_logs([(second, "h100/z.log"), (first, "h200/a.log")], archive)
    once = archive.read_bytes()
    add_log.add_logs([(first, "h200/a.log")], archive)  # the same content again
    assert archive.read_bytes() == once
    assert _members(archive) == {"h100/z.log": b"run 2\n", "h200/a.log": b"run 1\n"}
    first.write_text("run 1, again\n")
    add_log.add_logs([(first, "h200/a.log")], archive)
    assert _members(archive)["h200/a.log"] == b"run 1, again\n"


@pytest.mark.parametrize("name", ["/tmp/x.log", "../x.log", "h200/../../x.log"])
def test_a_name_outside_the_results_folder_is_refused(tmp_path, name):
    log = tmp_path / "a.log"
    log.write_text("x\n")
    with pytest.raises(SystemExit, match="give a path below bench/results/"):
        add_log.add_logs([(log, name)], tmp_path / "logs.tar.xz")
    assert not (tmp_path / "logs.tar.xz").exists()


def test_the_committed_archive_holds_every_log_the_docs_name():
    """A log named in backquotes (`name.log`, `folder/name.txt`) by the experiment log
    or the guarantees is in the archive."""
    names = {name.rsplit("/", 1)[-1] for name in _members(add_log.ARCHIVE)}
    text = "".join((ROOT / "docs" / page).read_text() for page in ("experiments.md", "guarantees.md"))
    named = set(re.findall(r"`(?:[\w./-]*/)?([\w.-]+\.(?:log|txt))`", text))
    assert len(named) > 50 and not sorted(named - names)

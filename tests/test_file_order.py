"""The heaviest-files-first order (tests/file_order.py) and its seconds file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.file_order import UNKNOWN_SECONDS, file_seconds, heaviest_files_first

REPO = Path(__file__).resolve().parents[1]


def _items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_go_heaviest_first_and_keep_their_tests_in_order():
    items = _items("a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "b.py::t2", "d.py::t1")
    seconds = {"a.py": 1.0, "b.py": 50.0, "c.py": 1.0}  # d.py unknown: UNKNOWN_SECONDS, between
    order = [i.nodeid for i in heaviest_files_first(items, seconds)]
    assert UNKNOWN_SECONDS > 1.0
    assert order == ["b.py::t1", "b.py::t2", "d.py::t1", "a.py::t1", "a.py::t2", "c.py::t1"]


def test_the_seconds_file_names_test_files_that_exist():
    seconds = file_seconds()
    assert len(seconds) > 50, "tests/file_seconds.json is missing or nearly empty"
    missing = [f for f in seconds if not (REPO / f).is_file()]
    assert len(missing) <= len(seconds) // 10, f"stale: regenerate with scripts/test_file_seconds.py: {missing}"


def test_the_seconds_script_reads_a_junit_file(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite name="pytest">'
                     '<testcase classname="tests.rag.test_x" name="a" time="2.5"/>'
                     '<testcase classname="tests.rag.test_x.TestY" name="b" time="1.0"/>'
                     '<testcase classname="tests.test_z" name="c" time="4.0"/>'
                     '</testsuite></testsuites>')
    out = tmp_path / "seconds.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "test_file_seconds.py"), str(junit), "--out", str(out)],
                   check=True, capture_output=True)
    assert out.read_text().split() == ["{", '"tests/test_z.py":', "4.0,", '"tests/rag/test_x.py":', "3.5", "}"]

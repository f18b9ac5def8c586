"""The CI gate (tests/ci_gate.py): with CI set, a skipped test fails the run, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SAMPLE = '''
import pytest

def test_runs():
    assert 1 + 1 == 2

def test_missing_program():
    pytest.skip("no /usr/bin/chromium here")

@pytest.mark.skipif(True, reason="Debian's manual is not installed")
def test_marked():
    pass

@pytest.mark.parametrize("store", ["plain", "rebuild"])
def test_only_for_plain(store):
    if store == "rebuild":
        pytest.skip("not applicable: a rebuild has its own test")

@pytest.mark.xfail(strict=True, reason="a known miss")
def test_expected_failure():
    assert False
'''

MODULE_SKIP = '''
import pytest
pytest.importorskip("no_such_package_for_the_gate")

def test_never_collected():
    pass
'''


def _pytest(tmp_path: Path, ci: str | None, source: str = SAMPLE) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_gate", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-q", "-rfEs", "--rootdir", str(tmp_path), "-c", os.devnull,
                           str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


@pytest.mark.slow
def test_outside_ci_skips_are_skips(tmp_path):
    done = _pytest(tmp_path, None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed, 3 skipped, 1 xfailed" in done.stdout
    assert _pytest(tmp_path, None, MODULE_SKIP).returncode == 5  # nothing collected, not a failure


@pytest.mark.slow
def test_in_ci_a_missing_component_fails_with_its_reason(tmp_path):
    done = _pytest(tmp_path, "true")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    # the runtime skip fails, the skipif marker errors at setup, each saying why
    assert "FAILED test_sample.py::test_missing_program" in out and "no /usr/bin/chromium here" in out
    assert "ERROR test_sample.py::test_marked" in out and "Debian's manual is not installed" in out
    # a case that does not apply stays a skip; an expected failure stays expected
    assert "1 failed, 2 passed, 1 skipped, 1 xfailed, 1 error" in out


@pytest.mark.slow
def test_in_ci_a_module_that_skips_itself_is_a_collection_error(tmp_path):
    done = _pytest(tmp_path, "true", MODULE_SKIP)
    assert done.returncode == 2 and "ERROR collecting test_sample.py" in done.stdout, done.stdout + done.stderr
    assert "no_such_package_for_the_gate" in done.stdout


@pytest.mark.slow
def test_ci_false_is_not_ci(tmp_path):
    assert _pytest(tmp_path, "false").returncode == 0

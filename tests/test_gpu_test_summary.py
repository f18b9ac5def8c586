"""scripts/gpu_test_summary.py: the GPU tests' page counts what the JUnit XML says, per file."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_test_summary.py"
spec = importlib.util.spec_from_file_location("gpu_test_summary", SCRIPT)
summary = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = summary  # dataclasses look their module up while it is being executed
spec.loader.exec_module(summary)

SAMPLE = '''
import pytest

def test_ok():
    pass

def test_broken():
    assert 1 == 2, "kernel disagrees"

def test_two_gpus():
    pytest.skip("needs two or more GPUs")

class TestGrouped:
    def test_in_a_class(self):
        pass
'''


@pytest.mark.slow
def test_the_page_counts_each_outcome_and_names_what_did_not_pass(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_kernels.py").write_text(SAMPLE)
    junit = tmp_path / "run.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-c", os.devnull,
                    "--rootdir", str(tmp_path), f"--junitxml={junit}", "tests"], cwd=tmp_path, capture_output=True,
                   timeout=120, env={k: v for k, v in os.environ.items() if k != "CI"})
    out = tmp_path / "gpu-tests.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--junit", str(junit), "--commit", "a" * 40, "--device", "H200",
                           "--versions", "torch 2.11", "--date", "2026-12-05", "--command", "pytest -m gpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1  # a failed test fails the script, after the page is written
    page = out.read_text()
    assert f"commit: `{'a' * 40}`" in page and "device: H200" in page
    assert "**4 tests: 2 passed, 1 failed, 0 error, 1 skipped**" in page
    assert "| `tests/test_kernels.py` | 2 | 1 | 0 | 1 |" in page
    assert "`tests/test_kernels.py::test_broken` | failed | AssertionError: kernel disagrees" in page
    assert "`tests/test_kernels.py::test_two_gpus` | skipped | needs two or more GPUs" in page


def test_a_short_or_missing_commit_is_refused(tmp_path):
    junit = tmp_path / "run.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_x" name="test_a" time="0.1"/>'
                     '</testsuite></testsuites>')
    done = subprocess.run([sys.executable, str(SCRIPT), "--junit", str(junit), "--commit", "HEAD", "--device", "x",
                           "--versions", "x", "--date", "x", "--command", "x", "--out", str(tmp_path / "o.md")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "full commit hash" in done.stderr
    assert [c.outcome for c in summary.read_cases(junit)] == ["passed"]


@pytest.mark.slow
def test_the_gpu_script_runs_every_file_that_has_gpu_tests():
    """scripts/gpu_tests.sh picks files by grep (the rest do not import there): none may be missed."""
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:xdist",
                                "tests"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    files = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    grepped = subprocess.run(["grep", "-rl", "--include=test_*.py", "mark.gpu", "tests"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    assert files and files <= set(grepped), files - set(grepped)

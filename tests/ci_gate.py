"""CI cannot go green by skipping: in CI every skip fails its test, unless it says it does not apply."""

from __future__ import annotations

import os

import pytest

# A skip that says a component is missing (Chromium, Slurm, LiteLLM, the PostgreSQL manual, a dev
# package) lets a run stay green while whole features go untested. In CI (`CI` set to anything but
# "" / "0" / "false") every skip fails the test instead, with its reason, unless the reason starts
# with NOT_APPLICABLE: a case that does not exist in this configuration (a parametrized store for
# which the claim has no meaning), never a missing program. GPU tests are deselected (`-m "not gpu"`),
# not skipped, so they never reach this.
NOT_APPLICABLE = "not applicable:"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _ci_forbids(report) -> str | None:
    """The skip reason when CI must turn this skipped report into a failure, else None."""
    if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    return None if reason.startswith(NOT_APPLICABLE) else reason


def _fail_skip(report, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"CI=true forbids skips (a skipped feature is an untested feature): {reason}\n"
                       f"Install what is missing in scripts/setup.sh, or start the reason with "
                       f"{NOT_APPLICABLE!r} if the case does not exist in this configuration.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    reason = _ci_forbids(report)
    if reason is not None:
        _fail_skip(report, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    reason = _ci_forbids(report)
    if reason is not None:  # a module that skips itself at import (pytest.importorskip at the top)
        _fail_skip(report, reason)

"""Turn the JUnit XML of a `pytest -m gpu` run into docs/gpu-tests.md: counts per file, tied to a commit.

Run by scripts/gpu_tests.sh on the GPU machine; docs/claims.md cites the page it writes instead of
prose about what passed on a GPU once.
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass(frozen=True)
class Case:
    file: str
    name: str
    outcome: str
    seconds: float
    message: str


def read_cases(junit: Path) -> list[Case]:
    """Every testcase of a pytest JUnit XML file, with its outcome and first line of message."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/")
        file = re.sub(r"/(Test\w+)$", "", file) + ".py"  # a class's tests count under its file
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (child.get("message") or child.text or "").strip().splitlines()[0:1]
                message = message[0] if message else ""
                break
        cases.append(Case(file, case.get("name", ""), outcome, float(case.get("time") or 0.0), message))
    return cases


def render(cases: list[Case], commit: str, device: str, versions: str, date: str, command: str) -> str:
    """The markdown page: the commit, the machine, totals, a row per file, every non-pass named."""
    totals = Counter(c.outcome for c in cases)
    per_file: dict[str, Counter] = defaultdict(Counter)
    seconds: Counter = Counter()
    for c in cases:
        per_file[c.file][c.outcome] += 1
        seconds[c.file] += c.seconds
    lines = [
        "# GPU tests",
        "",
        "Written by `scripts/gpu_tests.sh` (do not edit by hand): every test marked `gpu`, run on the GPU",
        "machine at the commit below. CI has no GPU; this page is the record of what passed there.",
        "",
        f"- commit: `{commit}`",
        f"- date: {date}",
        f"- device: {device}",
        f"- software: {versions}",
        f"- command: `{command}`",
        f"- **{len(cases)} tests: " + ", ".join(f"{totals[o]} {o}" for o in OUTCOMES) + "**"
        + f" in {sum(seconds.values()):.0f} s",
        "",
        "| file | " + " | ".join(OUTCOMES) + " | seconds |",
        "|---|" + "---|" * (len(OUTCOMES) + 1),
    ]
    for file in sorted(per_file):
        counts = per_file[file]
        lines.append(f"| `{file}` | " + " | ".join(str(counts[o]) for o in OUTCOMES) + f" | {seconds[file]:.1f} |")
    others = [c for c in cases if c.outcome != "passed"]
    if others:
        lines += ["", "## Not passed", "", "| test | outcome | message |", "|---|---|---|"]
        for c in others:
            message = c.message.replace("|", "\\|")[:200]
            lines.append(f"| `{c.file}::{c.name}` | {c.outcome} | {message} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--junit", type=Path, required=True)
    parser.add_argument("--commit", required=True, help="the 40-hex commit the tree was at")
    parser.add_argument("--device", required=True)
    parser.add_argument("--versions", required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not re.fullmatch(r"[0-9a-f]{40}", args.commit):
        parser.error(f"--commit must be a full commit hash, got {args.commit!r}")
    cases = read_cases(args.junit)
    if not cases:
        parser.error(f"{args.junit} holds no test cases")
    args.out.write_text(render(cases, args.commit, args.device, args.versions, args.date, args.command))
    bad = sum(c.outcome in ("failed", "error") for c in cases)
    print(f"{args.out}: {len(cases)} tests, {bad} failed or errored")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Write tests/file_seconds.json (seconds per test file) from the JUnit XML of a full run.

    .venv/bin/python -m pytest -m "not gpu" -n 2 --dist loadfile --junitxml=/tmp/junit.xml
    .venv/bin/python scripts/test_file_seconds.py /tmp/junit.xml

tests/file_order.py runs the heaviest files first from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_test_summary import read_cases  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "tests" / "file_seconds.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("junit", type=Path, help="a pytest --junitxml file of a full run")
    ap.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT})")
    args = ap.parse_args(argv)
    seconds: Counter = Counter()
    for case in read_cases(args.junit):
        seconds[case.file] += case.seconds
    if not seconds:
        ap.error(f"{args.junit} has no test cases")
    ordered = {file: round(s, 1) for file, s in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))}
    args.out.write_text(json.dumps(ordered, indent=0) + "\n")
    print(f"{len(ordered)} files, {sum(seconds.values()):.0f} s in all -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

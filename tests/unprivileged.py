"""Checks that need a real permission denial, also when the tests run as root (CI does).

Root reads a file whatever its mode, so a chmod 000 denies nothing to it. `run_unprivileged` runs
the check in a fresh interpreter that, started as root, becomes `nobody` once its imports are
done: the interpreter and its libraries may live where nobody can read (a pyenv under /root), but
the kernel then refuses the check's own opens exactly as for an ordinary user. Started as any
other user, it stays that user, for whom the mode already denies.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_DROP = """
import os, pwd
if os.geteuid() == 0:
    _nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(_nobody.pw_gid)
    os.setuid(_nobody.pw_uid)
assert os.geteuid() != 0
"""


def run_unprivileged(imports: str, check: str, *args: str) -> subprocess.CompletedProcess:
    """Run `imports` (as the current user), then `check` as an unprivileged user; `args` are sys.argv[1:].

    Returns the finished process (stdout and stderr as text); the caller asserts on it.
    """
    code = f"{imports}\n{_DROP}\n{check}"
    return subprocess.run([sys.executable, "-c", code, *args], cwd="/", capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


@contextlib.contextmanager
def searchable_dir() -> Iterator[Path]:
    """A fresh directory that any user may enter (pytest's tmp_path is 0700 under a 0700 root of its own)."""
    path = Path(tempfile.mkdtemp(prefix="rag-denied-"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

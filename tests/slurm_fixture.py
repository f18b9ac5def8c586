"""A real single-node Slurm for tests: munge, slurmctld and slurmd in a temporary directory.

Nothing of the machine's own Slurm or munge setup is used or touched: the key, the sockets, the
spool, the logs and the pid files all live in the temporary directory, the daemons listen on free
ports, and every client (sbatch, squeue, scontrol) finds this cluster through SLURM_CONF. The
daemons are stopped by the pids in their own pid files, never by name.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")
APT_PACKAGES = ("slurm-wlm", "munge")
# Job states after which a job never runs again (squeue's long names).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"})

SLURM_CONF = """\
ClusterName=ragtest
SlurmctldHost=localhost
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
StateSaveLocation={root}/spool/ctld
SlurmdSpoolDir={root}/spool/d
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Schedule as soon as a job is submitted or a dependency is met: the tests wait for it.
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
# A job whose afterok dependency failed is cancelled instead of pending forever.
DependencyParameters=kill_invalid_depend
# Finished jobs stay visible to squeue/scontrol for an hour (default 300 s: a slow run could lose them).
MinJobAge=3600
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
# A job in a partition of a higher PriorityTier preempts running jobs of a lower one, which go
# back to the queue and run again (a site's "high" or "interactive" partition over a batch one).
# A requeued job waits about cred_expire (AuthInfo above, default 120 s) before it runs again.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
# OverSubscribe=YES: jobs that ask with --oversubscribe may share CPUs (many one-line tasks at once).
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES PriorityTier=1
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10
"""


def search_path() -> str:
    """PATH with the sbin directories, where Debian puts the daemons (a user's PATH may lack them)."""
    parts = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join([*parts, *(d for d in ("/usr/sbin", "/sbin") if d not in parts)])


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p, path=search_path()) is None]


def ensure_slurm_installed() -> None:
    """Install Slurm and munge with apt where we can (root, apt-get), else skip the test, saying why.

    scripts/setup.sh installs them already; this covers a bare `pytest` on a fresh machine.
    """
    if not missing_programs():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"no Slurm here ({', '.join(missing_programs())} not found) and no way to install it: "
                    f"not root or no apt-get (install it with: apt-get install -y {' '.join(APT_PACKAGES)})")
    install = ["apt-get", "install", "-y", *APT_PACKAGES]
    done = subprocess.run(install, capture_output=True, text=True)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True)
        done = subprocess.run(install, capture_output=True, text=True)
    if done.returncode != 0 or missing_programs():
        pytest.fail(f"`{' '.join(install)}` failed (exit {done.returncode}); still missing: "
                    f"{', '.join(missing_programs()) or 'nothing'}\n{done.stderr[-2000:]}")


class LocalSlurm:
    """One node ("localhost") with the machine's CPUs and memory, and two partitions over it: "debug"
    (the default) and "high", whose jobs preempt (requeue) debug's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        # Clients see this cluster only, even when the tests themselves run inside a Slurm job.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env["SLURM_CONF"] = str(self.conf)
        self.env["PATH"] = search_path()
        self.cpus = 0  # the node's, once started

    def log(self, name: str) -> Path:
        """A daemon's log file: munged.log, slurmctld.log or slurmd.log."""
        return self.root / "log" / name

    def start(self, timeout: float = 60) -> None:
        root = self.root
        for sub in ("munge", "spool/ctld", "spool/d", "log", "run"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory or key that others could write or read.
        root.chmod(0o755)
        (root / "munge").chmod(0o755)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._run(["munged", f"--socket={root}/munge/munge.socket", f"--key-file={key}",
                   f"--pid-file={root}/run/munged.pid", f"--log-file={self.log('munged.log')}",
                   f"--seed-file={root}/munge/munged.seed"])
        cpus, memory = node_resources()
        self.cpus = cpus
        ctld_port, d_port = free_ports(2)
        self.conf.write_text(SLURM_CONF.format(root=root, user=getpass.getuser(), ctld_port=ctld_port,
                                               d_port=d_port, cpus=cpus, memory=memory))
        self._run(["slurmctld"])
        self._run(["slurmd", "-N", "localhost"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env)
            if "idle" in state.stdout:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm node did not come up in {timeout:.0f} s (sinfo: {state.stdout.strip()!r} "
                           f"{state.stderr.strip()!r}); logs in {root / 'log'}")

    def stop(self) -> None:
        """Cancel what still runs (a test that failed midway), then stop the daemons by the pids in
        their pid files, all at once: each takes a second or two."""
        self._cancel_all()
        pids = []
        for name in ("slurmd", "slurmctld", "munged"):
            try:
                pids.append(int((self.root / "run" / f"{name}.pid").read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        _terminate(pids)

    def _cancel_all(self, grace: float = 15) -> None:
        # Job steps outlive a stopped slurmd: cancel them while it can still signal them.
        try:
            active = self._active_jobs()
            if not active:
                return
            subprocess.run(["scancel", *active], capture_output=True, env=self.env, timeout=30)
            deadline = time.monotonic() + grace
            while self._active_jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        except (OSError, subprocess.SubprocessError):
            pass  # the controller is not up (a failed start): nothing can be running

    def _active_jobs(self) -> list[str]:
        done = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, env=self.env, timeout=30)
        return done.stdout.split()

    def sbatch(self, args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None) -> str:
        """Submit a batch job (`sbatch --parsable ARGS` in `cwd`); returns its job id."""
        done = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, capture_output=True, text=True,
                              env={**self.env, **(env or {})}, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def states(self, job_ids: Sequence[str]) -> dict[str, str]:
        """State of each job and each array task ("12", "13_1", ...), finished ones included."""
        done = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(job_ids), "-o", "%i %T"],
                              capture_output=True, text=True, env=self.env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"squeue failed: {done.stderr.strip()}")
        return dict(line.split() for line in done.stdout.splitlines() if line.strip())

    def wait(self, job_ids: Sequence[str], timeout: float) -> dict[str, str]:
        """Wait until every job (and every task of an array) has ended; returns their final states.

        Raises:
            TimeoutError: some job has not ended after `timeout` seconds (they are cancelled).
        """
        deadline = time.monotonic() + timeout
        while True:
            states = self.states(job_ids)
            pending = [job for job in job_ids if not _ended(job, states)]
            if not pending:
                return states
            if time.monotonic() > deadline:
                subprocess.run(["scancel", *job_ids], env=self.env, capture_output=True)
                raise TimeoutError(f"Slurm jobs still not done after {timeout:.0f} s: {states}")
            time.sleep(0.5)

    def wait_until(self, condition: Callable[[], object], timeout: float, what: str,
                   report: Callable[[], str] = lambda: "") -> None:
        """Poll `condition` (every 0.2 s) until it is true.

        Raises:
            TimeoutError: still false after `timeout` seconds; the message says `what` was awaited
                and ends with `report()` (logs, states).
        """
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not after {timeout:.0f} s\n{report()}")
            time.sleep(0.2)

    def requeue(self, job_id: str) -> None:
        """`scontrol requeue JOB` (an array task as "12_3"): kill it and put it back in the queue."""
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, env=self.env,
                              timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"scontrol requeue {job_id} failed: {done.stderr.strip()}")

    def restarts(self, job_id: str) -> int:
        """How many times a job (or array task) was requeued: scontrol's Restarts."""
        return int(self.show_job(job_id).get("Restarts", "0"))

    def show_job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` of one job or array task, as a dict (JobState, ExitCode, StdOut, ...)."""
        done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              env=self.env, timeout=60)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def _run(self, argv: list[str]) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} did not start (exit {done.returncode}): {done.stderr.strip()}; "
                               f"logs in {self.root / 'log'}")


def _ended(job: str, states: Mapping[str, str]) -> bool:
    # An array job appears as its tasks ("12_0", "12_1", ...; "12_[3-4]" while some still wait).
    mine = [state for key, state in states.items() if key == job or key.startswith(f"{job}_")]
    return bool(mine) and all(state in FINAL_STATES for state in mine)


def node_resources() -> tuple[int, int]:
    """(CPUs, RealMemory in MB) of this machine as slurmd sees it: a node may not claim more."""
    slurmd = shutil.which("slurmd", path=search_path()) or "slurmd"
    done = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=60)
    found = dict(re.findall(r"(\w+)=(\S+)", done.stdout))
    return int(found.get("CPUs", os.cpu_count() or 1)), int(found.get("RealMemory", 1024))


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _terminate(pids: list[int], grace: float = 10) -> None:
    """SIGTERM, then SIGKILL for those still alive after `grace` seconds."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            alive.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if _is_alive(pid)]
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def slurm() -> Iterator[LocalSlurm]:
    """A running single-node Slurm for the whole session, stopped at the end."""
    ensure_slurm_installed()
    # Not under pytest's base temp: munged wants every directory above its socket open to all
    # (execute for all), and pytest makes its base 0700.
    root = Path(tempfile.mkdtemp(prefix="rag-slurm-"))
    cluster = LocalSlurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)

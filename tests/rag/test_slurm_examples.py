"""The Slurm examples (examples/slurm/) on a real Slurm: 1-based and stepped arrays, the merge behind afterok.

What a job array's tasks see comes from Slurm itself (tests/slurm_fixture.py), never from a
hand-written guess: the shard mapping of `rag ingest` (rag.shards.run.resolve_shard) is checked
against the variables a real Slurm sets for every form of `--array`, and the repository's own
scripts are submitted through submit.sh and must leave the collection one job would have built.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rag.errors import ConfigError
from rag.shards.run import resolve_shard
from tests.rag.conftest import REPO, rag_factory  # noqa: F401 - rag_factory is a fixture
from tests.rag.test_shards import assert_same_collection, corpus, single  # noqa: F401 - fixtures
from tests.slurm_fixture import LocalSlurm, slurm  # noqa: F401 - slurm is a fixture

EXAMPLES = REPO / "examples" / "slurm"
VENV_BIN = Path(sys.executable).parent  # where `rag` is installed: the jobs find it on PATH
# What a 2-core machine without GPUs can run: the command line overrides the scripts' #SBATCH lines
# (submit.sh passes its arguments to the array's sbatch, MERGE_OPTS to the merge's).
SMALL_TASK = ["--gres=none", "--cpus-per-task=1", "--mem=1G"]
SMALL_MERGE = "--cpus-per-task=1 --mem=1G"

# Array forms that are ranges: every one must map its tasks onto shards 0..N-1, each exactly once.
# (Small ones: the forms matter, not the sizes.)
RANGES = {"0-3": 4, "1-4": 4, "0-6:2": 4, "3-9:3": 3, "0-3%2": 4, "0-4:2,6": 4}
# Lists: Slurm gives a task no position in them (STEP=1), so each task is refused.
LISTS = ["1,3,7", "3,5,9", "0,2,4", "1-3,10-12"]


def _env(task: int, first: int, last: int, step: int, count: int) -> dict[str, str]:
    return {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": str(first),
            "SLURM_ARRAY_TASK_MAX": str(last), "SLURM_ARRAY_TASK_STEP": str(step),
            "SLURM_ARRAY_TASK_COUNT": str(count)}


def test_array_variables_as_slurm_sets_them_map_onto_shards():
    # The values Slurm 22.05 sets (seen on the real one; the slow test below checks them live).
    one_based = [resolve_shard(None, None, _env(t, 1, 8, 1, 8)) for t in range(1, 9)]  # --array=1-8
    assert one_based == [(i, 8) for i in range(8)]
    stepped = [resolve_shard(None, None, _env(t, 0, 14, 2, 8)) for t in range(0, 15, 2)]  # --array=0-14:2
    assert stepped == [(i, 8) for i in range(8)]
    for task in (1, 3, 7):  # --array=1,3,7: MIN=1 MAX=7 STEP=1 COUNT=3
        with pytest.raises(ConfigError, match=r"not a range .*--array=1,3,7 gives a task no shard number"):
            resolve_shard(None, None, _env(task, 1, 7, 1, 3))
    with pytest.raises(ConfigError, match="not a range"):  # a task off the step: not an array Slurm makes
        resolve_shard(None, None, _env(3, 0, 6, 2, 4))
    # Explicit options need no array variables at all, and --num-shards 1 turns sharding off.
    assert resolve_shard(5, 8, _env(7, 1, 7, 1, 3)) == (5, 8)
    assert resolve_shard(None, 1, _env(7, 1, 7, 1, 3)) is None


def _submit_env(home: Path, corpus_dir: Path) -> dict[str, str]:
    return {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAG_HOME": str(home),
            "CORPUS": str(corpus_dir), "COLLECTION": "lab", "RAG_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MERGE_OPTS": SMALL_MERGE}


@pytest.mark.slow  # a real Slurm: a few seconds of scheduling for ~50 one-line tasks
def test_real_slurm_array_variables_map_onto_shards(slurm: LocalSlurm, tmp_path):  # noqa: F811
    script = tmp_path / "print-array.sh"
    script.write_text("#!/bin/bash\nenv | grep '^SLURM_ARRAY_TASK_'\n")
    jobs = {}
    for n, spec in enumerate([*RANGES, *LISTS]):
        jobs[spec] = slurm.sbatch([f"--array={spec}", "--mem=50M", "--oversubscribe", "-o", f"{tmp_path}/{n}-%a.env",
                                   str(script)], cwd=tmp_path)
    states = slurm.wait(list(jobs.values()), timeout=180)
    assert set(states.values()) == {"COMPLETED"}, states

    def task_envs(spec: str) -> list[dict[str, str]]:
        n = [*RANGES, *LISTS].index(spec)
        files = sorted(tmp_path.glob(f"{n}-*.env"))
        return [dict(line.split("=", 1) for line in f.read_text().splitlines()) for f in files]

    for spec, count in RANGES.items():
        shards = sorted(resolve_shard(None, None, env) for env in task_envs(spec))
        assert shards == [(i, count) for i in range(count)], (spec, task_envs(spec))
    for spec in LISTS:
        for env in task_envs(spec):
            with pytest.raises(ConfigError, match="not a range"):
                resolve_shard(None, None, env)


def _run_submit(cluster: LocalSlurm, workdir: Path, env: dict[str, str], array: str) -> tuple[str, str]:
    """./submit.sh --array=ARRAY in `workdir`, as a user would on a login node; (array job id, merge job id)."""
    done = subprocess.run([str(workdir / "scripts" / "submit.sh"), f"--array={array}", *SMALL_TASK],
                          cwd=workdir, env={**cluster.env, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = re.search(r"ingest array (\d+) queued, merge (\d+) behind it", done.stdout)
    assert found, done.stdout
    return found.group(1), found.group(2)


def _log_report(cluster: LocalSlurm, workdirs: list[Path]) -> str:
    """Every job log and the daemon logs' tails: what a failure message needs."""
    parts = [f"--- {log}\n{log.read_text()[-3000:]}" for w in workdirs for log in sorted((w / "logs").glob("*"))]
    for name in ("slurmctld.log", "slurmd.log"):
        if cluster.log(name).exists():
            parts.append(f"--- {name}\n{cluster.log(name).read_text()[-3000:]}")
    return "\n".join(parts)


@pytest.mark.slow  # two arrays of 4 `rag ingest` tasks and two merges on a real Slurm (~a minute on 2 cores)
def test_example_scripts_on_a_real_slurm_equal_one_job(slurm: LocalSlurm, tmp_path, rag_factory,  # noqa: F811
                                                        corpus, single):  # noqa: F811
    # A 1-based array and a stepped one: tasks 1..4 and 0,2,4,6 must both be shards 0..3 of 4.
    arrays = {"1-4": [1, 2, 3, 4], "0-6:2": [0, 2, 4, 6]}
    runs = {}
    for n, array in enumerate(arrays):
        workdir = tmp_path / f"submit-{n}"  # where a user submits from: logs/ appears here
        shutil.copytree(EXAMPLES, workdir / "scripts")
        home = tmp_path / f"home-{n}"
        rag_factory(home).close()  # links the session's converted models: tasks do not convert them again
        runs[array] = (workdir, home, *_run_submit(slurm, workdir, _submit_env(home, corpus), array))

    ids = [job for _, _, array_job, merge_job in runs.values() for job in (array_job, merge_job)]
    workdirs = [workdir for workdir, *_ in runs.values()]
    states = slurm.wait(ids, timeout=300)
    assert set(states.values()) == {"COMPLETED"}, f"{states}\n{_log_report(slurm, workdirs)}"

    for array, (workdir, home, array_job, merge_job) in runs.items():
        logs = workdir / "logs"
        task_logs = [logs / f"rag-ingest-{array_job}_{task}.out" for task in arrays[array]]
        assert [log.exists() for log in task_logs] == [True] * 4, sorted(logs.iterdir())
        merge_log = (logs / f"rag-merge-{merge_job}.out").read_text()
        assert '"shards_removed": true' in merge_log, merge_log
        # Each task's --json summary names its shard: every shard once, none out of range.
        shards = sorted(int(re.search(r'"shard": (\d+)', log.read_text()).group(1)) for log in task_logs)
        assert shards == [0, 1, 2, 3], array
        assert all('"num_shards": 4' in log.read_text() for log in task_logs)
        merged = rag_factory(home, rerank=False, collection="lab")
        assert_same_collection(merged, single)


@pytest.mark.slow  # two `rag ingest` tasks on a real Slurm, writing into a real PostgreSQL
def test_pgvector_example_on_a_real_slurm_equals_one_job(slurm: LocalSlurm, tmp_path, rag_factory,  # noqa: F811
                                                          corpus, single, pg_dsn):  # noqa: F811
    workdir = tmp_path / "submit"
    shutil.copytree(EXAMPLES, workdir / "scripts")
    home = tmp_path / "home"
    rag_factory(home).close()
    dsn_file = tmp_path / "dsn"  # the password stays in a file only we can read, as the script wants it
    dsn_file.write_text(pg_dsn + "\n")
    dsn_file.chmod(0o600)
    env = {**slurm.env, **_submit_env(home, corpus), "DSN_FILE": str(dsn_file)}
    done = subprocess.run([str(workdir / "scripts" / "submit.sh"), "pgvector", "--array=2-3", *SMALL_TASK],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = re.search(r"pgvector ingest array (\d+) queued", done.stdout)
    assert found, done.stdout
    job = found.group(1)
    states = slurm.wait([job], timeout=300)
    assert set(states.values()) == {"COMPLETED"}, f"{states}\n{_log_report(slurm, [workdir])}"

    task_logs = [workdir / "logs" / f"rag-ingest-pg-{job}_{task}.out" for task in (2, 3)]
    assert sorted(int(re.search(r'"shard": (\d+)', log.read_text()).group(1)) for log in task_logs) == [0, 1]
    assert not (home / "shards").exists()  # written straight into the shared collection: no merge
    shared = rag_factory(home, rerank=False, collection="lab", store="pgvector", dsn=pg_dsn)
    assert_same_collection(shared, single, queries=False)
    shared.close()


@pytest.mark.slow  # three short-lived `rag ingest` tasks: they stop before loading any model
def test_a_list_array_fails_every_task_with_a_clear_log_and_no_merge(slurm: LocalSlurm, tmp_path,  # noqa: F811
                                                                     rag_factory, corpus):  # noqa: F811
    workdir = tmp_path / "submit"
    shutil.copytree(EXAMPLES, workdir / "scripts")
    home = tmp_path / "home"
    rag_factory(home).close()
    array_job, merge_job = _run_submit(slurm, workdir, _submit_env(home, corpus), "1,3,7")
    states = slurm.wait([array_job, merge_job], timeout=180)
    # No shard is ingested under a wrong number; the merge behind afterok never runs (this
    # cluster cancels it: kill_invalid_depend; by default Slurm leaves it pending).
    assert states == {f"{array_job}_1": "FAILED", f"{array_job}_3": "FAILED", f"{array_job}_7": "FAILED",
                      merge_job: "CANCELLED"}, f"{states}\n{_log_report(slurm, [workdir])}"
    for task in (1, 3, 7):
        log = (workdir / "logs" / f"rag-ingest-{array_job}_{task}.out").read_text()
        assert "not a range" in log and "--array=1,3,7" in log, log
    assert not (home / "shards").exists()


# Installed as sitecustomize.py (through PYTHONPATH) in the jobs of the requeue and preemption
# tests, so that "mid-ingest" is a fact rather than a guess about timing: the first run of each
# chosen array task, right after it has stored its first document, says so in its log, touches
# paused-<task> and waits for `release` in the same folder (or for Slurm to kill it). A rerun
# (SLURM_RESTART_COUNT > 0) runs through.
PAUSE_HOOK = '''\
import json
import os
import sys
import time
from pathlib import Path


def _install() -> None:
    folder, task = os.environ.get("RAG_TEST_PAUSE_DIR"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if not folder or task not in os.environ.get("RAG_TEST_PAUSE_TASKS", "").split(","):
        return
    if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
        return
    import ingest.pipeline as pipeline
    from retrieval.stores.embedded import catalog as embedded_catalog
    from retrieval.stores.pgvector import rebuild

    # Both stores commit a batch of documents per transaction, and ingest writes the documents an
    # embed batch completes in one call: one document per transaction and one chunk per embed batch
    # here (so at most one document completes in each), so that the first document is stored and no
    # other when the task pauses, as a batch of a big corpus is when a task is killed.
    rebuild.DEFAULT_BATCH_DOCUMENTS = 1
    embedded_catalog.BATCH_DOCUMENTS = 1
    os.environ["RAG_INGEST_BATCH_CHUNKS"] = "1"
    real = pipeline._count_written

    def count_written(entry, report):
        real(entry, report)
        if report.added + report.updated == 1:
            print(f"test hook: task {task} paused after 1 document ({entry.doc.key})", file=sys.stderr, flush=True)
            Path(folder, f"paused-{task}").touch()
            deadline = time.monotonic() + 600
            while not Path(folder, "release").exists() and time.monotonic() < deadline:
                time.sleep(0.2)

    pipeline._count_written = count_written


_install()
'''


def _pause_env(tmp_path: Path, tasks: list[int]) -> tuple[dict[str, str], Path]:
    """The environment that installs PAUSE_HOOK for `tasks`, and the folder of its files."""
    hook = tmp_path / "pause-hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PAUSE_HOOK)
    folder = tmp_path / "pause"
    folder.mkdir()
    return {"PYTHONPATH": str(hook), "RAG_TEST_PAUSE_DIR": str(folder),
            "RAG_TEST_PAUSE_TASKS": ",".join(map(str, tasks)), "DO_NOT_TRACK": "1"}, folder


def _summary(log: str) -> dict:
    """The last `rag ingest --json` summary in a task's log (a requeued task's log holds every run)."""
    start = log.rindex("\n{") + 1 if "\n{" in log else log.index("{")
    return json.JSONDecoder().raw_decode(log[start:])[0]


@pytest.mark.slow  # a 2-task array, one task requeued mid-ingest and run again, then the merge
def test_a_requeued_task_resumes_and_the_merge_equals_one_job(slurm: LocalSlurm, tmp_path, rag_factory,  # noqa: F811
                                                               corpus, single):  # noqa: F811
    workdir = tmp_path / "submit"
    shutil.copytree(EXAMPLES, workdir / "scripts")
    home = tmp_path / "home"
    rag_factory(home).close()
    pause_env, paused = _pause_env(tmp_path, [0])
    array_job, merge_job = _run_submit(slurm, workdir, {**_submit_env(home, corpus), **pause_env}, "0-1")
    task = f"{array_job}_0"

    def report() -> str:
        return f"{slurm.states([array_job, merge_job])}\n{_log_report(slurm, [workdir])}"

    slurm.wait_until(lambda: (paused / "paused-0").exists(), 180, f"{task} committing its first document", report)
    slurm.requeue(task)  # killed with one document committed and the rest of its shard to do
    states = slurm.wait([array_job, merge_job], timeout=240)
    assert set(states.values()) == {"COMPLETED"}, report()
    assert slurm.restarts(task) == 1 and slurm.restarts(f"{array_job}_1") == 0

    # Both runs in one log (--open-mode=append): the first stopped after a document, the rerun
    # found it stored and did only the rest.
    log = (workdir / "logs" / f"rag-ingest-{array_job}_0.out").read_text()
    assert "test hook: task 0 paused after 1 document" in log, log
    rerun = _summary(log)
    assert rerun["shard"] == 0 and rerun["unchanged"] == 1 and rerun["added"] >= 1, rerun
    assert '"shards_removed": true' in (workdir / "logs" / f"rag-merge-{merge_job}.out").read_text()
    assert_same_collection(rag_factory(home, rerank=False, collection="lab"), single)


@pytest.mark.slow  # a 2-task pgvector array; a job in the `high` partition preempts one task mid-ingest
def test_a_preempted_task_resumes_and_the_collection_equals_one_job(slurm: LocalSlurm, tmp_path,  # noqa: F811
                                                                     rag_factory, corpus, single,  # noqa: F811
                                                                     pg_dsn):
    workdir = tmp_path / "submit"
    shutil.copytree(EXAMPLES, workdir / "scripts")
    home = tmp_path / "home"
    rag_factory(home).close()
    dsn_file = tmp_path / "dsn"
    dsn_file.write_text(pg_dsn + "\n")
    dsn_file.chmod(0o600)
    pause_env, paused = _pause_env(tmp_path, [0])
    env = {**slurm.env, **_submit_env(home, corpus), **pause_env, "DSN_FILE": str(dsn_file)}
    # %1: one task at a time, so the one that runs is the one a job needing every CPU preempts.
    done = subprocess.run([str(workdir / "scripts" / "submit.sh"), "pgvector", "--array=0-1%1", *SMALL_TASK],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    job = re.search(r"pgvector ingest array (\d+) queued", done.stdout).group(1)
    task = f"{job}_0"
    jobs = [job]

    def report() -> str:
        return f"{slurm.states(jobs)}\n{_log_report(slurm, [workdir])}"

    slurm.wait_until(lambda: (paused / "paused-0").exists(), 180, f"{task} committing its first document", report)
    assert slurm.states([task])[task] == "RUNNING", report()
    jobs.append(slurm.sbatch(["--partition=high", f"--cpus-per-task={slurm.cpus}", "--mem=100M",
                              "-o", str(tmp_path / "high.out"), "--wrap", "sleep 1"], cwd=tmp_path))
    slurm.wait_until(lambda: slurm.restarts(task), 60, f"{task} preempted by the high job", report)
    (paused / "release").touch()  # (only a task that was not preempted would still wait)
    states = slurm.wait(jobs, timeout=240)
    assert set(states.values()) == {"COMPLETED"}, report()
    assert slurm.restarts(task) == 1 and slurm.restarts(f"{job}_1") == 0

    # The preempted task's log holds both runs; its rerun found its first document stored.
    log = (workdir / "logs" / f"rag-ingest-pg-{task}.out").read_text()
    assert "test hook: task 0 paused after 1 document" in log, log
    rerun = _summary(log)
    assert rerun["shard"] == 0 and rerun["unchanged"] == 1 and rerun["added"] >= 1, rerun
    other = _summary((workdir / "logs" / f"rag-ingest-pg-{job}_1.out").read_text())
    assert other["shard"] == 1 and other["unchanged"] == 0, other
    shared = rag_factory(home, rerank=False, collection="lab", store="pgvector", dsn=pg_dsn)
    assert_same_collection(shared, single, queries=False)
    shared.close()

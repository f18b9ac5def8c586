"""Benchmark: requests/s of POST /v1/query (generate: false) against one `rag serve` replica and two.

Both replicas serve one PostgreSQL database (store = pgvector): chunks, users, keys and the
audit log are shared, so any key works on either and clients may spread over both. One run:

  1. a throwaway PostgreSQL + pgvector (`rag db start`'s server) in a temporary directory, the
     sample corpus (examples/lab-docs) ingested into it, the demo users and one key per client;
  2. replica A alone: N concurrent clients send questions back to back for --seconds;
  3. replica B started beside A: the same N clients, alternating between A and B, same duration;
  4. the identity lookup of one request (`authenticate_key` + `is_admin`, what rag/api/deps.py
     reads), in this process: PostgreSQL with the versioned cache (one query), PostgreSQL without
     it (every row read), and the embedded SQLite directory.

Prints both rates, their ratio, the lookup costs, the machine and the date. Each replica gets the
same settings (torch threads, no reranker unless --rerank); on a machine with few cores the two
replicas share them, so the ratio says what a second replica on the same machine buys, not what a
second machine would.

    PYTHONPATH=. python bench/replicas.py [--clients 8] [--seconds 20] [--threads 1] [--rerank]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.machine import describe_machine  # noqa: E402

USERS = {"alice": ["genomics"], "bob": ["imaging"], "carol": ["hpc-admins"], "dave": []}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def replica(home: Path, env: dict[str, str], log_dir: Path) -> Iterator[str]:
    """`rag serve` over `home` on a free port; yields its URL once /readyz answers 200."""
    port = free_port()
    log = (log_dir / f"serve-{port}.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "rag.cli", "serve", "--port", str(port)], cwd=REPO,
                               env={**os.environ, **env, "RAG_HOME": str(home)}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"rag serve exited: see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"rag serve not ready: see {log.name}")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def load(urls: list[str], keys: list[str], questions: list[str], seconds: float) -> dict:
    """len(keys) clients, client i on urls[i % len(urls)], each asking back to back for `seconds`."""
    done: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    start = time.monotonic()
    stop_at = start + seconds

    def client(i: int) -> None:
        url = urls[i % len(urls)]
        asked = itertools.cycle(questions[i % len(questions):] + questions[:i % len(questions)])
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {keys[i]}"}) as http:
            while time.monotonic() < stop_at:
                sent = time.monotonic()
                r = http.post(f"{url}/v1/query", json={"question": next(asked), "generate": False, "k": 5})
                with lock:
                    if r.status_code == 200:
                        done.append(time.monotonic() - sent)
                    else:
                        failures.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    if failures:
        raise RuntimeError(f"{len(failures)} failed requests, e.g. {failures[0]}")
    return {"requests": len(done), "seconds": round(wall, 2), "requests_per_s": round(len(done) / wall, 2),
            "p50_ms": round(statistics.median(done) * 1000, 1),
            "p99_ms": round(sorted(done)[int(0.99 * (len(done) - 1))] * 1000, 1)}


def lookup_costs(dsn: str, home: Path, rounds: int = 2000) -> dict[str, float]:
    """Mean microseconds of one request's identity reads (authenticate_key + is_admin), per backend."""
    from permissions.identity import IdentityStore
    from rag.pg_identity import PgIdentityStore

    out = {}
    for name, store in (("postgres, versioned cache", PgIdentityStore(dsn)),
                        ("postgres, no cache", PgIdentityStore(dsn, cache=False)),
                        ("sqlite (embedded default)", IdentityStore(home / "lookup-bench.sqlite"))):
        key = store.create_key("bench-user", ["g"])
        for _ in range(50):  # connections open, statements prepared
            store.is_admin(store.authenticate_key(key).key_id)
        started = time.perf_counter()
        for _ in range(rounds):
            store.is_admin(store.authenticate_key(key).key_id)
        out[name] = round((time.perf_counter() - started) / rounds * 1e6, 1)
        store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each replica (OMP_NUM_THREADS)")
    parser.add_argument("--rerank", action="store_true", help="rerank with the cross-encoder (default: off)")
    parser.add_argument("--out", type=Path, help="also write the result as JSON")
    args = parser.parse_args()

    from rag.local_postgres.server import LocalPostgres
    from rag.pipeline import Rag
    from rag.settings import load_settings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    with tempfile.TemporaryDirectory(prefix="rag-replicas-") as tmp:
        root = Path(tmp)
        models = root / "models"
        models.mkdir()
        pg = LocalPostgres(root / "postgres", server_options={"fsync": "off", "synchronous_commit": "off"})
        pg.start()
        try:
            dsn = pg.dsn
            env = {"RAG_STORE": "pgvector", "RAG_DSN": dsn, "RAG_DEVICE": "cpu", "RAG_RERANK": str(args.rerank).lower(),
                   "RAG_ANSWER_MODE": "extract", "OMP_NUM_THREADS": str(args.threads),
                   "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
            homes = {}
            for name in ("operator", "replica-a", "replica-b"):
                homes[name] = root / name
                homes[name].mkdir(mode=0o700)
                (homes[name] / "models").symlink_to(models, target_is_directory=True)
            rag = Rag(load_settings(home=homes["operator"], store="pgvector", dsn=dsn, rerank=args.rerank))
            try:
                report = rag.ingest([REPO / "examples" / "lab-docs"], progress=False)
                assert report.ok, report.problems
                for user, groups in USERS.items():
                    rag.identity.add_user(user, groups)
                keys = [rag.identity.create_key(list(USERS)[i % len(USERS)], label=f"client {i}")
                        for i in range(args.clients)]
            finally:
                rag.close()
            questions = [json.loads(line)["question"] for line in
                         (REPO / "examples" / "questions.jsonl").read_text().splitlines() if line.strip()]
            with replica(homes["replica-a"], env, root) as a:
                load([a], keys[:1], questions, 3.0)  # warm-up
                one = load([a], keys, questions, args.seconds)
                with replica(homes["replica-b"], env, root) as b:
                    load([b], keys[:1], questions, 3.0)
                    two = load([a, b], keys, questions, args.seconds)
            lookups = lookup_costs(dsn, root)
        finally:
            pg.destroy()
    result = {"date": datetime.date.today().isoformat(), "machine": describe_machine(use_gpu=False),
              "clients": args.clients, "seconds": args.seconds, "torch_threads_per_replica": args.threads,
              "rerank": args.rerank, "one_replica": one, "two_replicas": two,
              "ratio": round(two["requests_per_s"] / one["requests_per_s"], 2), "identity_lookup_us": lookups}
    print(f"{result['date']}  {result['machine']}")
    print(f"{args.clients} clients, {args.seconds:.0f} s each, POST /v1/query generate=false, "
          f"rerank {'on' if args.rerank else 'off'}, {args.threads} torch thread(s) per replica")
    for label, r in (("one replica ", one), ("two replicas", two)):
        print(f"  {label}: {r['requests_per_s']:7.2f} req/s  (p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
              f"{r['requests']} requests)")
    print(f"  ratio two/one: {result['ratio']:.2f}x")
    print("identity reads of one request (authenticate_key + is_admin), mean:")
    for name, us in lookups.items():
        print(f"  {name}: {us} us")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

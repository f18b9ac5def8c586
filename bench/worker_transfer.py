"""An embed worker's vectors back to the ingest process: pickled through the Connection against raw bytes.

The ingest process reads, chunks and writes on Python threads while its embedder runs in a worker
process (`ingest_embed_process`). Each call's vectors (4,096 x 384 float32, 6.3 MB) come back over
the worker's socket pair. `Connection.recv` reads them one socket buffer at a time, and after each
read its thread must take the GIL back, which beside busy Python threads can take the whole switch
interval (5 ms) every time. `ingest/embed/workers.py` sends a small message and then the raw
bytes, read with one blocking `recv(MSG_WAITALL)` (`recv_array_bytes`). Same run, same worker:
the median round trip (ask, receive) of each way, with 0 and 2 busy Python threads here, at the
switch intervals 5 ms and 0.1 ms.

    PYTHONPATH=. python bench/worker_transfer.py [--rows 4096] [--dim 384] [--reps 15]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time

import numpy as np

from ingest.embed.workers import raw_channel, recv_array_bytes, send_array


def _worker(conn, rows: int, dim: int) -> None:
    array = np.random.default_rng(0).random((rows, dim), dtype=np.float32)
    raw = raw_channel(conn)
    while True:
        way = conn.recv()
        if way is None:
            return
        if way == "pickled":
            conn.send(("ok", (array, 0.0)))  # the protocol before
        else:
            send_array(conn, raw, "ok", array, 0.0)


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))  # Python bytecode: holds the GIL until the interval asks for it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, args.rows, args.dim), daemon=True)
    proc.start()
    child.close()
    raw = raw_channel(conn)
    conn.send("raw")  # the worker's start, outside the timings
    _, (shape, dtype, _) = conn.recv()
    recv_array_bytes(raw, shape, dtype)
    mb = args.rows * args.dim * 4 / 1e6
    print(f"# {datetime.date.today()}; {platform.processor() or platform.machine()}; {os.cpu_count()} CPUs; "
          f"Python {platform.python_version()}; {args.rows} x {args.dim} float32 ({mb:.1f} MB) per call")
    print("| busy Python threads here | switch interval | pickled Connection.recv | raw recv(MSG_WAITALL) | speed-up |")
    print("|---|---|---|---|---|")
    saved = sys.getswitchinterval()
    for busy in (0, 2):
        for switch_ms in (5.0, 0.1):
            sys.setswitchinterval(switch_ms / 1000)
            stop = threading.Event()
            threads = [threading.Thread(target=_busy, args=(stop,)) for _ in range(busy)]
            for t in threads:
                t.start()
            medians = {}
            for way in ("pickled", "raw"):
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    conn.send(way)
                    _, value = conn.recv()
                    if way == "raw":
                        recv_array_bytes(raw, value[0], value[1])
                    times.append(time.perf_counter() - t0)
                medians[way] = statistics.median(times) * 1000
            stop.set()
            for t in threads:
                t.join()
            print(f"| {busy} | {switch_ms} ms | {medians['pickled']:.1f} ms | {medians['raw']:.1f} ms "
                  f"| {medians['pickled'] / medians['raw']:.1f}x |", flush=True)
    sys.setswitchinterval(saved)
    conn.send(None)
    proc.join(timeout=10)


if __name__ == "__main__":
    main()

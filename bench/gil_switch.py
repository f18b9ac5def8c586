"""The GIL convoy that an overlapped embed thread meets, and what a shorter switch interval buys.

A thread that runs many short torch ops (an embedder on a GPU: each op a ~10 µs launch that
releases the GIL and needs it back) beside a thread that runs Python (the ingest chunking and
writing): per switch interval, the ops thread's time for N ops beside the Python thread against
its time alone (the peer, same run), and the Python thread's speed meanwhile against its own alone.

    PYTHONPATH=. python bench/gil_switch.py                 # CUDA ops when a GPU is there, else CPU
    PYTHONPATH=. python bench/gil_switch.py --device cpu --ops 1000

rag/switch_interval.py sets OVERLAP_SWITCH_INTERVAL_MS while ingest overlaps embedding.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.machine import describe_machine  # noqa: E402
from rag.switch_interval import OVERLAP_SWITCH_INTERVAL_MS  # noqa: E402

OVERLAP = OVERLAP_SWITCH_INTERVAL_MS / 1000.0


def run_ops(x: torch.Tensor, n: int) -> float:
    started = time.perf_counter()
    y = x
    for _ in range(n):
        y = torch.tanh(y)
    if y.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def python_step() -> None:
    s = 0
    for i in range(1000):
        s += i * i


def python_rate(seconds: float = 1.0) -> float:
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        python_step()
        n += 1
    return n / (time.perf_counter() - started)


def main(args: argparse.Namespace) -> None:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    x = torch.randn(64, 64, device=device)
    run_ops(x, 100)  # warm-up
    alone_rate = python_rate()
    default = sys.getswitchinterval()
    print(f"# {datetime.date.today()}, {describe_machine(use_gpu=device == 'cuda')}; {args.ops} tanh ops on {device}")
    print()
    print("| switch interval | ops alone | ops beside a Python thread | slowdown | Python thread meanwhile |")
    print("|---|---|---|---|---|")
    for interval in sorted({default, 1e-3, 5e-4, 2e-4, OVERLAP, 5e-5}, reverse=True):
        sys.setswitchinterval(interval)
        alone = min(run_ops(x, args.ops) for _ in range(3))
        result: dict[str, float] = {}

        def timed(out: dict[str, float] = result) -> None:
            out["t"] = run_ops(x, args.ops)

        worker = threading.Thread(target=timed)
        started, steps = time.perf_counter(), 0
        worker.start()
        while worker.is_alive():
            python_step()
            steps += 1
        rate = steps / (time.perf_counter() - started)
        label = {default: " (default)", OVERLAP: " (ingest overlap)"}.get(interval, "")
        print(f"| {interval * 1e3:g} ms{label} | {alone * 1e3:.1f} ms | {result['t'] * 1e3:.1f} ms "
              f"| {result['t'] / alone:.1f}x | {rate / alone_rate:.2f} of alone |")
    sys.setswitchinterval(default)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--ops", type=int, default=1000)
    main(parser.parse_args())

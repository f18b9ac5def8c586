"""Worker processes that each run the embedder on one device: one per extra GPU, so several GPUs embed
one call, or every device, so the model's launches never wait for the GIL of the process that reads,
chunks and writes (`EmbedderConfig.in_worker`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import numpy as np

from ingest.embed.runner import RunnerSpec
from rag.errors import ModelError


def raw_channel(conn: Connection) -> socket.socket:
    """A socket on the connection's own socket pair (a duplex Pipe on POSIX), for raw array bytes."""
    return socket.socket(fileno=os.dup(conn.fileno()))


def send_array(conn: Connection, raw: socket.socket, tag: str, array: np.ndarray, extra: object = None) -> None:
    """Send (tag, (shape, dtype, extra)) as a message, then the array's bytes raw on the same socket."""
    array = np.ascontiguousarray(array)
    conn.send((tag, (array.shape, array.dtype.str, extra)))
    if array.nbytes:
        raw.sendall(memoryview(array).cast("B"))


def recv_array_bytes(raw: socket.socket, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The raw bytes that follow a `send_array` message, read straight into a new array.

    One `recv` with MSG_WAITALL blocks until all of them are there: the GIL is released and taken
    back once, not once per socket buffer (~200 kB) as `Connection.recv` reads. Beside busy Python
    threads each take-back can wait the whole switch interval (5 ms): with two of them, 4,096 x 384
    float32 vectors took 195 ms that way against 12.8 ms this way (2-core VM, bench/worker_transfer.py).

    Raises:
        EOFError: the other end closed before all the bytes came.
    """
    out = np.empty(shape, dtype=np.dtype(dtype))
    if not out.nbytes:
        return out
    view = memoryview(out).cast("B")
    got = 0
    while got < len(view):  # MSG_WAITALL can still return early on a signal
        n = raw.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise EOFError("the connection closed in the middle of an array")
        got += n
    return out


def _serve(spec: RunnerSpec, conn: Connection, tokenizer_threads: int) -> None:
    """A worker's life: build the runner, then embed each list of texts it is sent until told to stop."""
    # The Rust tokenizer of each process would otherwise start one thread per core; its pool
    # reads this on first use.
    os.environ.setdefault("RAYON_NUM_THREADS", str(tokenizer_threads))
    try:
        import torch

        from ingest.embed.runner import EncoderRunner

        if spec.device.startswith("cuda"):
            torch.cuda.set_device(spec.device)  # pinned buffers and streams belong to this GPU
        runner = EncoderRunner.from_spec(spec)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", runner.dim))
    raw = raw_channel(conn)
    while True:
        try:
            texts = conn.recv()
        except (EOFError, OSError):  # the process that started this one is gone
            return
        if texts is None:
            return
        try:
            started = time.perf_counter()
            vectors = runner.run(texts)
        except Exception as e:  # reported to the caller, which raises it; the worker lives on
            conn.send(("error", f"{type(e).__name__}: {e}"))
            continue
        try:
            send_array(conn, raw, "ok", vectors, time.perf_counter() - started)
        except OSError:  # the process that started this one is gone
            return


class EmbedWorkers:
    """One spawned process per spec, each holding its own copy of the model on its own device.

    Spawned, not forked: CUDA cannot be used in a forked child of a process that has touched it.
    Calls are not thread-safe; the embedder serializes them.
    """

    def __init__(self, specs: Sequence[RunnerSpec], wait: bool = True) -> None:
        """Start one process per spec.

        Args:
            wait: return once every worker has loaded its model (raising ModelError if one could
                not); False returns at once and the first `submit` waits (the caller reads or
                parses meanwhile).
        """
        ctx = mp.get_context("spawn")
        self._starting = False
        self.specs = list(specs)
        self.busy_seconds = 0.0  # spent inside the workers embedding what they were sent (all of them)
        self._conns: list[Connection] = []
        self._raws: list[socket.socket] = []  # the vectors' bytes come back on these (recv_array_bytes)
        self._procs: list[mp.process.BaseProcess] = []
        threads = max(1, (os.cpu_count() or 1) // (len(self.specs) + 1))  # this process tokenizes too
        for spec in self.specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(spec, child, threads), name=f"embed-{spec.device}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._raws.append(raw_channel(parent))
            self._procs.append(proc)
        self._starting = True
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every worker has its model loaded (at once when they have).

        Raises:
            ModelError: a worker could not load the model (the workers are stopped).
        """
        if not self._starting:
            return
        self._starting = False
        for i in range(len(self.specs)):
            kind, value = self._receive(i)
            if kind != "ready":
                self.close()
                raise ModelError(f"the embedding worker for {self.specs[i].device} failed to start: {value}")

    def __len__(self) -> int:
        return len(self.specs)

    def submit(self, i: int, texts: list[str]) -> None:
        """Send texts to worker i; collect the vectors with result(i)."""
        self.wait_ready()
        if not self._conns:
            raise ModelError("the embedding workers were stopped")
        try:
            self._conns[i].send(texts)
        except (OSError, ValueError) as e:  # its end of the pipe is gone: the process died
            raise ModelError(f"the embedding worker for {self.specs[i].device} died ({type(e).__name__}); "
                             "see its output above") from e

    def result(self, i: int) -> np.ndarray:
        """The vectors of the texts last submitted to worker i (blocks until they are ready).

        Raises:
            ModelError: the worker failed on them or died.
        """
        kind, value = self._receive(i)
        if kind != "ok":
            raise ModelError(f"the embedding worker for {self.specs[i].device} failed: {value}")
        shape, dtype, seconds = value  # type: ignore[misc]
        try:
            vectors = recv_array_bytes(self._raws[i], shape, dtype)
        except (EOFError, OSError) as e:
            raise ModelError(f"the embedding worker for {self.specs[i].device} died while sending its vectors "
                             f"({type(e).__name__}); see its output above") from e
        self.busy_seconds += seconds
        return vectors

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._starting = False
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):  # already gone
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        for conn in self._conns:
            conn.close()
        for raw in self._raws:
            raw.close()
        self._conns, self._raws, self._procs = [], [], []

    def _receive(self, i: int) -> tuple[str, object]:
        try:
            return self._conns[i].recv()
        except (EOFError, OSError) as e:
            return "error", f"the process died ({type(e).__name__}); see its output above"

"""Arrays back from an embed worker: a message, then the raw bytes read in one blocking receive."""

from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import pytest

from ingest.embed.workers import raw_channel, recv_array_bytes, send_array


def _echo(conn, rows: int) -> None:
    raw = raw_channel(conn)
    array = np.arange(rows * 384, dtype=np.float32).reshape(rows, 384)
    send_array(conn, raw, "ok", array, 1.5)
    if rows:  # then a message whose bytes never come
        conn.send(("ok", ((rows, 384), "<f4", 0.0)))
        raw.sendall(b"\x00" * 100)


@pytest.mark.parametrize("rows", [0, 1, 4096])  # 4,096 x 384 float32 is 6.3 MB, many socket buffers
def test_an_array_crosses_a_process_whole_and_a_short_one_is_an_error(rows):
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_echo, args=(child, rows))
    proc.start()
    child.close()
    raw = raw_channel(parent)
    try:
        kind, (shape, dtype, extra) = parent.recv()
        got = recv_array_bytes(raw, shape, dtype)
        assert (kind, extra, got.dtype, got.shape) == ("ok", 1.5, np.float32, (rows, 384))
        np.testing.assert_array_equal(got, np.arange(rows * 384, dtype=np.float32).reshape(rows, 384))
        if rows:
            _, (shape, dtype, _) = parent.recv()
            proc.join(timeout=30)  # the child is gone after 100 of the bytes
            with pytest.raises(EOFError, match="middle of an array"):
                recv_array_bytes(raw, shape, dtype)
    finally:
        proc.join(timeout=30)
        raw.close()
        parent.close()


def test_a_receive_beside_a_busy_python_thread_still_gets_every_byte():
    # The point of the raw read: one blocking receive however the GIL is contended.
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_echo, args=(child, 4096))
    proc.start()
    child.close()
    raw = raw_channel(parent)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=busy)
    spinner.start()
    try:
        _, (shape, dtype, _) = parent.recv()
        got = recv_array_bytes(raw, shape, dtype)
        assert got[-1, -1] == 4096 * 384 - 1
    finally:
        stop.set()
        spinner.join()
        proc.join(timeout=30)
        raw.close()
        parent.close()

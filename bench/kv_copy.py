"""The reused-chunk KV copy before a prefill: one Triton launch against the torch path and the roofline.

    PYTHONPATH=. python bench/kv_copy.py [--chunks 1,2,4,8] [--blocks-per-chunk 31] [--repeats 50]

With chunk KV reuse, a request that reuses a chunk cached elsewhere first copies the chunk's
blocks (every layer, K and V) into its own blocks, the keys re-rotated by the position delta.
That copy runs before the request's prefill and adds to its time to first token. Cache shape of
Llama-3.1-8B (32 layers, 8 KV heads of 128, blocks of 16, bf16); each chunk is a 512-token
chunk less its recomputed first block (31 blocks), with its own delta, as a request reusing
that many chunks copies them.

Rows, each the wall time of one call until the GPU has finished it (the copy is on the request's
critical path, host work included), median of --repeats:
- torch: `copy_blocks_rerotated`, the path before (the peer; it still serves CPUs);
- triton: `triton_kv_copy.copy_rerotate_blocks`, the engine's CUDA path now;
- memcpy: a contiguous device-to-device copy of the same bytes (what the GPU's copy engine
  reaches: a practical bound);
- roofline: the bytes read and written divided by the nominal HBM bandwidth (--bandwidth).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from machine import describe_machine  # noqa: E402

from generation.layers.rerotation import copy_blocks_rerotated  # noqa: E402
from generation.layers.rotary import rope_inv_freq  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def wall_ms(fn: Callable[[], None], repeats: int) -> float:
    """Median wall milliseconds of fn() until the device is idle again (after warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", default="1,2,4,8", help="reused chunks per request (comma-separated)")
    parser.add_argument("--blocks-per-chunk", type=int, default=31)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="nominal HBM bytes/s (H200: 4.8 TB/s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kv_copy.py needs a CUDA GPU (the torch path alone serves CPUs)")
    from generation.layers.triton_kv_copy import copy_rerotate_blocks

    layers, block_size, kv_heads, head_dim = 32, 16, 8, 128
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    most = max(chunk_counts) * args.blocks_per_chunk
    num_blocks = 2 * most + 16
    cache = torch.randn(layers, 2, num_blocks, block_size, kv_heads, head_dim, device="cuda").to(torch.bfloat16)
    inv_freq = rope_inv_freq(head_dim, 500000.0, LLAMA3_SCALING).cuda()
    block_bytes = layers * 2 * block_size * kv_heads * head_dim * cache.element_size()

    print(f"# reused-chunk KV copy, Llama-3.1-8B cache shape, bf16, {args.blocks_per_chunk} blocks a chunk, "
          f"{datetime.date.today()}, {describe_machine(True)}")
    print("| chunks | blocks | MB moved | torch ms | triton ms | torch / triton | memcpy ms | roofline ms "
          "| triton / roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for chunks in chunk_counts:
        copies = []
        for c in range(chunks):
            delta = 2_560 - 512 * c  # each chunk moved by its own delta, as in a request
            for b in range(args.blocks_per_chunk):
                src = c * args.blocks_per_chunk + b
                copies.append((src, most + src, delta))
        blocks = len(copies)
        moved = 2 * blocks * block_bytes  # read and written once
        span = blocks * block_bytes // cache.element_size()
        torch_ms = wall_ms(lambda c=copies: copy_blocks_rerotated(cache, c, inv_freq), args.repeats)
        triton_ms = wall_ms(lambda c=copies: copy_rerotate_blocks(cache, c, inv_freq), args.repeats)
        memcpy_ms = wall_ms(lambda s=span, f=cache.view(-1): f[s:2 * s].copy_(f[:s]), args.repeats)
        roof_ms = moved / args.bandwidth * 1e3
        print(f"| {chunks} | {blocks} | {moved / 1e6:,.0f} | {torch_ms:.3f} | {triton_ms:.3f} | "
              f"{torch_ms / triton_ms:.2f}x | {memcpy_ms:.3f} | {roof_ms:.3f} | {triton_ms / roof_ms:.2f}x |")


if __name__ == "__main__":
    main()

"""The fewest prompt tokens a KV reuse mode can compute over a request stream: bench/rag_kv_reuse.py's ideal.

A lower bound, not a model: no run of the engine, whatever its cache size, arrival times or batching,
computes fewer prompt tokens (`prompt_computed_tokens`) for the stream than `least_computed` says, so a
measured token speed-up is at most 100% of the ideal. It takes an unbounded cache, requests computed one
at a time in arrival order (each published before the next arrives: no miss for want of a step), every
exact prefix that any earlier prompt could have left (whole blocks, as the prefix cache keeps them), and,
where the mode's choice depends on the cache (the cache-aware source order, which missed chunk leads),
the best choice for each request. What it still charges are the mode's own rules:

  every mode     the question; the block holding a prompt's last token is never a hit (it gives logits).
  exact-*        a prompt's exact prefix is the longest run of its leading sources that an earlier
                 prompt also led with (in rank order, or in any order for exact-aware); the label after
                 that run is cached too (every earlier prompt with the same run had one there), and
                 everything after it is computed. The head and label [1] are cached after the first
                 request.
  chunks-*       the head ends with label [1] (the service's layout): the first source sits where its
                 chunk's canonical KV `head ‖ chunk` does, so a cached chunk there is an exact hit and
                 a missed one is computed once and publishes itself. Beyond the exact prefix (as above,
                 counted generously: as if no reused chunk had stopped its prompt's publishing) each
                 label is computed, each reused chunk recomputes its first block, and a chunk seen for
                 the first time is computed in full: in place ("in_place"), or compiled first and then
                 reused with its first block recomputed ("wait", `chunks`).
  chunks-inplace a chunk computed in place (not in the lead) has no canonical KV; it gets one at its
                 next retrieval, which computes it once more: as the lead, or in place with a compile
                 behind (its second miss, the chunk doorkeeper). A request leads with one chunk at most.
  -rank, -split  the order is the rank order (no choice); -split puts label [1] after the head, so no
                 source sits at its canonical position and every first miss is computed in place.
  chunks-split   "wait" in the -split layout (the bench's `chunks` before 50e9fdc, 2026-12-03).

A real run can only compute more: a smaller cache evicts, concurrent requests miss what an earlier one
is still computing, and an exact prefix stops at a reused chunk's second block (its copy is not
published). The one order a real run could take that the bound does not is a preempted request
readmitted after later ones, which recomputes everything it had computed: never a saving in practice.

    PYTHONPATH=. python bench/kv_reuse_bound.py --warmup 400 --seq-requests 60 --requests 120 \\
        --loads seq,offline,0.9x,1.25x --modes no-cache,exact-rank,chunks-inplace
        # the bound for the streams of an earlier run (its command's arguments), on a CPU
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

BOUND_MODES = ("no-cache", "exact-rank", "exact-aware", "chunks", "chunks-inplace", "chunks-inplace-rank",
               "chunks-inplace-anymiss", "chunks-inplace-split", "chunks-split")  # fmt: skip

# Decoding warm-up: the bench runs the last this many warm-up requests again with full answers.
KERNEL_WARMUP = 64


class StreamSizes(Protocol):
    head_tokens: int
    label_tokens: int
    chunk_tokens: int
    question_tokens: int
    sources: int


class StreamRequest(Protocol):
    chunk_ids: tuple[int, ...]  # rank order


@dataclass(frozen=True)
class Bound:
    """Prompt tokens of the stream, and the fewest of them any run of the mode computes."""

    prompt_tokens: int
    least_computed: int

    @property
    def ideal_speedup(self) -> float:
        return self.prompt_tokens / self.least_computed


def least_computed(sizes: StreamSizes, history: Sequence[StreamRequest], stream: Sequence[StreamRequest],
                   mode: str, block_size: int = 16) -> Bound:  # fmt: skip
    """The bound over `stream`, after `history` ran on the same engine (it fills the cache, is not counted).

    Args:
        sizes: token counts of the head, a label, a chunk and a question, and sources per request.
        history: what ran before, in order (warm-up, earlier loads).
        stream: the requests counted, in arrival order.
        mode: one of BOUND_MODES, or a bench mode with suffixes ("chunks-inplace+host").
        block_size: the engine's KV block size; the head, label and chunk must be whole blocks.

    Raises:
        ValueError: an unknown mode, or sizes that are not whole blocks.
    """
    mode = mode.split("+", 1)[0]
    if mode not in BOUND_MODES:
        raise ValueError(f"no bound for mode {mode!r}; valid: {', '.join(BOUND_MODES)}")
    for name in ("head_tokens", "label_tokens", "chunk_tokens"):
        if getattr(sizes, name) % block_size:
            raise ValueError(f"{name} = {getattr(sizes, name)} is not a multiple of the block size {block_size}")
    s = sizes
    prompt = s.head_tokens + s.sources * (s.label_tokens + s.chunk_tokens) + s.question_tokens
    total = prompt * len(stream)
    if mode == "no-cache":
        return Bound(total, total)
    requests = [*history, *stream]
    first = len(history)
    first_block = min(block_size, s.chunk_tokens)
    if mode == "exact-aware":
        overlap = _overlaps(requests)
        computed = sum(_exact_cost(s, overlap[i], i == 0) for i in range(first, len(requests)))
    elif mode == "exact-rank":
        run = _rank_runs(requests)
        computed = sum(_exact_cost(s, run[i], i == 0) for i in range(first, len(requests)))
    elif mode in ("chunks", "chunks-inplace", "chunks-inplace-anymiss"):
        computed = _free_lead_cost(s, requests, first, mode == "chunks", first_block)
    else:
        computed = _ranked_cost(s, requests, first, _rank_runs(requests), mode, first_block)
    return Bound(total, computed)


def _overlaps(requests: Sequence[StreamRequest]) -> list[int]:
    """Per request, the most chunks it shares with one earlier request.

    What the cache-aware order (any order of the sources) can put first at best: an exact prefix
    of n sources is n sources that an earlier prompt led with, in its order.
    """
    with_chunk: dict[int, list[int]] = defaultdict(list)
    out = []
    for i, req in enumerate(requests):
        shared = Counter(j for c in set(req.chunk_ids) for j in with_chunk[c])
        out.append(max(shared.values(), default=0))
        for c in set(req.chunk_ids):
            with_chunk[c].append(i)
    return out


def _longest_run(order: tuple[int, ...], prefixes: set[tuple[int, ...]]) -> int:
    d = 0
    while d < len(order) and order[: d + 1] in prefixes:
        d += 1
    return d


def _rank_runs(requests: Sequence[StreamRequest]) -> list[int]:
    """Per request, its longest leading run of sources in rank order that an earlier request led with too."""
    prefixes: set[tuple[int, ...]] = set()
    out = []
    for req in requests:
        out.append(_longest_run(req.chunk_ids, prefixes))
        prefixes.update(req.chunk_ids[: t + 1] for t in range(len(req.chunk_ids)))
    return out


def _lead_orders(req: StreamRequest) -> dict[int, tuple[int, ...]]:
    """The orders a chunk mode can give a request: one chunk first (`rag.source_order.lead_with`), the rest by rank."""
    return {c: (c, *(x for x in req.chunk_ids if x != c)) for c in req.chunk_ids}


def _lead_runs(requests: Sequence[StreamRequest]) -> list[dict[int, int]]:
    """Per request and choice of lead, the longest run of leading sources an earlier request can have led with.

    Any earlier request counts as having led with whichever of its chunks gives the longer run.
    """
    prefixes: set[tuple[int, ...]] = set()
    out = []
    for req in requests:
        orders = _lead_orders(req)
        out.append({c: _longest_run(order, prefixes) for c, order in orders.items()})
        prefixes.update(order[: t + 1] for order in orders.values() for t in range(len(order)))
    return out


def _labels(s: StreamSizes, covered: int) -> int:
    """Label tokens computed past an exact prefix of `covered` sources (the label after it is cached)."""
    return max(0, s.sources - 1 - covered) * s.label_tokens


def _exact_cost(s: StreamSizes, covered: int, first_ever: bool) -> int:
    head = s.head_tokens + s.label_tokens if first_ever else 0
    return head + (s.sources - covered) * s.chunk_tokens + _labels(s, covered) + s.question_tokens


def _first_seen(requests: Sequence[StreamRequest]) -> tuple[list[set[int]], list[dict[int, int]]]:
    """Per request: the chunks retrieved there for the first time, and each of those chunks' next retrieval."""
    new: list[set[int]] = []
    last_seen: dict[int, int] = {}
    following: list[dict[int, int]] = [{} for _ in requests]
    for i, req in enumerate(requests):
        new.append({c for c in req.chunk_ids if c not in last_seen})
        for c in req.chunk_ids:
            if c in last_seen:
                following[last_seen[c]].setdefault(c, i)
            last_seen[c] = i
    nxt = [{c: following[i][c] for c in new[i] if c in following[i]} for i in range(len(requests))]
    return new, nxt


def _free_lead_cost(s: StreamSizes, requests: Sequence[StreamRequest], first: int, wait: bool,
                    first_block: int) -> int:  # fmt: skip
    """chunks / chunks-inplace / -anymiss: the engine chooses the lead, so each request takes its best lead.

    Charged per request: the question, labels and first blocks past its exact prefix, and each chunk
    seen for the first time in full. "wait" adds that chunk's first block where it is not the lead
    (compiled, then reused). "in_place" adds the chunk once more where it is not the lead and is
    retrieved again within the stream (its next retrieval computes it again, as the lead or in place
    with a compile behind): charged here, so each request's choice of lead stays its own. A request
    in the history charges what its choice costs the stream: of its first-seen chunks retrieved next
    inside the stream, all but the one it leads with.
    """
    k, ct = s.sources, s.chunk_tokens
    new, nxt = _first_seen(requests)
    runs = _lead_runs(requests)
    computed = 0
    for i in range(len(requests)):
        again = [c for c in new[i] if nxt[i].get(c, -1) >= first]
        if i < first:
            computed += 0 if wait else max(0, len(again) - 1) * ct
            continue
        fresh = len(new[i])
        extra = fresh * first_block if wait else len(again) * ct
        head = s.head_tokens + s.label_tokens if i == 0 else 0
        options = []
        if fresh < k:  # lead with a chunk seen before (an exact hit), as far as an exact prefix reaches
            d = max(d for c, d in runs[i].items() if c not in new[i])
            options.append(_labels(s, d) + (k - max(d, 1) - fresh) * first_block + fresh * ct + extra)
        if fresh:  # lead with a new chunk: it publishes itself (no first block, no second computation)
            saved = first_block if wait else (ct if again else 0)
            options.append(_labels(s, 0) + (k - fresh) * first_block + fresh * ct + extra - saved)
        computed += head + min(options) + s.question_tokens
    return computed


def _ranked_cost(s: StreamSizes, requests: Sequence[StreamRequest], first: int, run: list[int], mode: str,
                 first_block: int) -> int:  # fmt: skip
    """chunks-inplace-rank, chunks-inplace-split, chunks-split: rank order, so each chunk's state is determined.

    A chunk is new, "once" (computed in place, no canonical KV, one miss counted) or canonical.
    """
    ct = s.chunk_tokens
    split = mode != "chunks-inplace-rank"
    wait = mode == "chunks-split"
    canonical: set[int] = set()
    once: set[int] = set()
    computed = 0
    for i, req in enumerate(requests):
        d = run[i]
        cost = (s.head_tokens + s.label_tokens if i == 0 else 0) + _labels(s, d) + s.question_tokens
        for j, c in enumerate(req.chunk_ids):
            if j == 0 and not split:  # the lead: an exact hit when canonical, else computed and published
                cost += 0 if c in canonical else ct
                canonical.add(c)
                once.discard(c)
            elif c in canonical:
                cost += 0 if j < d else first_block
            elif c in once:  # its second miss: a compile behind, and computed in place unless exact
                cost += ct + (0 if j < d else ct)
                canonical.add(c)
                once.discard(c)
            elif wait:  # compiled first, then reused
                cost += ct + (0 if j < d else first_block)
                canonical.add(c)
            else:
                cost += ct
                once.add(c)
        if i >= first:
            computed += cost
    return computed


def main() -> None:
    ap = argparse.ArgumentParser(description="The bound for the streams of a bench/rag_kv_reuse.py command")
    ap.add_argument("--modes", default="no-cache,exact-rank,exact-aware,chunks,chunks-inplace")
    ap.add_argument("--loads", default="seq,offline,0.5x,0.9x", help="the command's loads, rates spelled out")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--seq-requests", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=400)
    ap.add_argument("--slo-probes", type=int, default=0, help="probes of an slo load (its streams' count)")
    ap.add_argument("--dry-run", action="store_true", help="the dry run's sizes")
    args = ap.parse_args()
    from bench.rag_kv_reuse import DRY, ISSUE, Corpus, history_of, load_streams

    sizes = DRY if args.dry_run else ISSUE
    corpus = Corpus(sizes, 1024 if args.dry_run else 128256)
    loads = [x for x in args.loads.split(",") if x]
    warm_stream = corpus.requests(args.warmup)
    streams = load_streams(corpus, loads, args.requests, args.seq_requests, args.slo_probes)
    print("| mode | load | requests | prompt tokens | least computed | ideal speed-up |\n|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for load, stream in streams.items():
            b = least_computed(sizes, history_of(warm_stream, streams, load), stream, mode)
            print(f"| {mode} | {load} | {len(stream)} | {b.prompt_tokens} | {b.least_computed} | "
                  f"{b.ideal_speedup:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()

"""Which source order shares the longest prompt prefixes: rank, (document, chunk) sort, or cache-aware.

A simulation, not a timing: the sample questions (`examples/questions.jsonl`, each asked by its
user) are retrieved over the sample corpus exactly as `Rag.prepare` does, then replayed in file
order and in shuffled orders against an exact-prefix cache of unlimited size. For each order
policy it prints the share of source tokens that an earlier prompt of the same cache domain had
already computed, in the two domains a deployment has:

- "per user": a remote server with `cache_salt = user` (the default), one salt per request;
- "shared": the local engine (sources shared by ACL) or a remote server with `cache_salt = off`.

`cache-aware` is `rag.source_order.order_for_reuse` with the simulated cache as its probe (what
the local engine does); the others are what a generator without cache information can do.

Usage: python bench/rag_source_order.py [--home DIR] [--shuffles N]
(the first run ingests the sample corpus into DIR, converting the models: a few minutes on CPU).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def retrieved_sources(home: Path) -> tuple[list[tuple[str, list]], Callable[[str], int]]:
    """(user, the sources Rag.prepare would put in the prompt, best first) per sample question."""
    from permissions.models import Principal
    from rag.pipeline import Rag
    from rag.prompts import select_sources
    from rag.settings import load_settings

    rag = Rag(load_settings(home=home))
    questions = [json.loads(line) for line in (REPO / "examples/questions.jsonl").read_text().splitlines() if line]
    if not (home / ".ingested").exists():
        corpus = home / "lab-docs"
        shutil.rmtree(corpus, ignore_errors=True)
        shutil.copytree(REPO / "examples/lab-docs", corpus)
        report = rag.ingest([corpus])
        assert report.ok, report.problems
        (home / ".ingested").write_text("ok")
    from transformers import AutoTokenizer

    from generation.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None, home / "models")))
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    out = []
    for q in questions:
        principal = Principal(q["user"], frozenset(q.get("groups", [])))
        prepared = rag.prepare(q["question"], principal, generate=False)
        hits = prepared.answer.hits
        floor = rag.settings.min_rerank_score
        if rag.settings.rerank and floor is not None:
            hits = [h for h in hits if h.score >= floor]
        if hits:
            out.append((q["user"], select_sources(hits, count, rag.settings.context_tokens)))
    rag.close()
    return out, count


class PrefixCache:
    """Source sequences of earlier prompts per cache domain; a prompt reuses its longest common prefix."""

    def __init__(self, length: Callable) -> None:
        self.seen: dict[str, list[tuple[int, ...]]] = {}
        self.length = length

    def reused(self, domain: str, order: Sequence) -> tuple[int, tuple[int, ...]]:
        """Tokens of `order`'s leading sources computed before in `domain`, and each source's end."""
        from itertools import accumulate

        ids = tuple(h.chunk_id for h in order)
        ends = tuple(accumulate(self.length(h) for h in order))
        best = 0
        for seen in self.seen.get(domain, ()):
            n = 0
            while n < min(len(seen), len(ids)) and seen[n] == ids[n]:
                n += 1
            best = max(best, n)
        return (ends[best - 1] if best else 0), ends

    def add(self, domain: str, order: Sequence) -> None:
        self.seen.setdefault(domain, []).append(tuple(h.chunk_id for h in order))


def replay(requests, policy: str, per_user: bool, length: Callable) -> float:
    from rag.generator import CachedPrefix
    from rag.prompts import canonical_order
    from rag.source_order import order_for_reuse

    cache = PrefixCache(length)
    reused = total = 0
    for user, ranked in requests:
        domain = user if per_user else "all"
        if policy == "rank":
            order = list(ranked)
        elif policy == "canonical":
            order = canonical_order(ranked)
        else:  # cache-aware: ties by rank, or by the (document, chunk) sort
            base = list(ranked) if policy == "cache-aware" else canonical_order(ranked)
            order = order_for_reuse(base, lambda o, d=domain: CachedPrefix(*cache.reused(d, o)))
        hit, ends = cache.reused(domain, order)
        reused += hit
        total += ends[-1]
        cache.add(domain, order)
    return reused / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path("/tmp/rag-source-order"),
                        help="data directory for the ingested sample corpus (reused between runs)")
    parser.add_argument("--shuffles", type=int, default=50, help="random question orders to average over")
    args = parser.parse_args()
    requests, count = retrieved_sources(args.home)
    from rag.prompts import source_label, source_text

    length = lambda h: count(source_label(1) + source_text(h))  # noqa: E731
    rng = random.Random(0)
    shuffled = [rng.sample(requests, len(requests)) for _ in range(args.shuffles)]
    print(f"# {len(requests)} sample questions with sources, {date.today()}; share of source tokens reused")
    print(f"{'policy':<28} {'per user':>9} {'shared':>8} {'per user (shuffled)':>20} {'shared (shuffled)':>18}")
    results = {}
    for policy in ("rank", "canonical", "cache-aware", "cache-aware, ties canonical"):
        row = [replay(requests, policy, per_user, length) for per_user in (True, False)]
        row += [sum(replay(s, policy, per_user, length) for s in shuffled) / len(shuffled)
                for per_user in (True, False)]
        results[policy] = row
        print(f"{policy:<28} {row[0]:>9.3f} {row[1]:>8.3f} {row[2]:>20.3f} {row[3]:>18.3f}")
    for i, name in enumerate(("per user", "shared", "per user shuffled", "shared shuffled")):
        base = results["canonical"][i]
        print(f"ratio rank/canonical, {name}: {results['rank'][i] / base if base else float('nan'):.2f}; "
              f"cache-aware/canonical: {results['cache-aware'][i] / base if base else float('nan'):.2f}")


if __name__ == "__main__":
    main()

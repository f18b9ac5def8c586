"""What position-independent chunk KV reuse costs in answer quality: SmolLM2 on CPU, against full prefill.

For each question the prompt is laid out as segments (KV-REUSE.md B1): a block-padded head (chat
template, system prompt, "Sources:"), then per source a label "[k] " and the chunk text, each
padded to a KV block boundary, then the question and the template's tail. Every condition runs
the same token ids:

    full          full prefill, no prefix cache (the reference)
    exact         kv_reuse="exact": prefix-cache hits of earlier prompts (head, shared leading sources)
    first_block   kv_reuse="chunks", each reused chunk's first block recomputed (MEPIC/EPIC)
    frac=F        kv_reuse="chunks", each reused chunk's leading fraction F recomputed

and, through the dense slow reference (generation/reference/chunk_blend.py, not the engine):

    ref full            no reuse: checks the dense reference against the engine's full prefill
    ref first_block     the engine's first-block rule rebuilt by hand: checks the "chunks" path
    blend k r=R         CacheBlend selection (LMCache's rule): every token is computed at layer 0;
                        at layer 1 each reused chunk token's squared L2 distance between its fresh
                        key and the canonical (reused) key is taken, and from layer 1 on only the
                        top R of the prompt's reused tokens are recomputed, the rest keep reused KV
    blend v r=R         the same on values (the CacheBlend prototype's choice)
    blend+fb k r=R      every reused chunk's first block recomputed, plus the top R of the rest

Label [1] ends the head, as in the service's layout, so the first source sits where its chunk's
canonical KV `head ‖ chunk` does (an exact prefix, or computed as that KV when missed), and every
other chunk lands after a label: in "chunks" mode it is reused at a shifted position.
`--split-label` puts label [1] after the head as the other labels (the layout before 2026-12-03):
then every chunk is reused at a shifted position. Reported per condition and set:
greedy agreement with full prefill (whole answer equal; mean matching-prefix length, where an
answer that stops early counts up to its end), KL(p_full ‖
p_cond) of the next-token distribution at the first answer token, top-1 agreement there, and
correctness (the expected string in the answer, case-insensitive). Reference rows also report
the share of token-layers after the head that are computed (full prefill = 1).

Two sets: the sample questions of examples/questions.jsonl (sources: paragraphs of the readable
relevant documents, ranked by word overlap, the one holding the expected answer included), and a
synthetic multi-source set (several facility records of the same shape, the answer in one, in
shuffled orders so that each chunk is reused at many positions).

    python bench/kv_reuse_quality.py [--max-tokens 24] [--sources 4] [--limit N] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from generation.config import EngineConfig  # noqa: E402
from generation.engine.blend_selection import DeviationSelection  # noqa: E402
from generation.engine.chunk_reuse import ChunkRecompute  # noqa: E402
from generation.engine.llm_engine import LLMEngine  # noqa: E402
from generation.engine.prompt_segments import PromptSegment, prompt_token_ids  # noqa: E402
from generation.engine.sequence import SequenceStatus  # noqa: E402
from generation.loader import resolve_model_dir  # noqa: E402
from generation.reference.chunk_blend import (  # noqa: E402
    CanonicalKV,
    RecomputeRule,
    blended_prefill,
    dense_layers,
    greedy_continue,
    reusable_ranges,
)
from generation.sampling_params import SamplingParams  # noqa: E402

SYSTEM = "Answer the question using only the numbered sources. Be brief and cite sources as [n]."
DOCS = ROOT / "examples" / "lab-docs"
WORD = re.compile(r"[a-z0-9]+")


@dataclass
class Item:
    question: str
    sources: list[tuple[str, str]]  # (title, text)
    expect: str | None


# --------------------------------------------------------------------------------------------------
# The two question sets
# --------------------------------------------------------------------------------------------------


def _doc_paragraphs(ref: str) -> list[tuple[str, str]]:
    """(title, paragraph) of a readable example document; [] for pdf/docx (they need the ingest parser)."""
    path, _, record = ref.partition("#")
    file = DOCS / path
    if not file.is_file() or file.suffix in (".pdf", ".docx"):
        return []
    if file.suffix == ".jsonl":
        out = []
        for line in file.read_text().splitlines():
            row = json.loads(line)
            if not record or row.get("id") == record:
                out.append((row.get("title", path), row["text"]))
        return out
    text = file.read_text()
    if file.suffix == ".html":
        text = re.sub(r"<[^>]+>", " ", text)
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return [(path, p[:900]) for p in paragraphs if len(p) > 40]


def _overlap(question: str, text: str) -> int:
    return len(set(WORD.findall(question.lower())) & set(WORD.findall(text.lower())))


def sample_items(num_sources: int) -> list[Item]:
    """examples/questions.jsonl questions that have an expected answer in a readable relevant document."""
    items = []
    for line in (ROOT / "examples" / "questions.jsonl").read_text().splitlines():
        q = json.loads(line)
        expect = q.get("expect_contains")
        if not expect:
            continue
        candidates = [p for ref in q["relevant"] for p in _doc_paragraphs(ref)]
        answer = [p for p in candidates if expect.lower() in p[1].lower()]
        if not answer:
            continue
        rest = sorted((p for p in candidates if p not in answer), key=lambda p: -_overlap(q["question"], p[1]))
        sources = [answer[0], *rest[: num_sources - 1]]
        random.Random(q["question"] + q["user"]).shuffle(sources)
        items.append(Item(q["question"], sources, expect))
    return items


_FACILITIES = ["Kestrel", "Osprey", "Heron", "Plover", "Merlin", "Avocet", "Dunlin", "Curlew", "Godwit", "Shrike"]
_BUILDINGS = ["North Hall", "Building 7", "the Annex", "Lab Wing C", "Building 12"]
_GIVEN = ["Ana", "Ben", "Chen", "Dara", "Emil", "Farah"]
_FAMILY = ["Ito", "Novak", "Okafor", "Silva"]


def synthetic_items(num_sources: int, count: int = 20) -> list[Item]:
    """Facility records of one shape with different values; each question's answer is in one of them."""
    rng = random.Random(16)
    records = {}
    for i, name in enumerate(_FACILITIES):
        facts = {
            "building": _BUILDINGS[i % len(_BUILDINGS)],
            "quota": f"{rng.randint(10, 99)} TB",
            "contact": f"{rng.choice(_GIVEN)} {rng.choice(_FAMILY)}",
            "hours": f"{rng.randint(6, 9)}:00 to {rng.randint(17, 22)}:00",
        }
        text = (
            f"The {name} facility is in {facts['building']}. Its shared storage quota is {facts['quota']}, "
            f"and its contact person is {facts['contact']}. Staffed hours are {facts['hours']} on weekdays; "
            f"outside those hours, jobs on {name} run unattended and tickets are answered the next morning."
        )
        records[name] = (f"{name} facility record", text, facts)
    questions = {
        "quota": "What is the shared storage quota of the {} facility?",
        "contact": "Who is the contact person for the {} facility?",
        "building": "In which building is the {} facility?",
        "hours": "What are the staffed hours of the {} facility?",
    }
    items = []
    for _ in range(count):
        names = rng.sample(_FACILITIES, num_sources)
        target, fact = names[0], rng.choice(list(questions))
        rng.shuffle(names)
        sources = [records[n][:2] for n in names]
        items.append(Item(questions[fact].format(target), sources, records[target][2][fact]))
    return items


# --------------------------------------------------------------------------------------------------
# Layout and the engine drive
# --------------------------------------------------------------------------------------------------


class Layout:
    """Segments of a RAG prompt for one tokenizer and block size (KV-REUSE.md B1)."""

    def __init__(self, tokenizer, block_size: int, split_label: bool = False) -> None:  # noqa: ANN001
        self.tok, self.block_size, self.split_label = tokenizer, block_size, split_label
        marker = "\u2063CONTENT\u2063"
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": marker}],
            tokenize=False,
            add_generation_prompt=True,
        )
        self.before, self.after = text.split(marker)
        self.pad = self._ids("\n")[0]

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def _padded(self, ids: list[int]) -> list[int]:
        return ids + [self.pad] * (-len(ids) % self.block_size)

    def segments(self, item: Item, user: str) -> list[PromptSegment]:
        head_ids = self._padded(self._ids(self.before + "Sources:\n\n"))
        if not self.split_label:  # label 1 ends the head, as the service lays it out (rag.prompt_layout)
            head_ids += self._padded(self._ids("[1] "))
        out = [PromptSegment.of("head", head_ids, "system")]
        for k, (title, text) in enumerate(item.sources, 1):
            if k > 1 or self.split_label:
                out.append(PromptSegment.of("label", self._padded(self._ids(f"[{k}] ")), f"user:{user}"))
            out.append(PromptSegment.of("chunk", self._padded(self._ids(f"{title}\n{text}\n\n")), "acl:docs"))
        out.append(PromptSegment.of("suffix", self._ids(f"Question: {item.question}" + self.after), f"user:{user}"))
        return out


def greedy_with_first_logits(
    engine: LLMEngine, segments: list[PromptSegment], max_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the fp32 logits at the first answer token, driving scheduler and runner directly."""
    rid = engine.add_segmented_request(segments, SamplingParams(max_tokens=max_tokens))
    first: torch.Tensor | None = None
    target = engine._requests[rid].seq
    while target.status is not SequenceStatus.FINISHED:
        batch = engine.scheduler.schedule()
        logits = engine.model_runner.compute_logits(batch)
        sampled = {}
        for row, entry in enumerate(batch.sampling_entries):
            token = int(logits[row].argmax())
            sampled[entry.seq.seq_id] = [token]
            if entry.seq is target and first is None:
                first = logits[row].clone()
            entry.seq.finished = token in engine.eos_token_ids or entry.seq is not target
        engine.scheduler.postprocess(batch, sampled)
    for seq_id in [i for i, r in engine._requests.items() if r.seq.status is SequenceStatus.FINISHED]:
        del engine._requests[seq_id]
    engine._compiles.clear()
    assert first is not None
    return target.output_token_ids, first


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------

CONDITIONS: dict[str, dict] = {
    "full": {"enable_prefix_caching": False},
    "exact": {},
    # chunk_miss="wait": every chunk is compiled first and reused, so each condition measures the
    # approximation on every chunk ("in_place" computes a chunk's first two sightings exactly).
    "first_block": {"kv_reuse": "chunks", "chunk_miss": "wait"},
    "frac=0.15": {"kv_reuse": "chunks", "chunk_miss": "wait", "chunk_recompute": "fraction",
                  "chunk_recompute_fraction": 0.15},
    "frac=0.5": {"kv_reuse": "chunks", "chunk_miss": "wait", "chunk_recompute": "fraction",
                 "chunk_recompute_fraction": 0.5},
}

# Conditions computed by the dense reference (see the module doc); compared with the engine's full prefill.
REFERENCE_CONDITIONS: dict[str, RecomputeRule] = {
    "ref full": None,
    "ref first_block": ChunkRecompute("first_block"),
    "blend k r=0.15": DeviationSelection(ratio=0.15),
    "blend k r=0.3": DeviationSelection(ratio=0.3),
    "blend k r=0.5": DeviationSelection(ratio=0.5),
    "blend v r=0.15": DeviationSelection(ratio=0.15, deviation_of="v"),
    "blend+fb k r=0.15": DeviationSelection(ratio=0.15, keep_first_block=True),
}


def reference_answer(
    engine: LLMEngine,
    segments: list[PromptSegment],
    block_size: int,
    rule: RecomputeRule,
    canonical: CanonicalKV,
    max_tokens: int,
) -> tuple[list[int], torch.Tensor, float]:
    """Greedy tokens, first-token fp32 logits and the computed share under the dense reference (engine's weights)."""
    model = engine.model_runner.model
    prefill = blended_prefill(model, segments, block_size, rule, canonical)
    tokens = greedy_continue(model, prefill, max_tokens, engine.eos_token_ids)
    return tokens, prefill.logits, prefill.computed_share()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=24, help="greedy answer length compared (default 24)")
    parser.add_argument("--sources", type=int, default=4, help="sources per prompt (default 4)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many questions per set")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path.home() / ".cache" / "labrag-bench",
        help="where the packaged SmolLM2 GGUF is converted once (default ~/.cache/labrag-bench)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also append the per-question rows here")
    parser.add_argument("--split-label", action="store_true",
                        help="label [1] its own segment after the head (the layout before 2026-12-03), so that "
                             "no source sits where its chunk's canonical KV does")  # fmt: skip
    parser.add_argument("--only", nargs="*", default=None, help="run only these conditions (full always runs)")
    parser.add_argument("--sets", nargs="*", default=None, help="run only these question sets (sample, multi-source)")
    parser.add_argument(
        "--deviation-profile", action="store_true",
        help="instead of the conditions: how concentrated the reused KV's deviation from full prefill is",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None, args.cache_dir)
    sets = {"sample": sample_items(args.sources), "multi-source": synthetic_items(args.sources)}
    if args.sets:
        sets = {k: v for k, v in sets.items() if k in args.sets}
    if args.limit:
        sets = {k: v[: args.limit] for k, v in sets.items()}
    if args.deviation_profile:
        deviation_profile(model_dir, sets, args.block_size)
        return
    started = time.monotonic()
    engine_conditions = {k: v for k, v in CONDITIONS.items() if k == "full" or args.only is None or k in args.only}
    reference_conditions = {k: v for k, v in REFERENCE_CONDITIONS.items() if args.only is None or k in args.only}
    engines = {
        name: LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32", block_size=args.block_size,
                                                 num_kv_blocks=768, max_model_len=2048, **kw))
        for name, kw in engine_conditions.items()
    }  # fmt: skip
    canonical = CanonicalKV(engines["full"].model_runner.model)
    layout = Layout(engines["full"].tokenizer, args.block_size, args.split_label)
    rows = []
    for set_name, items in sets.items():
        for i, item in enumerate(items):
            segments = layout.segments(item, user=f"u{i % 3}")
            ref_tokens, ref_logits = greedy_with_first_logits(engines["full"], segments, args.max_tokens)
            tokenizer = engines["full"].tokenizer
            runs = [(name, engine, None) for name, engine in engines.items()]
            runs += [(name, None, rule) for name, rule in reference_conditions.items()]
            for name, engine, rule in runs:
                share = None
                if name == "full":
                    tokens, logits = ref_tokens, ref_logits
                elif engine is not None:
                    tokens, logits = greedy_with_first_logits(engine, segments, args.max_tokens)
                else:
                    tokens, logits, share = reference_answer(
                        engines["full"], segments, args.block_size, rule, canonical, args.max_tokens
                    )
                answer = tokenizer.decode(tokens, skip_special_tokens=True)
                rows.append({
                    "set": set_name, "item": i, "question": item.question, "condition": name,
                    "prompt_tokens": sum(len(s.token_ids) for s in segments),
                    "same": tokens == ref_tokens, "prefix": matching_prefix(tokens, ref_tokens),
                    "kl": kl(ref_logits, logits), "top1": int(logits.argmax()) == int(ref_logits.argmax()),
                    "computed": share, "logits": logits,
                    "correct": item.expect is not None and item.expect.lower() in answer.lower(),
                    "answer": answer,
                })  # fmt: skip
            if args.json:  # per question, so that a long run interrupted keeps what it measured
                with args.json.open("a") as out:
                    for r in rows[-len(runs) :]:
                        out.write(json.dumps({k: v for k, v in r.items() if k != "logits"}) + "\n")
            progress = f"{set_name} {i + 1}/{len(items)} done at {time.monotonic() - started:.0f} s"
            print(progress, file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started
    cpu = platform.processor() or platform.machine()
    print(f"# Chunk KV reuse quality: SmolLM2 ({model_dir.name}), CPU fp32, {cpu}, {datetime.date.today()}, "
          f"{args.sources} sources, {args.max_tokens} greedy tokens, {elapsed:.0f} s")  # fmt: skip
    for set_name, items in sets.items():
        n = len(items)
        prompt = sum(r["prompt_tokens"] for r in rows if r["set"] == set_name and r["condition"] == "full") / max(n, 1)
        print(f"\n{set_name}: {n} questions, mean prompt {prompt:.0f} tokens")
        print("| condition | greedy = full | mean matching prefix | mean KL first token | max KL | top-1 = full "
              "| correct | computed |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for name in [*engine_conditions, *reference_conditions]:
            rs = [r for r in rows if r["set"] == set_name and r["condition"] == name]
            if not rs:
                continue
            mean_kl = sum(r["kl"] for r in rs) / len(rs)
            shares = [r["computed"] for r in rs if r["computed"] is not None]
            computed = f"{sum(shares) / len(shares):.2f}" if shares else "-"
            print(f"| {name} | {sum(r['same'] for r in rs)}/{len(rs)} | {sum(r['prefix'] for r in rs) / len(rs):.1f}"
                  f" / {args.max_tokens} | {mean_kl:.2e} | {max(r['kl'] for r in rs):.2e} | "
                  f"{sum(r['top1'] for r in rs)}/{len(rs)} | {sum(r['correct'] for r in rs)}/{len(rs)} "
                  f"| {computed} |")  # fmt: skip
        _print_checks(rows, set_name)
    for name in engine_conditions:
        engine = engines[name]
        m = engine.get_metrics()
        print(f"\n{name}: computed prompt tokens {m.prompt_computed_tokens}, prefix hits {m.prefix_cache_hit_tokens}, "
              f"chunk-reused {m.chunk_reused_tokens}, chunk hits/misses {m.chunk_cache_hits}/{m.chunk_cache_misses}",
              end="")  # fmt: skip
    print()


def deviation_profile(model_dir: Path, sets: dict[str, list[Item]], block_size: int, ratio: float = 0.15) -> None:
    """CacheBlend's premise on this model: is the reused KV's deviation concentrated, and does layer 1 find it?

    Per prompt, every reused chunk token's squared L2 distance between its canonical key (the
    chunk compiled after the head) and its full-prefill key, per layer, with nothing recomputed.
    Reported, averaged over the prompts: the share of the total deviation that the top `ratio`
    of the tokens hold (at layer 1, and summed over all layers); how many of layer 1's top tokens
    are among the all-layer top ones (what a layer-1 check can find); how many of the all-layer
    top tokens sit in a chunk's first block (what first-block recompute covers), beside the first
    blocks' share of the reused tokens; and the key's relative deviation at the first and last layers.
    """
    config = EngineConfig(device="cpu", dtype="float32", block_size=block_size, num_kv_blocks=256,
                          max_model_len=2048, enable_prefix_caching=False)  # fmt: skip
    engine = LLMEngine(model_dir, config)
    layout = Layout(engine.tokenizer, block_size)
    canonical = CanonicalKV(engine.model_runner.model)
    print(f"# Reused-key deviation profile: SmolLM2 ({model_dir.name}), CPU fp32, {datetime.date.today()}, "
          f"top {ratio:.0%}")  # fmt: skip
    print("| set | prompts | reused tokens | top share L1 | top share all layers | L1 top in all-layer top "
          "| all-layer top in first blocks (first blocks' share) | rel. deviation L1 / last |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for set_name, items in sets.items():
        stats = [
            _deviation_stats(canonical, layout.segments(item, user=f"u{i % 3}"), block_size, ratio)
            for i, item in enumerate(items)
        ]
        m = [sum(col) / len(stats) for col in zip(*stats, strict=True)]
        print(f"| {set_name} | {len(stats)} | {m[0]:.0f} | {m[1]:.2f} | {m[2]:.2f} | {m[3]:.2f} | "
              f"{m[4]:.2f} ({m[5]:.2f}) | {m[6]:.3f} / {m[7]:.3f} |")  # fmt: skip


@torch.no_grad()
def _deviation_stats(
    canonical: CanonicalKV, segments: list[PromptSegment], block_size: int, ratio: float
) -> tuple[float, ...]:
    """One prompt's row of deviation_profile (see there)."""
    _, full = dense_layers(canonical.model, prompt_token_ids(segments), with_logits=False)
    ranges = reusable_ranges(segments, block_size)
    positions = torch.tensor([p for _, start, end in ranges for p in range(start, end)])
    first = torch.tensor([p - start < block_size for _, start, end in ranges for p in range(start, end)])
    per_layer = []
    for layer, (k, _) in enumerate(full):
        reused = torch.cat(
            [canonical.rows(segments[0], segments[j])[layer][0][: end - start] for j, start, end in ranges]
        )
        per_layer.append((k[positions] - reused).pow(2).sum((-2, -1)))
    dev = torch.stack(per_layer)  # [layers, reused tokens]
    n = max(1, int(ratio * dev.shape[1]))
    top1, top_all = dev[1].topk(n).indices, dev.sum(0).topk(n).indices
    share_1 = float(dev[1].topk(n).values.sum() / dev[1].sum())
    share_all = float(dev.sum(0).topk(n).values.sum() / dev.sum())
    found = len(set(top1.tolist()) & set(top_all.tolist())) / n
    rel = [float(dev[i].sum().sqrt() / full[i][0][positions].pow(2).sum().sqrt()) for i in (1, len(full) - 1)]
    return (dev.shape[1], share_1, share_all, found, float(first[top_all].float().mean()),
            float(first.float().mean()), *rel)  # fmt: skip


def _print_checks(rows: list[dict], set_name: str) -> None:
    """How far each engine path is from its dense reference: the max |logit difference| at the first token."""
    pairs = [("full", "ref full"), ("first_block", "ref first_block")]
    by = {(r["item"], r["condition"]): r for r in rows if r["set"] == set_name}
    for engine_name, ref_name in pairs:
        diffs = [
            float((by[(i, engine_name)]["logits"] - r["logits"]).abs().max())
            for (i, name), r in by.items()
            if name == ref_name and (i, engine_name) in by
        ]
        if diffs:
            print(f"check: engine {engine_name} vs {ref_name}: max |logit diff| at the first token {max(diffs):.1e} "
                  f"over {len(diffs)} questions")  # fmt: skip


if __name__ == "__main__":
    main()

"""Batched chunking (counts from `Chunker.precount`) makes exactly the chunks of the one-at-a-time path."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest

from ingest.chunk import Chunker, ChunkingConfig
from ingest.parse import parse_item
from ingest.pipeline import IngestPipeline
from ingest.sources import SourceItem, walk_sources
from rag.types import Chunk, Document, Element
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection

LAB_DOCS = Path(__file__).resolve().parents[2] / "examples" / "lab-docs"
CONFIGS = [ChunkingConfig(), ChunkingConfig(max_tokens=48, overlap_tokens=8, title_context=True),
           ChunkingConfig(max_tokens=16, overlap_tokens=7)]


def as_rows(chunks: list[Chunk]) -> list[tuple]:
    return [astuple(c) for c in chunks]


def chunk_both(tokenizer, config: ChunkingConfig, docs: list[Document]) -> tuple[list, list, Chunker]:
    old = Chunker(tokenizer, config, batched=False)
    new = Chunker(tokenizer, config)
    assert new.is_batched and not old.is_batched
    texts = [e.text for d in docs for e in d.elements] + [d.title or "" for d in docs]
    assert new.precount(texts) > 0
    return [as_rows(old.chunk(d)) for d in docs], [as_rows(new.chunk(d)) for d in docs], new


@pytest.fixture(scope="module")
def lab_docs() -> list[Document]:
    pytest.importorskip("unstructured")
    items = [i for i in walk_sources([LAB_DOCS]) if isinstance(i, SourceItem)]
    assert len(items) > 20
    return [parse_item(i) for i in items]


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "small-title-context", "tiny"])
def test_lab_docs_chunk_the_same_batched(tokenizer, lab_docs, config) -> None:
    old, new, _ = chunk_both(tokenizer, config, lab_docs)
    assert sum(map(len, old)) > 50
    assert new == old  # texts, headings, pages, token counts, indices


def records(n: int, seed: int = 0) -> list[Document]:
    """JSONL-like records: a title sometimes, paragraphs of words, punctuation, accents, CJK, tabs,
    lines that open with the title (a heading the body already says), and the odd huge paragraph."""
    rng = random.Random(seed)
    words = ("GPU", "node", "Slurm's", "naïve", "résumé", "e.g.", "U.S.", "(see", "below)", "—", "中文",
             "42", "3.14", "job-array", "ACL:", "x\ty", "hello", "world!", "über", "¿qué?", "don't", "/scratch/lab")
    out = []
    for i in range(n):
        title = rng.choice([None, "", "Quota policy", "A title that runs on " * rng.randint(1, 30)])
        paras = []
        for _ in range(rng.randint(1, 6)):
            k = rng.randint(300, 700) if rng.random() < 0.08 else rng.choice([rng.randint(1, 30), rng.randint(40, 150)])
            paras.append(" ".join(rng.choice(words) for _ in range(k)))
        if title and rng.random() < 0.3:
            paras[0] = f"{title}\n{paras[0]}"
        elements = [Element("Title" if rng.random() < 0.15 else "NarrativeText", p) for p in paras]
        out.append(Document(key=f"r{i}", source="records.jsonl", text="", content_hash=str(i), acl=None,
                            title=title, elements=tuple(elements)))
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "small-title-context", "tiny"])
def test_records_chunk_the_same_batched(tokenizer, config) -> None:
    docs = records(150)
    old, new, chunker = chunk_both(tokenizer, config, docs)
    assert sum(map(len, old)) > 150
    assert new == old
    # The counts are right, not merely the same as the old path's: each is the tokenizer's.
    sample = [c for d in docs[:40] for c in chunker.chunk(d)]
    assert all(c.num_tokens == chunker.count_tokens(c.text) for c in sample)


def test_a_jsonl_file_chunks_the_same_batched(tokenizer, tmp_path) -> None:
    rng = random.Random(1)
    with (tmp_path / "many.jsonl").open("w") as f:
        for i, d in enumerate(records(150, seed=2)):
            text = "\n\n".join(e.text for e in d.elements) + rng.choice(["", "\n\n  ", "\r\n trailing"])
            f.write(json.dumps({"id": f"r{i}", "text": text, "title": d.title, "acl": ["public"]}) + "\n")
    docs = [parse_item(i) for i in walk_sources([tmp_path]) if isinstance(i, SourceItem)]
    assert len(docs) == 150
    old, new, _ = chunk_both(tokenizer, ChunkingConfig(), docs)
    assert new == old


def test_precount_is_what_the_batched_path_reads(tokenizer) -> None:
    chunker = Chunker(tokenizer, ChunkingConfig())
    doc = records(1, seed=5)[0]
    chunker.precount([e.text for e in doc.elements])
    calls = []
    real = chunker.count_tokens
    chunker.count_tokens = lambda text: calls.append(text) or real(text)  # type: ignore[method-assign]
    small = Document(key="s", source="s", text="", content_hash="h", acl=None, title=None,
                     elements=(Element("NarrativeText", "short one"), Element("NarrativeText", "short two")))
    chunker.precount(["short one", "short two"])
    chunks = chunker.chunk(small)
    assert [c.text for c in chunks] == ["short one\n\nshort two"] and chunks[0].num_tokens == 4
    assert calls == []  # every count came from the batch call


def test_a_tokenizer_that_marks_spaces_counts_exactly() -> None:
    """Byte-level BPE counts " b" apart from "b": the sum of parts would be wrong, so it is not used."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(["alpha beta gamma delta"] * 50)] * 20,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    chunker = Chunker(tok, ChunkingConfig(max_tokens=16, overlap_tokens=4))
    assert not chunker.is_batched
    assert chunker.precount(["alpha beta"]) == 0
    d = Document(key="k", source="s", text="", content_hash="h", acl=None, title="alpha",
                 elements=(Element("NarrativeText", "beta gamma " * 30),))
    assert all(c.num_tokens == chunker.count_tokens(c.text) <= 16 for c in chunker.chunk(d))


def fake_embed(texts) -> np.ndarray:
    """A vector per text that depends on the text only (the model is not what is tested here)."""
    out = np.zeros((len(texts), 8), dtype=np.float32)
    for i, t in enumerate(texts):
        out[i] = np.frombuffer(hashlib.sha256(t.encode()).digest()[:32], dtype=np.uint8)[:8]
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_the_pipeline_writes_the_same_collection_parsing_ahead(tokenizer, tmp_path) -> None:
    """Windows of parsed sources tokenized together: same rows, same problems in the same order,
    as one source at a time; a source that fails to parse inside a window is reported, not written."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / ".rag-acl.toml").write_text('allow = ["public"]\n')
    with (corpus / "many.jsonl").open("w") as f:
        for i, d in enumerate(records(40, seed=3)):
            f.write(json.dumps({"id": f"r{i}", "text": "\n\n".join(e.text for e in d.elements),
                                "title": d.title}) + "\n")
    for i, d in enumerate(records(12, seed=4)):
        (corpus / f"n{i:02d}.md").write_text("\n\n".join(
            ("# " if e.kind == "Title" else "") + e.text.replace("\n", " ") for e in d.elements) + "\n")
    (corpus / "n05b.txt").write_bytes(b"\x00\x01binary\xff" * 50)  # fails to parse, mid-window
    (corpus / "n07b.md").write_text("")  # no text

    def ingest(chunk_batch: int) -> tuple[list[dict], list[tuple[str, str]]]:
        catalog = Catalog(tmp_path / f"catalog{chunk_batch}.sqlite")
        info = catalog.create_collection("c", "fake", "fp", 8, ChunkingConfig().as_dict())
        store = EmbeddedCollection(catalog, info, tmp_path / f"indexes{chunk_batch}")
        chunker = Chunker(tokenizer, ChunkingConfig(), batched=chunk_batch > 1)
        report = IngestPipeline(store, fake_embed, chunker, batch_chunks=16, chunk_batch=chunk_batch).run([corpus])
        assert report.added == 40 + 12, report.problems
        rows = [{k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in r.items()
                 if k not in ("updated_at", "id", "document_id")} for r in catalog.dump("c")]
        catalog.close()
        return rows, [(Path(p.key).name, p.reason) for p in report.problems]

    one_rows, one_problems = ingest(1)
    rows, problems = ingest(5)
    assert len(one_rows) > 52 and rows == one_rows
    assert problems == one_problems, problems
    assert [n for n, _ in problems] == ["n05b.txt", "n07b.md"], problems


def test_the_next_window_is_counted_while_this_one_is_chunked(tmp_path) -> None:
    # The count of window 2 waits until the ingest has taken an item of window 1: were windows
    # counted one after the other before their items were handed on, it would time out.
    import threading

    from ingest.pipeline import _Clock

    corpus = tmp_path / "records.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"r{i}", "text": f"record {i} text", "acl": ["public"]}) + "\n"
                              for i in range(6)))
    took_first = threading.Event()
    events: list[tuple[str, object]] = []

    class Counting:
        calls = 0

        def count_batch(self, texts):
            self.calls += 1
            window = self.calls
            if window == 2 and not took_first.wait(timeout=20):
                events.append(("timed out", window))
            return {"window": window}

        def use_counts(self, counts):
            events.append(("use", counts["window"]))

    pipeline = IngestPipeline(None, None, Counting(), chunk_batch=2)  # type: ignore[arg-type]
    for _item, parsed in pipeline._parsed_ahead(iter(walk_sources([corpus])), lambda i: True, _Clock({})):
        assert parsed is not None and not isinstance(parsed, Exception)
        events.append(("item", parsed[0].text))
        took_first.set()
    assert ("timed out", 2) not in events
    # Each window's own counts are in place before its first item is handed on.
    assert [e for e in events if e[0] == "use"] == [("use", 1), ("use", 2), ("use", 3)]
    assert events.index(("use", 2)) == 3 and events.index(("use", 3)) == 6 and len(events) == 9

"""ChunkStaging: a document's embedded chunks wait here until it is written whole, across restarts."""

from __future__ import annotations

import numpy as np

from ingest.staging import ChunkStaging, text_hash
from rag.types import Chunk


def _chunks(key: str, texts: list[str]) -> tuple[list[Chunk], np.ndarray]:
    chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split())) for i, t in enumerate(texts)]
    return chunks, np.arange(len(texts) * 4, dtype=np.float32).reshape(len(texts), 4)


def test_staged_rows_are_found_in_the_same_run_and_after_a_restart(tmp_path) -> None:
    path = tmp_path / "staging.sqlite"
    staging = ChunkStaging(path, "scope-1")
    assert staging.staged("doc-a", "h1") == {}
    chunks, vectors = _chunks("doc-a", ["first part", "second part"])
    staging.put("doc-a", "h1", chunks, vectors)
    expected = {0: text_hash("first part"), 1: text_hash("second part")}
    assert staging.staged("doc-a", "h1") == expected
    assert staging.staged("doc-b", "h1") == {}
    staging.close()
    again = ChunkStaging(path, "scope-1")  # a restart after a kill: what was staged is found
    assert again.staged("doc-a", "h1") == expected
    taken, taken_vectors = again.take("doc-a", "h1", 4)
    assert [c.text for c in taken] == ["first part", "second part"] and np.array_equal(taken_vectors, vectors)
    again.close()


def test_a_new_version_drops_the_old_rows_and_stages_its_own(tmp_path) -> None:
    path = tmp_path / "staging.sqlite"
    staging = ChunkStaging(path, "scope-1")
    staging.put("doc-a", "h1", *_chunks("doc-a", ["old text"]))
    assert staging.staged("doc-a", "h2") == {}  # the content changed: the old version's rows go
    assert staging.count() == 0
    staging.put("doc-a", "h2", *_chunks("doc-a", ["new text"]))
    assert staging.staged("doc-a", "h2") == {0: text_hash("new text")}
    staging.close()
    assert ChunkStaging(path, "scope-1").staged("doc-a", "h2") == {0: text_hash("new text")}


def test_discarded_and_other_scope_rows_are_gone(tmp_path) -> None:
    path = tmp_path / "staging.sqlite"
    staging = ChunkStaging(path, "scope-1")
    staging.put("doc-a", "h1", *_chunks("doc-a", ["a"]))
    staging.put("doc-b", "h1", *_chunks("doc-b", ["b"]))
    staging.discard("doc-a")
    assert staging.staged("doc-a", "h1") == {} and staging.staged("doc-b", "h1") == {0: text_hash("b")}
    staging.close()
    other = ChunkStaging(path, "scope-2")  # another embedder or chunking: the vectors would not fit
    assert other.staged("doc-b", "h1") == {} and other.count() == 0
    other.close()

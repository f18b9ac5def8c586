"""Bringing one collection store in line with another by copying stored chunks and vectors.

No re-embedding: a document whose content hash and chunk count match is left alone, an ACL
difference alone is applied with `set_acl`, everything else is copied (document, chunks,
vectors) from the source catalog. The shard jobs use it both ways: seeding a shard store from
the main collection, and merging shards into it (`rag.shards`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rag.errors import StoreError
from rag.types import Chunk, Document
from retrieval.base import CollectionStore
from retrieval.records import DocumentCounts, DocumentState
from retrieval.stores.embedded.catalog import Catalog

# Progress callback: (stage, done, total), as ingest's.
ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class _Step:
    action: str  # "write" (document, chunks and vectors from `source`), "acl" or "delete"
    key: str
    acl: frozenset[str] = frozenset()
    source: Catalog | None = None


def sync_documents(source: Catalog, collection: str, target: CollectionStore,
                   in_scope: Callable[[str], bool], progress: ProgressFn | None = None) -> DocumentCounts:
    """Make the target's documents in scope exactly the source's, copying stored chunks and vectors.

    Documents with the same content hash and chunk count are not rewritten; an ACL difference
    alone is applied with set_acl. Used to seed a shard store from the main collection.
    """
    counts = DocumentCounts()
    wanted = {k: (s, source) for k, s in source.document_states(collection).items() if in_scope(k)}
    have = {k: s for k, s in target.document_states().items() if in_scope(k)}
    apply(plan(wanted, have, counts), collection, have, target, counts, progress, "copy")
    return counts


def read_document(catalog: Catalog, collection: str, key: str
                  ) -> tuple[Document, frozenset[str], list[Chunk], np.ndarray] | None:
    """A stored document with its ACL, chunks and vectors (n, dim) float32, as replace_document takes them."""
    conn = catalog.conn
    row = conn.execute(
        "SELECT d.id, d.source, d.title, d.content_hash, d.acl, d.metadata, c.dim FROM documents d"
        " JOIN collections c ON c.name = d.collection WHERE d.collection = ? AND d.key = ?",
        (collection, key),
    ).fetchone()
    if row is None:
        return None
    doc_id, source, title, content_hash, acl, metadata, dim = row
    # The catalog keeps no document text (only chunks), and writing a document does not need it.
    doc = Document(key=key, source=source, text="", content_hash=content_hash,
                   acl=frozenset(json.loads(acl)), title=title, metadata=json.loads(metadata))
    chunks, vectors = [], []
    for idx, text, heading, num_tokens, chunk_meta, vector in conn.execute(
        "SELECT idx, text, heading, num_tokens, metadata, vector FROM chunks WHERE document_id = ?"
        " ORDER BY idx", (doc_id,),
    ):
        chunks.append(Chunk(key, idx, text, num_tokens, heading, json.loads(chunk_meta)))
        vectors.append(np.frombuffer(vector, dtype=np.float32))
    matrix = np.stack(vectors) if vectors else np.empty((0, dim), dtype=np.float32)
    return doc, frozenset(json.loads(acl)), chunks, matrix


def plan(wanted: dict[str, tuple[DocumentState, Catalog]], have: dict[str, DocumentState],
          counts: DocumentCounts) -> list[_Step]:
    steps = []
    for key in sorted(wanted):
        state, source = wanted[key]
        old = have.get(key)
        if old is None or old.content_hash != state.content_hash or old.num_chunks != state.num_chunks:
            steps.append(_Step("write", key, source=source))
        elif old.acl != state.acl:
            steps.append(_Step("acl", key, acl=state.acl))
        else:
            counts.unchanged += 1
    steps.extend(_Step("delete", key) for key in sorted(have.keys() - wanted.keys()))
    return steps


def apply(steps: list[_Step], collection: str, have: dict[str, DocumentState], target: CollectionStore,
           counts: DocumentCounts, progress: ProgressFn | None, stage: str) -> None:
    for done, step in enumerate(steps, 1):
        if step.action == "write":
            assert step.source is not None
            stored = read_document(step.source, collection, step.key)
            if stored is None:
                raise StoreError(f"document {step.key!r} vanished from a shard during the merge: "
                                 "is a shard job still writing? wait for it, then merge again")
            doc, acl, chunks, vectors = stored
            target.replace_document(doc, acl, chunks, vectors)
            counts.chunks_written += len(chunks)
            if step.key in have:
                counts.updated += 1
            else:
                counts.added += 1
        elif step.action == "acl":
            target.set_acl(step.key, step.acl)
            counts.acl_updated += 1
        else:
            target.delete_document(step.key)
            counts.deleted += 1
        if progress:
            progress(stage, done, len(steps))



"""pgvector: deleted, replaced and re-permissioned text leaves the server's files after a purge.

A cluster of its own (`rag db start`'s code path) with `wal_recycle = off`, so the WAL segments
a purge releases are deleted rather than renamed for reuse with their old bytes. After the
purge (VACUUM FULL, ANALYZE, checkpoints, WAL switch) every file of the data directory is read
as raw bytes.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from rag.local_postgres.server import LocalPostgres
from rag.types import Chunk, Document
from retrieval.stores.pgvector.collection import PgvectorCollection, create_collection
from retrieval.stores.pgvector.purge import purge_removed_text

DIM = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pg = LocalPostgres(tmp_path_factory.mktemp("pg-purge"),
                       server_options={"fsync": "off", "wal_recycle": "off", "autovacuum": "off"})
    pg.start()
    try:
        yield pg
    finally:
        pg.destroy()


def _holding(data_dir: Path, needle: bytes) -> list[str]:
    found = []
    for path in sorted(data_dir.rglob("*")):
        try:
            if path.is_file() and needle in path.read_bytes():
                found.append(str(path.relative_to(data_dir)))
        except OSError:  # a file the server removed while we walked
            continue
    return found


def _write(coll: PgvectorCollection, key: str, acl: set[str], texts: list[str], title: str | None = None) -> None:
    doc = Document(key=key, source=f"/lab/{key}", text="\n".join(texts), content_hash=str(hash(tuple(texts))),
                   acl=frozenset(acl), title=title)
    chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split())) for i, t in enumerate(texts)]
    rng = np.random.default_rng(len(texts))
    vectors = rng.normal(size=(len(chunks), DIM)).astype(np.float32)
    coll.replace_document(doc, frozenset(acl), chunks, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))


@pytest.fixture
def setup(server):
    marker = "qz" + uuid.uuid4().hex[:12]  # lexeme and text alike: letters and digits only
    coll = create_collection(server.dsn, f"c{uuid.uuid4().hex[:8]}", "test-embedder", "fp", DIM, {})
    for i in range(20):
        _write(coll, f"notes{i}", {"group:imaging"}, [f"beamline notes {i}: flux calibration"])
    _write(coll, "plan", {"group:imaging"}, [f"the {marker} incident plan, step {j}" for j in range(3)],
           title=f"Plan {marker}")
    purge_removed_text(server.dsn)  # on disk (not only in shared buffers): the search below can see it
    assert _holding(server.data_dir, marker.encode()), "the marker must be on disk before removal"
    yield coll, marker
    coll.close()


def test_a_deleted_document_leaves_no_text_on_disk(server, setup):
    coll, marker = setup
    coll.delete_document("plan")
    purge_removed_text(server.dsn)
    assert _holding(server.data_dir, marker.encode()) == []
    assert coll.keyword_search("beamline", 5, ["group:imaging"])


def test_replaced_text_leaves_no_trace_on_disk(server, setup):
    coll, marker = setup
    _write(coll, "plan", {"group:imaging"}, ["the incident plan, rewritten without the code name"], title="Plan")
    purge_removed_text(server.dsn)
    assert _holding(server.data_dir, marker.encode()) == []
    assert coll.keyword_search(marker, 5, ["group:imaging"]) == []


def test_a_re_permissioned_document_leaves_no_old_acl_keys(server, setup):
    """The keyword keys of the old ACL's domain (`tag:word`) are gone; only the new domain's remain."""
    coll, marker = setup
    with coll._connection().cursor() as cur:
        old_tag, new_tag = (cur.execute("SELECT rag_keyword_domain(%s, %s)", (coll.physical, [acl])).fetchone()[0]
                            for acl in ("group:imaging", "group:secret"))
    assert _holding(server.data_dir, f"{old_tag}:{marker}".encode())
    coll.set_acl("plan", frozenset({"group:secret"}))
    purge_removed_text(server.dsn)
    assert _holding(server.data_dir, f"{old_tag}:{marker}".encode()) == []
    assert _holding(server.data_dir, f"{new_tag}:{marker}".encode())
    assert coll.keyword_search(marker, 5, ["group:imaging"]) == []
    assert len(coll.keyword_search(marker, 5, ["group:secret"])) == 3

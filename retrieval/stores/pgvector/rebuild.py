"""Rebuilding a pgvector collection with another embedder or chunking beside the live one.

The contract of `retrieval.rebuild`, as `retrieval.stores.embedded.rebuild` keeps it: an ingest
whose embedder or chunking differ writes the next generation (the hidden row `NAME@G` of `rag_collections`, with
its own partial HNSW index of the new dimension, built once the load ends: `bulk.IndexLoad`) from
scratch, a batch of documents per transaction, so a killed or preempted job resumes into it;
queries keep reading the live generation; once the build holds every document of the live one
and its index, one transaction flips `live` to it and the old generation is deleted. Readers
follow the flip on their next query (`PgvectorCollection.refresh`).
Parallel shard jobs (`--shard I --num-shards N`) all write the same build; whichever finishes
last finds it complete and switches.
"""

from __future__ import annotations

import logging

from retrieval.rebuild import CollectionBuild
from retrieval.records import BuildOutcome, BuildSpec, DocumentState, describe
from retrieval.stores.pgvector.bulk import DEFAULT_BATCH_DOCUMENTS
from retrieval.stores.pgvector.collection import PgvectorCollection, hnsw_params
from retrieval.stores.pgvector.schema import (
    admin_connection,
    drop_generation,
    ensure_collection,
    find_live,
    hidden_generations,
    migrate,
)

log = logging.getLogger(__name__)


class PgvectorBuild(CollectionBuild):
    """The next generation of a pgvector collection, written beside the live one (see CollectionBuild)."""

    def __init__(self, dsn: str, name: str, live: PgvectorCollection, build_info, tuning: dict) -> None:
        super().__init__(name, live.info, build_info, lambda: live)
        self.dsn = dsn
        self._tuning = tuning
        self._live_store = live

    def _open_build(self) -> PgvectorCollection:
        return PgvectorCollection(self.dsn, self._info, follow_live=False, **self._tuning)

    def _live_states(self) -> dict[str, DocumentState]:
        return self._live_store.document_states()

    def finish(self) -> BuildOutcome:
        """Switch to the build if it holds every document of the live generation; then drop the old one."""
        build = self._info
        outcome = BuildOutcome(self.name, self.live.generation, build.generation, describe(self.live),
                               describe(build))
        self.build.flush()
        outcome.missing, outcome.missing_examples = missing_documents(self.dsn, self.live.name, build.name)
        if outcome.missing:
            return outcome
        # Complete: wait for any other shard job still loading it, then build its HNSW index if
        # none did, so queries never switch to a version without one.
        self.build.end_load(wait=True)
        retired = promote(self.dsn, self.name, build.name)
        outcome.switched = True
        if retired is not None:  # None: another shard job switched first (and drops the old one)
            outcome.old_documents_deleted = drop_generation(self.dsn, retired)
        self._live_store.refresh()
        return outcome

    def close(self) -> None:
        if self._build is not None:
            self._build.close()


def missing_documents(dsn: str, collection: str, other: str, limit: int = 5) -> tuple[int, list[str]]:
    """Documents of generation `collection` that generation `other` lacks: (how many, the first `limit` keys)."""
    where = (" FROM rag_documents d WHERE d.collection = %s AND NOT EXISTS"
             " (SELECT 1 FROM rag_documents o WHERE o.collection = %s AND o.key = d.key)")
    with admin_connection(dsn, f"comparing versions of collection {collection!r}") as conn:
        count = conn.execute("SELECT count(*)" + where, (collection, other)).fetchone()[0]
        keys = [r[0] for r in conn.execute("SELECT d.key" + where + " ORDER BY d.key LIMIT %s",
                                           (collection, other, limit))]
    return int(count), keys


def promote(dsn: str, name: str, build: str) -> str | None:
    """Make generation `build` the live one of collection `name`, in one transaction.

    Returns:
        The physical name of the generation that was live (to drop), or None when `build` was
        already live (a concurrent shard job switched).
    """
    with admin_connection(dsn, f"switching collection {name!r}") as conn, conn.transaction():
        # Lock every generation's row: concurrent finishers serialize here.
        rows = conn.execute("SELECT name, live FROM rag_collections WHERE public_name = %s FOR UPDATE",
                            (name,)).fetchall()
        live = [r[0] for r in rows if r[1]]
        if build in live:
            return None
        if build not in {r[0] for r in rows}:
            raise RuntimeError(f"version {build!r} of collection {name!r} vanished before the switch")
        conn.execute("UPDATE rag_collections SET live = false WHERE public_name = %s AND live", (name,))
        conn.execute("UPDATE rag_collections SET live = true WHERE name = %s", (build,))
    return live[0] if live else None


def open_for_ingest(dsn: str, name: str, spec: BuildSpec, **tuning: int) -> PgvectorCollection | PgvectorBuild:
    """What an ingest into pgvector collection `name` with `spec` writes to.

    The collection itself (created if new) when it was built the same way; otherwise its next
    generation, resumed if a killed run left one built the same way. Generations left over by an
    interrupted switch, or built with settings no longer asked for, are dropped first. Its writes
    are batched (`tuning`'s batch_documents, default `bulk.DEFAULT_BATCH_DOCUMENTS`), and a new
    collection or generation is loaded without its HNSW index, built once the load ends.
    """
    tuning = {"batch_documents": DEFAULT_BATCH_DOCUMENTS, **tuning}
    hnsw_params(**tuning)  # refuse bad graph values before creating anything
    migrate(dsn)
    with admin_connection(dsn, f"opening collection {name!r}") as conn:
        live = find_live(conn, name)
    if live is None:
        # New and empty: loaded in bulk, its HNSW index built when the load ends (bulk.IndexLoad).
        info = ensure_collection(dsn, name, spec.embedder, spec.fingerprint, spec.dim, spec.chunking,
                                 build_index=False)
        return PgvectorCollection(dsn, info, **tuning)
    hidden = hidden_generations(dsn, name)
    resume = None if spec.matches(live) else next(
        (h for h in hidden if h.generation > live.generation and spec.matches(h)), None)
    for h in hidden:
        if h is not resume:
            if h.generation > live.generation:
                log.warning("dropping the unfinished version %d of collection %r (%s): this run builds with %s",
                            h.generation, name, describe(h), describe(spec))
            drop_generation(dsn, h.name)
    live_store = PgvectorCollection(dsn, live, **tuning)
    if spec.matches(live):
        return live_store
    build = resume or ensure_collection(dsn, name, spec.embedder, spec.fingerprint, spec.dim, spec.chunking,
                                        generation=live.generation + 1, build_index=False)
    return PgvectorBuild(dsn, name, live_store, build, tuning)


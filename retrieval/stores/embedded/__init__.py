"""The embedded backend: a SQLite catalog (the source of truth: documents, chunks, ACLs, vectors
and the per-ACL-domain keyword index) plus a vector index file that is only a cache of it.

`catalog` (the SQLite file), `catalog_schema` (its tables and migrations), `keyword_index` (FTS5
tables per ACL domain and the keyword search over them), `collection` (`EmbeddedCollection`, the
`retrieval.base.CollectionStore`), `rebuild` (versioned rebuilds beside the live collection).
"""

"""The pgvector backend: a collection's documents, chunks, ACLs and vectors in PostgreSQL.

`schema` (tables, migrations, the collection registry), `session` (one connection with retry
and error mapping), `collection` (`PgvectorCollection`, the `retrieval.base.CollectionStore`),
`rebuild` (versioned rebuilds beside the live generation), `purge` (making deleted text
unreadable in the server's files).
"""

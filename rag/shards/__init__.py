"""Sharded ingest for Slurm job arrays, and joining the shards: jobs built on the whole service.

`run` (which shard a job is, and ingesting it), `layout` (shard data directories and their
records), `merge` (joining embedded shards into the main collection). They sit in `rag` because
they drive `rag.pipeline.Rag`; the store-to-store copy they share is `retrieval.sync`.
"""

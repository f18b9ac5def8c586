"""Retrieval: collection stores with the ACL filter inside the search, hybrid retrieval, reranking.

`base` (the protocols) and `records` (their record types); `stores` (the collection backends,
one package each, and `CollectionStores`, the one place that picks one); `vectors` (the vector
index kinds of the embedded backend); `rebuild` (versioned rebuilds), `sync` (store-to-store
copy); `keyword`, `fusion`, `retriever`, `rerank`, `evaluate`. Import the submodules directly.
"""

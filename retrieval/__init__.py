"""Retrieval: the catalog, vector stores with in-search ACL filters, reranking.

Import the submodules directly (`retrieval.retriever`, `retrieval.stores.faiss`, ...).
"""

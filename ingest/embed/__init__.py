"""Embedding chunks: `embedder` (`Embedder`, the sentence-transformers-compatible model we run
ourselves), `batches` (length-sorted token batches), `runner` (the encoder on one device),
`workers` (one process per GPU), `prefetch` (tokenizing ahead of the GPU).
"""

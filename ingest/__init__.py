"""Ingest: walk sources, parse, chunk, embed and write them with their ACLs.

Import the submodules directly (`ingest.pipeline`, `ingest.embed`, ...): they pull in
heavy libraries (torch, unstructured) that a bare `import ingest` should not.
"""

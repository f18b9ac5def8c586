"""A local PostgreSQL + pgvector server for one data directory (`rag db ...`, and the tests' server).

`server` (`LocalPostgres`: create, start, stop, secure a cluster; `local_dsn`), `processes`
(running the binaries: as whom, which copy of them, probing processes and ports).
"""

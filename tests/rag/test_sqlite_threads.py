"""The catalog and the identity store under many threads at once, as the query service uses them."""

from __future__ import annotations

import threading

from permissions.identity import IdentityStore
from rag.sqlite_threads import ThreadConnections


def test_each_thread_gets_its_own_connection_and_close_closes_all(tmp_path):
    import sqlite3

    conns = ThreadConnections(lambda: sqlite3.connect(tmp_path / "db.sqlite", check_same_thread=False))
    seen: list[int] = []

    def use() -> None:
        c = conns.get()
        assert conns.get() is c
        seen.append(id(c))
        c.execute("SELECT 1").fetchone()

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 4
    conns.close()


def test_authentication_and_catalog_reads_from_many_threads_never_mix_up(lab_rag):
    identity = IdentityStore(lab_rag.settings.catalog_path)
    keys = {f"user{i}": identity.create_key(f"user{i}", [f"g{i}"]) for i in range(8)}
    index = lab_rag.collection()
    errors: list[BaseException] = []

    def hammer(user: str) -> None:
        try:
            for _ in range(150):
                p = identity.authenticate(keys[user])
                assert p.user == user and p.groups == frozenset({f"g{user[4:]}"})
                hits = index.keyword_search("GPU reservation", 5, ["public", "group:imaging"])
                assert hits and index.chunk_records([hits[0][0]])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(u,)) for u in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    identity.close()
    assert not errors, errors[:3]

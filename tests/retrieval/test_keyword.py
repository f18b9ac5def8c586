"""Keyword retrieval: query terms, safe FTS5 expressions, and the catalog's ACL-filtered BM25."""

from __future__ import annotations

import sqlite3
import threading

import numpy as np
import pytest

from permissions.models import Principal
from permissions.policy import store_filter
from rag.types import Chunk, Document
from retrieval.keyword import MAX_TERMS, fts5_match, query_terms
from retrieval.stores.embedded import keyword_index
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.catalog_schema import SCHEMA, connect

DIM = 4
ALICE = store_filter(Principal("alice", frozenset({"genomics"})))
BOB = store_filter(Principal("bob", frozenset({"imaging"})))

ATTACKS = [
    '"foo" OR NOT bar*',
    "NEAR(foo bar, 2)",
    "NEAR(",
    'unbalanced "quote',
    '"',
    '""""',
    "text:secret",
    "{text heading}: secret",
    "^secret",
    "secret*",
    "foo AND AND bar",
    ")))(((",
    "- foo + bar",
    "'; DROP TABLE chunks; --",
]

# ----------------------------------------------------------------------------- query_terms


@pytest.mark.parametrize(("text", "terms"), [
    ("My job is pending with reason QOSMaxGRESPerJob. What does that mean?",
     ["job", "pending", "reason", "QOSMaxGRESPerJob", "mean"]),
    ("Is BRCA1 on gpu-a100-03 when I use sbatch?", ["BRCA1", "gpu-a100-03", "sbatch"]),
    ("(E-VCF-017), gpu05. secret/hpc/breakglass, 7.10.30; MERGE_VCFS",
     ["E-VCF-017", "gpu05", "secret/hpc/breakglass", "7.10.30", "MERGE_VCFS"]),
    ("What temperature is the -80 freezer alarm set to?", ["temperature", "80", "freezer", "alarm", "set"]),
    ("mail alice@niqb.example.org about rack 7", ["mail", "alice@niqb.example.org", "rack", "7"]),
])
def test_query_terms_keep_identifiers_whole(text, terms):
    assert query_terms(text) == terms


def test_query_terms_drop_punctuation_stop_words_and_stray_letters():
    assert query_terms("??? --- ... !! __ _ -- ''") == []
    assert query_terms("What is the? How would it be, and why?") == []
    assert query_terms("What's the Krios's status?") == ["Krios", "status"]


def test_query_terms_are_unicode_aware():
    assert query_terms("Müller's Genomsequenzierung für naïve Zellen") == [
        "Müller", "Genomsequenzierung", "für", "naïve", "Zellen"]
    # Devanagari vowel signs are combining marks: the words must not be cut at them.
    assert query_terms("जीनोम विश्लेषण") == ["जीनोम", "विश्लेषण"]
    assert query_terms("ゲノム解析 の 猫") == ["ゲノム解析", "の", "猫"]
    # A decomposed accent (e + U+0301) is composed, not a word break.
    assert query_terms("cafe\u0301 crème") == ["café", "crème"]


def test_query_terms_dedup_case_insensitively_keeping_the_first_spelling():
    assert query_terms("Krios krios KRIOS gpu05 GPU05") == ["Krios", "gpu05"]


def test_query_terms_are_capped():
    words = [f"w{i}" for i in range(200)]
    assert query_terms(" ".join(words)) == words[:MAX_TERMS]
    assert query_terms(" ".join(words), max_terms=3) == words[:3]


# ------------------------------------------------------------------------------ fts5_match


def test_fts5_match_quotes_every_term_as_a_phrase():
    assert fts5_match(["E-VCF-017", "gpu05"]) == '"E-VCF-017" OR "gpu05"'
    assert fts5_match(['say "hi"']) == '"say ""hi"""'


def test_fts5_match_refuses_no_terms():
    with pytest.raises(ValueError, match="no keyword terms"):
        fts5_match([])


@pytest.fixture
def fts():
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE VIRTUAL TABLE t USING fts5(text, tokenize='porter unicode61')")
    rows = {1: "foo or not bar", 2: "barista baz", 3: "secret plans", 4: "near foo bar", 5: "foo"}
    conn.executemany("INSERT INTO t (rowid, text) VALUES (?, ?)", rows.items())
    yield lambda terms: sorted(r[0] for r in conn.execute(
        "SELECT rowid FROM t WHERE t MATCH ?", (fts5_match(terms),)))
    conn.close()


def test_fts5_match_makes_operators_and_filters_plain_words(fts):
    # As FTS5 syntax these would mean: NOT, prefix, column filter, initial-token anchor.
    assert fts(['foo" OR NOT bar*']) == [1]  # only the literal word sequence
    assert fts(["bar*"]) == [1, 4]  # not a prefix query: "barista" does not match
    assert fts(["text:secret"]) == []  # "text secret" is not in any row
    assert fts(["^secret", "secret*"]) == [3]
    assert fts(["NEAR(", ")"]) == [4]
    assert fts(['"', '""', "*", "^"]) == []  # phrases with no tokens match nothing, no error
    assert fts(["foo", "baz"]) == [1, 2, 4, 5]  # OR semantics


@pytest.mark.parametrize("attack", ATTACKS)
def test_raw_user_text_as_a_term_never_breaks_the_match(fts, attack):
    fts([attack])  # no sqlite3.OperationalError (fts5: syntax error)
    fts(query_terms(attack) or ["x"])


# ----------------------------------------------------------------------- catalog search


def _doc(key: str, version: str = "1") -> Document:
    return Document(key=key, source=f"/src/{key}", text=version, content_hash=f"h-{key}-{version}",
                    acl=None, title=key)


def _put(catalog: Catalog, key: str, texts: list[str], acl: set[str], collection: str = "docs",
         heading: str | None = None) -> None:
    chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split()), heading=heading)
              for i, t in enumerate(texts)]
    vectors = np.ones((len(chunks), DIM), dtype=np.float32)
    catalog.replace_document(collection, _doc(key, "|".join(texts)), frozenset(acl), chunks, vectors)


def _ids(results: list[tuple[int, float]]) -> list[int]:
    return [i for i, _ in results]


def _keys(catalog: Catalog, results: list[tuple[int, float]], collection: str = "docs") -> list[str]:
    records = catalog.chunk_records(_ids(results), collection)
    return [records[i].document_key for i in _ids(results)]


def _check_index(catalog: Catalog) -> None:
    # FTS5 compares its index with the chunks table; raises on any difference.
    keyword_index.integrity_check(catalog.conn)


@pytest.fixture
def catalog(tmp_path):
    c = Catalog(tmp_path / "catalog.sqlite")
    c.create_collection("docs", "test-embedder", "fp1", DIM, {})
    yield c
    c.close()


def test_an_identifier_is_found_only_by_those_who_may_read_it(catalog):
    _put(catalog, "variants", ["Known errors: E-VCF-017 in MERGE_VCFS means a space in a sample ID"],
         {"group:genomics"})
    _put(catalog, "guide", ["General help: errors are listed in the pipeline notes"], {"public"})
    question = "varcall-nf fails with E-VCF-017, what now?"
    assert _keys(catalog, catalog.keyword_search("docs", question, 5, ALICE)) == ["variants"]
    assert catalog.keyword_search("docs", question, 5, BOB) == []
    assert catalog.keyword_search("docs", question, 5, []) == []
    catalog.set_acl("docs", "variants", frozenset({"group:imaging"}))  # no re-index needed
    assert _keys(catalog, catalog.keyword_search("docs", question, 5, BOB)) == ["variants"]
    assert catalog.keyword_search("docs", question, 5, ALICE) == []


def test_up_to_k_readable_hits_however_many_unreadable_chunks_match_better(catalog):
    """The ACL filter is inside the query: 200 strong forbidden matches cannot crowd out k."""
    strong = "QOSMaxGRESPerJob QOSMaxGRESPerJob QOSMaxGRESPerJob"
    weak = "QOSMaxGRESPerJob " + " ".join(f"filler{i}" for i in range(60))
    for n in range(200):
        _put(catalog, f"admin-{n:03d}", [strong], {"group:hpc-admins"})
    for n in range(3):
        _put(catalog, f"public-{n}", [weak], {"public"})
    everyone = ["public", "group:hpc-admins"]
    top = catalog.keyword_search("docs", "QOSMaxGRESPerJob", 3, everyone)
    assert all(key.startswith("admin-") for key in _keys(catalog, top))  # they really rank higher
    dave = store_filter(Principal("dave"))
    found = catalog.keyword_search("docs", "QOSMaxGRESPerJob", 3, dave)
    assert sorted(_keys(catalog, found)) == ["public-0", "public-1", "public-2"]
    assert len(catalog.keyword_search("docs", "QOSMaxGRESPerJob", 10, dave)) == 3


def test_scores_higher_is_better_ties_by_id_and_k(catalog):
    _put(catalog, "once", ["alpha beta gamma delta"], {"public"})
    _put(catalog, "twice", ["alpha alpha gamma delta"], {"public"})
    _put(catalog, "none", ["beta gamma delta epsilon"], {"public"})
    _put(catalog, "copy-b", ["zeta eta theta iota"], {"public"})
    _put(catalog, "copy-a", ["zeta eta theta iota"], {"public"})
    found = catalog.keyword_search("docs", "alpha", 5, ["public"])
    assert _keys(catalog, found) == ["twice", "once"]
    assert found[0][1] > found[1][1] > 0
    ties = catalog.keyword_search("docs", "zeta", 5, ["public"])
    assert ties[0][1] == ties[1][1] and _ids(ties) == sorted(_ids(ties))
    assert len(catalog.keyword_search("docs", "gamma delta", 2, ["public"])) == 2
    assert catalog.keyword_search("docs", "gamma", 0, ["public"]) == []


def test_a_match_in_the_heading_counts_more(catalog):
    _put(catalog, "body", ["Overview\n\nthe cryoem-res reservation is listed elsewhere"], {"public"},
         heading="Overview")
    _put(catalog, "head", ["cryoem-res\n\nhow to use the standing reservation here"], {"public"},
         heading="cryoem-res")
    assert _keys(catalog, catalog.keyword_search("docs", "cryoem-res", 2, ["public"]))[0] == "head"


def test_stemming_and_case_folding(catalog):
    _put(catalog, "booking", ["Cancellations less than 72 hours ahead are charged"], {"public"})
    assert _keys(catalog, catalog.keyword_search("docs", "cancellation CHARGES", 5, ["public"])) == [
        "booking"]


def test_no_usable_terms_give_nothing(catalog):
    _put(catalog, "a", ["what is the point of this"], {"public"})
    assert catalog.keyword_search("docs", "What is the?", 5, ["public"]) == []
    assert catalog.keyword_search("docs", "?!", 5, ["public"]) == []


@pytest.mark.parametrize("attack", ATTACKS)
def test_fts_syntax_in_a_question_is_harmless(catalog, attack):
    _put(catalog, "secret", ["secret plans foo bar"], {"group:hpc-admins"})
    _put(catalog, "open", ["foo bar barista"], {"public"})
    found = catalog.keyword_search("docs", attack, 10, ["public"])
    assert "secret" not in _keys(catalog, found)


def test_collections_are_searched_separately(catalog):
    catalog.create_collection("other", "test-embedder", "fp1", DIM, {})
    _put(catalog, "a", ["KRIOS-2 booking"], {"public"}, collection="docs")
    _put(catalog, "b", ["KRIOS-2 booking"], {"public"}, collection="other")
    assert _keys(catalog, catalog.keyword_search("docs", "KRIOS-2", 5, ["public"])) == ["a"]
    assert _keys(catalog, catalog.keyword_search("other", "KRIOS-2", 5, ["public"]), "other") == ["b"]
    # A chunk id of one collection is not found in another (GET /v1/documents/docs/{id of b} is a 404).
    assert catalog.chunk_records(_ids(catalog.keyword_search("other", "KRIOS-2", 5, ["public"])), "docs") == {}


def test_replace_and_delete_keep_the_index_in_step(catalog):
    _put(catalog, "a", ["old text mentions SN-HX-10458", "second chunk"], {"public"})
    assert len(catalog.keyword_search("docs", "SN-HX-10458", 5, ["public"])) == 1
    _put(catalog, "a", ["new text mentions SN-HX-10463"], {"public"})
    assert catalog.keyword_search("docs", "SN-HX-10458", 5, ["public"]) == []
    assert catalog.keyword_search("docs", "second chunk", 5, ["public"]) == []
    (chunk_id,) = _ids(catalog.keyword_search("docs", "SN-HX-10463", 5, ["public"]))
    assert catalog.chunk_records([chunk_id], "docs")[chunk_id].text == "new text mentions SN-HX-10463"
    _check_index(catalog)
    catalog.delete_document("docs", "a")
    assert catalog.keyword_search("docs", "SN-HX-10463", 5, ["public"]) == []
    _check_index(catalog)


def test_a_failed_replace_leaves_the_index_as_it_was(catalog):
    _put(catalog, "a", ["v1 mentions INC-2291"], {"public"})
    bad = [Chunk("a", 0, "v2 mentions CHG-1187", 1), Chunk("a", 0, "dup", 1)]  # UNIQUE(doc, idx)
    with pytest.raises(sqlite3.IntegrityError):
        catalog.replace_document("docs", _doc("a", "v2"), frozenset({"public"}), bad,
                                 np.ones((2, DIM), dtype=np.float32))
    assert len(catalog.keyword_search("docs", "INC-2291", 5, ["public"])) == 1
    assert catalog.keyword_search("docs", "CHG-1187", 5, ["public"]) == []
    _check_index(catalog)


# -------------------------------------------------------------------- catalogs made earlier


def _old_catalog(path) -> None:
    """A catalog as the code before the keyword index wrote it: old schema, plain SQL writes."""
    conn = connect(path)
    conn.executescript(SCHEMA)
    assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'chunks_fts'").fetchone() is None
    conn.execute("INSERT INTO collections (name, embedder, fingerprint, dim, chunking, created_at)"
                 " VALUES ('docs', 'e', 'fp1', ?, '{}', 0)", (DIM,))
    for doc_id, (key, acl, text) in enumerate([
        ("node-inventory", "group:hpc-admins", "gpu05 serial SN-HX-10458, drained"),
        ("user-guide", "public", "the gpu partition has gpu01-gpu08"),
    ], start=1):
        conn.execute("INSERT INTO documents (id, collection, key, source, content_hash, acl, metadata,"
                     " updated_at) VALUES (?, 'docs', ?, ?, 'h', ?, '{}', 0)",
                     (doc_id, key, f"/src/{key}", f'["{acl}"]'))
        conn.execute("INSERT INTO document_acl (document_id, principal) VALUES (?, ?)", (doc_id, acl))
        conn.execute("INSERT INTO chunks (document_id, idx, text, num_tokens, metadata, vector)"
                     " VALUES (?, 0, ?, 5, '{}', ?)", (doc_id, text, np.ones(DIM, np.float32).tobytes()))
    conn.close()


def test_an_old_catalog_is_backfilled_on_open(tmp_path):
    path = tmp_path / "catalog.sqlite"
    _old_catalog(path)
    catalog = Catalog(path)
    carol = store_filter(Principal("carol", frozenset({"hpc-admins"})))
    assert _keys(catalog, catalog.keyword_search("docs", "SN-HX-10458", 5, carol)) == ["node-inventory"]
    assert catalog.keyword_search("docs", "SN-HX-10458", 5, ["public"]) == []
    _check_index(catalog)
    _put(catalog, "later", ["written after the upgrade: SN-HX-10458 again"], {"public"})
    catalog.close()

    again = Catalog(path)  # a second open changes nothing
    assert _keys(again, again.keyword_search("docs", "SN-HX-10458", 5, ["public"])) == ["later"]
    assert len(again.keyword_search("docs", "SN-HX-10458 gpu01-gpu08", 5, carol)) == 3
    _check_index(again)
    again.close()


def test_an_index_with_an_older_tokenizer_is_rebuilt(tmp_path, monkeypatch):
    path = tmp_path / "catalog.sqlite"
    _old_catalog(path)
    monkeypatch.setattr(keyword_index, "TOKENIZE", "unicode61")
    monkeypatch.setattr(keyword_index, "FORMAT", "domains-1 tokenize=unicode61")
    older = Catalog(path)
    assert older.keyword_search("docs", "drain", 5, ["group:hpc-admins"]) == []  # no stemmer
    older.close()
    monkeypatch.undo()
    catalog = Catalog(path)
    assert not keyword_index.needs_rebuild(catalog.conn)
    # "drain" finds "drained" only with the porter stemmer of the current schema.
    assert len(catalog.keyword_search("docs", "drain", 5, ["group:hpc-admins"])) == 1
    _check_index(catalog)
    catalog.close()


def test_opening_an_up_to_date_catalog_does_not_wait_for_a_writer(tmp_path):
    path = tmp_path / "catalog.sqlite"
    Catalog(path).close()
    writer = connect(path)
    writer.execute("BEGIN IMMEDIATE")  # an ingest holding the write lock
    try:
        opened = threading.Event()
        thread = threading.Thread(target=lambda: (Catalog(path).close(), opened.set()), daemon=True)
        thread.start()
        assert opened.wait(timeout=5), "opening the catalog waited for the write lock"
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    thread.join(timeout=35)


def test_scores_and_order_ignore_unreadable_chunks(catalog):
    """BM25 statistics come from readable chunks only: hidden text changes nothing a reader sees."""
    _put(catalog, "a", ["the alpha protocol for buffers"], {"user:bob"})
    _put(catalog, "b", ["the beta protocol for buffers"], {"user:bob"})
    before = catalog.keyword_search("docs", "alpha beta", 5, ["user:bob"])
    for i in range(60):  # many hidden chunks with "alpha": global IDF of alpha would collapse
        _put(catalog, f"hidden{i}", [f"alpha alpha note {i}"], {"group:secret"})
    after = catalog.keyword_search("docs", "alpha beta", 5, ["user:bob"])
    assert after == before
    assert len(catalog.keyword_search("docs", "alpha", 100, ["group:secret"])) == 60

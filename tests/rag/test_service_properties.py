"""Property-based leak test of the whole service: real ingest of files on disk, real models, the
real API over HTTP, under random change sequences (hypothesis.stateful).

The corpus of each run is a directory the ingest job reads as a lab would have it:

    root/side/        a `.rag-acl.toml` decides (allow list and rules), files *.md / *.txt
    root/side/deep/   its own sidecar, nearer (may be removed: then side/'s decides)
    root/posix/       no sidecar: owner, group and mode of each file decide
    root/records.jsonl  records with an explicit `acl` field (sometimes an invalid one)

Rules change it at random (write, edit and delete files; rewrite, break, fix and remove sidecars;
chmod/chown; rewrite records; move users between groups; revoke keys), and every change is
followed by `rag ingest` (the Rag of the test, like a batch job) while the server (its own Rag
over the same data directory, in a thread) keeps answering. After every step, for random users
(through their API keys) and random questions, exact phrases and marker words of unreadable and
deleted text among them, nothing a user gets shows text they may not read: not the Rag's hits in
any mode, with or without the reranker; not /v1/query's citations, answer or error bodies; not
/v1/chat/completions (the official openai client, with real generation by the packaged SmolLM2);
not /v1/documents (an unreadable chunk is the same 404 as a missing one); not /v1/models. A
revoked key is refused on the next request. The expected ACL of each file comes from
`AclResolver` (its own properties are tested in tests/permissions/test_acl_properties.py),
except that an ACL that cannot be determined (broken sidecar, invalid record ACL) must deny.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from permissions.models import Principal, make_acl
from permissions.sources import SIDECAR_NAME, AclResolver
from rag.api.app import create_app
from rag.errors import ConfigError, RagError
from retrieval.retriever import MODES
from tests.fuzz_corpus import FILLER, GROUPS, OUTSIDER, USERS, Reference, acls, marker, scaled, system_ids
from tests.rag.conftest import make_rag
from tests.rag.live_server import serving

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or system_ids() is None,
                       reason="chown of corpus files needs root and the system accounts"),
]

ALL_USERS = (*USERS, OUTSIDER)
SIDECAR_PATTERNS = ["*.txt", "f1.md", "**", "f?.md"]
BROKEN_SIDECARS = ["allow = [", "allow = ['root:x']", "deny = ['public']", ""]
MODES_ON_DISK = [0o644, 0o640, 0o604, 0o600, 0o440, 0o400, 0o004, 0o040, 0o000]
BAD_RECORD_ACLS = [["root:x"], ["user:"], "public", [3]]
_runs = itertools.count()


class Service:
    """A data directory, the Rag that ingests into it, and the API serving it over HTTP."""

    def __init__(self, rag, url: str, store: str) -> None:
        self.rag, self.url, self.store = rag, url, store

    def chunk_ids(self, collection: str) -> dict[int, str]:
        """Every chunk id of a collection with its text (read behind the API's back)."""
        if self.store == "pgvector":
            import psycopg

            with psycopg.connect(self.rag.dsn) as conn:
                rows = conn.execute("SELECT id, text FROM rag_chunks WHERE collection = %s", (collection,)).fetchall()
        else:
            rows = self.rag.catalog.conn.execute(
                "SELECT c.id, c.text FROM chunks c JOIN documents d ON d.id = c.document_id"
                " WHERE d.collection = ?", (collection,)).fetchall()
        return {int(i): t for i, t in rows}


@pytest.fixture(scope="module", params=["faiss", "pgvector"])
def service(request, tmp_path_factory, model_cache):
    overrides = {"max_new_tokens": 6, "store": request.param}
    dsn_context = None
    if request.param == "pgvector":
        from tests.pg_fixture import fresh_database

        dsn_context = fresh_database(request.getfixturevalue("pg_server"))
        overrides["dsn"] = dsn_context.__enter__()
    home = tmp_path_factory.mktemp("fuzz-home")
    rag = make_rag(home, model_cache, **overrides)
    try:
        with serving(create_app(rag.settings)) as url:
            yield Service(rag, url, request.param)
    finally:
        rag.close()
        if dsn_context is not None:
            dsn_context.__exit__(None, None, None)


# ------------------------------------------------------------------------------ the machine


class ServiceMachine(RuleBasedStateMachine):
    SERVICE: Service

    def __init__(self) -> None:
        super().__init__()
        self.svc = self.SERVICE
        self.rag = self.svc.rag
        self.collection = f"fuzz{next(_runs)}"
        self.base = Path(tempfile.mkdtemp(prefix="fuzz-service-"))
        os.chmod(self.base, 0o755)
        self.root = self.base / "root"
        for d in ("side/deep", "posix"):
            (self.root / d).mkdir(parents=True)
        self.uids, self.gids = system_ids()
        self.versions: dict[str, int] = {}  # document (file or record) -> version on disk
        self.doc_numbers: dict[str, int] = {}
        self.texts: dict[str, str] = {}  # document -> its text on disk
        self.record_acls: dict[str, object] = {}  # record id -> its acl field as written
        self.keys: dict[str, str] = {}
        self.revoked: list[str] = []
        self.http = httpx.Client(base_url=self.svc.url, timeout=300)

    def teardown(self) -> None:
        self.http.close()
        shutil.rmtree(self.base, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------

    def _text(self, doc: str) -> str:
        n = self.doc_numbers.setdefault(doc, len(self.doc_numbers))
        self.versions[doc] = self.versions.get(doc, -1) + 1
        words = [FILLER[(n * 7 + i * 3 + self.versions[doc]) % len(FILLER)] for i in range(12)]
        words.insert(n % 12, marker(n, self.versions[doc]))
        self.texts[doc] = " ".join(words)
        return self.texts[doc]

    def _ingest(self) -> None:
        # The operator means every deletion here: the guard against mass deletion (ingest/deletion_guard.py,
        # which keeps the documents of a vanished tree as they were) would hold most of these tiny corpora.
        # Where that guard is not there yet, every deletion is made anyway: the same behaviour.
        mean_it = {"allow_mass_delete": True} if "allow_mass_delete" in inspect.signature(self.rag.ingest).parameters \
            else {}
        self.rag.ingest([self.root], collection=self.collection, **mean_it)

    def _files(self) -> list[Path]:
        return sorted(p for p in self.root.rglob("*") if p.is_file() and p.suffix in (".md", ".txt"))

    def expected(self) -> Reference:
        """What each user may read now: the resolver's ACL, or nobody where it cannot be determined."""
        ref = Reference()
        resolver = AclResolver(self.root)
        for path in self._files():
            doc = str(path.relative_to(self.root))
            try:
                acl, _ = resolver.resolve(path)
            except (RagError, OSError):
                acl = frozenset()  # fail closed
            ref.put(doc, acl, [self.texts[doc]], marker(self.doc_numbers[doc], self.versions[doc]))
        for rid, raw in self.record_acls.items():
            doc = f"records#{rid}"
            try:
                acl = make_acl(raw) if isinstance(raw, list) else None
            except ConfigError:
                acl = None
            ref.put(doc, acl or frozenset(), [self.texts[doc]], marker(self.doc_numbers[doc], self.versions[doc]))
        live = {d.mark for d in ref.docs.values()}
        ref.gone = {marker(self.doc_numbers[d], v) for d, last in self.versions.items() for v in range(last + 1)} - live
        return ref

    def principal(self, user: str) -> Principal:
        return self.rag.identity.principal_for(user)

    # -- setup ---------------------------------------------------------------------------

    @initialize(data=st.data())
    def start(self, data) -> None:
        (self.root / "side" / SIDECAR_NAME).write_text(self._sidecar(data))
        for user in ALL_USERS:
            groups = data.draw(st.frozensets(st.sampled_from(GROUPS), max_size=2), label=f"groups of {user}")
            self.rag.identity.add_user(user, sorted(groups))
            self.keys[user] = self.rag.identity.create_key(user, [], label="fuzz")
        for _ in range(data.draw(st.integers(2, 4), label="files")):
            self._write(data)
        self._records(data)
        self._ingest()

    # -- rules ---------------------------------------------------------------------------

    def _sidecar(self, data) -> str:
        if data.draw(st.integers(0, 4), label="broken?") == 0:
            return data.draw(st.sampled_from(BROKEN_SIDECARS), label="broken sidecar")
        allow = data.draw(acls, label="allow")
        lines = [f"allow = {json.dumps(sorted(allow))}"]
        for pattern, acl in data.draw(st.lists(st.tuples(st.sampled_from(SIDECAR_PATTERNS), acls), max_size=2),
                                      label="rules"):
            lines += ["[[rule]]", f"match = {json.dumps(pattern)}", f"allow = {json.dumps(sorted(acl))}"]
        return "\n".join(lines) + "\n"

    def _write(self, data) -> None:
        where = data.draw(st.sampled_from(["side", "side/deep", "posix"]), label="dir")
        name = data.draw(st.sampled_from(["f1.md", "f2.md", "notes.txt"]), label="file")
        path = self.root / where / name
        path.write_text(self._text(str(path.relative_to(self.root))) + "\n")
        if where == "posix":
            self._chmod(data, path)

    def _chmod(self, data, path: Path) -> None:
        user = data.draw(st.sampled_from(USERS), label="owner")
        group = data.draw(st.sampled_from(GROUPS), label="group")
        os.chown(path, self.uids[user], self.gids[group])
        os.chmod(path, data.draw(st.sampled_from(MODES_ON_DISK), label="mode"))

    def _records(self, data) -> None:
        lines = []
        for rid in data.draw(st.sets(st.sampled_from(["r0", "r1", "r2"]), min_size=1), label="records"):
            if data.draw(st.integers(0, 5), label="bad acl?") == 0:
                acl: object = data.draw(st.sampled_from(BAD_RECORD_ACLS), label="bad acl")
            else:
                acl = sorted(data.draw(acls, label="acl"))
            doc = f"records#{rid}"
            text = self.texts[doc] if doc in self.texts and data.draw(st.booleans(), label="same text") \
                else self._text(doc)
            self.record_acls[rid] = acl
            lines.append(json.dumps({"id": rid, "title": f"record {rid}", "text": text, "acl": acl}))
        for rid in set(self.record_acls) - {json.loads(line)["id"] for line in lines}:
            del self.record_acls[rid]
        (self.root / "records.jsonl").write_text("\n".join(lines) + "\n")

    @rule(data=st.data())
    def write_file(self, data) -> None:
        self._write(data)
        self._ingest()

    @rule(data=st.data())
    def delete_file(self, data) -> None:
        files = self._files()
        if files:
            data.draw(st.sampled_from(files), label="delete").unlink()
        self._ingest()

    @rule(data=st.data())
    def repermission_posix_file(self, data) -> None:
        files = [p for p in self._files() if p.parent.name == "posix"]
        if files:
            self._chmod(data, data.draw(st.sampled_from(files), label="chmod"))
        self._ingest()

    @rule(data=st.data())
    def rewrite_sidecar(self, data) -> None:
        where = data.draw(st.sampled_from(["side", "side/deep"]), label="sidecar")
        (self.root / where / SIDECAR_NAME).write_text(self._sidecar(data))
        self._ingest()

    @rule(data=st.data())
    def remove_sidecar(self, data) -> None:
        where = data.draw(st.sampled_from(["side", "side/deep"]), label="sidecar")
        (self.root / where / SIDECAR_NAME).unlink(missing_ok=True)
        self._ingest()

    @rule(data=st.data())
    def rewrite_records(self, data) -> None:
        self._records(data)
        self._ingest()

    @rule(data=st.data())
    def move_user(self, data) -> None:
        user = data.draw(st.sampled_from(ALL_USERS), label="user")
        groups = data.draw(st.frozensets(st.sampled_from(GROUPS), max_size=2), label="new groups")
        self.rag.identity.add_user(user, sorted(groups))

    @rule(data=st.data())
    def revoke_key(self, data) -> None:
        user = data.draw(st.sampled_from(ALL_USERS), label="user")
        key_id = self.keys[user].split("_")[1]
        self.rag.identity.revoke_key(key_id)
        self.revoked.append(self.keys[user])
        self.keys[user] = self.rag.identity.create_key(user, [], label="fuzz")

    # -- the checks after every step -------------------------------------------------------

    @invariant()
    def revoked_keys_are_refused(self) -> None:
        for key in self.revoked[-2:]:
            r = self.http.post("/v1/query", json={"question": "freezer", "generate": False,
                                                  "collection": self.collection},
                               headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 401, r.text
            assert "qz" not in r.text

    @invariant()
    def nobody_sees_what_they_may_not_read(self) -> None:
        # The invariant draws nothing itself: the question and user follow from the state, varied
        # by the step count so that a run covers every user, mode and kind of question.
        ref = self.expected()
        step = sum(self.versions.values()) + len(self.revoked)
        user = ALL_USERS[step % len(ALL_USERS)]
        principal = self.principal(user)
        questions = _questions(ref, principal, step)
        for n, question in enumerate(questions):
            self._check_rag(ref, principal, question, MODES[(step + n) % len(MODES)], rerank=n == 0)
            self._check_api(ref, principal, user, question, generate=n == 0 and step % 2 == 0,
                            stream=step % 4 == 0)
        self._check_documents(ref, principal, user)
        self._check_models(ref, principal, user)

    def _forbidden_in(self, ref: Reference, principal: Principal, shown: str, asked: str) -> set[str]:
        # A marker the user typed may come back as their own question (or be parroted by the model).
        return {m for m in ref.leaks(principal, shown) if m not in asked}

    def _check_rag(self, ref, principal, question, mode, rerank) -> None:
        try:
            answer = self.rag.query(question, principal, collection=self.collection, k=10, generate=False,
                                    rerank=rerank, mode=mode)
        except ConfigError:  # e.g. a question of stop words only, in keyword mode
            return
        allowed = {d.mark for d in ref.docs.values() if principal.can_read(d.acl)}
        for hit in answer.hits:
            assert any(m in hit.text for m in allowed), (principal, mode, hit.text, hit.acl)
        shown = json.dumps([[h.text, h.title, h.source] for h in answer.hits]
                           + [[c.text, c.source] for c in answer.citations])
        assert not self._forbidden_in(ref, principal, shown, question), (principal, mode, question)

    def _check_api(self, ref, principal, user, question, generate, stream) -> None:
        headers = {"Authorization": f"Bearer {self.keys[user]}"}
        r = self.http.post("/v1/query", headers=headers,
                           json={"question": question, "generate": False, "k": 10, "collection": self.collection})
        assert r.status_code in (200, 400, 404), r.text
        assert not self._forbidden_in(ref, principal, r.text, question), (user, question, r.text)
        if r.status_code == 200:
            allowed = {d.mark for d in ref.docs.values() if principal.can_read(d.acl)}
            for c in r.json()["citations"]:
                assert any(m in c["text"] for m in allowed), (user, c)
        if not generate:
            return
        client = openai.OpenAI(base_url=f"{self.svc.url}/v1", api_key=self.keys[user], max_retries=0, timeout=300)
        try:
            completion = client.chat.completions.create(
                model=self.collection, messages=[{"role": "user", "content": question}], max_tokens=6,
                stream=stream)
            # Streamed, every chunk (deltas and their annotations) is what the user saw.
            shown = "\n".join(c.model_dump_json() for c in completion) if stream else completion.model_dump_json()
        except openai.APIStatusError as e:  # 404 for a collection this user reads nothing of; 400s
            assert e.status_code in (400, 404), e
            shown = e.response.text
        assert not self._forbidden_in(ref, principal, shown, question), (user, question, shown)

    def _check_documents(self, ref, principal, user) -> None:
        headers = {"Authorization": f"Bearer {self.keys[user]}"}
        missing = self.http.get(f"/v1/documents/{self.collection}/999999999999", headers=headers)
        assert missing.status_code == 404
        allowed = {d.mark for d in ref.docs.values() if principal.can_read(d.acl)}
        for chunk_id, text in sorted(self.svc.chunk_ids(self.collection).items()):
            r = self.http.get(f"/v1/documents/{self.collection}/{chunk_id}", headers=headers)
            readable = any(m in text for m in allowed)
            if readable:
                assert r.status_code == 200 and r.json()["text"] == text, (user, chunk_id, r.text)
            else:
                # The same answer as for an id that does not exist: nothing says it is there.
                assert (r.status_code, r.content) == (missing.status_code, missing.content), (user, text)
        # A joined citation ("{id}+{id2}", a source read with its second chunk): both chunks of
        # one document, both readable, or the same 404. Neighbouring ids cross documents too.
        chunks = sorted(self.svc.chunk_ids(self.collection).items())
        for (a, text_a), (b, text_b) in zip(chunks, chunks[1:], strict=False):
            r = self.http.get(f"/v1/documents/{self.collection}/{a}+{b}", headers=headers)
            if r.status_code == 200:
                one, two = (self.http.get(f"/v1/documents/{self.collection}/{i}", headers=headers).json()
                            for i in (a, b))
                assert one["document"] == two["document"] == r.json()["document"], (user, a, b)
                assert all(t.split("\n\n", 1)[-1] in r.json()["text"] for t in (text_a, text_b))
                assert any(m in text_a for m in allowed) and any(m in text_b for m in allowed)
            else:
                assert (r.status_code, r.content) == (missing.status_code, missing.content), (user, a, b)

    def _check_models(self, ref, principal, user) -> None:
        r = self.http.get("/v1/models", headers={"Authorization": f"Bearer {self.keys[user]}"})
        assert r.status_code == 200
        listed = self.collection in {m["id"] for m in r.json()["data"]}
        stored = self.svc.chunk_ids(self.collection).values()
        allowed = {d.mark for d in ref.docs.values() if principal.can_read(d.acl)}
        if listed:  # named only to users who may read something in it
            assert any(m in t for t in stored for m in allowed), user


def _questions(ref: Reference, principal: Principal, step: int) -> list[str]:
    """Two questions: an unreadable (or deleted) document's exact text or marker when there is one,
    and a readable one's, else filler; `queries` in the store-level tests covers the odd syntax."""
    unreadable = sorted(d.texts[0] for d in ref.docs.values() if not principal.can_read(d.acl))
    gone = sorted(ref.gone)
    readable = sorted(d.mark for d in ref.docs.values() if principal.can_read(d.acl))
    hostile = (unreadable + gone) or ["freezer protocol"]
    friendly = readable or ["sequencer backup"]
    return [hostile[step % len(hostile)], f"What about {friendly[step % len(friendly)]}?"]


def test_the_service_never_shows_what_it_should_not(service):
    machine = type(f"ServiceMachine_{service.store}", (ServiceMachine,), {"SERVICE": service})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=scaled(2, 15), stateful_step_count=scaled(6, 12), deadline=None,
        suppress_health_check=list(HealthCheck)))

"""The `rag` command line: ingest, query, serve, keys, users, collections."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from rag.cli.audit import audit_app
from rag.cli.choices import ModeChoice, StoreChoice, plain
from rag.cli.db import db_app
from rag.cli.engine import engine_app
from rag.cli.eval import eval_command
from rag.cli.index import index_app
from rag.errors import RagError

app = typer.Typer(
    help="Permission-aware RAG over a lab's documents. Data lives in --home (default ./.rag, "
    "or RAG_HOME).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="API keys for `rag serve` (each stands for a user and groups).",
                       no_args_is_help=True)
users_app = typer.Typer(help="The user directory: which groups each user belongs to (in PostgreSQL with "
                        "store = pgvector, shared by every replica).",
                        no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(db_app, name="db")
app.add_typer(users_app, name="users")
app.add_typer(index_app, name="index")
app.add_typer(engine_app, name="engine")
app.add_typer(audit_app, name="audit")
app.command("eval")(eval_command)

_state: dict[str, object] = {}

Home = Annotated[Path | None, typer.Option("--home", help="data directory (default: RAG_HOME or ./.rag)")]
Collection = Annotated[str | None, typer.Option("--collection", "-c", help="collection name (default: 'default')")]
Store = Annotated[StoreChoice | None, typer.Option(
    "--store", help="where chunks live: faiss (default), faiss-hnsw, faiss-ivf, memory or pgvector")]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON (for scripts)")]
Dsn = Annotated[str | None, typer.Option(
    "--dsn", help="PostgreSQL URL for --store pgvector (default: the server of `rag db start`)")]


def _err(message: str) -> None:
    typer.echo(f"error: {message}", err=True)


def _rag(home: Path | None = None, **overrides: object):
    from rag.pipeline import Rag
    from rag.settings import load_settings

    settings = load_settings(home=home or _state.get("home"), **{k: plain(v) for k, v in overrides.items()})
    return Rag(settings)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"labrag {version('labrag')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("labrag (not installed)")
        raise typer.Exit()


@app.callback()
def _main(
    home: Home = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log what happens")] = False,
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="print the version and exit")] = False,
) -> None:
    _state["home"] = home
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _parse_size(text: str | None, flag: str) -> int | None:
    """'200M' -> 209715200 (binary units; a trailing B or iB is allowed: 200MB, 200MiB)."""
    if text is None:
        return None
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise typer.BadParameter(f"{text!r} is not a size: use bytes or a number with K, M, G or T "
                                 "(e.g. 200M)", param_hint=flag)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(
        help="files or directories to ingest (md, txt, html, pdf, docx, jsonl)")],
    collection: Collection = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
    store: Store = None,
    dsn: Dsn = None,
    shard: Annotated[int | None, typer.Option(
        "--shard", help="ingest only shard I (0..N-1) of the documents, for job arrays (default: from "
        "SLURM_ARRAY_TASK_ID)")] = None,
    num_shards: Annotated[int | None, typer.Option(
        "--num-shards", help="number of shard jobs N (default: SLURM_ARRAY_TASK_COUNT; 1 turns sharding off)")] = None,
    max_delete_fraction: Annotated[float | None, typer.Option(
        "--max-delete-fraction", min=0.0, max=1.0,
        help="delete at most this share of the collection's documents in one run (of this shard's, "
        "in a job array); past it nothing is deleted and the run fails (default 0.5, or "
        "max_delete_fraction)")] = None,
    allow_mass_delete: Annotated[bool, typer.Option(
        "--allow-mass-delete", help="the sources are really gone: delete them however many, even "
        "all of those under a path that now yields nothing (an empty or unmounted directory is "
        "refused without it)")] = False,
    max_document_bytes: Annotated[str | None, typer.Option(
        "--max-document-bytes", metavar="SIZE",
        help="skip (and list) sources larger than SIZE: bytes, or with a unit (500K, 200M, 2G; "
        "binary units); 0 = no cap (default 100M, or max_document_bytes). A skipped source's "
        "stored version, if any, stays as it was")] = None,
) -> None:
    """Ingest documents with their permissions; re-running only redoes what changed.

    ACLs come from sidecar `.rag-acl.toml` files (nearest up the tree wins), JSONL `acl`
    fields, or else the files' POSIX owner/group/mode. Exit code 1 if any source failed.

    A document whose ACL cannot be determined (broken or unreadable sidecar, bad JSONL `acl`,
    an owner with no name) is stored or kept readable by nobody until it is fixed, and listed as
    such (`acl_errors` in --json; exit 1). ACLs that let more principals in than before are
    listed as a warning (`widened`; exit 0). A path that yields nothing while the collection holds documents from it,
    or deleting more than --max-delete-fraction of the collection, is refused (nothing deleted,
    exit 2 / 1) unless --allow-mass-delete.

    With --shard I --num-shards N (or inside a Slurm job array) the job takes a stable hash
    partition of the documents: with --store pgvector it writes into the collection, otherwise
    into a shard directory that `rag index merge` joins into the collection once all N are done.
    """
    from ingest.heap import fix_mmap_threshold
    from rag.cli.progress import IngestProgress
    from rag.shards.run import ingest_shard, resolve_shard

    fix_mmap_threshold()  # flat memory over long runs (see ingest/heap.py)
    for p in paths:
        if not p.exists():
            raise RagError(f"path not found: {p}")
    sharding = resolve_shard(shard, num_shards, os.environ)
    rag = _rag(store=store, dsn=dsn, max_delete_fraction=max_delete_fraction,
               max_document_bytes=_parse_size(max_document_bytes, "--max-document-bytes"))
    started = time.perf_counter()
    show = sys.stderr.isatty() and not as_json
    with IngestProgress(enabled=show) as bar:
        # Before the bar starts counting documents; in a worker process where ingest_embed_process
        # says so (touching `rag.embedder` here would load the query embedder in this process).
        rag.load_ingest_embedder()
        progress = bar.update
        if sharding is None:
            # Says so up front when this run builds a new version of the collection.
            notice = rag.collection(collection, create=True).notice
            if notice:
                bar.notice(notice)
            report = rag.ingest(paths, collection, progress, allow_mass_delete=allow_mass_delete)
            shard_run = None
        else:
            shard_run = ingest_shard(rag, paths, collection, *sharding, progress=progress,
                                     allow_mass_delete=allow_mass_delete)
            report = shard_run.report
    elapsed = time.perf_counter() - started
    name = collection or rag.settings.collection
    # An embedded shard writes its own directory: the collection itself may not exist yet.
    stats = shard_run.stats if shard_run is not None else rag.collection(collection).stats()
    shard_dir = shard_run.directory if shard_run is not None else None
    if as_json:
        out = report.as_dict() | {"collection": name, "wall_seconds": round(elapsed, 2),
                                  "collection_stats": stats,
                                  "shard": shard_run.shard if shard_run else None,
                                  "num_shards": shard_run.num_shards if shard_run else None,
                                  "shard_dir": str(shard_dir) if shard_dir else None}
        typer.echo(json.dumps(out, indent=2))
    else:
        where = f"collection {name!r}"
        if shard_run is not None:
            where += f" shard {shard_run.shard} of {shard_run.num_shards}"
        typer.echo(
            f"{where}: {report.added} added, {report.updated} updated, "
            f"{report.acl_updated} ACL-only updates, {report.unchanged} unchanged, "
            f"{report.deleted} deleted; {report.chunks_written} chunks written "
            f"({report.tokens_embedded} tokens embedded) in {elapsed:.1f}s"
        )
        if shard_dir is not None:
            typer.echo(f"shard now {stats['documents']} documents, {stats['chunks']} chunks in {shard_dir}; "
                       f"run `rag index merge --collection {name}` once all {shard_run.num_shards} shards are done")
        else:
            typer.echo(f"now {stats['documents']} documents, {stats['chunks']} chunks")
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items())
        rates = report.rates()
        typer.echo(f"time by stage: {stages}; {rates['documents_per_second']} documents/s, embedding "
                   f"{rates['embed_chunks_per_second']} chunks/s ({rates['embed_tokens_per_second']} tokens/s)")
        if report.build is not None:
            typer.echo(report.build.summary())
        if report.skipped:
            typer.echo(f"{len(report.skipped)} source(s) over the size cap, not read (--max-document-bytes; "
                       "a version ingested before stays as it was):")
        for s in report.skipped:
            typer.echo(f"  {s.key}: {s.bytes:,} bytes, cap {s.max_bytes:,}")
        if report.chunks_resumed:
            typer.echo(f"{report.chunks_resumed} chunks embedded by an interrupted run were reused")
        if report.problems:
            typer.echo(f"{len(report.problems)} source(s) skipped:")
            for p in report.problems:
                typer.echo(f"  {p.key}: {p.reason}")
        _echo_acl_report(report)
    if not report.ok:
        raise typer.Exit(1)


def _echo_acl_report(report) -> None:
    """The ACL part of the ingest summary: what nobody may read now, what more may, what was not deleted."""
    if report.acl_errors:
        typer.echo(f"{len(report.acl_errors)} document(s) readable by nobody until their ACL is fixed:")
        for a in report.acl_errors:
            typer.echo(f"  {a.source}: {a.error}")
    if report.widened:
        typer.echo(f"warning: {len(report.widened)} document(s) readable by more principals than before:")
        for w in report.widened:
            typer.echo(f"  {w.source}: {', '.join(sorted(w.before)) or '(nobody)'} -> "
                       f"{', '.join(sorted(w.after)) or '(nobody)'}")
    if report.deletion_refused is not None:
        typer.echo(f"error: {report.deletion_refused.message()}")


@app.command()
def query(
    question: Annotated[str, typer.Argument(help="the question")],
    user: Annotated[str | None, typer.Option(
        "--as", help="ask as this user (registered or a system user); local queries only")] = None,
    group: Annotated[list[str] | None, typer.Option(
        "--group", "-g", help="extra group for this query (repeatable); local queries only")] = None,
    k: Annotated[int | None, typer.Option("--k", help="number of sources (default 5)")] = None,
    no_generate: Annotated[bool, typer.Option("--no-generate", help="retrieve and rerank only")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    collection: Collection = None,
    mode: Annotated[ModeChoice | None, typer.Option(
        "--mode", help="retrieval: dense (embeddings), keyword (BM25 / full text) or hybrid "
        "(both, fused; the default)")] = None,
    no_rerank: Annotated[bool, typer.Option("--no-rerank", help="skip the cross-encoder")] = False,
    store: Store = None,
    dsn: Dsn = None,
    server: Annotated[str | None, typer.Option(
        "--server", envvar="RAG_SERVER", metavar="URL",
        help="ask a running `rag serve` at URL (e.g. http://gpu01:8000) instead of loading the models here; "
        "its API key (from `rag keys create`) says who asks: RAG_API_KEY, or --key-file")] = None,
    key_file: Annotated[Path | None, typer.Option(
        "--key-file", envvar="RAG_API_KEY_FILE", metavar="FILE",
        help="with --server: a file holding the API key (chmod 600; keys never go on the command line)")] = None,
) -> None:
    """Answer a question from the documents USER may read, with numbered citations.

    Citations show a relevance from 0 to 1 (the cross-encoder's probability that the source
    answers the question); without the reranker they show their rank instead. --json keeps
    the raw `score` beside `relevance` and `rank`.

    Every local query loads the models first (seconds); with --server URL (or RAG_SERVER) it
    asks a running `rag serve`, which keeps them loaded, and answers from what its key may read.
    """
    if server:
        _query_server(server, key_file, question, user=user, group=group, store=store, dsn=dsn,
                      no_rerank=no_rerank, collection=collection, k=k, generate=not no_generate,
                      mode=plain(mode), as_json=as_json)
        return
    if user is None:
        raise RagError("who asks? pass --as USER for a local query, or --server URL (or RAG_SERVER) to ask a "
                       "running `rag serve` with your API key")
    rag = _rag(store=store, dsn=dsn)
    try:
        principal = rag.principal(user, group or [])
        answer = rag.query(question, principal, collection=collection, k=k, generate=not no_generate,
                           rerank=False if no_rerank else None, mode=plain(mode))
    finally:
        rag.close()  # stops the engine's step thread before the interpreter exits
    _print_answer(answer_to_dict(answer, principal, rag.answer_mode if not no_generate else None), as_json)
    from rag.query_client import load_hint

    hint = load_hint(answer.timings)
    if hint:
        typer.echo(hint, err=True)


def _query_server(server: str, key_file: Path | None, question: str, *, user: str | None,
                  group: list[str] | None, store: object, dsn: str | None, no_rerank: bool,
                  collection: str | None, k: int | None, generate: bool, mode: str | None,
                  as_json: bool) -> None:
    """`rag query --server`: the key names the user, and the server's own settings choose the store."""
    from rag.query_client import ServerQueryError, query_server, resolve_api_key

    local_only = [flag for flag, given in (("--as", user is not None), ("--group", bool(group)),
                                           ("--store", store is not None), ("--dsn", dsn is not None),
                                           ("--no-rerank", no_rerank)) if given]
    if local_only:
        raise RagError(f"{', '.join(local_only)} cannot be used with --server (or RAG_SERVER): the server's "
                       "API key says who asks and its own settings choose the store; drop them, or unset "
                       "RAG_SERVER for a local query")
    key = resolve_api_key(key_file, os.environ)
    try:
        result = query_server(server, key, question, collection=collection, k=k, generate=generate, mode=mode)
    except ServerQueryError as e:
        _err(str(e))
        raise typer.Exit(e.exit_code) from None
    _print_answer(result, as_json)


def _print_answer(result: dict, as_json: bool) -> None:
    """A query's answer (the dict of `answer_to_dict`, local or from a server) for people or scripts."""
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    if result["answer"] is not None:
        typer.echo(result["answer"])
        if result.get("answer_mode"):
            typer.echo(f"({ANSWER_MODE_NOTES.get(result['answer_mode'], result['answer_mode'])})")
        typer.echo("")
    if not result["citations"]:
        typer.echo(f"(no sources that {result['user']} may read match this question)")
    for c in result["citations"]:
        typer.echo(f"[{c['number']}] {_display_path(c['source'])} (chunk {c['chunk']}, {_shown_relevance(c)})")
    if result["timings_ms"]:
        typer.echo(f"({', '.join(f'{k} {v:.0f} ms' for k, v in result['timings_ms'].items())})", err=True)


def _shown_relevance(citation: dict) -> str:
    """'relevance 0.97' where the reranker gave one, else the rank (a search score is not a probability)."""
    if citation.get("relevance") is not None:
        return f"relevance {citation['relevance']:.2f}"
    if citation.get("rank") is not None:
        return f"rank {citation['rank']}"
    return f"score {citation['score']:.3f}"


# How the answer above was written (settings.answer_mode; "auto" extracts with a small generator).
ANSWER_MODE_NOTES = {
    "extract": "answer mode: extract - sentences quoted from the sources, best supported first; "
               "answer_mode = \"generate\" lets the model write",
    "generate": "answer mode: generate - written by the generator",
}


def answer_to_dict(answer, principal, answer_mode: str | None = None) -> dict:
    """A local answer in the --json shape (also what `rag.query_client.response_to_dict` returns).

    Args:
        answer_mode: "extract" or "generate" (how the text was written), None without an answer.
    """
    return {
        "question": answer.question,
        "user": principal.user,
        "groups": sorted(principal.groups),
        "answer": answer.text,
        "answer_mode": answer_mode,
        "citations": [
            {"number": c.number, "source": c.source, "document": c.document_key,
             "chunk": c.chunk_index, "score": round(c.score, 4),
             "relevance": None if c.relevance is None else round(c.relevance, 4), "rank": c.rank,
             "text": c.text}
            for c in answer.citations
        ],
        "timings_ms": {k: round(v * 1000, 1) for k, v in answer.timings.items()},
    }


def _display_path(source: str) -> str:
    if not source.startswith("/"):  # a path under its ingest root, or a URL (source_urls)
        return source
    try:
        return os.path.relpath(source)
    except ValueError:
        return source


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default 8000)")] = None,
    store: Store = None,
    dsn: Dsn = None,
    generator_url: Annotated[str | None, typer.Option(
        "--generator-url", help="generate on this OpenAI-compatible server (vLLM, SGLang, LiteLLM, `rag engine "
        "serve`), e.g. http://gpu01:8001/v1; its key goes in RAG_GENERATOR_API_KEY or generator_api_key_file")] = None,
    generator_model: Annotated[str | None, typer.Option(
        "--generator-model", help="model id on that server (default: the first it lists)")] = None,
    max_concurrent: Annotated[int | None, typer.Option(
        "--max-concurrent", help="answers generated at once (default 64)")] = None,
    max_queued: Annotated[int | None, typer.Option(
        "--max-queued", help="questions waiting for a slot before new ones get 429 (default 256)")] = None,
    log_format: Annotated[str | None, typer.Option(
        "--log-format", help="text (default) or json: one JSON object per line, with the request id")] = None,
) -> None:
    """Serve the query API and the OpenAI-compatible chat API.

    Routes: POST /v1/query (JSON or server-sent events), GET /v1/models, POST /v1/chat/completions,
    GET /v1/documents/COLLECTION/CHUNK, GET /healthz, GET /readyz. Every /v1 route takes
    `Authorization: Bearer KEY` (keys from `rag keys create`).
    """
    import uvicorn

    from rag.api.app import create_app
    from rag.api.logs import configure_logging
    from rag.settings import load_settings

    backend = "remote" if generator_url else None
    settings = load_settings(home=_state.get("home"), host=host, port=port, store=store, dsn=dsn,
                             generator_backend=backend, generator_url=generator_url,
                             generator_model=generator_model, max_concurrent_generations=max_concurrent,
                             max_queued_generations=max_queued, log_format=log_format)
    log_config = configure_logging(settings.log_format)  # our access lines replace uvicorn's
    uvicorn.run(create_app(settings, freeze_heap=True), host=settings.host, port=settings.port, log_level="info",
                log_config=log_config, access_log=False)


@app.command("collections")
def collections(store: Store = None, dsn: Dsn = None, as_json: AsJson = False) -> None:
    """List collections with their document and chunk counts."""
    rag = _rag(store=store, dsn=dsn)
    rows = []
    for name in rag.collection_names():
        index = rag.collection(name)
        info, stats = index.info, index.stats()
        rows.append({"name": name, "documents": stats["documents"], "chunks": stats["chunks"],
                     "embedder": info.embedder, "dim": info.dim})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no collections yet: run `rag ingest PATH`")
    for r in rows:
        typer.echo(f"{r['name']}: {r['documents']} documents, {r['chunks']} chunks, "
                   f"embedder {r['embedder']} ({r['dim']} dims)")


@keys_app.command("create")
def keys_create(
    user: Annotated[str | None, typer.Option("--user", help="the user this key stands for")] = None,
    group: Annotated[list[str] | None, typer.Option(
        "--group", "-g", help="register a new user with this group (repeatable); a registered user's key "
        "takes their groups from the directory (`rag users add`) at every request")] = None,
    scope: Annotated[list[str] | None, typer.Option(
        "--scope", help="restrict the key to this one of its user's groups (repeatable); never widens")] = None,
    label: Annotated[str | None, typer.Option(help="a note to tell keys apart")] = None,
    proxy: Annotated[bool, typer.Option(
        "--proxy", help="a front-end key (Open WebUI, LibreChat, LiteLLM): it names its user in a header "
        "(proxy_user_headers), who must be registered with `rag users add`; groups come from there")] = False,
    admin: Annotated[bool, typer.Option(
        "--admin", help="an operator's key: API answers carry per-stage timings (timings_ms), which other "
        "keys never get because they depend on documents the caller may not read; access to documents "
        "is unchanged")] = False,
) -> None:
    """Create an API key; it is printed once and stored only as a hash."""
    key = _rag().identity.create_key(user, group or [], label, proxy=proxy, scope=scope or None, admin=admin)
    typer.echo(key)


@keys_app.command("list")
def keys_list(as_json: AsJson = False) -> None:
    """List keys (ids, users, their groups now, scopes; never the keys themselves)."""
    identity = _rag().identity
    admins = identity.admin_key_ids()
    if as_json:
        typer.echo(json.dumps([
            {"id": k.key_id, "kind": k.kind, "user": k.user or None, "label": k.label, "revoked": k.revoked,
             "admin": k.key_id in admins, "scope": None if k.scope is None else list(k.scope),
             "groups": None if k.is_proxy else sorted(identity.key_groups(k.user, k.scope)),
             "created_at": k.created_at} for k in identity.list_keys()], indent=2))
        return
    for k in identity.list_keys():
        state = "revoked" if k.revoked else "active"
        if k.key_id in admins:
            state += "  admin"
        if k.is_proxy:
            typer.echo(f"{k.key_id}  (proxy: names its user in a header)  {state}  {k.label or ''}")
            continue
        groups = identity.key_groups(k.user, k.scope)
        scope = "" if k.scope is None else f"  scope={','.join(k.scope) or '-'}"
        typer.echo(f"{k.key_id}  {k.user}  groups={','.join(sorted(groups)) or '-'}{scope}  {state}  {k.label or ''}")


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="key id from `rag keys list`")]) -> None:
    """Revoke a key: requests with it get 401 from then on."""
    _rag().identity.revoke_key(key_id)
    typer.echo(f"revoked {key_id}")


@users_app.command("add")
def users_add(
    name: Annotated[str, typer.Argument(help="user name")],
    group: Annotated[list[str] | None, typer.Option("--group", "-g", help="group (repeatable)")] = None,
) -> None:
    """Register a user with their groups (replaces the groups of an existing user)."""
    p = _rag().identity.add_user(name, group or [])
    typer.echo(f"{p.user}: {', '.join(sorted(p.groups)) or '(no groups)'}")


@users_app.command("list")
def users_list(as_json: AsJson = False) -> None:
    """List registered users and their groups."""
    users = _rag().identity.users()
    if as_json:
        typer.echo(json.dumps([{"user": p.user, "groups": sorted(p.groups)} for p in users], indent=2))
        return
    for p in users:
        typer.echo(f"{p.user}: {', '.join(sorted(p.groups)) or '(no groups)'}")


@users_app.command("migrate")
def users_migrate(dsn: Dsn = None) -> None:
    """Copy this data directory's users and API keys into PostgreSQL, where store = pgvector keeps them.

    With store = pgvector every `rag serve` replica reads users, groups and keys from the store's
    database. This copies those of the data directory (--home) there: users with their groups,
    and keys as they are (hashes only, revoked ones stay revoked, scopes and admin flags kept), so
    keys handed out before keep working. Safe to run again: what is there already is skipped; a
    user registered in both with other groups keeps the database's groups and is listed.
    """
    from permissions.identity import IdentityStore
    from rag.identity_backend import store_dsn
    from rag.pg_identity import PgIdentityStore
    from rag.settings import load_settings
    from retrieval.stores.pgvector.schema import mask_dsn

    settings = load_settings(home=_state.get("home"), dsn=dsn)
    if not settings.catalog_path.exists():
        raise RagError(f"no users or keys to copy: {settings.catalog_path} does not exist (is --home right?)")
    target = store_dsn(settings)
    source, shared = IdentityStore(settings.catalog_path), PgIdentityStore(target)
    try:
        users, keys = source.users(), source.key_records()
        report = shared.import_records(users, keys)
    finally:
        source.close()
        shared.close()
    typer.echo(f"copied {report.users_added} of {len(users)} users and {report.keys_added} of {len(keys)} keys "
               f"to {mask_dsn(target)} (the rest were there already)")
    for user in report.conflicts:
        typer.echo(f"  {user}: registered there with other groups, kept as they are there "
                   f"(change them with `rag users add {user} -g ...` under store = pgvector)")
    if settings.store != "pgvector":
        typer.echo("note: this data directory's store is not pgvector: set store = \"pgvector\" and dsn "
                   "(rag.toml or RAG_STORE / RAG_DSN) for `rag serve` and `rag keys` to use them")


def main() -> None:
    """Entry point: one-line errors and a non-zero exit for anything the user can fix."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # The tokenizer's threads are much of the GPU embedder's speed (its lead over
    # sentence-transformers falls from 5.6-7.8x to 1.7-2x without them: docs/benchmarks.md).
    # Saying "true" keeps them and silences tokenizers' fork warning: our embed workers are
    # spawned, never forked, and the children we fork (Postgres tools, runuser) exec at once.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # Our model loads silence third-party bars themselves (rag/quiet.py, as in notebooks); a
    # command has no user settings to keep, so it also turns them off process-wide as a backstop.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF converter's bar, too
    # Everything a `rag` command writes is lab data (chunk text, keys, logs): owner-only even where a
    # third-party writer ignores rag.private_files. The library itself never touches the umask.
    os.umask(os.umask(0o077) | 0o077)
    try:
        app()
    except RagError as e:
        _err(str(e))
        sys.exit(2)
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()

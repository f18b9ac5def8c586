"""`rag index ...`: maintenance of a collection's index; `merge` joins the Faiss shards of a job array."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer

from rag.cli.choices import StoreChoice, plain

index_app = typer.Typer(help="Collection indexes: join the Faiss shards written by `rag ingest --shard`.",
                        no_args_is_help=True)


@index_app.command()
def merge(
    ctx: typer.Context,
    collection: Annotated[str | None, typer.Option(
        "--collection", "-c", help="collection name (default: 'default')")] = None,
    keep_shards: Annotated[bool, typer.Option(
        "--keep-shards", help="leave the shard directories in place after merging")] = False,
    num_shards: Annotated[int | None, typer.Option(
        "--num-shards", min=1, help="which run to merge when shards of several shard counts are present")] = None,
    store: Annotated[StoreChoice | None, typer.Option(
        "--store", help="the collection's vector index: faiss (default), faiss-hnsw, faiss-ivf or memory")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Join the shards of `rag ingest --shard I --num-shards N` into the collection.

    All N shards must be there and finished. The collection ends as one `rag ingest` over the
    same paths would leave it (shards built with another embedder or chunking make its next
    version, as that job would); nothing is re-embedded, unchanged documents are not rewritten,
    and merging the same shards again changes nothing. The shard directories are removed
    afterwards unless --keep-shards.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rag.pipeline import Rag
    from rag.settings import load_settings
    from rag.shards.merge import merge_shards

    # `rag --home DIR index merge`: the top-level callback's option lives on the root context.
    rag = Rag(load_settings(home=ctx.find_root().params.get("home"), store=plain(store)))
    started = time.perf_counter()
    show = sys.stderr.isatty() and not as_json
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True, disable=not show) as bar:
        task = bar.add_task("reading shards", total=None)

        def progress(stage: str, done: int, total: int) -> None:
            bar.update(task, description="merging", completed=done, total=total)

        report = merge_shards(rag, collection, keep_shards=keep_shards, num_shards=num_shards, progress=progress)
    elapsed = time.perf_counter() - started
    stats = rag.collection(report.collection).stats()
    if as_json:
        out = report.as_dict() | {"wall_seconds": round(elapsed, 2), "collection_stats": stats}
        typer.echo(json.dumps(out, indent=2))
        return
    c = report.counts
    if report.already_merged:
        typer.echo(f"collection {report.collection!r}: its {report.num_shards} shards were merged already; "
                   "nothing to do")
    else:
        typer.echo(
            f"collection {report.collection!r}: merged {report.num_shards} shards: {c.added} added, "
            f"{c.updated} updated, {c.acl_updated} ACL-only updates, {c.unchanged} unchanged, {c.deleted} deleted; "
            f"{c.chunks_written} chunks copied in {elapsed:.1f}s")
    if report.build is not None:  # the shards were built with another embedder or chunking
        typer.echo(report.build.summary())
    typer.echo(f"now {stats['documents']} documents, {stats['chunks']} chunks")
    if report.shards_removed:
        typer.echo(f"removed the shard directories under {report.shards_root}")
    elif not report.already_merged or keep_shards:
        typer.echo(f"kept the shard directories under {report.shards_root}")

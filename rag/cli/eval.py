"""`rag eval`: a labelled question set over configurations, as a table, CSV or JSON; exit 1 on any leak."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from rag.cli.choices import StoreChoice, plain
from rag.errors import ConfigError

_CONFIG_HELP = (
    "a configuration to run, as key=value pairs separated by commas (repeatable; default: the "
    "settings' hybrid + rerank). Keys: mode (dense, keyword, hybrid), rerank (on/off), k, candidates, "
    "dense_feedback (on/off: hybrid's third, pseudo-relevance-feedback leg), max_hits_per_document (at most N of "
    "the k hits from one document, default 1, whose sources are then read with their second chunk; 0: no "
    "cap), page_evidence (0..1: with one hit a document, the weight of a "
    "document's second-best chunk in its rank), chunk (max tokens), overlap, title_context (on/off), embedder, "
    "store, name. E.g. --config mode=dense,rerank=off --config mode=hybrid,k=10 --config "
    "mode=hybrid,dense_feedback=off,max_hits_per_document=2 --config chunk=100,overlap=16. Unset keys take the "
    "settings' values. Retrieval keys apply per query; chunking, embedder and store variants are built once "
    "in HOME/experiments and reused")


def eval_command(
    ctx: typer.Context,
    questions: Annotated[Path, typer.Option(
        "--questions", "-q", metavar="FILE|DIR",
        help="labelled questions: a JSONL file (see examples/questions.jsonl) or a BEIR folder "
        "(corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv), whose corpus is ingested into its own collection")],
    root: Annotated[Path | None, typer.Option(
        "--root", metavar="DIR", help="the directory you ingested: a JSONL set's labels are paths under it "
        "(needed for a JSONL file)")] = None,
    config: Annotated[list[str] | None, typer.Option("--config", help=_CONFIG_HELP)] = None,
    collection: Annotated[str | None, typer.Option(
        "--collection", "-c", help="collection to ask (default: 'default'; a BEIR set gets its own)")] = None,
    generate: Annotated[bool, typer.Option(
        "--generate", help="also generate answers and score them: citation precision, expected fact, "
        "refusals (slow on a CPU)")] = False,
    ks: Annotated[str, typer.Option("--ks", help="the k of the recall@k and nDCG@k columns")] = "1,3,5,10",
    split: Annotated[str, typer.Option("--split", help="which qrels of a BEIR folder to use")] = "test",
    csv_out: Annotated[Path | None, typer.Option(
        "--csv", metavar="FILE", help="write one row per question x configuration as CSV ('-': stdout)")] = None,
    json_out: Annotated[Path | None, typer.Option(
        "--json", metavar="FILE", help="write the summary and every row as JSON ('-': stdout)")] = None,
    store: Annotated[StoreChoice | None, typer.Option(
        "--store", help="where the collection lives: faiss (default), faiss-hnsw, faiss-ivf, memory or "
        "pgvector")] = None,
    dsn: Annotated[str | None, typer.Option("--dsn", help="PostgreSQL URL for --store pgvector")] = None,
) -> None:
    """Measure retrieval (and answers) on a labelled question set, per configuration.

    Each question is asked as its user (`user`, `groups` in the set) through the same path as
    `rag query`. Prints recall@k, MRR and nDCG@k per configuration over the questions whose
    asker may read an answer source (decided by the stored ACLs), the leaks, and the median
    latency. A leak is any source in the results that the asker may not read, or that the set
    lists as `forbidden`: they are listed and the exit code is 1. Exit 2 on a usage error.
    """
    from rag.experiments import Experiment, parse_config, read_questions, summarize
    from rag.experiments.summary import leaks
    from rag.pipeline import Rag
    from rag.settings import load_settings

    k_values = _parse_ks(ks)
    configs = [parse_config(c) for c in config or []] or None
    qset = read_questions(questions, split)
    if qset.corpus is None and root is None:
        raise ConfigError(f"{questions} labels its sources by path: pass --root DIR, the directory you ingested "
                          "(e.g. --root examples/lab-docs)")
    if root is not None and not root.is_dir():
        raise ConfigError(f"--root {root} is not a directory")
    rag = Rag(load_settings(home=ctx.find_root().params.get("home"), store=plain(store), dsn=dsn))
    quiet = "-" in (str(csv_out), str(json_out))
    try:
        with Experiment(rag, root=root, collection=collection, progress=False if quiet else None) as exp:
            df = exp.run(qset, configs, generate=generate, ks=k_values)
    finally:
        rag.close()
    summary = summarize(df)
    if csv_out is not None:
        _write(csv_out, _flat(df).to_csv(index=False))
    if json_out is not None:
        payload = {"questions": str(questions), "summary": _records(summary.reset_index()), "rows": _records(df)}
        _write(json_out, json.dumps(payload, indent=2, default=str))
    _print_table(summary, to_stderr=quiet)
    found = leaks(df)
    if len(found):
        typer.echo(f"error: {int(df['leaks'].sum())} leaked source(s): the asker may not read them", err=True)
        for r in found.itertuples():
            typer.echo(f"  {r.config}: {r.user} asked {r.question!r}: {', '.join(r.leaked_sources)}", err=True)
        raise typer.Exit(1)


def _parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise ConfigError(f"--ks takes whole numbers separated by commas, e.g. 1,3,5,10; got {text!r}") from None
    if not ks or ks[0] < 1:
        raise ConfigError(f"--ks needs at least one k of 1 or more, got {text!r}")
    return ks


def _write(target: Path, text: str) -> None:
    if str(target) == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        target.write_text(text, encoding="utf-8")


def _flat(df):
    """List cells (retrieved and leaked sources) as 'a; b' for CSV readers."""
    out = df.copy()
    for col in ("retrieved", "leaked_sources"):
        out[col] = out[col].map("; ".join)
    return out


def _records(df) -> list[dict]:
    """Rows as plain JSON values (NaN as null, numpy numbers as Python ones)."""
    return [{k: _plain(v) for k, v in row.items()} for row in df.to_dict(orient="records")]


def _plain(value):
    if hasattr(value, "item") and not isinstance(value, list | str):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if value is not None and type(value).__name__ == "NAType":
        return None
    return value


def _print_table(summary, to_stderr: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rag eval: per configuration (metrics over answerable questions)")
    table.add_column("config")
    for col in summary.columns:
        table.add_column(col, justify="right")
    for config, row in summary.iterrows():
        cells = []
        for col in summary.columns:
            value = row[col]
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append("-")
            elif col == "leaks" and value:
                cells.append(f"[bold red]{int(value)}[/]")
            elif isinstance(value, float) and not value.is_integer():
                cells.append(f"{value:.3f}" if col != "median_ms" else f"{value:.1f}")
            else:
                cells.append(str(int(value)) if isinstance(value, float) else str(value))
        table.add_row(str(config), *cells)
    Console(stderr=to_stderr, width=200 if not sys.stdout.isatty() else None).print(table)

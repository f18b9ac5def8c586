"""Per-configuration summaries of an experiment's rows, and the leak check.

Means are over the questions a metric is defined for: recall, MRR and nDCG over answerable
questions (the asker may read an answer source), refusals over all of them. Latencies are
medians of the per-question milliseconds, loads excluded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration (in run order): counts, mean metrics, leaks, median latency."""
    import pandas as pd

    metric_cols = [c for c in df.columns if c.startswith(("recall@", "ndcg@"))] + ["mrr"]
    out = []
    for config, group in df.groupby("config", sort=False):
        answerable = group[~group["should_refuse"]]
        row = {"config": config, "questions": len(group), "answerable": len(answerable),
               "should_refuse": int(group["should_refuse"].sum())}
        for col in metric_cols:
            values = answerable[col].dropna()
            if len(values):  # recall@10 of a k=5 configuration is not a number to show
                row[col] = round(float(values.mean()), 4)
        row["leaks"] = int(group["leaks"].sum())
        row["median_ms"] = round(float(group["total_ms"].median()), 1)
        if "refusal" in group:
            outcomes = group["refusal"].value_counts()
            row |= {"correct_refusals": int(outcomes.get("correct refusal", 0)),
                    "wrong_answers": int(outcomes.get("wrong answer", 0)),
                    "false_refusals": int(outcomes.get("false refusal", 0)),
                    "citation_precision": _mean(group["citation_precision"]),
                    "expected_found": _mean(group["expected_found"])}
        out.append(row)
    return pd.DataFrame(out).set_index("config")


def leaks(df: pd.DataFrame) -> pd.DataFrame:
    """The rows where a source the asker may not read came back, with those sources."""
    return df.loc[df["leaks"] > 0, ["config", "question_id", "question", "user", "groups", "leaked_sources"]]


def assert_no_leaks(df: pd.DataFrame) -> None:
    """Raise AssertionError naming every leak (question, user, source); the check CI and `rag eval` run."""
    found = leaks(df)
    if len(found):
        lines = [f"  {r.config}: {r.user} asked {r.question!r} and got {', '.join(r.leaked_sources)}"
                 for r in found.itertuples()]
        raise AssertionError(f"{int(df['leaks'].sum())} leaked source(s):\n" + "\n".join(lines))


def _mean(column: pd.Series) -> float | None:
    values = column.dropna().astype(float)
    return round(float(values.mean()), 4) if len(values) else None

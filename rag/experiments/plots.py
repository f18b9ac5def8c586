"""Plots of an experiment's rows: recall@k curves per configuration, latency per stage.

Each returns a matplotlib Figure (a notebook shows it; `fig.savefig("recall.png")` writes it).
Figures are closed in pyplot's registry before they are returned, so a notebook cell shows
each once, and a script holds no global figure state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag.experiments.runner import STAGES

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure


def plot_recall(df: pd.DataFrame, title: str = "Recall@k by configuration") -> Figure:
    """Mean recall@k over answerable questions, one line per configuration, k on the x axis."""
    fig, ax = _figure()
    answerable = df[~df["should_refuse"]]
    ks = sorted(int(c.split("@")[1]) for c in df.columns if c.startswith("recall@") and df[c].notna().any())
    for config, group in answerable.groupby("config", sort=False):
        points = [(k, group[f"recall@{k}"].mean()) for k in ks if group[f"recall@{k}"].notna().any()]
        ax.plot([k for k, _ in points], [r for _, r in points], marker="o", label=config)
    ax.set(xlabel="k (hits)", ylabel="recall (share of readable answer sources found)", title=title,
           ylim=(0, 1.05), xticks=ks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_latency(df: pd.DataFrame, title: str = "Latency per stage (mean per question)") -> Figure:
    """A stacked bar per configuration: mean milliseconds of each pipeline stage (loads excluded)."""
    fig, ax = _figure()
    configs = list(dict.fromkeys(df["config"]))
    means = df.groupby("config", sort=False)[[f"{s}_ms" for s in STAGES]].mean().reindex(configs).fillna(0.0)
    left = [0.0] * len(configs)
    for stage in STAGES:
        values = means[f"{stage}_ms"].tolist()
        if any(values):
            ax.barh(configs, values, left=left, label=stage)
            left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set(xlabel="milliseconds", title=title)
    ax.invert_yaxis()  # the first configuration on top, as in the tables
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def _figure():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    plt.close(fig)
    return fig, ax

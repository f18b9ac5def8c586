"""Retrieval and answer experiments that return data: tidy DataFrames, summaries and plots.

    from rag.experiments import Config, Experiment, read_questions, summarize, plot_recall
    exp = Experiment(rag, root="examples/lab-docs")
    df = exp.run(read_questions("examples/questions.jsonl"),
                 [Config(mode="dense", rerank=False), Config(mode="hybrid", rerank=False), Config()])
    summarize(df); plot_recall(df)
"""

from rag.experiments.beir import ingest_beir, read_beir, write_records
from rag.experiments.configs import Config, grid, parse_config
from rag.experiments.questions import Question, QuestionSet, read_jsonl, read_questions
from rag.experiments.runner import Experiment, run_experiment
from rag.experiments.summary import assert_no_leaks, leaks, summarize


def plot_recall(df, title: str = "Recall@k by configuration"):
    """Mean recall@k per configuration (see rag.experiments.plots); imports matplotlib on first use."""
    from rag.experiments.plots import plot_recall as plot

    return plot(df, title)


def plot_latency(df, title: str = "Latency per stage (mean per question)"):
    """Mean milliseconds per stage per configuration (see rag.experiments.plots)."""
    from rag.experiments.plots import plot_latency as plot

    return plot(df, title)


__all__ = ["Config", "Experiment", "Question", "QuestionSet", "assert_no_leaks", "grid", "ingest_beir", "leaks",
           "parse_config", "plot_latency", "plot_recall", "read_beir", "read_jsonl", "read_questions",
           "run_experiment", "summarize", "write_records"]

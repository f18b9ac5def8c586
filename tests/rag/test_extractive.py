"""Extractive answers (rag/extractive.py) and the answer mode (rag/answer_mode.py).

The unit tests score sentences with a keyword function (one module alone); the end-to-end tests
use the real cross-encoder over the ingested sample corpus, the real HTTP API and the real CLI.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import subprocess
import sys

import httpx
import pytest

from permissions.models import Principal
from rag.answer_mode import SMALL_MODEL_PARAMETERS, parameter_count, resolve_answer_mode
from rag.api.app import create_app
from rag.citations import clean_markers
from rag.experiments.answer_metrics import cited_numbers, is_refusal
from rag.extractive import (
    ExtractConfig,
    candidate_sentences,
    cite,
    extract_answer,
    split_sentences,
    split_units,
    table_rows,
)
from rag.settings import Settings
from rag.types import Hit
from tests.rag.conftest import LAB_DOCS
from tests.rag.live_server import serving


def _hit(i: int, text: str, title: str | None = None) -> Hit:
    return Hit(chunk_id=i, document_key=f"/d/{i}.md", source=f"{i}.md", chunk_index=0, text=text, score=1.0,
               title=title, acl=frozenset({"public"}))


def keyword_scorer(*words: str):
    """A stand-in cross-encoder: +5 per question word found in the passage, -8 for none."""

    def score(question: str, passages: list[str]) -> list[float]:
        return [sum(5.0 for w in words if w in p.casefold()) or -8.0 for p in passages]

    return score


SOURCES = [
    _hit(1, "# Freezers\n\nThe lab has two freezers. They are in room B214.", "Freezer inventory"),
    _hit(2, "- The -80 alarm is set to -65 C.\n- Alarms page the on-call phone.", "Alarms"),
]


def test_sentences_drop_layout_headings_and_fragments():
    text = "# Using the GPU nodes\n\n- gpu01-gpu08 are in the gpu partition.\n* Notes:\nSee the guide. It helps a lot!"
    assert split_sentences(text) == ["gpu01-gpu08 are in the gpu partition.", "See the guide.", "It helps a lot!"]


def test_the_title_context_that_leads_a_chunk_is_never_quoted():
    # The chunker heads a chunk "document title › section heading" (ingest/chunk.py): longer than
    # a short heading, but no more an answer (the demo once quoted "Basalt Cluster User Guide ›
    # Using the GPU nodes [2]." as a second sentence). A sentence that ends as one stays.
    text = ("Basalt Cluster User Guide \u203a Using the GPU nodes\n\n"
            "All GPU work goes through the gpu partition. Menus › Settings › Save saves it.")
    want = ["All GPU work goes through the gpu partition.", "Menus › Settings › Save saves it."]
    assert split_sentences(text) == want


def test_the_best_sentence_is_quoted_with_the_number_of_its_source():
    answer = extract_answer("What is the -80 alarm set to?", SOURCES, keyword_scorer("alarm", "-65"))
    # "Alarms page the on-call phone." scores 5 (its title says "alarm"): more than `margin` below the best.
    assert answer == "The -80 alarm is set to -65 C [2]."


def test_below_the_floor_there_is_no_answer():
    assert extract_answer("Who won the 1998 World Cup?", SOURCES, keyword_scorer("football")) is None
    assert extract_answer("anything", [_hit(1, "Contents")], keyword_scorer("contents")) is None  # nothing to quote


def test_a_weaker_second_sentence_is_left_out():
    scores = iter([[9.0, 1.0, 8.5, 0.0]])
    answer = extract_answer("q", SOURCES, lambda q, p: next(scores), ExtractConfig(max_sentences=3, margin=2.0),
                            source_scores=[9.0, 8.5])  # the reranker's: only sentences are scored
    assert answer == "The lab has two freezers [1]. The -80 alarm is set to -65 C [2]."


def test_a_sentence_repeated_by_overlapping_chunks_is_scored_once_and_cites_its_first_source():
    overlap = [_hit(1, "The first part is here. The shared sentence is here."),
               _hit(2, "The shared sentence is here. The later part is here.")]
    assert [(s.text, s.number) for s in candidate_sentences(overlap)] == [
        ("The first part is here.", 1), ("The shared sentence is here.", 1), ("The later part is here.", 2)]


def test_the_title_gives_a_sentence_its_subject_when_scored():
    seen: list[str] = []

    def score(question, passages):
        seen.extend(passages)
        return [0.0] * len(passages)

    extract_answer("q", SOURCES, score)
    assert "Alarms: The -80 alarm is set to -65 C." in seen


def test_markers_go_before_the_final_punctuation():
    assert cite("It is -65 C.", 2) == "It is -65 C [2]."
    assert cite("Window: Tuesday 11 March", 1) == "Window: Tuesday 11 March [1]."
    assert cite("Ask staff:", 3) == "Ask staff [3]."


@pytest.mark.parametrize("question", ["alarm", "freezers room", "phone", "nothing at all"])
def test_every_marker_points_at_a_shown_source_that_holds_the_quoted_sentence(question):
    answer = extract_answer(question, SOURCES, keyword_scorer(*question.split()))
    if answer is None:
        return
    numbers = cited_numbers(answer)
    assert numbers and all(1 <= n <= len(SOURCES) for n in numbers)
    for sentence, n in re.findall(r"(.+?) \[(\d+)\][.!?]\s*", answer):
        assert sentence.strip() in SOURCES[int(n) - 1].text


# A procedure whose steps each say too little alone: no sentence reaches the floor, the source does.
STEPS = [_hit(1, "Ask the facility for a guest account. The endpoint is niqb-dtn. Share the folder from there.",
              "Sharing data"),
         _hit(2, "The microscope is booked in slots of four hours.", "Booking")]


def _scores_by_passage(table: dict[str, float]):
    """A stand-in cross-encoder: a fixed logit per passage (-9 for any other), and the passages it saw."""
    seen: list[list[str]] = []

    def score(question, passages):
        seen.append(list(passages))
        return [table.get(p, -9.0) for p in passages]

    return score, seen


def test_a_source_above_its_floor_is_quoted_when_no_sentence_is_alone():
    score, seen = _scores_by_passage({"Sharing data: The endpoint is niqb-dtn.": -4.0,
                                      "Sharing data: Share the folder from there.": -5.0,
                                      "Sharing data: Ask the facility for a guest account.": -8.0,
                                      STEPS[0].text: 0.5})
    answer = extract_answer("How do I share maps?", STEPS, score)
    # the source's best two sentences, best first, within the margin of each other
    assert answer == "The endpoint is niqb-dtn [1]. Share the folder from there [1]."
    assert len(seen) == 1 and STEPS[0].text in seen[0] and STEPS[1].text in seen[0]  # one batch, sources in it


def test_a_source_below_its_floor_still_gets_no_answer():
    score, _ = _scores_by_passage({"Sharing data: The endpoint is niqb-dtn.": -4.0, STEPS[0].text: -3.9})
    assert extract_answer("How do I share maps?", STEPS, score) is None


def test_the_rerankers_source_scores_are_used_as_given():
    score, seen = _scores_by_passage({"Sharing data: The endpoint is niqb-dtn.": -4.0})
    assert extract_answer("q", STEPS, score, source_scores=[1.0, -9.0]) == "The endpoint is niqb-dtn [1]."
    # the best source is the one quoted from, whatever sentence scores best elsewhere
    assert extract_answer("q", STEPS, score, source_scores=[-9.0, 1.0]) == (
        "The microscope is booked in slots of four hours [2].")
    assert extract_answer("q", STEPS, score, source_scores=[-3.0, -4.0]) is None
    assert all(s.text not in batch for batch in seen for s in STEPS)  # the sources are not scored again


def test_a_sentence_quoted_for_its_source_cites_that_source():
    # The sentence occurs first in source 1, but it is source 2 that answers as a whole.
    shared = "The endpoint is niqb-dtn."
    hits = [_hit(1, f"Old notes. {shared}"), _hit(2, f"Sharing maps with guests. {shared} Use a guest account.")]
    score, _ = _scores_by_passage({shared: -4.0, hits[1].text: 2.0})
    assert extract_answer("q", hits, score).startswith("The endpoint is niqb-dtn [2].")


def test_config_is_checked():
    with pytest.raises(ValueError, match="max_sentences"):
        ExtractConfig(max_sentences=0)
    with pytest.raises(ValueError, match="margin"):
        ExtractConfig(margin=-1)


# -- tables: a row at a time -------------------------------------------------------------------

PARTITIONS = """Partitions

Every job runs in one partition.

| Partition | Nodes | Max time | Notes |
| --- | --- | --- | --- |
| cpu | cn001-cn064 | 7 days | - |
| gpu | gpu01-gpu08 | 48 hours | Dr. Chen approves longer jobs. |
|  | - |  |  |

Ask Research Computing for more."""


def test_a_table_is_split_into_rows_labelled_by_its_header_and_led_by_its_heading():
    assert split_units(PARTITIONS, "Partitions") == [
        "Every job runs in one partition.",
        "Partitions \u2014 Partition: cpu; Nodes: cn001-cn064; Max time: 7 days",  # "-": an empty cell
        "Partitions \u2014 Partition: gpu; Nodes: gpu01-gpu08; Max time: 48 hours; Notes: Dr. Chen approves "
        "longer jobs.",  # "Dr. " does not end a row
        "Ask Research Computing for more.",
    ]


def test_a_chunk_that_starts_mid_table_has_no_header_to_label_with():
    rows = ["| gpu | gpu01-gpu08 | 48 hours |", "| debug | cn063-cn064 | 30 minutes |"]
    assert table_rows(rows) == ["gpu | gpu01-gpu08 | 48 hours", "debug | cn063-cn064 | 30 minutes"]


def test_the_best_row_is_quoted_not_the_table():
    hits = [dataclasses.replace(_hit(1, PARTITIONS, "Slurm partitions"), heading="Partitions")]
    answer = extract_answer("How long may a gpu job run?", hits, keyword_scorer("gpu01", "48 hours"))
    assert answer == ("Partitions \u2014 Partition: gpu; Nodes: gpu01-gpu08; Max time: 48 hours; Notes: Dr. Chen "
                      "approves longer jobs [1].")


def _parsed_table_chunk(path):
    """A chunk as ingest writes a table section: heading, then the real parser's table as Markdown rows."""
    from unstructured.partition.html import partition_html
    from unstructured.partition.md import partition_md

    from ingest.table_text import markdown_table

    partition = partition_md if path.suffix == ".md" else partition_html
    heading = None
    for el in partition(filename=str(path), languages=["eng"]):
        if el.category == "Title":
            heading = el.text
        elif el.category == "Table":
            text = f"{heading}\n\n{markdown_table(el.metadata.text_as_html)}"
            return Hit(chunk_id=1, document_key=str(path), source=path.name, chunk_index=0, text=text, score=1.0,
                       heading=heading, title=path.stem, acl=frozenset({"public"}))
    raise AssertionError(f"no table in {path}")


@pytest.mark.parametrize(("document", "question", "row", "other_rows"), [
    ("public/seminar-schedule.md", "Is there a seminar about cryo-electron tomography this spring?",
     "Schedule \u2014 Date: 9 Apr 2025; Speaker: Prof. Anna Weiss (ETH Zurich); Title: Cryo-electron tomography "
     "of the nuclear pore [1].", ["15 Jan 2025", "23 Apr 2025"]),
    ("public/slurm-partitions.html", "What is the maximum run time of a job in the gpu partition?",
     "Partitions \u2014 Partition: gpu; Nodes: gpu01-gpu08; Default time: 1 hour; Max time: 48 hours; "
     "Default QOS: gpu-normal [1].", ["cn001-cn064", "bm01-bm02"]),
])
def test_the_cross_encoder_picks_the_answering_row_of_a_really_parsed_table(lab_rag, document, question, row,
                                                                            other_rows):
    chunk = _parsed_table_chunk(LAB_DOCS / document)
    scorer = lab_rag.batched_reranker.batcher
    answer = extract_answer(question, [chunk], lambda q, passages: scorer((q, passages)))
    assert answer is not None and answer.startswith(row)
    assert not any(other in answer for other in other_rows)  # one row (or two), never the whole table


def test_a_flattened_text_table_is_quoted_by_a_window_around_the_answer_not_whole(lab_rag):
    # A text file's pipe table: the real parser joins its lines into one 109-word "sentence".
    from ingest.parse import parse_file

    title, elements = parse_file(LAB_DOCS / "hpc-admins" / "node-inventory.txt")
    gpu = next(e.text for e in elements if e.text.startswith("--- GPU nodes"))
    assert len(gpu.split()) > 100 and "\n" not in gpu
    chunk = Hit(chunk_id=1, document_key="node-inventory.txt", source="node-inventory.txt", chunk_index=0,
                text=f"{title}\n\n{gpu}", score=1.0, title=title, acl=frozenset({"group:hpc-admins"}))
    scorer = lab_rag.batched_reranker.batcher
    answer = extract_answer("What is the serial number of gpu05?", [chunk], lambda q, passages: scorer((q, passages)))
    assert answer is not None and "SN-HX-10458" in answer
    quotes = re.findall(r"(.+?) \[1\][.]", answer)
    assert quotes and all(len(q.split()) <= 26 for q in quotes)  # a window (and "…" marks), not the table
    assert all(q.strip() in [_as_quoted(u) for u in split_units(chunk.text)] for q in quotes)


def test_overlong_runs_are_cut_into_overlapping_windows_that_cover_them():
    words = [f"w{i}" for i in range(61)]
    units = split_sentences(" ".join(words))
    assert len(units) == 5 and units[0].endswith("\u2026") and units[-1].startswith("\u2026w48")
    covered = {w for u in units for w in u.strip("\u2026").split()}
    assert covered == set(words)
    assert split_sentences(" ".join(words[:60]) + ".") == [" ".join(words[:60]) + "."]  # 60 words: a sentence


# -- the answer mode --------------------------------------------------------------------------


def _fake_safetensors(folder, shape):
    """A weight file whose header names one tensor of `shape` (the data is never read)."""
    folder.mkdir()
    header = json.dumps({"w": {"dtype": "F16", "shape": shape, "data_offsets": [0, 0]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return folder


def test_auto_extracts_with_the_packaged_or_a_small_local_model_and_generates_otherwise(tmp_path):
    small = _fake_safetensors(tmp_path / "small", [1000, 1000])
    large = _fake_safetensors(tmp_path / "large", [SMALL_MODEL_PARAMETERS, 2])
    assert parameter_count(small) == 1_000_000
    assert resolve_answer_mode(Settings(home=tmp_path)) == "extract"  # SmolLM2-135M
    assert resolve_answer_mode(Settings(home=tmp_path, generator=str(small))) == "extract"
    assert resolve_answer_mode(Settings(home=tmp_path, generator=str(large))) == "generate"
    assert resolve_answer_mode(Settings(home=tmp_path, generator=str(tmp_path))) == "generate"  # size unknown
    remote = Settings(home=tmp_path, generator_backend="remote", generator_url="http://gpu01:8000/v1")
    assert resolve_answer_mode(remote) == "generate"
    assert resolve_answer_mode(Settings(home=tmp_path, answer_mode="generate")) == "generate"
    assert resolve_answer_mode(Settings(home=tmp_path, answer_mode="extract", generator=str(large))) == "extract"


# -- end to end: the real cross-encoder over the sample corpus ---------------------------------

FREEZER = "What temperature is the -80 freezer alarm set to?"
GPU = "Which GPU nodes can I use?"


@pytest.fixture
def scored_sources(lab_rag, monkeypatch):
    """Every source list the extractive answerer was handed, and every passage it scored."""
    import rag.pipeline

    seen: dict[str, list] = {"sources": [], "passages": [], "parts": []}
    real = rag.pipeline.extract_answer

    def spy(question, sources, score, *args, **kwargs):
        seen["sources"].append(list(sources))
        # The chunks each source is read from (a source with its page's second chunk is two).
        seen["parts"].append(kwargs.get("parts") or [[h] for h in sources])

        def scored(query, passages):
            seen["passages"].extend(passages)
            return score(query, passages)

        return real(question, sources, scored, *args, **kwargs)

    monkeypatch.setattr(rag.pipeline, "extract_answer", spy)
    return seen


@pytest.mark.slow
def test_the_default_answers_the_freezer_question_by_quoting_the_inventory(lab_rag):
    assert lab_rag.answer_mode == "extract"
    answer = lab_rag.query(FREEZER, lab_rag.principal("alice"), k=3)
    assert "-65 C" in answer.text
    cited = {n: c for c in answer.citations for n in [c.number]}
    numbers = cited_numbers(answer.text)
    assert numbers and all(n in cited for n in numbers)
    assert any(cited[n].source.endswith("genomics/freezer-inventory.txt") for n in numbers)
    assert "extract" in answer.timings
    assert "generator" not in lab_rag.__dict__  # the 135M model was never loaded


ERIN = Principal("erin", frozenset({"genomics"}))  # genomics, but not the core manager
KRAS = "What did the KRAS burden analysis in the CHR-77 cohort find?"  # embargoed: the core manager only


@pytest.mark.parametrize(("user", "question", "secret"), [
    ("dave", GPU, "cryoem-res"), ("dave", GPU, "gpu07"), ("dave", "Why is gpu05 unavailable?", "HBM"),
    ("erin", KRAS, "3.4"), ("erin", KRAS, "KRAS (ENSG"),
])
@pytest.mark.slow
def test_it_never_quotes_or_scores_text_the_asker_may_not_read(lab_rag, scored_sources, user, question, secret):
    principal = ERIN if user == "erin" else lab_rag.principal(user)
    answer = lab_rag.query(question, principal, k=5)
    assert secret not in answer.text
    for sources, parts in zip(scored_sources["sources"], scored_sources["parts"], strict=True):
        assert all(principal.can_read(h.acl) for h in sources)
        assert all(principal.can_read(c.acl) for chunks in parts for c in chunks)
    # Every passage scored is a readable source shown, or a sentence (table row) of one of its
    # chunks as scored.
    scorable = set()
    for sources, parts in zip(scored_sources["sources"], scored_sources["parts"], strict=True):
        for hit, chunks in zip(sources, parts, strict=True):
            title = hit.title or hit.heading
            scorable |= {hit.text} | {f"{title}: {u}" if title else u
                                      for c in chunks for u in split_units(c.text, c.heading)}
    assert set(scored_sources["passages"]) <= scorable
    if not is_refusal(answer.text):
        shown, parts = scored_sources["sources"][-1], scored_sources["parts"][-1]
        quotes = re.findall(r"(.+?) \[(\d+)\][.!?](?:\s+|$)", answer.text)
        assert quotes and clean_markers(answer.text, 0)
        for quote, number in quotes:
            # every quote is a sentence (or table row) of the readable source its marker names
            chunks = parts[int(number) - 1]
            assert shown[int(number) - 1].document_key == chunks[0].document_key
            assert quote in [_as_quoted(u) for c in chunks for u in split_units(c.text, c.heading)], quote


def _as_quoted(unit: str) -> str:
    """A unit as `cite` quotes it: without its final mark (the marker goes before it)."""
    return unit[:-1].rstrip() if unit[-1:] in ".!?:;" else unit


def test_a_question_no_readable_sentence_answers_gets_the_generators_refusal(lab_rag):
    answer = lab_rag.query(KRAS, ERIN, k=5)
    assert answer.text.startswith("I don't know")


def test_streaming_gives_the_quoted_answer_in_one_piece(lab_rag):
    answer, pieces = lab_rag.stream(FREEZER, lab_rag.principal("alice"), k=3)
    text = list(pieces)
    assert len(text) == 1 and "-65 C" in text[0]


def test_the_api_says_which_mode_wrote_the_answer(lab_rag):
    key = lab_rag.identity.create_key("alice", ["genomics"])
    headers = {"Authorization": f"Bearer {key}"}
    with serving(create_app(lab_rag.settings)) as url:
        plain = httpx.post(f"{url}/v1/query", json={"question": FREEZER, "k": 3}, headers=headers, timeout=300)
        bare = httpx.post(f"{url}/v1/query", json={"question": FREEZER, "generate": False}, headers=headers,
                          timeout=300)
        with httpx.stream("POST", f"{url}/v1/query", json={"question": FREEZER, "k": 3, "stream": True},
                          headers=headers, timeout=300) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        chat = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=300,
                          json={"model": "default", "messages": [{"role": "user", "content": FREEZER}]})
    assert plain.status_code == 200 and plain.json()["answer_mode"] == "extract"
    assert "-65 C" in plain.json()["answer"]
    assert bare.json()["answer_mode"] is None
    deltas = [e["text"] for e in events if e["type"] == "delta"]
    done = events[-1]
    assert done["type"] == "done" and done["answer_mode"] == "extract" and "".join(deltas) == done["answer"]
    body = chat.json()
    assert body["answer_mode"] == "extract" and "-65 C" in body["choices"][0]["message"]["content"]
    assert body["object"] == "chat.completion"  # the OpenAI shape, with one extension field


@pytest.mark.slow
def test_the_cli_shows_the_mode_in_its_output_and_json(lab_rag):
    env_home = str(lab_rag.settings.home)
    base = [sys.executable, "-m", "rag.cli", "--home", env_home, "query", FREEZER, "--as", "alice", "--k", "3"]
    human = subprocess.run(base, capture_output=True, text=True, timeout=600)
    as_json = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=600)
    assert human.returncode == 0 and as_json.returncode == 0, human.stderr + as_json.stderr
    assert "answer mode: extract" in human.stdout and "-65 C" in human.stdout
    assert json.loads(as_json.stdout)["answer_mode"] == "extract"


def test_a_source_read_with_its_second_chunk_labels_each_chunks_rows_with_its_own_heading() -> None:
    from retrieval.second_chunks import joined, reading_parts

    best = Hit(chunk_id=8, document_key="guide", source="guide.md", chunk_index=3, score=2.0,
               heading="Using the GPU nodes",
               text="Guide › Using the GPU nodes\n\nAll GPU work goes through the gpu partition.")
    table = Hit(chunk_id=7, document_key="guide", source="guide.md", chunk_index=2, score=1.0,
                heading="Compute nodes",
                text="Guide › Compute nodes\n\n| Partition | Nodes |\n| --- | --- |\n| bigmem | bm01-bm02 |\n"
                     "| gpu | gpu01-gpu08 |")
    source = joined(best, table)
    parts = [reading_parts(best, {best.chunk_id: table})]
    assert [h.chunk_index for h in parts[0]] == [2, 3]  # document order
    units = [s.text for s in candidate_sentences([source], parts)]
    # The table sits under "Compute nodes": its rows say so, not the best chunk's heading.
    assert units == ["Compute nodes — Partition: bigmem; Nodes: bm01-bm02",
                     "Compute nodes — Partition: gpu; Nodes: gpu01-gpu08",
                     "All GPU work goes through the gpu partition."]
    assert all(s.number == 1 for s in candidate_sentences([source], parts))
    other = Hit(chunk_id=9, document_key="other", source="other.md", chunk_index=0, text="x y z.", score=0.0)
    with pytest.raises(ValueError, match="its own document"):
        candidate_sentences([source], [[best, other]])
    with pytest.raises(ValueError, match="its own document"):
        candidate_sentences([source], [])

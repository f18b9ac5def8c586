"""What the README's demo promises, pinned: the same questions, the same users, the same settings.

`scripts/demo.sh` asks with `--k 3` and the default generator settings (greedy SmolLM2); so do we.
"""

from __future__ import annotations

import pytest

from tests.rag.conftest import DEMO_USERS, make_rag

GPU = "Which GPU nodes can I use?"
FREEZER = "What temperature is the -80 freezer alarm set to?"


@pytest.fixture(scope="module")
def demo_rag(tmp_path_factory, model_cache, lab_copy):
    rag = make_rag(tmp_path_factory.mktemp("demo-home"), model_cache)  # the demo's settings: defaults
    assert rag.ingest([lab_copy]).ok
    for user, groups in DEMO_USERS.items():
        rag.identity.add_user(user, groups)
    yield rag
    rag.close()


def _ask(rag, question, user):
    return rag.query(question, rag.principal(user), k=3)


def _sources(answer) -> list[str]:
    return [c.source.split("lab-docs/", 1)[1] for c in answer.citations]


@pytest.mark.slow
def test_alice_gets_the_freezer_alarm_threshold_from_the_inventory(demo_rag):
    answer = _ask(demo_rag, FREEZER, "alice")
    assert "-65" in answer.text
    assert "genomics/freezer-inventory.txt" in _sources(answer)


def test_bob_gets_i_dont_know_about_the_freezer(demo_rag):
    answer = _ask(demo_rag, FREEZER, "bob")
    assert answer.text.startswith("I don't know") and answer.citations == []
    assert "-65" not in answer.text


@pytest.mark.slow
def test_bobs_gpu_answer_cites_his_groups_reservation(demo_rag):
    answer = _ask(demo_rag, GPU, "bob")
    assert "imaging/gpu-reservation.txt" in _sources(answer)
    assert answer.text and answer.text != ""


def test_daves_gpu_answer_cites_only_the_public_guide(demo_rag):
    answer = _ask(demo_rag, GPU, "dave")
    sources = _sources(answer)
    assert sources and all(s.startswith("public/") for s in sources)
    assert "public/cluster-user-guide.md" in sources
    assert "cryoem-res" not in answer.text and "gpu07" not in answer.text

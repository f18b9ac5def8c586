"""Schemathesis over every route of `rag serve`'s OpenAPI schema, on the real app over real HTTP.

Each operation is called with schema-valid and schema-violating inputs (schemathesis' positive and
negative modes), once with no key and once with a valid user key. Whatever comes in, the service
answers without a 5xx, and every error carries the one shape `{"error": {"message", "type",
"param", "code"}}`. Example counts come from the Hypothesis profile of tests/conftest.py: the
default keeps this file well under a minute; `HYPOTHESIS_PROFILE=slow` runs thousands.

The app runs with real models but small budgets (a 64-token context, 2 new tokens, no rerank),
so that a schema-valid question, which really is answered, stays cheap on CPU.
Run with -s to see how many calls were made, by status.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from rag.api.app import create_app
from tests.rag.live_server import serving

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

ERROR_KEYS = {"message", "type", "param", "code"}
# A valid chat request may ask for thousands of tokens; answering them is not what this suite
# checks, and on CPU it would take minutes. Larger asks are lowered to this before sending.
MAX_ASKED_TOKENS = 4

calls: Counter[str] = Counter()


@pytest.fixture(scope="module")
def served(lab_rag):
    key = lab_rag.identity.create_key("bob", ["imaging"])
    settings = lab_rag.settings.model_copy(update={
        "device": "cpu", "max_new_tokens": 2, "context_tokens": 64, "rerank": False, "candidates": 5})
    with serving(create_app(settings, preload=False)) as url:
        yield url, key
    # Shown with -s: how much the run covered.
    print(f"\nschema fuzz: {sum(calls.values())} calls, by status: {dict(sorted(calls.items()))}")


@pytest.fixture(scope="module")
def operations(served) -> list:
    url, _ = served
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    # Every route of the schema, so a new route is fuzzed without anyone listing it here.
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= {
        "GET /healthz", "GET /readyz", "POST /v1/query", "GET /v1/models", "POST /v1/chat/completions",
        "GET /v1/documents/{collection}/{chunk_id}", "GET /metrics/engine"}
    return ops


def _check(response, case) -> None:
    calls[str(response.status_code)] += 1
    where = f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        body = json.loads(response.content)
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, where
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], where


def _lower_token_asks(case) -> None:
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_ASKED_TOKENS:
                case.body[field] = MAX_ASKED_TOKENS


def _fuzz(operations: list, send) -> None:
    """Run `send(case)` over Hypothesis examples of every operation, valid inputs and invalid ones.

    (Schemathesis' own pytest loader does not work with pytest 9, so its strategies are driven
    by Hypothesis directly; the example count is the active profile's max_examples.)
    """
    for operation in operations:
        has_inputs = any((operation.body, operation.path_parameters, operation.query, operation.headers))
        # A route with no inputs (GET /healthz) has nothing to violate.
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_inputs else (GenerationMode.POSITIVE,)
        for mode in modes:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(suppress_health_check=list(HealthCheck))
            def run(case) -> None:
                send(case)

            run()


@pytest.mark.parametrize("with_key", [False, True], ids=["no key", "user key"])
def test_any_input_is_answered_without_a_5xx_in_the_one_error_shape(served, operations, with_key):
    url, key = served

    def send(case) -> None:
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        if with_key:
            _lower_token_asks(case)
            headers["Authorization"] = f"Bearer {key}"
        case.headers = headers
        response = case.call(base_url=url, timeout=120)
        _check(response, case)
        if not with_key and case.path not in ("/healthz", "/readyz"):
            assert response.status_code == 401, f"{case.method} {case.formatted_path}: {response.status_code}"

    _fuzz(operations, send)

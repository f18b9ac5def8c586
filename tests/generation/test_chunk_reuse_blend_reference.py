"""The dense reference of chunk reuse (generation/reference/chunk_blend.py): exact where it must be, equal to
the engine and to the older reference for the engine's rules, and CacheBlend's selection doing what it says."""

from __future__ import annotations

import pytest
import torch

from generation import SamplingParams
from generation.engine.blend_selection import DeviationSelection, kv_deviation, select_top
from generation.engine.chunk_reuse import ChunkRecompute
from generation.reference.chunk_blend import (
    CanonicalKV,
    blended_prefill,
    dense_layers,
    greedy_continue,
    reusable_ranges,
)

from .chunk_reuse_reference import dense_forward, reference_logits
from .test_chunk_reuse import BS, MIXED, REORDERED, first_logits, make_llm


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_factory):
    return make_llm(tiny_model_factory("default")[0], enable_prefix_caching=False)


def test_without_reuse_the_reference_is_full_prefill(tiny_llm):
    ids = [t for s in REORDERED for t in s.token_ids]
    want, _ = dense_forward(tiny_llm.model, ids)
    got = blended_prefill(tiny_llm.model, REORDERED, BS, None)
    torch.testing.assert_close(got.logits, want[-1], rtol=0, atol=1e-5)
    assert got.reusable == [] and got.computed_share() == 1.0


@pytest.mark.parametrize("rule", [ChunkRecompute(), ChunkRecompute("fraction", 0.5)])
def test_the_engines_rules_match_the_older_reference_and_the_engine(tiny_model_factory, tiny_llm, rule):
    got = blended_prefill(tiny_llm.model, REORDERED, BS, rule).logits
    older = reference_logits(tiny_llm.model, REORDERED, BS, mode=rule.mode, fraction=rule.fraction)
    torch.testing.assert_close(got, older, rtol=0, atol=1e-5)
    llm = make_llm(tiny_model_factory("default")[0], kv_reuse="chunks", chunk_recompute=rule.mode,
                   chunk_recompute_fraction=rule.fraction)  # fmt: skip
    first_logits(llm.engine, MIXED)
    engine = first_logits(llm.engine, REORDERED)
    assert llm.engine.chunk_planner.num_chunks_reused == 6  # 3 in MIXED, 3 here
    torch.testing.assert_close(got, engine, rtol=0, atol=1e-5)


def test_selecting_every_reused_token_is_full_prefill(tiny_llm):
    full = blended_prefill(tiny_llm.model, REORDERED, BS, None)
    got = blended_prefill(tiny_llm.model, REORDERED, BS, DeviationSelection(ratio=1.0))
    assert got.reusable, "the test must have reusable tokens"
    torch.testing.assert_close(got.logits, full.logits, rtol=0, atol=1e-5)


def test_selection_recomputes_the_ratio_from_the_check_layer_and_changes_the_result(tiny_llm):
    # The tiny model has 2 layers: check layer 1 selects there, layer 0 is computed in full.
    rule = DeviationSelection(ratio=0.25)
    got = blended_prefill(tiny_llm.model, REORDERED, BS, rule)
    n = len(got.reusable)
    assert n == sum(end - start for _, start, end in reusable_ranges(REORDERED, BS)) == 36
    assert len(got.selected) == 2
    assert got.selected[0] == got.reusable  # layer 0: every reused token fresh
    assert len(got.selected[1]) == rule.num_selected(n) == 9
    full = blended_prefill(tiny_llm.model, REORDERED, BS, None)
    assert (got.logits - full.logits).abs().max() > 1e-4
    # Computed token-layers after the head: layer 0 all of them, layer 1 all but the 27 unselected.
    after_head = got.num_tokens - len(REORDERED[0].token_ids)
    assert got.computed_share() == pytest.approx((2 * after_head - (n - 9)) / (2 * after_head))


def test_the_selected_tokens_are_those_whose_keys_deviate_most(tiny_llm):
    # Recompute the check layer's inputs by hand: layer 0 in full, then each reused token's fresh
    # key at layer 1 against its canonical key.
    model, rule = tiny_llm.model, DeviationSelection(ratio=0.25)
    got = blended_prefill(model, REORDERED, BS, rule)
    ids = [t for s in REORDERED for t in s.token_ids]
    _, fresh = dense_layers(model, ids)  # layer 1's KV when layer 0 is exact: full prefill's
    canonical = CanonicalKV(model)
    deviation = {}
    for index, start, end in reusable_ranges(REORDERED, BS):
        rows = canonical.rows(REORDERED[0], REORDERED[index])
        for pos in range(start, end):
            deviation[pos] = float(((fresh[1][0][pos] - rows[1][0][pos - start]) ** 2).sum())
    ranked = sorted(deviation, key=lambda p: -deviation[p])[:9]
    assert got.selected[1] == sorted(ranked)


def test_keep_first_block_always_recomputes_each_chunks_first_block(tiny_llm):
    got = blended_prefill(tiny_llm.model, REORDERED, BS, DeviationSelection(ratio=0.25, keep_first_block=True))
    firsts = {p for _, start, _ in reusable_ranges(REORDERED, BS) for p in range(start, start + BS)}
    assert firsts <= set(got.selected[1])
    assert len(got.selected[1]) == len(firsts) + DeviationSelection(ratio=0.25).num_selected(36 - len(firsts))


def test_greedy_continuation_without_reuse_equals_the_engines_generation(tiny_llm):
    prefill = blended_prefill(tiny_llm.model, REORDERED, BS, None)
    ids = [t for s in REORDERED for t in s.token_ids]
    engine = tiny_llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert greedy_continue(tiny_llm.model, prefill, 8, set()) == engine.token_ids


def test_the_selection_rule_is_checked_and_ties_are_stable():
    with pytest.raises(ValueError, match="ratio"):
        DeviationSelection(ratio=0.0)
    with pytest.raises(ValueError, match="check layer"):
        DeviationSelection(check_layer=0)
    with pytest.raises(ValueError, match="deviation"):
        DeviationSelection(deviation_of="q")
    assert DeviationSelection(ratio=0.15).num_selected(10) == 2 and DeviationSelection().num_selected(0) == 0
    assert select_top(torch.tensor([1.0, 3.0, 3.0, 0.5, 3.0]), 2).tolist() == [1, 2]
    k = torch.zeros(3, 2, 4)
    cached_k = k.clone()
    cached_k[1] += 1.0
    v = torch.zeros(3, 2, 4)
    cached_v = v.clone()
    cached_v[2] += 2.0
    assert kv_deviation((k, v), (cached_k, cached_v), "k").tolist() == [0.0, 8.0, 0.0]
    assert kv_deviation((k, v), (cached_k, cached_v), "v").tolist() == [0.0, 0.0, 32.0]
    assert kv_deviation((k, v), (cached_k, cached_v), "kv").tolist() == [0.0, 8.0, 32.0]

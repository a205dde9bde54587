"""Scoring functions against hand-worked examples."""

from __future__ import annotations

import math

import pytest
import torch

from eval.metrics import (
    exact_match,
    normalize_answer,
    rouge_l,
    step_fidelity,
    string_match_all,
    string_match_part,
    substring_match,
    summarize_fidelity,
)


def test_normalization_and_exact_match():
    assert normalize_answer("  The Cat, sat!  ") == "cat sat"
    assert exact_match("The Paris.", ["paris"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("london", ["Paris", "London"]) == 1.0


def test_substring_match():
    assert substring_match("It is Paris, in France.", ["paris"]) == 1.0
    assert substring_match("It is Paris.", ["London", "Rome"]) == 0.0
    assert substring_match("anything", ["the"]) == 0.0  # a reference that normalizes to nothing never matches


def test_ruler_string_match():
    # RULER: fraction of references found (all), or any found (part); case-insensitive.
    assert string_match_all("numbers: 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("The Key Is ABCDE", ["abcde"]) == 1.0
    assert string_match_part("numbers: 123 and 456", ["789", "456"]) == 1.0
    assert string_match_part("nothing", ["789"]) == 0.0


def test_rouge_l_by_hand():
    # LCS("the cat on the mat", "the cat sat on the mat") = 5 tokens: P = 5/5, R = 5/6, F = 2PR/(P+R) = 10/11.
    assert rouge_l("the cat on the mat", ["the cat sat on the mat"]) == pytest.approx(10 / 11)
    assert rouge_l("a b", ["x y", "A B"]) == 1.0  # best reference, case-insensitive
    assert rouge_l("x", ["a b"]) == 0.0


def test_step_fidelity_by_hand():
    ref, ours = torch.tensor([0.0, 0.0]), torch.tensor([math.log(3.0), 0.0])  # p = (1/2, 1/2), q = (3/4, 1/4)
    kl, agree, nll_ref, nll = step_fidelity(ref, ours, target=1)
    assert kl == pytest.approx(0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25), rel=1e-6)
    assert agree and nll_ref == pytest.approx(math.log(2)) and nll == pytest.approx(math.log(4))
    assert not step_fidelity(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), 0)[1]
    logits = torch.randn(49152)
    assert step_fidelity(logits, logits.clone(), 7)[:2] == (0.0, True)  # identical: exactly 0


def test_summarize_fidelity_by_hand():
    m = summarize_fidelity([0.0, 1.0, 2.0, 3.0], [True, False, True, True], [math.log(2)] * 4, [math.log(4)] * 4)
    assert m["kl_mean"] == 1.5 and m["kl_p95"] == pytest.approx(2.85) and m["kl_max"] == 3.0
    assert m["top1_agreement"] == 0.75 and m["scored_tokens"] == 4
    assert m["perplexity_full"] == pytest.approx(2.0) and m["perplexity"] == pytest.approx(4.0)
    assert m["perplexity_delta"] == pytest.approx(2.0) and m["perplexity_ratio"] == pytest.approx(2.0)

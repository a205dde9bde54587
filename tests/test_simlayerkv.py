"""Naive SimLayerKV on layer 0: the attention mass the prompt's last queries give the sinks and the recent window,
re-computed with a softmax per query head over the full-cache run's keys (float64), decides whether the layer
is lazy; a lazy layer then holds exactly the sinks and the window at every decode step, another layer every
token (the tiny model, a 24-token prompt + 16 new tokens, 2 sinks, a 4-token window, a budget of the whole
sequence)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL
from tests.test_strategies import evictions, layer0_queries, reference_kv


def naive_mass(model, ids, last: int) -> float:
    """Mean over the last `last` prompt queries and every query head of their causal softmax's mass on positions
    < GLOBAL or ≥ PROMPT − RECENT."""
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids).double()
    rep = q.shape[0] // ref_k.shape[0]
    masses = []
    for head in range(q.shape[0]):
        keys = ref_k[head // rep].double()
        for i in range(PROMPT - last, PROMPT):
            logits = torch.tensor([float(q[head, i] @ keys[j]) / math.sqrt(keys.shape[-1]) for j in range(i + 1)])
            probs = torch.softmax(logits, 0).tolist()
            masses.append(sum(p for j, p in enumerate(probs) if j < GLOBAL or j >= PROMPT - RECENT))
    return sum(masses) / len(masses)


@pytest.mark.parametrize("last", [1, 3])
def test_a_layer_is_lazy_exactly_when_its_last_queries_attend_to_sinks_and_window_above_the_threshold(last):
    model, ids, _ = evictions("simlayerkv", "1.0")
    mass = naive_mass(model, ids, last)
    assert 0.01 < mass < 0.99, mass  # both sides of it are thresholds in range
    for threshold, lazy in ((mass - 1e-4, True), (mass + 1e-4, False)):  # float32 within 1e-4
        _, _, steps = evictions("simlayerkv", "1.0", "--simlayer_threshold", str(threshold),
                                "--simlayer_last", str(last))
        for p, _, after in steps:
            expected = set(range(GLOBAL)) | set(range(p + 1 - RECENT, p + 1)) if lazy else set(range(p + 1))
            assert all(held == expected for held in after), (threshold, p, after)
    assert TOTAL > GLOBAL + RECENT + 1  # a lazy layer really drops tokens here

"""Naive CurDKV: its score re-computed here from the definition with plain loops over the layer-0 keys and values
of a full-cache run (float64 squared norms, sums over each window written out), and compared with what the
cache kept at prefill and evicted at every decode step (budget 16 of a 24-token prompt + 16 new tokens, 2
sinks, a 4-token recent window)."""

from __future__ import annotations

import pytest
import torch

from errors import UserError
from tests.strategy_matrix import PROMPT, TOTAL
from tests.test_strategies import evictions, reference_kv
from tests.test_strategies_recent import BUDGET, Score, assert_evicts_lowest, assert_prompt_kept_best


def combined(key_share: float, value_share: float, leverage: str) -> float:
    return {"key": key_share, "value": value_share, "kv_avg": (key_share + value_share) / 2,
            "kv_product": key_share * value_share}[leverage]


def naive_window_shares(key_sq: list[float], value_sq: list[float], window: int, leverage: str) -> list[float]:
    """The combined shares of consecutive windows of `window` entries (the last one the remainder)."""
    shares = []
    for first in range(0, len(key_sq), window):
        keys, values = key_sq[first : first + window], value_sq[first : first + window]
        shares += [combined(a / sum(keys), b / sum(values), leverage) for a, b in zip(keys, values, strict=True)]
    return shares


def squared_norms(x: torch.Tensor) -> list[float]:
    return [float(sum(c * c for c in row.double().tolist())) for row in x]


def curdkv_oracle(model, ids, window: int = 16, leverage: str = "kv_product") -> Score:
    """Prompt token x: its share of its window's squared key norms (windows 0..w−1, w..2w−1, ...; the last
    one the remainder) combined with its share of their squared value norms, over the head's sum of that
    over the prompt. Decoded token p: the same shares of the window p−w+1..p, over the prompt's sum."""
    ref_k, ref_v = reference_kv(model, ids)
    table: list[dict[int, float]] = []
    for h in range(ref_k.shape[0]):
        key_sq, value_sq = squared_norms(ref_k[h, :TOTAL]), squared_norms(ref_v[h, :TOTAL])
        raw = naive_window_shares(key_sq[:PROMPT], value_sq[:PROMPT], window, leverage)
        total = sum(raw)
        row = {x: s / total for x, s in enumerate(raw)}
        for p in range(PROMPT, TOTAL):
            members = range(max(0, p - window + 1), p + 1)
            key_sum, value_sum = sum(key_sq[x] for x in members), sum(value_sq[x] for x in members)
            row[p] = combined(key_sq[p] / key_sum, value_sq[p] / value_sum, leverage) / total
        table.append(row)
    return lambda p, h, held, x: table[h][x]


@pytest.mark.parametrize("window, leverage", [
    (16, "kv_product"),  # windows of 16 and 8 prompt tokens
    (5, "kv_product"),  # four windows of 5 and one of 4
    (5, "kv_avg"),
    (7, "key"),
    (7, "value"),
])
def test_curdkv_keeps_and_evicts_by_the_naive_window_normalised_norms(window, leverage):
    model, ids, steps = evictions("curdkv", str(BUDGET), "--curdkv_window", str(window),
                                  "--curdkv_leverage", leverage)
    score = curdkv_oracle(model, ids, window, leverage)
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0


def test_curdkv_decodes_by_its_rule_whatever_rule_chose_the_prompt():
    """With another prompt rule (l2) the prompt's scale and the decode window still come from the whole prompt,
    so decoded tokens and held prompt tokens compare as in the oracle."""
    model, ids, steps = evictions("curdkv", str(BUDGET), "--curdkv_window", "16", "--prompt_compression_strategy", "l2")
    assert assert_evicts_lowest(steps, curdkv_oracle(model, ids)) > 0


def test_curdkv_prompt_rule_needs_its_own_cache():
    with pytest.raises(UserError, match="curdkv"):
        evictions("l2", str(BUDGET), "--prompt_compression_strategy", "curdkv")

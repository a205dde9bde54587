"""The bootstrap intervals of eval/uncertainty.py against independent references: the exact bootstrap
distribution of a tiny sample (enumerated by hand), the closed-form standard error of a mean, coverage on
synthetic data with a known mean, and the paired interval against the interval of the differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.uncertainty import (
    bootstrap_function,
    bootstrap_mean,
    bootstrap_means,
    item_intervals,
    paired_difference,
)


def test_tiny_sample_matches_the_enumerated_bootstrap_distribution():
    # [0, 0, 1]: a resample's mean is k/3 with k ~ Binomial(3, 1/3): P = 8/27, 12/27, 6/27, 1/27.
    means = bootstrap_means([0.0, 0.0, 1.0], resamples=20000, seed=1)
    exact = {0.0: 8 / 27, 1 / 3: 12 / 27, 2 / 3: 6 / 27, 1.0: 1 / 27}
    for value, p in exact.items():
        share = np.isclose(means, value).mean()
        assert share == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / 20000)), value
    # Cumulative: P(k ≤ 0) = 0.296 > 0.025 and P(k ≤ 2) = 0.963 < 0.975, so the interval is [0, 1].
    ci = bootstrap_mean([0.0, 0.0, 1.0])
    assert (ci.estimate, ci.low, ci.high, ci.n) == (pytest.approx(1 / 3), 0.0, 1.0, 3)


def test_large_sample_matches_the_closed_form_standard_error():
    x = np.random.default_rng(7).normal(3.0, 2.0, size=400)
    ci = bootstrap_mean(x)
    # The bootstrap distribution of the mean has sd = population sd of the sample / sqrt(n) and is close
    # to normal at n = 400: the interval is mean ± 1.96 sd, within resampling noise (~5% of the width).
    half = 1.959964 * x.std(ddof=0) / math.sqrt(x.size)
    assert ci.estimate == pytest.approx(x.mean(), abs=1e-12)
    assert ci.low == pytest.approx(x.mean() - half, abs=0.08 * half)
    assert ci.high == pytest.approx(x.mean() + half, abs=0.08 * half)


def test_coverage_on_synthetic_data_with_a_known_mean():
    rng = np.random.default_rng(3)
    trials, hits = 300, 0
    for t in range(trials):
        sample = rng.binomial(1, 0.3, size=60).astype(float)
        ci = bootstrap_mean(sample, resamples=1000, seed=t)
        hits += ci.low <= 0.3 <= ci.high
    # Percentile intervals undercover slightly at n = 60; 95% nominal, 300 trials (sd ≈ 1.3 points).
    assert 0.89 <= hits / trials <= 0.99, hits / trials


def test_degenerate_samples():
    assert bootstrap_mean([1.0] * 20).to_dict() == {"estimate": 1.0, "low": 1.0, "high": 1.0, "n": 20}
    single = bootstrap_mean([0.5])
    assert single.n == 1 and single.estimate == 0.5 and math.isnan(single.low) and math.isnan(single.high)
    assert single.to_dict()["low"] is None
    for bad in ([], [1.0, math.nan]):
        with pytest.raises(ValueError):
            bootstrap_mean(bad)


def test_seeded_and_reproducible():
    x = np.random.default_rng(0).random(30)
    assert bootstrap_mean(x) == bootstrap_mean(x)
    assert bootstrap_mean(x, seed=1) != bootstrap_mean(x, seed=2)


def test_paired_difference_is_the_interval_of_the_item_differences():
    rng = np.random.default_rng(5)
    difficulty = rng.normal(0, 1, size=80)  # shared by both configurations: cancels in the pairs
    full = difficulty + rng.normal(0, 0.1, size=80)
    ours = difficulty - 0.3 + rng.normal(0, 0.1, size=80)
    paired = paired_difference(ours, full)
    direct = bootstrap_mean(ours - full)
    assert paired == direct
    assert paired.estimate == pytest.approx(ours.mean() - full.mean(), abs=1e-12)
    half = 1.959964 * (ours - full).std(ddof=0) / math.sqrt(80)
    assert paired.high - paired.low == pytest.approx(2 * half, rel=0.15)
    # Unpaired intervals of the two means are ~10x wider here: pairing is what resolves the gap.
    assert paired.high < 0 and (bootstrap_mean(ours).high - bootstrap_mean(ours).low) > 5 * (paired.high - paired.low)
    shifted = paired_difference(full + 0.25, full)
    assert (shifted.low, shifted.high) == (pytest.approx(0.25), pytest.approx(0.25))
    with pytest.raises(ValueError, match="same items"):
        paired_difference([1.0, 2.0], [1.0])


def test_item_intervals_take_the_metrics_every_item_reports():
    items = [{"acc": 1.0, "ratio": 0.5, "text": "a"}, {"acc": 0.0, "ratio": 0.5}, {"acc": 1.0, "ratio": 0.5}]
    intervals = item_intervals(items)
    assert set(intervals) == {"acc", "ratio"}
    assert intervals["acc"].estimate == pytest.approx(2 / 3) and intervals["acc"].n == 3
    assert intervals["ratio"].low == intervals["ratio"].high == 0.5


def test_function_of_means_resamples_items_jointly():
    rng = np.random.default_rng(11)
    x = rng.normal(2.0, 0.5, size=40)
    y = x + rng.normal(0.1, 0.05, size=40)  # strongly paired with x
    assert bootstrap_function({"x": x}, lambda x: x) == bootstrap_mean(x)  # same draws, same interval
    # exp is monotone: the interval of exp(mean) is exp of the mean's interval (up to interpolation).
    ci, mean_ci = bootstrap_function({"x": x}, lambda x: np.exp(x)), bootstrap_mean(x)
    assert (ci.low, ci.high) == (pytest.approx(math.exp(mean_ci.low), rel=1e-3),
                                 pytest.approx(math.exp(mean_ci.high), rel=1e-3))
    # Joint resampling keeps the pairing: the interval of mean(y) - mean(x) is the paired one.
    joint, paired = bootstrap_function({"x": x, "y": y}, lambda x, y: y - x), paired_difference(y, x)
    assert (joint.estimate, joint.low, joint.high) == (pytest.approx(paired.estimate, abs=1e-12),
                                                       pytest.approx(paired.low, abs=1e-12),
                                                       pytest.approx(paired.high, abs=1e-12))
    with pytest.raises(ValueError, match="same items"):
        bootstrap_function({"x": x, "y": y[:-1]}, lambda x, y: y - x)

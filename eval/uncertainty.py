"""Confidence intervals for the numbers eval reports: the percentile bootstrap over items.

Every aggregate a run reports that is a mean over items (accuracy, string match, KL per window, the
compression ratio) gets a 95% interval from resampling the items with replacement. A comparison of two
configurations on the same items (a strategy against the full cache) resamples the *pairs*, i.e. the
per-item differences: item difficulty cancels, so the interval is much tighter than comparing two
independent intervals, and it is the interval of the number a paper cites ("-12 points vs full").

Fixed seed and resample count, so the same items always give the same interval (results are
content-addressed and compared byte for byte). Percentile intervals: no normality assumption, and they
stay inside [0, 1] for accuracies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95
# Resamples drawn per batch: bounds memory at _BATCH × n indices for datasets with many items.
_BATCH = 250


@dataclass(frozen=True)
class Interval:
    """A point estimate (the sample mean), its percentile-bootstrap interval and the number of items.

    With a single item there is nothing to resample: the bounds are NaN (unknown), not the point."""

    estimate: float
    low: float
    high: float
    n: int

    def to_dict(self) -> dict:
        def num(v: float) -> float | None:
            return None if math.isnan(v) else v

        return {"estimate": num(self.estimate), "low": num(self.low), "high": num(self.high), "n": self.n}


def _as_array(values: Sequence[float] | np.ndarray) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("no values to bootstrap")
    if not np.isfinite(x).all():
        raise ValueError("values must be finite")
    return x


def bootstrap_means(values: Sequence[float] | np.ndarray, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """The means of `resamples` resamples of `values` (n items drawn with replacement), in draw order."""
    x = _as_array(values)
    rng = np.random.default_rng(seed)
    out = np.empty(resamples)
    for start in range(0, resamples, _BATCH):
        stop = min(start + _BATCH, resamples)
        idx = rng.integers(0, x.size, size=(stop - start, x.size))
        out[start:stop] = x[idx].mean(axis=1)
    return out


def bootstrap_mean(values: Sequence[float] | np.ndarray, resamples: int = RESAMPLES, seed: int = SEED,
                   level: float = LEVEL) -> Interval:
    """The mean of `values` with its `level` percentile-bootstrap interval."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = _as_array(values)
    estimate = float(x.mean())
    if x.size == 1:
        return Interval(estimate, math.nan, math.nan, 1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(bootstrap_means(x, resamples, seed), [tail, 100 - tail])
    # The percentile of a constant sample is the constant up to rounding of the mean; keep the point inside.
    return Interval(estimate, min(float(low), estimate), max(float(high), estimate), int(x.size))


def paired_difference(values: Sequence[float] | np.ndarray, reference: Sequence[float] | np.ndarray,
                      resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL) -> Interval:
    """mean(values - reference) over the same items, with the paired-bootstrap interval: the items are
    resampled together, so each resample's difference of means is the mean of the same item differences."""
    a, b = _as_array(values), _as_array(reference)
    if a.size != b.size:
        raise ValueError(f"paired samples must have the same items: {a.size} vs {b.size} values")
    return bootstrap_mean(a - b, resamples, seed, level)


def bootstrap_function(columns: dict[str, Sequence[float] | np.ndarray], fn: Callable[..., np.ndarray | float],
                       resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL) -> Interval:
    """An aggregate that is a function of several item means (perplexity = exp(mean NLL)): the items are
    resampled jointly, `fn(**means)` is evaluated on every resample's column means (arrays), and the
    percentile interval taken. The estimate is `fn` of the full sample's means."""
    arrays = {k: _as_array(v) for k, v in columns.items()}
    sizes = {a.size for a in arrays.values()}
    if len(sizes) != 1:
        raise ValueError(f"columns must have the same items, got sizes {sorted(sizes)}")
    (n,) = sizes
    estimate = float(fn(**{k: a.mean() for k, a in arrays.items()}))
    if n == 1:
        return Interval(estimate, math.nan, math.nan, 1)
    rng = np.random.default_rng(seed)
    values = np.empty(resamples)
    for start in range(0, resamples, _BATCH):
        stop = min(start + _BATCH, resamples)
        idx = rng.integers(0, n, size=(stop - start, n))
        values[start:stop] = fn(**{k: a[idx].mean(axis=1) for k, a in arrays.items()})
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return Interval(estimate, min(float(low), estimate), max(float(high), estimate), n)


def item_intervals(items: list[dict], resamples: int = RESAMPLES, seed: int = SEED,
                   level: float = LEVEL) -> dict[str, Interval]:
    """An interval for every metric that all items report (items: dicts of metric -> number)."""
    if not items:
        return {}
    names = [k for k in items[0] if all(_is_number(it.get(k)) for it in items)]
    return {k: bootstrap_mean([it[k] for it in items], resamples, seed, level) for k in names}


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

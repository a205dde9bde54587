"""Intervals over finished runs, from their items.jsonl: a configuration's metric pooled over its runs
(seeds), and a configuration against the full cache on the same items (paired bootstrap).

Items are matched by content, not by index: two runs' items pair when their token ids are identical and
the runs share task options (answer length, query mode: what else decides an item's score). Runs
written before items were recorded have none, and get no interval (the summary leaves the cell empty).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from eval import results
from eval.uncertainty import Interval, bootstrap_mean, paired_difference

ITEMS = results.ITEMS_FILE
# {item key: metrics} per (run directory, items.jsonl's mtime): a summary reads each run several times, and
# a run replaced in place (--overwrite) is read afresh.
_CACHE: dict[tuple[Path, int], dict[str, dict] | None] = {}


def item_key(item: dict) -> str:
    ids = json.dumps([item.get("context_ids"), item.get("question_ids")])
    return hashlib.sha256(ids.encode()).hexdigest()[:16]


def run_items(run_dir: Path) -> dict[str, dict] | None:
    """A run's per-item metrics keyed by item content; None when the run recorded no items."""
    run_dir = Path(run_dir)
    try:
        key = (run_dir, (run_dir / ITEMS).stat().st_mtime_ns)
    except OSError:
        return None
    if key not in _CACHE:
        try:
            items = results.read_items(run_dir, with_kept=False)
        except (OSError, ValueError) as e:  # a damaged file: no intervals for this run, the rest goes on
            print(f"warning: no intervals for {run_dir}: {ITEMS}: {str(e).splitlines()[0][:120]}",
                  file=sys.stderr)
            items = None
        _CACHE[key] = None if items is None else {item_key(it): it.get("metrics", {}) for it in items}
    return _CACHE[key]



def task_options(run_dir: Path) -> str:
    """What, beyond the tokens, decides an item's score: the task options and seed (as one string)."""
    try:
        identity = json.loads((Path(run_dir) / "config.json").read_text()).get("identity") or {}
    except (OSError, ValueError):
        return ""
    return json.dumps([identity.get("task_options"), identity.get("seed")], sort_keys=True, default=str)


def pooled(run_dirs: list[Path], metric: str) -> Interval | None:
    """The metric over the items of all these runs (several seeds: more items), with its interval."""
    values = []
    for run_dir in run_dirs:
        items = run_items(run_dir)
        if items is None or not items or not all(metric in m for m in items.values()):
            return None
        values += [m[metric] for m in items.values()]
    return bootstrap_mean(values)


def paired_vs(run_dirs: list[Path], reference_dirs: list[Path], metric: str) -> Interval | None:
    """mean(metric - reference's metric) over the items both have (same tokens, same task options), with
    the paired-bootstrap interval; None when no item pairs."""
    references: dict[tuple[str, str], float] = {}
    for ref in reference_dirs:
        items = run_items(ref)
        for key, m in (items or {}).items():
            if metric in m:
                references[(task_options(ref), key)] = m[metric]
    ours, theirs = [], []
    for run_dir in run_dirs:
        options = task_options(run_dir)
        for key, m in (run_items(run_dir) or {}).items():
            if metric in m and (options, key) in references:
                ours.append(m[metric])
                theirs.append(references[(options, key)])
    return paired_difference(ours, theirs) if ours else None


def format_interval(interval: Interval | None, signed: bool = False) -> str:
    """`0.45 [0.25, 0.65]`; the point alone with one item; empty without an interval."""
    if interval is None:
        return ""
    fmt = "{:+.3g}" if signed else "{:.3g}"
    point = fmt.format(interval.estimate)
    if interval.n < 2:
        return point
    return f"{point} [{fmt.format(interval.low)}, {fmt.format(interval.high)}]"

"""Intervals over finished runs, from their items.jsonl: a configuration's metric pooled over its runs
(seeds), and a configuration against another on the same items (paired bootstrap): the full cache in the
summary's tables, any run with `python -m eval.compare RUN REFERENCE`.

Items are matched by content, not by index: two runs' items pair when their token ids are identical and
the runs share task options (answer length, query mode: what else decides an item's score). Runs
written before items were recorded have none, and get no interval (the summary leaves the cell empty).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from errors import CliParser, UserError, run_cli
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


def paired_values(run_dirs: list[Path], reference_dirs: list[Path], metric: str) -> tuple[list[float], list[float]]:
    """The metric of every item the runs and the references both scored (same tokens, same task options and
    seed), as two aligned lists: the runs' values and the references'."""
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
    return ours, theirs


def paired_vs(run_dirs: list[Path], reference_dirs: list[Path], metric: str) -> Interval | None:
    """mean(metric - reference's metric) over the items both have (same tokens, same task options), with
    the paired-bootstrap interval; None when no item pairs."""
    ours, theirs = paired_values(run_dirs, reference_dirs, metric)
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


# ---- python -m eval.compare: one run against another on the items both scored -------------------------------

# Flags that say only where a run was written and what else its command ran: not a difference between runs.
NOT_DIFFERENCES = {"out_dir", "overwrite", "baseline", "tasks", "print_cache_spec"}


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        prog="python -m eval.compare", allow_abbrev=False,
        description="Two finished runs of python -m eval on the same items (e.g. one shot vs --prefill_chunk, "
                    "two strategies at one budget): each metric's mean over the items both scored, with its 95%% "
                    "bootstrap interval, and the paired difference run - reference with its interval. Writes "
                    "nothing.")
    p.add_argument("run", type=Path, help="a run directory (it holds items.jsonl)")
    p.add_argument("reference", type=Path, help="the run directory it is compared with")
    p.add_argument("--metrics", nargs="+", help="per-item metrics (default: every one both runs record)")
    return p


def required_items(run_dir: Path) -> list[dict]:
    """A run's items (without kept positions), or a UserError saying why there are none; what run_items then
    returns for the run, without reading the file again."""
    if not (run_dir / ITEMS).is_file():
        raise UserError(f"{run_dir}: no {ITEMS} (not a run directory of python -m eval, or a run written before "
                        f"items were recorded: run it again with --overwrite)")
    try:
        items = results.read_items(run_dir, with_kept=False)
    except (OSError, ValueError) as e:
        raise UserError(f"{run_dir}: {e}") from None
    if not items:
        raise UserError(f"{run_dir}: {ITEMS} holds no item")
    _CACHE[(run_dir, (run_dir / ITEMS).stat().st_mtime_ns)] = {item_key(it): it.get("metrics", {}) for it in items}
    return items


def flag_differences(run_dir: Path, reference_dir: Path) -> list[str]:
    """The flags the two runs were made with that differ, as `flag: run's value vs reference's`."""
    def flags(d: Path) -> dict:
        try:
            return json.loads((d / "config.json").read_text()).get("flags") or {}
        except (OSError, ValueError):
            return {}

    ours, theirs = flags(run_dir), flags(reference_dir)
    return [f"{k}: {ours.get(k)} vs {theirs.get(k)}" for k in sorted(ours.keys() | theirs.keys())
            if k not in NOT_DIFFERENCES and ours.get(k) != theirs.get(k)]


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    for run_dir in (args.run, args.reference):
        required_items(run_dir)
        results.check_not_damaged(run_dir)
    ours, theirs = run_items(args.run), run_items(args.reference)
    recorded = sorted({k for m in ours.values() for k, v in m.items() if isinstance(v, (int, float))}
                      & {k for m in theirs.values() for k in m})
    for metric in args.metrics or []:
        if metric not in recorded:
            raise UserError(f"--metrics: {metric!r} is not a per-item metric of both runs; they record: "
                            f"{', '.join(recorded) or 'none in common'}")
    rows = []
    for metric in args.metrics or recorded:
        run_values, reference_values = paired_values([args.run], [args.reference], metric)
        if not run_values:
            raise UserError(f"no item of {args.run} is in {args.reference} (items pair by their tokens, task "
                            f"options and seed)")
        rows.append({"metric": metric, "items": len(run_values), "run": bootstrap_mean(run_values),
                     "reference": bootstrap_mean(reference_values),
                     "difference": paired_difference(run_values, reference_values)})
    differences = flag_differences(args.run, args.reference)
    print(f"run:       {args.run}\nreference: {args.reference}\nflags that differ: "
          f"{'; '.join(differences) or 'none'}\n")
    print("| metric | items | run | reference | run - reference |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['metric']} | {r['items']} | {format_interval(r['run'])} | {format_interval(r['reference'])} | "
              f"{format_interval(r['difference'], signed=True)} |")
    return rows


if __name__ == "__main__":
    run_cli(main)

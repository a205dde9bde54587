"""`python -m eval.plot`: figures and a markdown summary from the finished runs in --out_dir.

    python -m eval.plot --out_dir results            # writes results/plots/*.png and results/summary.md

- quality_<model>_<task>.png: the task's headline metrics vs the *measured* compression ratio, a line per
  strategy with 95% bootstrap error bars over items, the full cache as a dashed line in its band;
- attention_loss_<model>_<key>.png: attention loss per layer (a heatmap, one row per run), for runs
  whose statistics carry per-layer `attention_loss*` lists (debug_<strategy> runs);
- kl_position_<model>.png: KL(full ‖ compressed) vs position for the fidelity runs, smoothed;
- summary.md: one table per task, every item mean with its 95% bootstrap interval and n (items pooled
  over seeds), and each configuration against the full cache on the same items: paired-bootstrap
  differences with their intervals (eval/compare.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from atomic_files import atomic_write
from errors import CliParser, UserError, run_cli
from eval import kvpress_runs, results
from eval.compare import format_interval, paired_vs, pooled
from eval.tasks import TASKS
from eval.uncertainty import Interval
from flag_types import count


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m eval.plot", description=__doc__, allow_abbrev=False)
    parser.add_argument("--out_dir", default="results", help="the results directory of eval / eval.sweep")
    parser.add_argument("--plots_dir", default=None, help="where figures go (default: <out_dir>/plots)")
    parser.add_argument("--smooth", type=count(), default=32, help="moving-average window of KL vs position")
    return parser


def task_metrics(task: str, frame: pd.DataFrame) -> list[str]:
    """The task's scores present in the table, headline first (unknown tasks: none)."""
    cls = TASKS.get(task)
    return [m for m in (cls.metrics if cls else ()) if m in frame and frame[m].notna().any()]


def config_label(row: pd.Series) -> str:
    return f"{row['strategy']}{' (query-aware)' if row.get('query_aware') is True else ''}"


def averaged(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds of every numeric column, per (strategy, budget, query mode)."""
    frame = frame.assign(label=frame.apply(config_label, axis=1), budget=frame["budget"].astype(str))
    numeric = [c for c in frame.select_dtypes("number").columns if c != "seed"]
    return frame.groupby(["label", "budget"], as_index=False)[numeric].mean()


def config_dirs(frame: pd.DataFrame, out_dir: Path, label: str, budget: str) -> list[Path]:
    """The run directories of one configuration (its seeds)."""
    match = (frame.apply(config_label, axis=1) == label) & (frame["budget"].astype(str) == budget)
    return [out_dir / d for d in frame.loc[match, "run_dir"]] if "run_dir" in frame else []


def ratio_axis(table: pd.DataFrame) -> tuple[str, str]:
    """The x axis of a quality plot: the measured compression ratio, or, where every run has one (the
    kvpress_dataset task, runs imported from kvpress), kvpress's ratio of the context alone: the measured
    ratio also counts the question and answer, never evicted there, and kvpress measures nothing."""
    if "context_compression_ratio" in table and table["context_compression_ratio"].notna().all():
        return "context_compression_ratio", "compression ratio of the context (kvpress's)"
    return "compression_ratio", "measured compression ratio"


def quality_plot(
    frame: pd.DataFrame, model: str, task: str, plots_dir: Path, out_dir: Path | None = None
) -> Path | None:
    import matplotlib.pyplot as plt

    metrics = task_metrics(task, frame)[:2]
    if not metrics:
        return None
    table = averaged(frame)
    full = table[table["label"] == "full"]
    x, x_label = ratio_axis(table)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for label, group in table[table["label"] != "full"].groupby("label"):
            group = group.sort_values(x)
            # Error bars: the 95% bootstrap interval over the configuration's items (none for old runs).
            intervals = [pooled(config_dirs(frame, out_dir, label, b), metric) if out_dir else None
                         for b in group["budget"]]
            y = [iv.estimate if iv else v for iv, v in zip(intervals, group[metric], strict=True)]
            err = np.array([[iv.estimate - iv.low, iv.high - iv.estimate] if iv and iv.n > 1 else [0.0, 0.0]
                            for iv in intervals]).T
            ax.errorbar(group[x], y, yerr=err, marker="o", capsize=3, label=label)
        if len(full):
            band = pooled(config_dirs(frame, out_dir, "full", full["budget"].iloc[0]), metric) if out_dir else None
            ax.axhline(band.estimate if band else full[metric].mean(), color="black", linestyle="--",
                       label="full cache")
            if band and band.n > 1:
                ax.axhspan(band.low, band.high, color="black", alpha=0.08)
        ax.set_xlabel(x_label)
        ax.set_ylabel(f"{metric} (mean, 95% CI)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{task} ({model})")
    fig.tight_layout()
    path = plots_dir / f"quality_{model}_{task}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def attention_loss_plots(runs: list[dict], model: str, plots_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    rows: dict[str, list[tuple[str, list[float]]]] = {}
    for run in runs:
        for key, values in (run.get("per_layer") or {}).items():
            if key.startswith("attention_loss") and values and all(isinstance(v, int | float) for v in values):
                rows.setdefault(key, []).append((f"{run['task']} {run['strategy']} b={run['budget']}", values))
    paths = []
    for key, entries in rows.items():
        width = max(len(v) for _, v in entries)
        grid = np.full((len(entries), width), np.nan)
        for i, (_, values) in enumerate(entries):
            grid[i, : len(values)] = values
        fig, ax = plt.subplots(figsize=(max(6, 0.3 * width), 1 + 0.4 * len(entries)))
        image = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_yticks(range(len(entries)), [label for label, _ in entries], fontsize=8)
        ax.set_xlabel("layer")
        ax.set_title(f"{key} ({model})")
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        path = plots_dir / f"{key}_{model}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def kl_position_plot(runs: list[dict], out_dir: Path, model: str, plots_dir: Path, smooth: int) -> Path | None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = 0
    for run in sorted(runs, key=lambda r: (r["strategy"], -float(r["budget"]) if _is_number(r["budget"]) else 0)):
        if run["task"] != "fidelity" or run["strategy"] == "full":
            continue
        rows = read_predictions(out_dir / run["run_dir"])
        if rows is None:
            continue
        per_position = pd.DataFrame(rows).groupby("position")["kl"].mean()
        curve = per_position.rolling(smooth, min_periods=1).mean()
        ax.plot(curve.index, curve.values, label=f"{run['strategy']} b={run['budget']} s={run['seed']}", lw=1)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel(f"KL(full ‖ compressed), moving mean over {smooth}")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"fidelity: KL vs position ({model})")
    fig.tight_layout()
    path = plots_dir / f"kl_position_{model}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def read_predictions(run_dir: Path) -> list[dict] | None:
    """A fidelity run's per-position rows, or None with a warning naming the run when they are damaged."""
    try:
        rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_bytes().decode().splitlines()]
        if not rows or not all(isinstance(r, dict) and "position" in r and "kl" in r for r in rows):
            raise ValueError("no per-position rows")
    except (OSError, ValueError) as e:
        print(f"warning: skipping damaged run {run_dir}: predictions.jsonl: {str(e).splitlines()[0][:120]}",
              file=sys.stderr)
        return None
    return rows


def _is_number(value: object) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return "" if np.isnan(v) else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def run_interval(group: pd.DataFrame, out_dir: Path, dirs: list[Path], metric: str) -> Interval | None:
    """A metric that is not an item mean (perplexity) has no pooled interval; with a single run, show the
    run's own (from results.csv). Averaging several seeds' bounds would not be an interval: none then."""
    if len(dirs) != 1 or f"{metric}_ci_low" not in group:
        return None
    row = group[group["run_dir"] == dirs[0].relative_to(out_dir).as_posix()]
    if len(row) != 1 or row[[f"{metric}_ci_low", f"{metric}_ci_high"]].isna().any(axis=None):
        return None
    r = row.iloc[0]
    return Interval(float(r[metric]), float(r[f"{metric}_ci_low"]), float(r[f"{metric}_ci_high"]), int(r["n_items"]))


def strategy_pairs(group: pd.DataFrame, out_dir: Path, table: pd.DataFrame, metric: str) -> list[list[object]]:
    """Every two configurations (not the full cache) at the same budget, paired on their common items:
    which strategy is better at equal budget, with its interval (strategies in name order)."""
    rows = []
    configs = table[table["label"] != "full"].sort_values(["budget", "label"])
    for budget, at_budget in configs.groupby("budget", sort=False):
        labels = list(at_budget["label"])
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                diff = paired_vs(config_dirs(group, out_dir, a, budget), config_dirs(group, out_dir, b, budget), metric)
                if diff is not None:
                    rows.append([a, b, budget, format_interval(diff, signed=True), diff.n])
    return rows


def paired_sections(task: str, metrics: list[str], paired_rows: list[tuple]) -> list[str]:
    """Every metric with item values paired against the full cache (the main table shows the headline's
    only), when there is more than one: a table's lines, or none."""
    paired_metrics = [m for m in metrics if any(d[m] for *_, d in paired_rows)]
    if len(paired_metrics) <= 1:
        return []
    table_rows = [[label, budget, *[format_interval(d[m], signed=True) for m in paired_metrics],
                   next(iv.n for iv in d.values() if iv)] for label, budget, d in paired_rows]
    return [f"Paired differences vs the full cache on the same items ({task}):", "",
            markdown_table(["strategy", "budget", *[f"Δ {m} [95% CI]" for m in paired_metrics], "pairs"],
                           table_rows), ""]


def summary_markdown(frame: pd.DataFrame, figures: list[Path], out_dir: Path) -> str:
    parts = ["# KV-cache evaluation summary", "",
             f"{len(frame)} finished runs in `{out_dir}`. *full* is the full cache on the same items; compression "
             "is measured (docs/DESIGN.md §6). A score is its mean over items (pooled over seeds) with the 95% "
             "percentile-bootstrap interval [low, high] and n, the number of items; Δ vs full is the paired "
             "bootstrap over the items both runs scored (same token ids). Speed and memory are one "
             "measurement per run (means over seeds), without an interval.", ""]
    for (model, task), group in frame.groupby(["model", "task"]):
        metrics = task_metrics(task, group)
        table = averaged(group)
        head = metrics[0] if metrics else None
        full_rows = table[table["label"] == "full"]
        full_dirs = [d for b in full_rows["budget"] for d in config_dirs(group, out_dir, "full", b)]
        full_speed = full_rows["decode_tokens_per_second"].mean() if len(full_rows) and \
            "decode_tokens_per_second" in full_rows else float("nan")
        full_head = pooled(full_dirs, head) if head and full_dirs else None
        header = ["strategy", "budget", "compression [95% CI]", "cache MiB", *[f"{m} [95% CI]" for m in metrics],
                  "n"]
        header += [f"full {head}", f"Δ {head} vs full (paired) [95% CI]", "pairs"] if head else []
        header += ["decode tok/s", "× full speed", "runs"]
        rows, paired_rows = [], []
        for _, r in table.sort_values(["label", "compression_ratio"]).iterrows():
            dirs = config_dirs(group, out_dir, r["label"], r["budget"])
            cells = {m: pooled(dirs, m) for m in ["compression_ratio", *metrics]}
            n = next((iv.n for iv in cells.values() if iv is not None), None)

            intervals = {m: iv if iv is not None else run_interval(group, out_dir, dirs, m) for m, iv in cells.items()}
            shown = {m: format_interval(iv) if iv is not None else r[m] for m, iv in intervals.items()}

            row = [r["label"], r["budget"], shown["compression_ratio"], r.get("cache_bytes", float("nan")) / 2**20,
                   *[shown[m] for m in metrics], "" if n is None else n]
            diffs = {m: paired_vs(dirs, full_dirs, m) if r["label"] != "full" else None for m in metrics}
            if head:
                full_cell = format_interval(full_head) if full_head else full_rows[head].mean() if len(full_rows) \
                    else float("nan")
                row += [full_cell, format_interval(diffs[head], signed=True),
                        diffs[head].n if diffs[head] else ""]
            speed = r.get("decode_tokens_per_second", float("nan"))
            row += [speed, speed / full_speed if full_speed else float("nan"), len(dirs)]
            rows.append(row)
            if any(diffs.values()):
                paired_rows.append((r["label"], r["budget"], diffs))
        parts += [f"## {task} ({model})", "", markdown_table(header, rows), ""]
        if task == kvpress_runs.TASK:  # scores x100 per task, as kvpress's leaderboard shows them
            parts += [f"Per task ({task}, kvpress's scorer; runs imported from kvpress measure nothing):", "",
                      kvpress_runs.leaderboard_markdown(group), ""]
        parts += paired_sections(task, metrics, paired_rows)
        between = strategy_pairs(group, out_dir, table, head) if head else []
        if between:
            parts += [f"Paired differences between strategies at the same budget ({task}, {head}):", "",
                      markdown_table(["strategy", "vs", "budget", f"Δ {head} [95% CI]", "pairs"], between), ""]
    if figures:
        parts += ["## Figures", ""] + [f"- [{p.name}]({p.relative_to(out_dir)})" if p.is_relative_to(out_dir)
                                       else f"- {p}" for p in figures] + [""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> list[Path]:
    args = build_parser().parse_args(argv)
    out_dir = Path(args.out_dir)
    if not out_dir.is_dir():
        raise UserError(f"results directory not found: {out_dir}")
    runs = results.load_runs(out_dir)  # damaged runs are skipped with a warning naming them
    frame = results.results_frame(out_dir, runs)
    if frame.empty:
        raise UserError(f"no finished runs in {out_dir}")
    plots_dir = results.check_out_dir(args.plots_dir or out_dir / "plots")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    figures: list[Path] = []
    for (model, task), group in frame.groupby(["model", "task"]):
        figures.append(quality_plot(group, model, task, plots_dir, out_dir))
    for model in sorted(frame["model"].unique()):
        model_runs = [r for r in runs if r["model"] == model]
        figures += attention_loss_plots(model_runs, model, plots_dir)
        figures.append(kl_position_plot(model_runs, out_dir, model, plots_dir, args.smooth))
    figures = [f for f in figures if f is not None]
    summary = out_dir / "summary.md"
    atomic_write(summary, summary_markdown(frame, figures, out_dir), overwrite=True)
    for path in [*figures, summary]:
        print(path)
    return [*figures, summary]


if __name__ == "__main__":
    run_cli(main)

"""`python -m eval.plot`: figures and a markdown summary from the finished runs in --out_dir.

    python -m eval.plot --out_dir results            # writes results/plots/*.png and results/summary.md

- quality_<model>_<task>.png: the task's headline metrics vs the *measured* compression ratio, a line per
  strategy, the full cache as a dashed reference line;
- attention_loss_<model>_<key>.png: attention loss per layer (a heatmap, one row per run), for runs
  whose statistics carry per-layer `attention_loss*` lists (debug_<strategy> runs);
- kl_position_<model>.png: KL(full ‖ compressed) vs position for the fidelity runs, smoothed;
- summary.md: one table per task, each configuration next to the full cache's score (mean over seeds).
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
from eval import results
from eval.tasks import TASKS


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m eval.plot", description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--out_dir", default="results", help="the results directory of eval / eval.sweep")
    parser.add_argument("--plots_dir", default=None, help="where figures go (default: <out_dir>/plots)")
    parser.add_argument("--smooth", type=int, default=32, help="moving-average window of KL vs position")
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


def quality_plot(frame: pd.DataFrame, model: str, task: str, plots_dir: Path) -> Path | None:
    import matplotlib.pyplot as plt

    metrics = task_metrics(task, frame)[:2]
    if not metrics:
        return None
    table = averaged(frame)
    full = table[table["label"] == "full"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for label, group in table[table["label"] != "full"].groupby("label"):
            group = group.sort_values("compression_ratio")
            ax.plot(group["compression_ratio"], group[metric], marker="o", label=label)
        if len(full):
            ax.axhline(full[metric].mean(), color="black", linestyle="--", label="full cache")
        ax.set_xlabel("measured compression ratio")
        ax.set_ylabel(metric)
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


def summary_markdown(frame: pd.DataFrame, figures: list[Path], out_dir: Path) -> str:
    parts = ["# KV-cache evaluation summary", "",
             f"{len(frame)} finished runs in `{out_dir}`; means over seeds. *full* is the full cache on the "
             "same items; compression is measured (docs/DESIGN.md §6).", ""]
    for (model, task), group in frame.groupby(["model", "task"]):
        metrics = task_metrics(task, group)
        table = averaged(group)
        full = table[table["label"] == "full"]
        head = metrics[0] if metrics else None
        full_head = full[head].mean() if head and len(full) else float("nan")
        full_speed = full["decode_tokens_per_second"].mean() if len(full) else float("nan")
        header = ["strategy", "budget", "compression", "cache MiB", *metrics]
        header += [f"full {head}", f"Δ {head}"] if head else []
        header += ["decode tok/s", "× full speed", "runs"]
        rows = []
        for _, r in table.sort_values(["label", "compression_ratio"]).iterrows():
            row = [r["label"], r["budget"], r["compression_ratio"], r["cache_bytes"] / 2**20,
                   *[r[m] for m in metrics]]
            row += [full_head, r[head] - full_head] if head else []
            speed = r.get("decode_tokens_per_second", float("nan"))
            row += [speed, speed / full_speed if full_speed else float("nan")]
            row.append(int(((group.apply(config_label, axis=1) == r["label"])
                            & (group["budget"].astype(str) == r["budget"])).sum()))
            rows.append(row)
        parts += [f"## {task} ({model})", "", markdown_table(header, rows), ""]
    if figures:
        parts += ["## Figures", ""] + [f"- [{p.name}]({p.relative_to(out_dir)})" if p.is_relative_to(out_dir)
                                       else f"- {p}" for p in figures] + [""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> list[Path]:
    args = build_parser().parse_args(argv)
    if args.smooth < 1:
        raise UserError(f"--smooth must be ≥ 1, got {args.smooth}")
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
        figures.append(quality_plot(group, model, task, plots_dir))
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

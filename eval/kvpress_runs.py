"""`python -m eval.kvpress_runs`: runs in kvpress's directory layout, both ways, so that a kvpress run and
ours sit in one table (NVIDIA/kvpress `evaluation/evaluate.py`).

    python -m eval.kvpress_runs run --compression_ratio 0.5 --cache_strategy snapkv --dataset ruler.jsonl ...
    python -m eval.kvpress_runs export results/<model>/kvpress_dataset/<run> --to kvpress_results
    python -m eval.kvpress_runs import kvpress_results/ --out_dir results
    python -m eval.kvpress_runs table --out_dir results
    python -m eval.kvpress_runs ruler_file --tasks niah_single_1 vt --limit 4 --seq_len 512 --to ruler.jsonl

A kvpress run is a directory `{dataset}__{data_dir}__{model with / as --}__{press}__{ratio:.2f}` (then
`__query_aware` when the question was compressed with the context) holding predictions.csv (the dataset's
columns but the context, plus predicted_answer and compression_ratio), metrics.json (RULER: task ->
{"string_match": score}; LongBench: one number, the run being one task) and config.yaml (EvaluationConfig).
kvpress's compression_ratio is the fraction of the context removed: --max_cache_length 1 - ratio here.

`run` passes every other flag to `python -m eval`. `export` writes kvpress's files from a finished
kvpress_dataset run (one directory per task for LongBench, as kvpress runs it); `import` turns kvpress's
directories, its own or exported ones, into run directories of `--out_dir`, rescoring predictions.csv
with our scorers where it is there (`score_rescored`: equal to kvpress's score when the scorers agree),
and rebuilds results.csv.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import pandas as pd
import yaml

from atomic_files import atomic_write, replace_dir, temp_dir_beside
from errors import CliParser, UserError, run_cli
from eval import results, scorers
from eval.tasks.kvpress_datasets import SCORE, SCORER_FLAVOR, list_literal, score_key
from flag_types import real

TASK = "kvpress_dataset"
BENCHMARKS = ("ruler", "longbench")
METRIC = "string_match"  # kvpress's key in a RULER metrics.json
# EvaluationConfig's fields in its order (threshold and head_compression_ratio are dropped when unset).
CONFIG_FIELDS = ("dataset", "data_dir", "model", "device", "press_name", "compression_ratio",
                 "key_channel_compression_ratio", "fraction", "max_new_tokens", "max_context_length", "query_aware",
                 "needle_depth", "compression_interval", "target_size", "hidden_states_buffer_size", "output_dir",
                 "log_level", "model_kwargs", "press_init_command", "seed", "fp8")
EXPORT_MARK = "exported_from"  # our own block in an exported config.yaml: what kvpress's fields cannot say
NO_PRESS = "no_press"


def check_ratio(value: object, where: str) -> float:
    """kvpress's compression_ratio: a number in [0, 1) (ScorerPress asserts it)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise UserError(f"{where}: compression_ratio must be a number in [0, 1), got {value!r:.40}")
    return float(value)


def run_name(dataset: str, data_dir: str | None, model: str, press: str, ratio: float, query_aware: bool) -> str:
    """evaluate.py get_results_dir for the settings used here (no fraction, threshold or needle depth)."""
    parts = [dataset, str(data_dir) if data_dir else "", model.replace("/", "--"), press, f"{ratio:.2f}"]
    return "__".join(p for p in [*parts, "query_aware" if query_aware else ""] if p)


# ---- run: python -m eval with kvpress's compression ratio ------------------------------------------------


def run_parser() -> argparse.ArgumentParser:
    """The run subcommand's own flags (the rest are python -m eval's)."""
    parser = CliParser(prog="python -m eval.kvpress_runs run", allow_abbrev=False,
                       description="python -m eval under the kvpress protocol at kvpress's --compression_ratio "
                                   "(the fraction of each context removed: --max_cache_length 1 - ratio here); "
                                   "every other flag goes to python -m eval.")
    parser.add_argument("--compression_ratio", type=real(0, 1, high_open=True), required=True,
                        help="kvpress's: the fraction of each context removed, in [0, 1)")
    return parser


def run(argv: list[str]) -> list[dict]:
    from eval import cli

    known, rest = run_parser().parse_known_args(argv)
    ratio = check_ratio(known.compression_ratio, "--compression_ratio")
    if any(a.startswith(("--max_cache_length", "--protocol")) for a in rest):
        raise UserError("run sets --max_cache_length (1 - --compression_ratio) and --protocol kvpress itself")
    tasks = [] if "--tasks" in rest else ["--tasks", TASK]
    strategies = cli.build_parser().parse_known_args(rest)[0].cache_strategy
    # the full cache keeps every token: a budget would be ignored (and eval refuses one typed for it)
    budget = [] if all(s.removeprefix("debug_") == "full" for s in strategies) else ["--max_cache_length",
                                                                                     repr(1 - ratio)]
    return cli.main([*tasks, *rest, "--protocol", "kvpress", *budget])


# ---- export ---------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> object:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {str(e).splitlines()[0][:120]}") from None


def nominal_ratio(flags: dict, where: Path) -> tuple[str | None, float]:
    """(press name for the full cache or None, kvpress's compression ratio) of one of our runs."""
    if set(flags["cache_strategy"]) == {"full"}:
        return NO_PRESS, 0.0
    budget = flags["max_cache_length"]
    if len(budget) != 1 or not 0 < budget[0] <= 1:
        raise UserError(f"{where}: --max_cache_length {budget} is not one fraction of the context; kvpress's "
                        "compression_ratio is 1 - that fraction")
    return None, check_ratio(1 - budget[0], str(where))


def export_run(run_dir: Path, to: Path, model: str | None = None, press_name: str | None = None,
               data_dir: str | None = None, overwrite: bool = False) -> list[Path]:
    """kvpress's directories for one finished kvpress_dataset run of ours; returns them."""
    metrics = _read_json(run_dir / "metrics.json", "metrics.json")
    results.check_not_damaged(run_dir)
    if "identity" not in metrics:
        raise UserError(f"{run_dir}: its metrics.json has no identity: not a finished run of python -m eval")
    config = _read_json(run_dir / "config.json", "config.json")
    if metrics.get("task") != TASK:
        raise UserError(f"{run_dir}: a {metrics.get('task')!r} run; only {TASK} runs have kvpress's columns")
    predictions = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    flags, options = config["flags"], config["task_options"]
    full_press, ratio = nominal_ratio(flags, run_dir)
    press = press_name or full_press or metrics["strategy"].replace(" ", "_")
    model = model or metrics["model"]
    benchmark = config["benchmark"]
    groups = {None: predictions} if benchmark == "ruler" else {}
    if benchmark == "longbench":  # kvpress runs LongBench one task (data_dir) at a time
        for p in predictions:
            groups.setdefault(p["task"], []).append(p)
    mark = {"run_dir": str(run_dir), "strategy": metrics["strategy"], "budget": metrics["budget"],
            "compression_ratio": metrics.get("compression_ratio"),
            "context_compression_ratio": metrics.get("context_compression_ratio"), "limit": options.get("limit"),
            "dataset": options.get("dataset"), "run_id": metrics.get("run_id"), "seed": metrics.get("seed")}
    written = []
    for task, rows in groups.items():
        directory = data_dir if task is None else task
        if directory is None:
            directory = options.get("dataset_config")
        name = run_name(benchmark, directory, model, press, ratio, bool(options["query_aware"]))
        fields = {"dataset": benchmark, "data_dir": directory, "model": model, "device": flags.get("device"),
                  "press_name": press, "compression_ratio": ratio, "key_channel_compression_ratio": None,
                  "fraction": 1.0, "max_new_tokens": options.get("max_new_tokens"), "max_context_length": None,
                  "query_aware": bool(options["query_aware"]), "needle_depth": None, "compression_interval": None,
                  "target_size": None, "hidden_states_buffer_size": None, "output_dir": str(to),
                  "log_level": "INFO", "model_kwargs": {},
                  "press_init_command": f"python -m eval {metrics['strategy']} --max_cache_length {1 - ratio:g}",
                  "seed": flags.get("seed"), "fp8": False}
        written.append(_write_kvpress_dir(to / name, rows, benchmark, {**fields, EXPORT_MARK: mark}, ratio,
                                          overwrite))
    return written


def _prediction_frame(rows: list[dict], benchmark: str, ratio: float) -> pd.DataFrame:
    answer = "answer" if benchmark == "ruler" else "answers"  # the two hub copies' column names
    # LongBench's classification tasks (trec, lsht) are scored against the dataset's classes: kept, as kvpress keeps
    # every column but the context, so an exported run rescores on import.
    has_classes = any("all_classes" in r for r in rows)
    classes = {"all_classes": [r.get("all_classes") or "" for r in rows]} if has_classes else {}
    return pd.DataFrame({
        **classes, "question": [r["question"] for r in rows], "answer_prefix": [r["answer_prefix"] for r in rows],
        answer: [r["answers"] for r in rows], "task": [r["task"] for r in rows],
        "max_new_tokens": [r["max_new_tokens"] for r in rows], "predicted_answer": [r["prediction"] for r in rows],
        "compression_ratio": ratio,  # kvpress writes the press's nominal ratio
        "context_compression_ratio": [r.get("context_compression_ratio") for r in rows],
        "measured_compression_ratio": [r.get("compression_ratio") for r in rows]})


def kvpress_metrics(rows: list[dict], benchmark: str) -> dict | float:
    """metrics.json as kvpress's calculate_metrics writes it, from our item scores (x100 in `score`)."""
    per_task: dict[str, list[float]] = {}
    for r in rows:
        per_task.setdefault(r["task"], []).append(r[SCORE] / 100)
    scores = {t: scorers.task_score(t, v) for t, v in sorted(per_task.items())}
    if benchmark == "ruler":
        return {t: {METRIC: s} for t, s in scores.items()}
    (score,) = scores.values()
    return score


def _write_kvpress_dir(target: Path, rows: list[dict], benchmark: str, fields: dict, ratio: float,
                       overwrite: bool) -> Path:
    if target.exists() and not overwrite:
        raise UserError(f"{target} exists; pass --overwrite to replace it")
    tmp = temp_dir_beside(target)
    try:
        _prediction_frame(rows, benchmark, ratio).to_csv(tmp / "predictions.csv", index=False)
        atomic_write(tmp / "metrics.json", json.dumps(kvpress_metrics(rows, benchmark), indent=4), overwrite=True)
        atomic_write(tmp / "config.yaml", yaml.dump(fields, default_flow_style=False, indent=2, sort_keys=False),
                     overwrite=True)
        replace_dir(tmp, target)
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---- import ---------------------------------------------------------------------------------------------


def kvpress_dirs(paths: list[Path]) -> list[Path]:
    """Every kvpress run directory (config.yaml beside metrics.json) at or below the given paths."""
    found = []
    for path in paths:
        if not path.is_dir():
            raise UserError(f"not a directory: {path}")
        candidates = [path] if (path / "config.yaml").is_file() else sorted(p.parent for p in path.rglob("config.yaml"))
        found += [d for d in candidates if (d / "metrics.json").is_file()]
    if not found:
        raise UserError(f"no kvpress run (config.yaml and metrics.json) in {', '.join(map(str, paths))}")
    return found


def _read_config(path: Path) -> dict:
    file = path / "config.yaml"
    try:
        config = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {file}: {str(e).splitlines()[0][:120]}") from None
    if not isinstance(config, dict):
        raise UserError(f"{file}: not a mapping of kvpress's fields")
    for key in ("dataset", "model", "press_name"):
        if not isinstance(config.get(key), str):
            raise UserError(f"{file}: field {key!r} missing or not text")
    if config["dataset"] not in BENCHMARKS:
        raise UserError(f"{file}: field 'dataset' is {config['dataset']!r}; importable: {', '.join(BENCHMARKS)}")
    if "compression_ratio" not in config:
        raise UserError(f"{file}: no field 'compression_ratio' (threshold and head-ratio runs are not importable)")
    config["compression_ratio"] = check_ratio(config["compression_ratio"], f"{file}: field 'compression_ratio'")
    return config


def task_scores(path: Path, config: dict) -> dict[str, float]:
    """Task -> score from kvpress's metrics.json, every task checked against the benchmark's names."""
    file = path / "metrics.json"
    data = _read_json(file, "metrics.json")
    if config["dataset"] == "longbench":
        task = str(config.get("data_dir"))
        if not isinstance(data, int | float) or isinstance(data, bool):
            raise UserError(f"{file}: a LongBench metrics.json is one number, got {type(data).__name__}")
        data = {task: {METRIC: data}}
    if not isinstance(data, dict) or not data:
        raise UserError(f"{file}: not a mapping of task to scores")
    scores = {}
    for task, value in data.items():
        if scorers.benchmark_of(task) != config["dataset"]:
            raise UserError(f"{file}: key {task!r} is not a {config['dataset']} task")
        score = value.get(METRIC) if isinstance(value, dict) else None
        if isinstance(score, bool) or not isinstance(score, int | float) or math.isnan(score):
            raise UserError(f"{file}: key {task!r} has no numeric {METRIC!r}")
        scores[task] = float(score)
    return scores


def parse_answers(cell: object, where: str) -> list[str]:
    """A references cell of predictions.csv: a list as pandas writes it, a numpy array's repr (kvpress's
    files: `['a' 'b']`) or JSON (list_literal)."""
    values = list_literal(cell) if isinstance(cell, str) else None
    if isinstance(cell, str) and not cell.strip().startswith("["):
        values = [cell]
    if not values:
        raise UserError(f"{where}: not a list of reference strings: {cell!r:.60}")
    return values


def rescored(path: Path, benchmark: str) -> tuple[list[dict], dict[str, float]] | None:
    """predictions.csv as prediction rows, and each task rescored with our scorers; None without it."""
    file = path / "predictions.csv"
    if not file.is_file():
        return None
    try:
        frame = pd.read_csv(file, keep_default_na=False, dtype=str)
    except (OSError, ValueError, pd.errors.ParserError) as e:
        raise UserError(f"cannot read {file}: {str(e).splitlines()[0][:120]}") from None
    answer = "answer" if benchmark == "ruler" else "answers"
    missing = [c for c in ("task", "predicted_answer", answer) if c not in frame]
    if missing:
        raise UserError(f"{file}: no column {', '.join(map(repr, missing))}; columns: {', '.join(frame.columns)}")
    if frame.empty:
        raise UserError(f"{file}: no prediction rows (a header alone, or a quote left open)")
    rows, per_task = [], {}
    for i, r in frame.iterrows():
        refs = parse_answers(r[answer], f"{file} row {i}, column {answer!r}")
        classes = parse_answers(r["all_classes"], f"{file} row {i}, column 'all_classes'") \
            if r.get("all_classes", "").startswith("[") else None
        try:
            value = scorers.item_score(r["task"], r["predicted_answer"], refs, classes, SCORER_FLAVOR)
        except UserError as e:
            raise UserError(f"{file} row {i}: {e}") from None
        per_task.setdefault(r["task"], []).append(value)
        rows.append({"index": int(i), "task": r["task"], "answers": refs, "prediction": r["predicted_answer"],
                     SCORE: 100 * value})
    return rows, {t: scorers.task_score(t, v) for t, v in per_task.items()}


def imported_metrics(path: Path, config: dict, model: str | None) -> tuple[dict, list[dict]]:
    """Our metrics.json for one kvpress directory (and its prediction rows)."""
    scores = task_scores(path, config)
    ratio = config["compression_ratio"]
    mark = config.get(EXPORT_MARK) if isinstance(config.get(EXPORT_MARK), dict) else None
    name = str(path.name if not path.name.isdigit() else f"{path.parent.name}-{path.name}")
    metrics = {
        "model": model or config["model"].split("/")[-1], "task": TASK,
        "strategy": mark["strategy"] if mark else f"kvpress:{config['press_name']}",
        "budget": mark["budget"] if mark else 1.0 - ratio, "query_aware": bool(config.get("query_aware")),
        "seed": mark.get("seed") if mark else config.get("seed"),
        "compression_ratio": mark.get("compression_ratio") if mark else ratio,
        "context_compression_ratio": mark.get("context_compression_ratio", ratio) if mark else ratio,
        SCORE: sum(scores.values()) / len(scores), **{score_key(t): s for t, s in scores.items()},
        "source": "ours (exported)" if mark else "kvpress", "imported_from": name,
        "run_id": hashlib.sha256(name.encode()).hexdigest()[:10]}
    again = rescored(path, config["dataset"])
    rows = []
    if again is not None:
        rows, rescores = again
        if set(rescores) != set(scores):  # the two files are not of one run: the rescored score would mislead
            raise UserError(f"{path / 'predictions.csv'}: its tasks ({', '.join(sorted(rescores))}) are not "
                            f"metrics.json's ({', '.join(sorted(scores))})")
        metrics["n_items"] = len(rows)
        metrics["score_rescored"] = sum(rescores.values()) / len(rescores)
        for t, s in rescores.items():
            metrics[f"{score_key(t)}_rescored"] = s
    return metrics, rows


def import_runs(paths: list[Path], out_dir: Path, model: str | None = None) -> list[Path]:
    """Each kvpress directory as a run directory of out_dir (model/kvpress_dataset/kvpress-<name>); every
    directory is checked before anything is written."""
    staged = []
    for path in kvpress_dirs(paths):
        config = _read_config(path)
        metrics, rows = imported_metrics(path, config, model)
        staged.append((config, metrics, rows))
    out_dir = results.check_out_dir(out_dir)
    written = []
    for config, metrics, rows in staged:
        target = out_dir / metrics["model"] / TASK / f"kvpress-{metrics['imported_from']}"
        tmp = results.start_run(target)
        try:
            results.finish_run(tmp, target, {"kvpress_config": config, "run_id": metrics["run_id"]}, rows, metrics)
        finally:
            results.abandon_run(tmp)
        written.append(target)
    results.write_results_table(out_dir)
    return written


# ---- the leaderboard table --------------------------------------------------------------------------------


def leaderboard_markdown(frame: pd.DataFrame) -> str:
    """kvpress_dataset rows as the leaderboard shows them: per model, press and ratio, the mean over tasks
    and each task's score (x100), with where the row came from."""
    from eval.plot import markdown_table

    rows = frame[frame["task"] == TASK]
    if rows.empty:
        return ""
    tasks = sorted(c.removeprefix(f"{SCORE}_") for c in rows.columns
                   if c.startswith(f"{SCORE}_") and not c.endswith(("_rescored", "_ci_low", "_ci_high")))
    ratio = rows["context_compression_ratio"] if "context_compression_ratio" in rows else rows["compression_ratio"]
    rows = rows.assign(_ratio=ratio).sort_values(["model", "strategy", "query_aware", "_ratio"])
    header = ["model", "strategy", "query-aware", "compression ratio", "n", "mean", *tasks, "source"]
    body = [[r["model"], r["strategy"], bool(r.get("query_aware")), round(float(r["_ratio"]), 3),
             r.get("n_items", ""), round(float(r[SCORE]), 2), *[r.get(score_key(t), "") for t in tasks],
             r.get("source") if isinstance(r.get("source"), str) else "ours"] for _, r in rows.iterrows()]
    return markdown_table(header, body)


# ---- command line ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m eval.kvpress_runs", description=__doc__, allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)
    ex = commands.add_parser("export", help="a finished kvpress_dataset run as kvpress's directory")
    ex.add_argument("run_dirs", nargs="+", type=Path)
    ex.add_argument("--to", type=Path, required=True, help="kvpress's output_dir")
    ex.add_argument("--model", default=None, help="the model's hub id in the name (default: our model name)")
    ex.add_argument("--press_name", default=None, help="kvpress's press name (default: our strategy)")
    ex.add_argument("--data_dir", default=None, help="RULER's context length (default: --dataset_config)")
    ex.add_argument("--overwrite", action="store_true")
    im = commands.add_parser("import", help="kvpress directories into --out_dir's table")
    im.add_argument("paths", nargs="+", type=Path)
    im.add_argument("--out_dir", type=Path, default=Path("results"))
    im.add_argument("--model", default=None, help="the model name in our table (default: the hub id's last part)")
    tb = commands.add_parser("table", help="the leaderboard-style table of --out_dir's kvpress_dataset runs")
    tb.add_argument("--out_dir", type=Path, default=Path("results"))
    commands.add_parser("run", help="python -m eval with --compression_ratio (kvpress's), flags passed on",
                        add_help=False)
    commands.add_parser("ruler_file", help="a local RULER-layout file from our generators", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> object:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "run":
        return run(argv[1:])
    if argv and argv[0] == "ruler_file":
        from eval.tasks.ruler import ruler_file_main

        return ruler_file_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "export":
        done = [d for run_dir in args.run_dirs for d in export_run(run_dir, args.to, args.model, args.press_name,
                                                                   args.data_dir, args.overwrite)]
    elif args.command == "import":
        done = import_runs(args.paths, args.out_dir, args.model)
    else:
        if not args.out_dir.is_dir():
            raise UserError(f"results directory not found: {args.out_dir}")
        table = leaderboard_markdown(results.results_frame(args.out_dir))
        if not table:
            raise UserError(f"no {TASK} runs in {args.out_dir}")
        print(table)
        return table
    for d in done:
        print(d)
    return done


if __name__ == "__main__":
    run_cli(main)

"""Where results go: one directory per (model, task, configuration), written atomically, and one tidy table.

    <out_dir>/<model>/<task>/<strategy>-b<budget>-s<seed>-<id>/
        config.json        the flags, the resolved per-layer cache spec, package versions, git commit
        predictions.jsonl  one line per item (per scored position for fidelity)
        metrics.json       written last: its presence marks the run finished
    <out_dir>/results.csv  one row per finished run, rebuilt from every metrics.json

A run's id hashes what determines its numbers (model, dtype, task options, cache flags, seed), so
re-running the same configuration finds the finished run and skips it. Cache hyper-parameters that none
of the run's strategies reads are left out of the id: with `full`, the budget does not matter.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path

import pandas as pd

from cache import CACHE_STRATEGIES, get_strategy
from checkpoint import BUNDLED_GGUF
from errors import UserError
from eval.harness import cache_flag_defaults
from generate import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "numpy", "pandas", "datasets", "tokenizers", "gguf", "safetensors", "rouge-score", "matplotlib")
# Columns first in results.csv; every other scalar of metrics.json follows in alphabetical order.
LEADING_COLUMNS = ["model", "task", "strategy", "budget", "storage", "query_aware", "seed", "n_items",
                   "compression_ratio", "cache_bytes", "budget_tokens_mean"]
TRAILING_COLUMNS = ["prefill_tokens_per_second", "decode_tokens_per_second", "decode_step_ms_median", "prefill_seconds",
                    "decode_seconds", "seconds",
                    "peak_memory_mb", "run_id", "run_dir"]


def cache_identity(args: argparse.Namespace) -> dict:
    flags = {k: getattr(args, k) for k in cache_flag_defaults()}
    strategies = set(args.cache_strategy)
    readable = {hp for cls in CACHE_STRATEGIES.values() for hp in cls.hyperparameters}
    read = {hp for name in strategies for hp in get_strategy(name).hyperparameters}
    unused = readable - read
    if strategies == {"full"}:
        unused |= {"max_cache_length", "cache_length_pattern"}
    if len(strategies) == 1:
        unused.add("cache_strategy_pattern")
    return {k: v for k, v in flags.items() if k not in unused}


def model_name(checkpoint_path: str | None) -> str:
    if checkpoint_path is None:
        return Path(BUNDLED_GGUF).stem
    path = Path(checkpoint_path)
    return path.name if path.is_dir() else path.stem


def strategy_label(args: argparse.Namespace) -> str:
    names = list(dict.fromkeys(args.cache_strategy))
    label = "+".join(names)
    return label if len(names) == 1 else f"{label} ({args.cache_strategy_pattern})"


def budget_value(args: argparse.Namespace) -> float | str:
    """The budget as typed (fraction or tokens); 1.0 for the full cache; a list as text."""
    if set(args.cache_strategy) == {"full"}:
        return 1.0
    values = [f"{v:g}" for v in args.max_cache_length]
    return float(values[0]) if len(values) == 1 else ",".join(values)


def run_identity(args: argparse.Namespace, task_name: str, task_options: dict, dtype: str) -> dict:
    return {"model": model_name(args.checkpoint_path), "dtype": dtype, "task": task_name,
            "task_options": task_options, "cache": cache_identity(args), "seed": args.seed}


def run_id(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:10]


def run_dir(out_dir: Path, args: argparse.Namespace, identity: dict) -> Path:
    budget = "" if set(args.cache_strategy) == {"full"} else f"-b{budget_value(args)}"
    name = f"{'+'.join(dict.fromkeys(args.cache_strategy))}{budget}-s{args.seed}-{run_id(identity)}"
    return out_dir / identity["model"] / identity["task"] / name.replace(" ", "").replace("/", "_")


def is_finished(path: Path) -> bool:
    return (path / "metrics.json").is_file()


def check_out_dir(path: str | Path) -> Path:
    """Create the output directory and prove it is writable, before any model is loaded."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe"):
            pass
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {path}: {e.strerror or e}") from None
    return path


# ---- writing one run ------------------------------------------------------------------------------------


def start_run(path: Path) -> None:
    """Forget an unfinished or overwritten attempt: the marker first, then leftovers of killed writers."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.json").unlink(missing_ok=True)
    for leftover in path.glob(".*.tmp*"):
        leftover.unlink(missing_ok=True)


def write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def finish_run(path: Path, config: dict, predictions: list[dict], metrics: dict) -> None:
    write_json_atomic(path / "config.json", config, overwrite=True)
    write_jsonl_atomic(path / "predictions.jsonl", predictions)
    write_json_atomic(path / "metrics.json", metrics, overwrite=True)  # last: the run is finished


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(root: Path = ROOT) -> str | None:
    """The checked-out commit, read from .git directly (no git binary needed); None outside a checkout."""
    git = root / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        return None
    return None


# ---- the table over all runs ----------------------------------------------------------------------------


def load_runs(out_dir: Path) -> list[dict]:
    runs = []
    for path in sorted(out_dir.glob("*/*/*/metrics.json")):
        metrics = json.loads(path.read_text())
        metrics["run_dir"] = str(path.parent.relative_to(out_dir))
        runs.append(metrics)
    return runs


def results_frame(out_dir: Path) -> pd.DataFrame:
    """One row per finished run with every scalar of its metrics.json (lists stay in the JSON)."""
    rows = [{k: v for k, v in run.items() if not isinstance(v, dict | list)} for run in load_runs(out_dir)]
    if not rows:
        return pd.DataFrame(columns=LEADING_COLUMNS + TRAILING_COLUMNS)
    frame = pd.DataFrame(rows)
    known = LEADING_COLUMNS + TRAILING_COLUMNS
    middle = sorted(c for c in frame.columns if c not in known)
    columns = [c for c in LEADING_COLUMNS if c in frame] + middle + [c for c in TRAILING_COLUMNS if c in frame]
    frame["_budget_order"] = pd.to_numeric(frame["budget"], errors="coerce")
    frame = frame.sort_values(["model", "task", "strategy", "_budget_order", "seed", "run_id"], ascending=[
        True, True, True, False, True, True], kind="stable")
    return frame[columns].reset_index(drop=True)


def write_results_table(out_dir: Path) -> Path:
    """Rebuild results.csv from every finished run; a lock keeps concurrent writers from interleaving."""
    out_dir = Path(out_dir)
    with open(out_dir / ".results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        frame = results_frame(out_dir)
        path = out_dir / "results.csv"
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        frame.to_csv(tmp, index=False)
        os.replace(tmp, path)
    return path

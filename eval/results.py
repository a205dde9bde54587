"""Where results go: one directory per (model, task, configuration), swapped in whole when complete, and one
tidy table.

    <out_dir>/<model>/<task>/<strategy>-b<budget>-s<seed>-<id>/
        config.json        the flags, the resolved per-layer cache spec, the input fingerprints, versions
        predictions.jsonl  one line per item (per scored position for fidelity)
        items.jsonl        one line per item: its metrics and the exact token ids fed (see read_items)
        kept_positions.npz per item and layer, the positions the cache held after prefill
        metrics.json       its `identity` says which inputs produced the numbers; every mean over items
                           with its 95% bootstrap interval (<metric>_ci_low / _ci_high, n = n_items)
    <out_dir>/results.csv  one row per finished run, rebuilt from every metrics.json

The directory's id hashes the configuration (model name, dtype, task options, cache flags, seed); cache
hyper-parameters that none of the run's strategies reads are left out (with `full`, the budget does not
matter). The run's `identity` hashes that configuration together with what the flags only name: the
model files' content, data files (--text_file, --dataset, --haystack, gates), and the code (the sources
that compute the numbers, Python and torch versions). A finished run is reused only when its identity
is the current one; otherwise it is run again and replaced.

`--batch_size` is not part of it: a fidelity window decoded in a batch records what it records alone, within
1e-5 on every per-item metric (the rows' matmuls round differently; tests/test_eval_batching.py); a
generation or multiple-choice item the same answer, scores, kept positions and discrete statistics, its
attention sums and option log-likelihoods within 1e-5 (tests/test_eval_generation_batching.py); and the
strategies whose decisions would depend on that rounding decode alone, and in bfloat16 and float16 no
strategy decodes more rows together than stay batch-invariant (eval/batching.py rows_per_batch: 8 on the CPU;
on a GPU, where none are, a note says a row may keep other tokens), so a run finished at one batch size is
reused at another. Its timings are per run and differ; a fidelity run's config.json
records the batch.

A run is written into a hidden directory beside its final place and swapped in only when complete, so an
interrupted run (Ctrl-C, SIGKILL, --overwrite included) leaves the previous result as it was.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import zipfile
import zlib
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd

from atomic_files import atomic_target, atomic_write, recover_dir, remove_leftovers, replace_dir, temp_dir_beside
from cache import Setting
from cache_spec import cache_flag_defaults, strategy_settings
from checkpoint import BUNDLED_GGUF, bundled_checkpoint_path
from errors import UserError
from eval.data import input_fingerprint
from file_stamps import file_stamp
from strategies import CACHE_STRATEGIES, get_strategy

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "numpy", "pandas", "datasets", "tokenizers", "gguf", "safetensors", "rouge-score", "matplotlib")
# Columns first in results.csv; every other scalar of metrics.json follows in alphabetical order.
LEADING_COLUMNS = ["model", "task", "strategy", "budget", "storage", "query_aware", "seed", "n_items",
                   "compression_ratio", "cache_bytes", "budget_tokens_mean"]
TRAILING_COLUMNS = ["prefill_tokens_per_second", "decode_tokens_per_second", "decode_step_ms_median", "prefill_seconds",
                    "decode_seconds", "compile_seconds", "seconds",
                    "peak_memory_mb", "run_id", "identity", "run_dir"]
# metrics.json without these is not a run (a stray or damaged file): skipped with a warning. Runs written
# before identities existed have none: they stay in the table and plots, and eval runs them again.
REQUIRED_KEYS = ("model", "task", "strategy", "budget")
# Sources that only orchestrate, draw, train or test: editing them does not change a run's numbers
# (a trailing "/": a whole folder). Every other Python file below the root counts, wherever it sits, so a
# module moved into a package keeps changing the identity.
NOT_COMPUTE = ("eval/plot.py", "eval/compare.py", "eval/replay.py", "eval/sweep.py", "eval/sweep_ray.py",
               "eval/kvpress_runs.py",
               "eval/bench/", "eval/reproduce/", "train_gates.py", "tests/", "benchmarks/")
# What computes numbers besides Python: the C/C++ kernels of the CPU's bf16 and quantized attention (built on
# first use), and the word list the RULER-style tasks draw their keys and lists from.
COMPUTE_SUFFIXES = (".py", ".c", ".cpp", ".h")
COMPUTE_DATA = ("eval/data/",)



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
    if flags.get("budget_allocation") == "uniform":
        unused.add("adakv_floor")  # read by pooled caches only (budget_allocation.py)
    return {k: v for k, v in flags.items() if k not in unused}


def model_name(checkpoint_path: str | None) -> str:
    if checkpoint_path is None:
        return Path(BUNDLED_GGUF).stem
    path = Path(checkpoint_path)
    return path.name if path.is_dir() else path.stem


def strategy_label(args: argparse.Namespace) -> str:
    names = list(dict.fromkeys(args.cache_strategy))
    label = "+".join(names)
    if getattr(args, "budget_allocation", "uniform") != "uniform":  # a line of its own in tables and plots
        label += f" {args.budget_allocation}"
    label = label if len(names) == 1 else f"{label} ({args.cache_strategy_pattern})"
    label += "".join(f" {part}" for part in changed_settings(args))
    # Re-rotated positions change the numbers: their own line in tables and plots (getattr: older configs).
    return f"{label} rerotated" if getattr(args, "rerotate_positions", False) else label


def changed_settings(args: argparse.Namespace) -> list[str]:
    """The settings of the run's strategies and prompt rules that differ from their declared defaults
    (`cam_merge_window=4`, a switch's name when set): a strategy run with other settings is another line in
    tables and plots, never pooled with its default runs as if it were a seed of them."""
    names = [*args.cache_strategy, *getattr(args, "prompt_compression_strategy", [])]
    names = [n.removeprefix("debug_") for n in names]
    classes = [CACHE_STRATEGIES[n] for n in names if n in CACHE_STRATEGIES]  # not `auto`
    parts = []
    for setting in dict.fromkeys(s for cls in classes for s in cls.settings):
        value = getattr(args, setting.name, setting.default)
        if value != setting.default:
            parts.append(setting.name if value is True else f"{setting.name}={value}")
    return parts


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
    """Whether `path` holds a complete, readable run (see damage)."""
    metrics = read_metrics(path)
    return metrics is not None and damage(path, metrics) is None


def refuse_file_as_out_dir(path: Path) -> None:
    """--out_dir naming a file: refused in those words (mkdir's "File exists" would not say what is wrong)."""
    if path.exists() and not path.is_dir():
        raise UserError(f"--out_dir {path} is not a directory")


def check_out_dir(path: str | Path) -> Path:
    """Create the output directory and prove it is writable, before any model is loaded."""
    path = Path(path)
    refuse_file_as_out_dir(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe"):
            pass
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {path}: {e.strerror or e}") from None
    return path


# ---- what the numbers depend on beyond the flags --------------------------------------------------------

_FILE_HASHES: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file's content, computed once per process for a given file_stamp (ctime
    included: `cp -p` restores the mtime of a replaced file)."""
    key = file_stamp(path)
    if key not in _FILE_HASHES:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        _FILE_HASHES[key] = digest.hexdigest()
    return _FILE_HASHES[key]


def path_fingerprint(path: str | Path) -> dict | None:
    """Content hashes of a file, or of every file in a directory (a Hugging Face checkpoint); None when
    the path does not exist (the run will say so)."""
    path = Path(path)
    if path.is_file():
        return {"size": path.stat().st_size, "sha256": file_sha256(path)}
    if path.is_dir():
        return {p.relative_to(path).as_posix(): file_sha256(p) for p in sorted(path.rglob("*"))
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)}
    return None


def compute_sources(root: Path = ROOT) -> list[Path]:
    """Every source file below `root` that computes numbers (Python and the C/C++ kernels: all of them but
    NOT_COMPUTE; the tasks' data, COMPUTE_DATA); hidden folders and virtual environments (a folder holding
    pyvenv.cfg) are not even walked."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d != "__pycache__"
                               and not (Path(folder) / d / "pyvenv.cfg").exists())
        for name in names:
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            source = name.endswith(COMPUTE_SUFFIXES) and not any(rel == n or (n.endswith("/") and rel.startswith(n))
                                                                 for n in NOT_COMPUTE)
            if source or rel.startswith(COMPUTE_DATA):
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def code_version(root: Path = ROOT) -> dict:
    """The code that computes the numbers: a hash of its sources (compute_sources; a git commit would miss
    uncommitted edits), and the Python (pydoc_data differs between versions) and torch versions."""
    digest = hashlib.sha256()
    for path in compute_sources(root):
        rel = path.relative_to(root).as_posix()
        digest.update(rel.encode() + b"\0" + file_sha256(path).encode() + b"\0")
    return {"sources_sha256": digest.hexdigest(), "python": platform.python_version(),
            "torch": _version("torch")}


def checkpoint_location(checkpoint_path: str | None) -> Path:
    """The file or directory a --checkpoint_path value loads from (the bundled GGUF without one)."""
    return bundled_checkpoint_path() if checkpoint_path is None else Path(checkpoint_path)


def input_fingerprints(args: argparse.Namespace, task_options: dict) -> dict:
    """Content hashes of every file the run reads: model, task data, calibration files; and the code version."""
    model = checkpoint_location(args.checkpoint_path)
    data = {}
    for key in ("text_file", "dataset", "haystack"):
        value = task_options.get(key)
        if value and Path(value).is_file():
            # hashed from the bytes the task then parses (eval.data.input_bytes), never hashed apart
            data[key] = input_fingerprint(value, f"--{key} file")
        elif value and Path(value).exists():  # a directory: the task refuses it; otherwise a name
            data[key] = path_fingerprint(value)
    read = {hp for name in args.cache_strategy for hp in get_strategy(name).hyperparameters}
    for setting in calibration_settings().values():
        if setting.name in read:  # keyed by the name less "_path" ("gates", "duo_heads"), as runs have recorded them
            data[setting.name.removesuffix("_path")] = path_fingerprint(getattr(args, setting.name, None)
                                                                        or setting.shipped_files)
    return {"model": path_fingerprint(model), "data": data, "code": code_version()}


def calibration_settings() -> dict[str, Setting]:
    """The strategies' calibration-file settings (Setting.shipped_files), by the key of their fingerprint."""
    return {s.name.removesuffix("_path"): s for _, s in strategy_settings() if s.shipped_files is not None}


def content_id(identity: dict, inputs: dict) -> str:
    """The run's identity: its configuration and the content of everything it read."""
    blob = json.dumps({"config": identity, "inputs": inputs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_metrics(path: Path) -> dict | None:
    """A run directory's metrics.json, or None with a warning naming it when it is damaged."""
    metrics, problem = _metrics_file(path)
    if problem is not None:
        print(f"warning: skipping damaged run {path}: {problem}", file=sys.stderr)
    return metrics


def _metrics_file(path: Path) -> tuple[dict | None, str | None]:
    """(metrics.json's content, None), (None, what is wrong with it), or (None, None) when there is none."""
    try:
        metrics = json.loads((path / "metrics.json").read_bytes().decode("utf-8"))
        if not isinstance(metrics, dict):
            raise ValueError("not a JSON object")
        missing = [k for k in REQUIRED_KEYS if k not in metrics]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"metrics.json: {str(e).splitlines()[0][:120]}"
    return metrics, None


# Every file a finished run has (finish_run writes metrics.json last, then swaps the directory in whole).
FINISHED_FILES = ("config.json", "predictions.jsonl", "items.jsonl", "kept_positions.npz", "metrics.json")
_SOUND: set[tuple] = set()  # runs found complete, by their files' (name, inode, size, mtime, ctime)


def damage(path: Path, metrics: dict) -> str | None:
    """Why a run directory with a readable metrics.json is not a finished run (a file missing, truncated or
    unparseable, items.jsonl holding another number of items than metrics.json counts), or None when it is
    one. Runs written before identities existed are not checked: eval runs them again anyway. A directory
    found sound is not read again while its files are unchanged (results.csv is rebuilt after every run)."""
    if "identity" not in metrics:
        return None
    try:
        key = tuple((name, *_stat_key(path / name)) for name in FINISHED_FILES)
    except FileNotFoundError as e:
        return f"{Path(e.filename).name} is missing"
    except OSError as e:
        return f"cannot read it: {e.strerror or e}"
    if key in _SOUND:
        return None
    problem = _read_problem(path, metrics)
    if problem is None:
        _SOUND.add(key)
    return problem


def run_damage(path: Path) -> str | None:
    """`damage` of a run directory as it is on disk, its metrics.json read here (a damaged one is the problem);
    None without a metrics.json (not a finished run of python -m eval: its other checks apply)."""
    metrics, problem = _metrics_file(path)
    return problem if metrics is None else damage(path, metrics)


def check_not_damaged(path: Path) -> None:
    """A UserError when `run_damage` finds the run damaged: commands that read a finished run (compare, replay,
    kvpress export) never count a damaged one, as eval does not."""
    problem = run_damage(path)
    if problem is not None:
        raise UserError(f"{path} is damaged ({problem}): python -m eval with its flags runs it again")


def _stat_key(file: Path) -> tuple[int, int, int, int]:
    st = file.stat()
    if not file.is_file():
        raise OSError(f"{file.name} is not a file")
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_problem(path: Path, metrics: dict) -> str | None:
    try:
        if not isinstance(json.loads((path / "config.json").read_bytes().decode("utf-8")), dict):
            return "config.json is not a JSON object"
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"config.json: {str(e).splitlines()[0][:100]}"
    try:
        lines = (path / "predictions.jsonl").read_bytes().decode("utf-8").splitlines()
    except (OSError, ValueError) as e:
        return f"predictions.jsonl: {str(e).splitlines()[0][:100]}"
    for number, line in enumerate(lines, 1):
        try:
            if not isinstance(json.loads(line), dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            return f"predictions.jsonl line {number}: {str(e).splitlines()[0][:100]}"
    try:
        items = read_items(path, with_kept=False) or []
        with zipfile.ZipFile(path / KEPT_FILE) as kept:
            bad = kept.testzip()  # reads every member: a truncated archive fails here or on opening
    except (OSError, *DAMAGED_ARCHIVE) as e:
        return str(e).splitlines()[0][:120]
    if bad is not None:
        return f"{KEPT_FILE}: {bad} is damaged"
    n_items = metrics.get("n_items")
    if isinstance(n_items, int) and len(items) != n_items:
        return f"{ITEMS_FILE} holds {len(items)} items, metrics.json counts {n_items}"
    return None


def changed_inputs(path: Path, inputs: dict) -> list[str]:
    """Which recorded inputs of a finished run differ from `inputs` (for the message)."""
    try:
        old = json.loads((path / "config.json").read_text()).get("inputs") or {}
    except (OSError, ValueError, AttributeError):
        return ["unknown (no readable config.json)"]
    names = {"model": "model file", "code": "code"}
    changed = [names[k] for k in names if old.get(k) != inputs.get(k)]
    old_data, new_data = old.get("data") or {}, inputs.get("data") or {}
    flags = {key: setting.name for key, setting in calibration_settings().items()}
    changed += [f"--{flags.get(k, k)}" for k in sorted(set(old_data) | set(new_data))
                if old_data.get(k) != new_data.get(k)]
    return changed or ["configuration"]


# ---- writing one run ------------------------------------------------------------------------------------


def start_run(path: Path) -> Path:
    """A fresh hidden directory beside `path` for a new attempt; the finished result (if any) stays in
    place until finish_run swaps the complete new one in. Leftovers of killed writers are cleared."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)
    remove_leftovers(path.parent, path.name)
    return temp_dir_beside(path)


def write_jsonl_atomic(path: Path, rows: list[dict], overwrite: bool = True) -> None:
    with atomic_target(path, overwrite) as tmp, tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


ITEMS_FILE = "items.jsonl"
KEPT_FILE = "kept_positions.npz"
# What reading a damaged or foreign .npz raises: a bad archive, a cut one, a corrupt deflate stream (zlib.error,
# raised before the member's CRC is checked), a bad .npy header.
DAMAGED_ARCHIVE = (zipfile.BadZipFile, EOFError, zlib.error, ValueError)


def kept_key(index: int, layer: int) -> str:
    return f"item{index}_layer{layer}"


def compact_positions(positions: np.ndarray) -> np.ndarray:
    """int16 when every position fits (contexts below 32k tokens: half the bytes), else int32."""
    a = np.asarray(positions)
    return a.astype(np.int16 if a.size == 0 or int(a.max()) < 2**15 else np.int32)


def write_items(directory: Path, items: list[dict]) -> None:
    """items.jsonl (each item without its kept positions) and kept_positions.npz: per item and layer an
    integer array [heads, n] of positions (-1 pads a head that holds fewer), compressed: position lists are
    long and repetitive (sinks, recent windows)."""
    arrays = {kept_key(it["index"], layer): compact_positions(a)
              for it in items for layer, a in enumerate(it.get("kept_positions") or [])}
    write_jsonl_atomic(directory / ITEMS_FILE, [{k: v for k, v in it.items() if k != "kept_positions"}
                                                for it in items])
    with atomic_target(directory / KEPT_FILE, overwrite=True) as tmp, tmp.open("wb") as f:
        np.savez_compressed(f, **arrays)


def read_items(run: Path, with_kept: bool = True) -> list[dict] | None:
    """A run's items.jsonl with each item's kept positions (a list of per-layer arrays) attached unless
    `with_kept` is False; None for runs written before items were recorded. A damaged file raises
    ValueError (OSError when unreadable)."""
    try:
        lines = (run / ITEMS_FILE).read_text().splitlines()
    except FileNotFoundError:
        return None
    items = []
    for number, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except ValueError:
            raise ValueError(f"{ITEMS_FILE} line {number} is not JSON (truncated?)") from None
        if not isinstance(item, dict) or not isinstance(item.get("index"), int):
            raise ValueError(f"{ITEMS_FILE} line {number} is not an item")
        items.append(item)
    if with_kept and (run / KEPT_FILE).is_file():
        try:
            with np.load(run / KEPT_FILE) as kept:
                for it in items:
                    layers = []
                    while kept_key(it["index"], len(layers)) in kept:
                        layers.append(kept[kept_key(it["index"], len(layers))])
                    it["kept_positions"] = layers
        except DAMAGED_ARCHIVE as e:  # np.load on a damaged or foreign file
            raise ValueError(f"{KEPT_FILE}: {e}") from None
    return items


def finish_run(tmp: Path, path: Path, config: dict, predictions: list[dict], metrics: dict,
               items: list[dict] | None = None) -> None:
    """Write the run into `tmp` (from start_run) and swap it in for `path`; `tmp` is gone afterwards."""
    try:
        atomic_write(tmp / "config.json", json.dumps(config, indent=2) + "\n", overwrite=True)
        write_jsonl_atomic(tmp / "predictions.jsonl", predictions)
        if items is not None:
            write_items(tmp, items)
        atomic_write(tmp / "metrics.json", json.dumps(metrics, indent=2) + "\n", overwrite=True)
        replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def abandon_run(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        versions[name] = _version(name)
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
    """Every finished run's metrics (with its `run_dir`); an unreadable metrics.json is skipped with a warning,
    and a run whose other files are damaged (see damage) is listed with one."""
    runs = []
    for path in sorted(out_dir.glob("*/*/*/metrics.json")):
        run = path.parent
        if any(part.startswith(".") for part in run.relative_to(out_dir).parts):
            continue  # a run being written, or the leftover of a killed one
        metrics = read_metrics(run)
        if metrics is None:
            continue
        problem = damage(run, metrics)
        if problem is not None:  # its metrics.json is whole: the table keeps its numbers, eval reruns it
            print(f"warning: damaged run {run}: {problem}; listed from its metrics.json, not counted as finished "
                  "(eval and the sweep run it again)", file=sys.stderr)
        metrics["run_dir"] = str(run.relative_to(out_dir))
        runs.append(metrics)
    return runs


def results_frame(out_dir: Path, runs: list[dict] | None = None) -> pd.DataFrame:
    """One row per finished run with every scalar of its metrics.json (lists stay in the JSON)."""
    runs = load_runs(out_dir) if runs is None else runs
    rows = [{k: v for k, v in run.items() if not isinstance(v, dict | list)} for run in runs]
    if not rows:
        return pd.DataFrame(columns=LEADING_COLUMNS + TRAILING_COLUMNS)
    frame = pd.DataFrame(rows)
    known = LEADING_COLUMNS + TRAILING_COLUMNS
    # An interval's bounds follow their metric: `x, x_ci_low, x_ci_high`.
    bounds = {c for c in frame.columns if c.endswith(("_ci_low", "_ci_high"))}
    middle = []
    for c in sorted(c for c in frame.columns if c not in known and c not in bounds):
        middle += [c] + [b for b in (f"{c}_ci_low", f"{c}_ci_high") if b in bounds]
    leading = []
    for c in LEADING_COLUMNS:
        if c in frame:
            leading += [c] + [b for b in (f"{c}_ci_low", f"{c}_ci_high") if b in bounds]
    placed = set(leading) | set(middle)
    middle += sorted(b for b in bounds if b not in placed)  # bounds of a metric that is missing
    columns = leading + middle + [c for c in TRAILING_COLUMNS if c in frame]
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
        with atomic_target(out_dir / "results.csv", overwrite=True) as tmp:
            frame.to_csv(tmp, index=False)
    return out_dir / "results.csv"

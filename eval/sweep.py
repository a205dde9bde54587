"""`python -m eval.sweep`: strategies × budgets × tasks × seeds, always with the full-cache baseline.

    python -m eval.sweep --strategies recent_global heavy_hitter --budgets 0.5 0.25 0.1 \\
        --tasks fidelity niah_single --seq_len 1024 --limit 10 --workers 2
    python -m eval.sweep --grid grid.yaml --devices cuda:0,cuda:1 --workers 2

Every other flag is passed to each `python -m eval` run (task options, model, cache hyper-parameters); a
task flag only to the runs of the tasks that read it, and one that no task of the sweep reads is refused.
A grid file holds the same keys (strategies, budgets, tasks, seeds, cache_configs) plus `args:`, a mapping
of eval flags; values are typed by the flags' own definitions (cache_spec.mapping_to_argv) and flags
typed on the command line win. `cache_configs` adds one configuration per preset.

Resumable: a run directory is swapped in only when complete, so after a crash or SIGKILL the same
command runs only what is missing, or stale (finished with another model file, data or code; see
eval/results.py). `--workers N` runs N processes, each
loading the model once; `--devices` spreads them over GPUs (worker i uses device i mod len).
`--backend ray` runs them on a Ray cluster instead, one worker per device (see eval/sweep_ray.py).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import signal
import sys
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

from cache_spec import mapping_to_argv, read_yaml
from checkpoint import parse_dtype, resolve_device
from errors import CliParser, UserError, run_cli
from eval import cli, results, sweep_ray
from flag_types import NON_NEGATIVE, POSITIVE, SEED, count, explicit_dests
from ignored_flags import cache_flags_read, check_cache_flags_read, check_storage_flags_read

GRID_KEYS = ("strategies", "budgets", "tasks", "seeds", "cache_configs", "args")
# Runs a sweep starts without --yes: past this a mistyped grid (one more seed list, a budget too many) is
# hours of compute, and the product is easy to misjudge.
CONFIRM_ABOVE = 200


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m eval.sweep", description=__doc__, allow_abbrev=False)
    parser.add_argument("--grid", default=None, help="YAML file with the grid (flags typed here win)")
    parser.add_argument("--strategies", nargs="+", default=["full"])
    parser.add_argument("--budgets", nargs="+", type=POSITIVE, default=[0.5, 0.25, 0.1],
                        help="fractions of |prompt|+new tokens (≤ 1) or tokens (> 1)")
    parser.add_argument("--cache_configs", nargs="+", default=[], help="presets, one configuration each")
    parser.add_argument("--tasks", nargs="+", default=["fidelity"])
    parser.add_argument("--seeds", nargs="+", type=SEED, default=[0])
    parser.add_argument("--workers", type=count(), default=1, help="parallel processes")
    parser.add_argument("--devices", default=None, help="comma-separated, e.g. cuda:0,cuda:1")
    parser.add_argument("--out_dir", default="results")
    parser.add_argument("--overwrite", action="store_true", help="re-run finished runs")
    parser.add_argument("--yes", action="store_true",
                        help=f"start more than {CONFIRM_ABOVE} runs (a grid that large is refused without it)")
    g = parser.add_argument_group("backend")
    g.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local processes (--workers, --devices) or a Ray cluster (needs requirements-ray.txt)")
    g.add_argument("--ray_address", default=None,
                   help="ray: auto or HOST:PORT of a running cluster (default: start Ray on this machine)")
    g.add_argument("--gpus_per_run", type=NON_NEGATIVE, default=None,
                   help="ray: GPUs each worker reserves (default 0: one CPU core each)")
    g.add_argument("--max_retries", type=count(0), default=None,
                   help=f"ray: re-sends of a run whose worker died (default {sweep_ray.DEFAULT_MAX_RETRIES})")
    return parser


# Eval flags the sweep sets for each run: a grid's `args:` may not set them.
SET_BY_SWEEP = ("cache_strategy", "max_cache_length", "seed", "baseline", "tasks", "out_dir", "overwrite", "help")


def read_grid(path: str) -> dict:
    """The grid file as a mapping with known keys (one UserError for anything else)."""
    grid = read_yaml(Path(path), "grid")
    if not isinstance(grid, dict):
        raise UserError(f"grid {path} must be a mapping with keys among {', '.join(GRID_KEYS)}")
    for key in grid:
        if key not in GRID_KEYS:
            raise UserError(f"grid {path}: unknown key {key!r}; keys: {', '.join(GRID_KEYS)}")
    return grid


def grid_values(grid: dict, parser: argparse.ArgumentParser, path: str) -> dict:
    """The grid's sweep keys, typed by the sweep's own flags (a single value is a one-element list)."""
    keys = {k: v for k, v in grid.items() if k != "args"}
    argv = mapping_to_argv(keys, parser, [k for k in GRID_KEYS if k != "args"], f"grid {path}", "grid key")
    try:
        typed = parser.parse_args(argv)
    except UserError as e:
        raise UserError(f"grid {path}: {e}") from None
    return {k: getattr(typed, k) for k in keys}


def grid_args(mapping: object, path: str) -> list[str]:
    """The grid's `args:` (a mapping of eval flags) as command-line words, checked against eval's flags."""
    source = f"grid {path}: args"
    if not isinstance(mapping, dict):
        raise UserError(f"{source} must be a mapping of eval flags to values, got {type(mapping).__name__}")
    for key in mapping:
        if key in SET_BY_SWEEP:
            raise UserError(f"{source}: {key} is set by the sweep (use strategies, budgets, tasks, seeds, "
                            "or the sweep's own flags)")
    parser = cli.build_parser()
    allowed = [a.dest for a in parser._actions if a.dest not in SET_BY_SWEEP]
    return mapping_to_argv(mapping, parser, allowed, source, "eval flag")


def parse_sweep(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(sweep flags, flags for every eval run); grid-file values are defaults the command line overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    sweep, rest = parser.parse_known_args(argv)
    if sweep.grid:
        grid = read_grid(sweep.grid)
        parser.set_defaults(**grid_values(grid, build_parser(), sweep.grid))
        sweep, rest = parser.parse_known_args(argv)
        rest = (grid_args(grid["args"], sweep.grid) if "args" in grid else []) + rest
    for flag in ("--cache_strategy", "--max_cache_length", "--seed", "--baseline", "--no-baseline"):
        if flag in rest:
            raise UserError(f"{flag} is set by the sweep's grid (use --strategies/--budgets/--seeds)")
    sweep_ray.check_flags(sweep)
    if "budgets" in explicit_dests(parser, argv) and set(sweep.strategies) == {"full"}:
        raise UserError("--budgets would be ignored: --strategies is full alone, which keeps every token")
    eval_parser = cli.build_parser()
    for task in sweep.tasks:
        cli.get_task(task)
    cli.check_task_flags_read(sweep.tasks, explicit_dests(eval_parser, rest), eval_parser)
    return sweep, sweep_ray.worker_flags(sweep, rest) if sweep.backend == "ray" else local_flags(sweep, rest)


def local_flags(sweep: argparse.Namespace, rest: list[str]) -> list[str]:
    """The eval flags of every local run, `--dtype auto` resolved for the --devices: a run's directory hashes
    its resolved dtype, and runs are planned (and found finished) before a device is assigned."""
    if not sweep.devices or cli.build_parser().parse_known_args(rest)[0].dtype != "auto":
        return rest
    kinds = {d.strip().split(":")[0] for d in sweep.devices.split(",")}
    if kinds == {"cpu"}:
        return rest
    if len(kinds) > 1:
        raise UserError(f"--devices {sweep.devices} mixes device kinds with --dtype auto, which resolves per "
                        "device: pass --dtype")
    return [*rest, "--dtype", str(parse_dtype("auto", kinds.pop())).removeprefix("torch.")]


def grid_jobs(sweep: argparse.Namespace, rest: list[str]) -> list[list[str]]:
    """The eval argv of every grid point: the full cache once per (task, seed), then the others. A run gets
    only the task flags its task reads (eval refuses one it would ignore; another task of the sweep reads it)."""
    common = [*rest, "--out_dir", sweep.out_dir, "--no-baseline"] + (["--overwrite"] if sweep.overwrite else [])
    parser = cli.build_parser()
    unread = {task: set(cli.task_flags(parser)) - set(cli.get_task(task).reads) for task in sweep.tasks}
    configs = [["--cache_strategy", "full"]]
    configs += [["--cache_strategy", s, "--max_cache_length", f"{b:g}"]
                for s in dict.fromkeys(sweep.strategies) if s != "full" for b in sweep.budgets]
    configs += [["--cache_config", preset] for preset in sweep.cache_configs]
    return [[*cli.without_flags(common, unread[task], parser), "--tasks", task, "--seed", str(seed), *config]
            for task in sweep.tasks for seed in sweep.seeds for config in configs]


def plan_jobs(jobs: list[list[str]]) -> list[tuple[list[str], Path]]:
    """Validate every job before running any, and drop duplicates (the same run directory)."""
    planned, seen = [], set()
    for job in jobs:
        ((_, _, path),) = cli.plan(cli.parse_args(job))
        if path not in seen:
            seen.add(path)
            planned.append((job, path))
    return planned


def check_flags_read(rest: list[str], jobs: list[list[str]]) -> None:
    """A strategy flag passed to every run that no run of the grid reads would be ignored: refuse it (one
    that some runs read reaches the others harmlessly: a run's identity leaves out what it does not read)."""
    typed = explicit_dests(cli.build_parser(), rest)
    read = set().union(*(cache_flags_read(cli.parse_args(job)) for job in jobs))
    check_cache_flags_read(typed, read, "the grid")
    if jobs:
        check_storage_flags_read(typed, cli.parse_args(jobs[0]))


def _die_with_parent() -> None:
    """Workers must not outlive a killed sweep: Linux delivers SIGKILL to them when the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker(jobs: object, done: object, device: str | None, threads: int, parent: int) -> None:
    """Run jobs from the queue until a None arrives (or the parent is gone); report (index, error)."""
    _die_with_parent()
    torch.set_num_threads(threads)
    while os.getppid() == parent:
        try:
            item = jobs.get(timeout=1.0)
        except queue.Empty:
            continue
        if item is None:
            return
        index, job = item
        try:
            cli.run_job(job, device, progress=True)
            done.put((index, None))
        except UserError as e:
            done.put((index, str(e)))
        except Exception:  # report and go on with the next run; the sweep says which failed
            done.put((index, traceback.format_exc()))


def run_parallel(pending: list[tuple[list[str], Path]], sweep: argparse.Namespace, devices: list[str | None],
                 bar: tqdm) -> dict[int, str]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fork would copy torch's thread pools and can deadlock
    jobs, done = ctx.Queue(), ctx.Queue()
    for i, (job, _) in enumerate(pending):
        jobs.put((i, job))
    workers = min(sweep.workers, len(pending))
    for _ in range(workers):
        jobs.put(None)
    threads = max(1, (os.cpu_count() or 1) // workers)
    procs = [ctx.Process(target=worker, args=(jobs, done, devices[i % len(devices)], threads, os.getpid()),
                         daemon=True) for i in range(workers)]
    for p in procs:
        p.start()
    failures, received = {}, 0
    while received < len(pending):
        try:
            index, error = done.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                raise UserError("a worker died before finishing its run (out of memory?); run the same command "
                                "again to resume") from None
            continue
        received += 1
        if error:
            failures[index] = error
        results.write_results_table(Path(sweep.out_dir))
        bar.update()
    for p in procs:
        p.join()
    return failures


def pending_jobs(planned: list[tuple[list[str], Path]], overwrite: bool) -> list[tuple[list[str], Path]]:
    """The runs to start: all with --overwrite, else those not finished with today's inputs (model, data,
    code) or damaged, each of the latter said in one line."""
    if overwrite:
        return list(planned)
    pending = []
    for job, path in planned:
        current, state = cli.job_state(job)
        if not current:
            pending.append((job, path))
            if state.startswith("rerun"):
                print(f"{state}: {path}", file=sys.stderr)
    return pending


def main(argv: list[str] | None = None) -> Path:
    sweep, rest = parse_sweep(argv)
    devices: list[str | None] = [resolve_device(d.strip()) for d in sweep.devices.split(",")] if sweep.devices \
        else [None]
    planned = plan_jobs(grid_jobs(sweep, rest))
    check_flags_read(rest, [job for job, _ in planned])
    pending = pending_jobs(planned, sweep.overwrite)
    print(f"{len(planned)} runs in the grid, {len(planned) - len(pending)} already finished", file=sys.stderr)
    if len(pending) > CONFIRM_ABOVE and not sweep.yes:
        raise UserError(f"the grid would start {len(pending)} runs (more than {CONFIRM_ABOVE}); check it and pass "
                        "--yes to start them")
    out_dir = results.check_out_dir(sweep.out_dir)
    bar = tqdm(total=len(planned), initial=len(planned) - len(pending), desc="sweep", unit="run")
    failures: dict[int, str] = {}
    if sweep.backend == "ray":
        failures = sweep_ray.run_ray(pending, sweep, bar)
    elif sweep.workers == 1 or len(pending) <= 1:
        for i, (job, _) in enumerate(pending):
            try:
                cli.run_job(job, devices[0], progress=None)
            except UserError as e:
                failures[i] = str(e)
            results.write_results_table(out_dir)  # after every run: the table is current even if killed
            bar.update()
    elif pending:
        failures = run_parallel(pending, sweep, devices, bar)
    bar.close()
    table = results.write_results_table(out_dir)
    for i, error in failures.items():
        print(f"failed: {' '.join(pending[i][0])}\n  {error.strip()}", file=sys.stderr)
    print(f"results table: {table}")
    if failures:
        raise UserError(f"{len(failures)} of {len(pending)} runs failed (see above); the others are in {table}")
    return table


if __name__ == "__main__":
    run_cli(main)

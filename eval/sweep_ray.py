"""`python -m eval.sweep --backend ray`: the same sweep spread over a Ray cluster, one actor per device.

    python -m eval.sweep --strategies full recent_global --budgets 0.5 0.25 --backend ray          # local Ray
    python -m eval.sweep --grid grid.yaml --backend ray --ray_address auto --gpus_per_run 1     # a cluster

Each actor holds one device (`--gpus_per_run` of a GPU, or one CPU core when it is 0) and keeps the model
loaded across its runs: `eval.cli.load_model` caches it per process. An actor runs eval's own `execute`
into a scratch directory on its node and sends the run's files back; the driver writes them into
`--out_dir` with `results.finish_run` and rebuilds `results.csv` with `results.write_results_table`, as
the local backend does, so both backends give the same directories, the same table and the same resume
(a run directory is swapped in whole when complete, and reused while its inputs are unchanged). Nothing
has to be shared between the nodes but the code, the environment and the files named in the flags, at
the same paths: a run computed from other files than the driver's is reported as failed.

A worker that dies mid-run (killed, out of memory, its node lost) loses that run only: a new actor takes its
place, and the run is sent again up to `--max_retries` times, after which it is recorded as failed (in
`<out_dir>/failed.csv` and at the end of the sweep, exit status 2). A run that raises is not retried: the
same flags on the same code fail the same way.

Ray is optional (requirements-ray.txt): this module imports it only when `--backend ray` is asked for.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import sys
import tempfile
import traceback
from pathlib import Path
from types import ModuleType

import pandas as pd
import torch
from tqdm import tqdm

from checkpoint import parse_dtype
from errors import UserError
from eval import cli, results

DEFAULT_MAX_RETRIES = 2
FAILED_TABLE = "failed.csv"
INSTALL_HINT = "pip install -r requirements-ray.txt"
# A run's scratch directory on a worker's node, <pid>-<random>, removed after the run.
SCRATCH = Path(tempfile.gettempdir()) / f"kv-evict-sweep-{os.getuid()}"


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise UserError(f"--backend ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def check_flags(sweep: argparse.Namespace) -> None:
    """Flags that belong to the other backend are an error, not silently ignored; fills Ray's defaults."""
    ray_flags = {"--ray_address": sweep.ray_address, "--gpus_per_run": sweep.gpus_per_run,
                 "--max_retries": sweep.max_retries}
    if sweep.backend == "local":
        given = [flag for flag, value in ray_flags.items() if value is not None]
        if given:
            raise UserError(f"{', '.join(given)} need --backend ray")
        return
    if sweep.workers != 1 or sweep.devices:
        raise UserError("--workers and --devices are for --backend local; Ray runs one worker per device of the "
                        "cluster (--gpus_per_run of a GPU each, or one CPU core each when it is 0)")
    sweep.gpus_per_run = 0.0 if sweep.gpus_per_run is None else sweep.gpus_per_run
    sweep.max_retries = DEFAULT_MAX_RETRIES if sweep.max_retries is None else sweep.max_retries
    import_ray()
    if sweep.ray_address and sweep.ray_address != "auto":
        check_reachable(sweep.ray_address)


def worker_device(sweep: argparse.Namespace) -> str:
    return "cuda" if sweep.gpus_per_run > 0 else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU


def worker_flags(sweep: argparse.Namespace, rest: list[str]) -> list[str]:
    """The eval flags of every run under Ray: no --device (the backend picks it), `--dtype auto` resolved.

    A run's id (its directory) hashes the resolved dtype, and the driver, which plans the runs and checks
    which are finished, may have no GPU: planned on the CPU, a GPU run would land in another directory
    than the one resume looks for.
    """
    if sweep.backend != "ray":
        return rest
    known, _ = cli.build_parser().parse_known_args(rest)
    if "--device" in rest:
        raise UserError("--device is set by --backend ray: each worker uses its own GPU with --gpus_per_run > 0, "
                        "else the CPU")
    if worker_device(sweep) == "cpu" or known.dtype != "auto":  # on the CPU the driver resolves it the same
        return rest
    return [*rest, "--dtype", str(parse_dtype("auto", worker_device(sweep))).removeprefix("torch.")]


# ---- the worker: one actor per device ---------------------------------------------------------------


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class SweepWorker:
    """Runs sweep jobs one at a time in one Ray worker process; the model stays loaded between them."""

    def __init__(self, cwd: str, argv: list[str]) -> None:
        # One torch thread for the one core the worker reserves: more threads than cores stall at every
        # op when the cores are shared (see README).
        torch.set_num_threads(1)
        if os.path.isdir(cwd):
            os.chdir(cwd)  # relative paths in the flags mean what they mean to the driver
        sys.argv = list(argv)  # config.json records the sweep's command, as the local workers do
        SCRATCH.mkdir(exist_ok=True)
        for old in SCRATCH.iterdir():  # a worker killed mid-run had no chance to remove its scratch
            pid = old.name.split("-")[0]
            if pid.isdigit() and not process_exists(int(pid)):
                shutil.rmtree(old, ignore_errors=True)

    def run(self, job: list[str], device: str, out_dir: str) -> dict:
        """One run into a fresh scratch directory; its files (as data), or the error, go back to the driver."""
        scratch = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=SCRATCH))
        reply: dict = {}
        try:
            cli.run_job([*job, "--out_dir", str(scratch)], device, progress=True)  # the last --out_dir wins
            (metrics_path,) = scratch.glob("*/*/*/metrics.json")
            path = metrics_path.parent
            config = json.loads((path / "config.json").read_text())
            config["flags"]["out_dir"] = out_dir  # the scratch directory is a detail: record the real one
            lines = (path / "predictions.jsonl").read_text().splitlines()
            reply = {"run_dir": str(path.relative_to(scratch)), "config": config,
                     "predictions": [json.loads(line) for line in lines],
                     "metrics": json.loads(metrics_path.read_text()),
                     "items": results.read_items(path)}  # per-item records and kept positions (numpy arrays)
        except UserError as e:
            reply = {"error": str(e)}
        except Exception:  # reported with the run, which is recorded as failed; the worker goes on
            reply = {"error": traceback.format_exc()}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return {**reply, "pid": os.getpid(), "model_loads": cli.load_model.cache_info().misses}


# ---- the driver -------------------------------------------------------------------------------------


def check_reachable(address: str) -> None:
    """Fail at once on a HOST:PORT where nothing listens: Ray itself retries it for many minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"--ray_address must be auto or HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        raise UserError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def connect(ray: ModuleType, address: str | None) -> bool:
    """Join the cluster at `address`, or start Ray on this machine; True when this call started it."""
    if ray.is_initialized():  # a caller (a notebook, the tests) already has a session: use it
        return False
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")  # Ray's C++ side warns on stderr otherwise
    quiet = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            ray.init(num_cpus=len(os.sched_getaffinity(0)), **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray"
        hint = ""
        if address and "RAY_AUTH_MODE" not in os.environ:  # `ray start` turns token authentication on
            hint = " (if the cluster uses token authentication, set RAY_AUTH_MODE=token; see README)"
        raise UserError(f"cannot start or join {where}: {str(e).strip().splitlines()[0]}{hint}") from None
    return True


def new_worker(ray: ModuleType, sweep: argparse.Namespace) -> object:
    """An actor reserving its device. A dead one is replaced, not restarted by Ray: calls sent to an actor
    while Ray restarts it fail at once, whereas calls to one being created wait for it."""
    actor = ray.remote(SweepWorker).options(num_cpus=1, num_gpus=sweep.gpus_per_run, max_restarts=0,
                                            max_task_retries=0)  # the driver counts the attempts
    return actor.remote(os.getcwd(), sys.argv)


def start_workers(ray: ModuleType, sweep: argparse.Namespace, n_runs: int) -> list:
    """As many actors as the cluster has devices for (never more than runs)."""
    resources = ray.cluster_resources()
    if sweep.gpus_per_run > 0:
        n = int(resources.get("GPU", 0) / sweep.gpus_per_run + 1e-9)
        if n == 0:
            raise UserError(f"the Ray cluster has {resources.get('GPU', 0):g} GPUs: none fits --gpus_per_run "
                            f"{sweep.gpus_per_run:g} (0 runs on CPUs)")
    else:
        n = int(resources.get("CPU", 0))
        if resources.get("GPU", 0):
            tqdm.write(f"note: the Ray cluster has {resources['GPU']:g} GPUs, unused: --gpus_per_run is 0",
                       file=sys.stderr)
        if n == 0:
            raise UserError("the Ray cluster has no CPU to run on")
    return [new_worker(ray, sweep) for _ in range(min(n, n_runs))]


def worker_died(ray: ModuleType) -> tuple[type[Exception], ...]:
    """The errors that mean the worker process is gone, not that the run failed."""
    names = ("RayActorError", "WorkerCrashedError", "NodeDiedError", "OutOfMemoryError")
    return tuple(getattr(ray.exceptions, n) for n in names if hasattr(ray.exceptions, n))


def short_error(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def write_failed_table(out_dir: Path, rows: list[dict]) -> None:
    """failed.csv: this sweep's failed runs (rewritten after each failure; removed when there is none)."""
    path = out_dir / FAILED_TABLE
    if not rows:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pd.DataFrame(rows, columns=["run_dir", "attempts", "error", "command"]).to_csv(tmp, index=False)
    os.replace(tmp, path)


def record(out_dir: Path, job: list[str], path: Path, reply: dict) -> str | None:
    """Write a finished run exactly as eval's `execute` would have; the error when the run failed."""
    if "error" in reply:
        return reply["error"]
    expected = str(path.relative_to(out_dir))
    if reply["run_dir"] != expected:  # a worker with other code or flags would file it elsewhere
        return f"the worker computed run directory {reply['run_dir']}, the driver {expected}: same code on every node?"
    tmp = results.start_run(path)
    try:
        results.finish_run(tmp, path, reply["config"], reply["predictions"], reply["metrics"], reply.get("items"))
    finally:
        results.abandon_run(tmp)  # a no-op after finish_run; if the driver is interrupted, no leftovers
    if not cli.job_is_current(job):  # the worker hashed other files than the driver: resume would redo it
        ((task, config, _),) = cli.plan(cli.parse_args(job))
        changed = ", ".join(results.changed_inputs(path, results.input_fingerprints(config, task.options)))
        return (f"the worker's inputs differ from the driver's ({changed}; the run was written but counts as "
                "stale): every node needs the same model, data and code at the same paths")
    return None


def replace_worker(ray, sweep: argparse.Namespace, dead, actors: list, idle: list) -> None:
    """A new worker, idle, in place of one that died mid-run (whatever is left of it is killed)."""
    ray.kill(dead)
    actor = new_worker(ray, sweep)
    actors.append(actor)
    idle.append(actor)


def record_reply(out_dir: Path, job: list[str], path: Path, reply: dict, attempts: int,
                 failed_rows: list[dict]) -> str | None:
    """A run's reply recorded (its files, or its error in the failed-runs table) and the results table
    rewritten, after every run, so both are current even if the sweep is killed; the error, if any."""
    error = record(out_dir, job, path, reply)
    if error:
        failed_rows.append({"run_dir": str(path.relative_to(out_dir)), "attempts": attempts,
                            "error": error.strip(), "command": " ".join(job)})
        write_failed_table(out_dir, failed_rows)
    results.write_results_table(out_dir)
    return error


def run_ray(pending: list[tuple[list[str], Path]], sweep: argparse.Namespace, bar: tqdm) -> dict[int, str]:
    """Run the pending jobs on Ray actors; returns {index in pending: error} of the runs that failed."""
    ray = import_ray()
    out_dir = Path(sweep.out_dir)
    write_failed_table(out_dir, [])  # the last sweep's failures are being retried now
    if not pending:
        return {}
    started = connect(ray, sweep.ray_address)
    died = worker_died(ray)
    device = worker_device(sweep)
    failures: dict[int, str] = {}
    failed_rows: list[dict] = []
    attempts: collections.Counter[int] = collections.Counter()
    queue = collections.deque(range(len(pending)))
    retried = 0
    model_loads: dict[int, int] = {}  # per worker process: how often it loaded a model
    actors: list = []
    try:
        actors = start_workers(ray, sweep, len(pending))
        idle = list(actors)
        in_flight: dict = {}
        while queue or in_flight:
            while queue and idle:  # one run per actor at a time: a dying actor takes one run with it
                index, actor = queue.popleft(), idle.pop()
                attempts[index] += 1
                in_flight[actor.run.remote(pending[index][0], device, sweep.out_dir)] = (actor, index)
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=1.0)
            for ref in ready:
                actor, index = in_flight.pop(ref)
                try:
                    reply = ray.get(ref)
                    idle.append(actor)
                except died as e:
                    replace_worker(ray, sweep, actor, actors, idle)
                    if attempts[index] <= sweep.max_retries:
                        queue.appendleft(index)
                        retried += 1
                        bar.set_postfix(failed=len(failures), retried=retried)
                        continue
                    tries = f"{attempts[index]} attempt{'s' if attempts[index] > 1 else ''}"
                    reply = {"error": f"its worker died mid-run ({tries}, --max_retries {sweep.max_retries}): "
                                      f"{short_error(e)}"}
                except ray.exceptions.RayError as e:
                    idle.append(actor)
                    reply = {"error": short_error(e)}
                if "pid" in reply:
                    model_loads[reply["pid"]] = reply["model_loads"]
                error = record_reply(out_dir, *pending[index], reply, attempts[index], failed_rows)
                if error:
                    failures[index] = error
                bar.set_postfix(failed=len(failures), retried=retried)
                bar.update()
    finally:
        for actor in actors:  # in a session the caller keeps, idle actors would hold their devices
            ray.kill(actor)
        if started:
            ray.shutdown()
    tqdm.write(f"ray: {len(pending)} runs on {len(model_loads)} worker processes, which loaded the model "
               f"{sum(model_loads.values())} times; {retried} re-sent after their worker died", file=sys.stderr)
    return failures

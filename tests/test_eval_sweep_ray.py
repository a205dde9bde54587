"""`python -m eval.sweep --backend ray` on a local Ray with 2 CPUs and the tiny checkpoint: the same rows and
files as the local backend, a worker SIGKILLed mid-run (sent again, or recorded as failed and resumed), the
driver SIGKILLed mid-sweep and resumed with the same command, and the one-line errors (no Ray installed,
the other backend's flags, no GPU for --gpus_per_run)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from errors import UserError, run_cli
from eval import cli, results, sweep, sweep_ray
from eval.results import TRAILING_COLUMNS
from eval.sweep_ray import SCRATCH
from tests.conftest import ROOT
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    finished,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    read_results,
    single_thread,
)

RUNS = 3  # the full cache, then recent_global at two budgets: more runs than the 2 workers
TIMING_KEYS = [c for c in TRAILING_COLUMNS if c not in ("run_id", "identity", "run_dir")]
RUN_TITLE = b"ray::SweepWorker.run"  # Ray's process title while an actor executes SweepWorker.run
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def sweep_flags(tiny_dir: Path, out_dir: Path) -> list[str]:
    # 300-token windows: a run takes 0.5 to 2 s here, long enough to be killed in the middle.
    return ["--strategies", "full", "recent_global", "--budgets", "0.5", "0.25", "--tasks", "fidelity",
            "--checkpoint_path", str(tiny_dir), "--text_file", str(PYDOC_EXCERPT), "--seq_len", "300",
            "--prefill_tokens", "32", "--out_dir", str(out_dir)]


def assert_same_rows(out_dir: Path, reference: Path) -> None:
    """Every metric of every run equal to the local backend's, bit for bit (one thread each, same ops)."""
    ours, theirs = (read_results(d / "results.csv").drop(columns=TIMING_KEYS) for d in (out_dir, reference))
    assert len(ours) == RUNS
    pd.testing.assert_frame_equal(ours, theirs, check_exact=True)


def process_titles() -> dict[int, tuple[bytes, int]]:
    """pid -> (command line, session id) of every process we can read."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            title = (entry / "cmdline").read_bytes()
            session = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])  # state ppid pgrp session
        except (OSError, IndexError, ValueError):
            continue
        found[int(entry.name)] = (title, session)
    return found


def kill_a_worker_mid_run(sweeping: threading.Thread) -> int:
    """SIGKILL the first worker of this process's Ray seen executing a run; its pid."""
    deadline, ours = time.monotonic() + 120, os.getsid(0)  # Ray started here keeps this session
    while True:
        running = [pid for pid, (title, sid) in process_titles().items() if title.startswith(RUN_TITLE) and sid == ours]
        if running:
            os.kill(running[0], signal.SIGKILL)
            return running[0]
        assert time.monotonic() < deadline, "no worker started a run"
        assert sweeping.is_alive()
        time.sleep(0.01)


def sweep_in_thread(argv: list[str]) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["table"] = sweep.main(argv)
        except Exception as e:  # handed to the test, which asserts on it
            outcome["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def ray_summary(stderr: str) -> tuple[int, int, int, int]:
    """(runs, worker processes, model loads, runs re-sent) from the driver's last line about Ray."""
    match = re.search(r"ray: (\d+) runs on (\d+) worker processes, which loaded the model (\d+) times; "
                      r"(\d+) re-sent", stderr)
    assert match, stderr
    return tuple(int(g) for g in match.groups())


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory) -> Path:
    """The sweep through the local backend, in this process."""
    out_dir = tmp_path_factory.mktemp("reference")
    with single_thread():  # module-scoped: set up before the autouse fixture applies
        sweep.main(sweep_flags(tiny_dir, out_dir))
    return out_dir


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray (2 CPUs) for the in-process sweeps of this module: the sweep uses a running session."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


# ---- without a Ray session ----------------------------------------------------------------------------


def test_bad_flags_and_missing_ray_are_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    out = ["--out_dir", str(tmp_path)]
    for argv, message in [
        (["--backend", "dask"], "invalid choice: 'dask'"),
        (["--ray_address", "auto"], "--ray_address need --backend ray"),
        (["--gpus_per_run", "1", "--max_retries", "1"], "--gpus_per_run, --max_retries need --backend ray"),
        (["--backend", "ray", "--workers", "2"], "--workers and --devices are for --backend local"),
        (["--backend", "ray", "--devices", "cpu"], "--workers and --devices are for --backend local"),
        (["--backend", "ray", "--max_retries", "-1"], "argument --max_retries: must be at least 0, got -1"),
        (["--backend", "ray", "--gpus_per_run", "-0.5"], "argument --gpus_per_run: must be at least 0, got -0.5"),
        (["--backend", "ray", "--device", "cuda"], "--device is set by --backend ray"),
        (["--backend", "ray", "--ray_address", "head"], "--ray_address must be auto or HOST:PORT, got 'head'"),
        (["--backend", "ray", "--ray_address", "127.0.0.1:1"], "cannot reach the Ray cluster at 127.0.0.1:1: "),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            sweep.main([*argv, *out])
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    with pytest.raises(SystemExit) as exit_info:
        run_cli(sweep.main, ["--backend", "ray", *out])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: --backend ray needs Ray, which is not installed: "
                                       "pip install -r requirements-ray.txt\n")


def test_gpu_runs_are_planned_with_the_gpus_dtype():
    """Run ids hash the resolved dtype: `auto` on the workers' GPUs is bfloat16, even if the driver has none."""
    _, rest = sweep.parse_sweep(["--backend", "ray", "--gpus_per_run", "0.5"])
    assert rest[-2:] == ["--dtype", "bfloat16"]
    assert sweep.parse_sweep(["--backend", "ray", "--gpus_per_run", "1", "--dtype", "float16"])[1] == [
        "--dtype", "float16"]
    assert sweep.parse_sweep(["--backend", "ray"])[1] == []


def test_the_local_backend_does_not_import_ray(tiny_dir, reference, tmp_path):
    out_dir = tmp_path / "results"
    shutil.copytree(reference, out_dir)  # everything finished: plans, skips, rewrites the table
    code = (f"import sys; from eval import sweep; sweep.main({sweep_flags(tiny_dir, out_dir)!r}); "
            "assert 'ray' not in sys.modules, 'ray was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{RUNS} runs in the grid, {RUNS} already finished" in done.stderr


def test_the_driver_refuses_a_run_filed_elsewhere_or_computed_from_other_inputs(tiny_dir, reference, tmp_path):
    """What a worker with other code, model or data sends back is not taken for the run the driver planned."""
    sweep_args, rest = sweep.parse_sweep([*sweep_flags(tiny_dir, tmp_path), "--backend", "ray"])
    job, path = sweep.plan_jobs(sweep.grid_jobs(sweep_args, rest))[0]
    source = reference / path.relative_to(tmp_path)
    reply = {"run_dir": str(path.relative_to(tmp_path)), "config": json.loads((source / "config.json").read_text()),
             "predictions": [json.loads(line) for line in (source / "predictions.jsonl").read_text().splitlines()],
             "metrics": json.loads((source / "metrics.json").read_text()),
             "items": results.read_items(source)}  # as a worker sends them: a run without them is damaged
    error = sweep_ray.record(tmp_path, job, path, {**reply, "run_dir": "tiny/fidelity/elsewhere"})
    assert error.startswith("the worker computed run directory tiny/fidelity/elsewhere") and not path.exists()
    other_code = copy.deepcopy(reply)
    other_code["config"]["inputs"]["code"]["sources_sha256"] = "0" * 64
    other_code["metrics"]["identity"] = "0" * 16
    error = sweep_ray.record(tmp_path, job, path, other_code)
    assert error.startswith("the worker's inputs differ from the driver's (code;"), error
    assert sweep_ray.record(tmp_path, job, path, reply) is None
    assert cli.job_is_current(job) and (path / "predictions.jsonl").read_bytes() == (
        source / "predictions.jsonl").read_bytes()


def test_driver_killed_mid_sweep_resumes_with_the_same_command(tiny_dir, reference, tmp_path):
    """The default: the sweep starts its own local Ray. Runs after SIGKILL, then the same command again."""
    out_dir, log = tmp_path / "results", tmp_path / "log"
    command = [sys.executable, "-m", "eval.sweep", *sweep_flags(tiny_dir, out_dir), "--backend", "ray"]
    with log.open("w") as f:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=ENV,
                                start_new_session=True)
    session = proc.pid

    def ray_processes() -> dict[int, bytes]:
        return {pid: title for pid, (title, sid) in process_titles().items() if sid == session}

    try:
        deadline = time.monotonic() + 180
        while finished(out_dir) == 0:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        assert any(title.startswith(b"ray::SweepWorker") for title in ray_processes().values())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for _ in range(300):  # the workers go with the Ray that the driver started
            if not any(title.startswith(b"ray::SweepWorker") for title in ray_processes().values()):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"workers outlived the killed driver: {ray_processes()}")
    finally:
        # Ray's agent processes can linger after their raylet is killed (observed with Ray 2.60.0).
        for pid in ray_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    done = finished(out_dir)
    assert 1 <= done < RUNS, done
    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{RUNS} runs in the grid, {done} already finished" in resumed.stderr
    assert ray_summary(resumed.stderr)[0] == RUNS - done
    assert_same_rows(out_dir, reference)


# ---- in a module-wide Ray session (2 CPUs) ------------------------------------------------------------


def test_ray_and_local_give_the_same_rows_and_files(ray_session, tiny_dir, reference, tmp_path, capsys):
    out_dir = tmp_path / "results"
    sweep.main([*sweep_flags(tiny_dir, out_dir), "--backend", "ray"])
    assert_same_rows(out_dir, reference)
    runs, processes, loads, resent = ray_summary(capsys.readouterr().err)
    assert (runs, resent) == (RUNS, 0)
    assert 1 <= processes <= 2 and loads == processes  # once per worker process, not once per run
    for path in reference.glob("*/*/*/"):
        if not path.is_dir():
            continue
        ours = out_dir / path.relative_to(reference)
        assert (ours / "predictions.jsonl").read_bytes() == (path / "predictions.jsonl").read_bytes()
        assert (ours / "items.jsonl").read_bytes() == (path / "items.jsonl").read_bytes()
        ours_kept, their_kept = (results.read_items(d) for d in (ours, path))
        assert [[a.tolist() for a in it["kept_positions"]] for it in ours_kept] == [
            [a.tolist() for a in it["kept_positions"]] for it in their_kept]
        ours_metrics, their_metrics = (json.loads((d / "metrics.json").read_text()) for d in (ours, path))
        assert {k: v for k, v in ours_metrics.items() if k not in TIMING_KEYS} == {
            k: v for k, v in their_metrics.items() if k not in TIMING_KEYS}
        ours_config, their_config = (json.loads((d / "config.json").read_text()) for d in (ours, path))
        assert ours_config["flags"]["out_dir"] == str(out_dir)  # not the worker's scratch directory
        for config in (ours_config, their_config):
            del config["flags"]["out_dir"], config["command"]
        assert ours_config == their_config
    assert not list(out_dir.rglob(".*.tmp*"))


def test_worker_killed_mid_run_is_sent_again(ray_session, tiny_dir, reference, tmp_path, capsys):
    out_dir = tmp_path / "results"
    thread, outcome = sweep_in_thread([*sweep_flags(tiny_dir, out_dir), "--backend", "ray", "--max_retries", "1"])
    kill_a_worker_mid_run(thread)
    thread.join(timeout=300)
    assert "table" in outcome, outcome
    assert_same_rows(out_dir, reference)
    assert not (out_dir / "failed.csv").exists()
    runs, processes, loads, resent = ray_summary(capsys.readouterr().err)
    assert (runs, resent) == (RUNS, 1) and loads == processes


def test_worker_killed_without_retries_fails_that_run_only_then_resumes(ray_session, tiny_dir, reference,
                                                                        tmp_path, capsys):
    out_dir = tmp_path / "results"
    argv = [*sweep_flags(tiny_dir, out_dir), "--backend", "ray", "--max_retries", "0"]
    thread, outcome = sweep_in_thread(argv)
    killed = kill_a_worker_mid_run(thread)
    thread.join(timeout=300)
    assert isinstance(outcome.get("error"), UserError), outcome
    assert str(outcome["error"]).startswith(f"1 of {RUNS} runs failed")
    assert finished(out_dir) == RUNS - 1 and len(read_results(out_dir / "results.csv")) == RUNS - 1
    (failed,) = pd.read_csv(out_dir / "failed.csv").to_dict("records")
    assert failed["attempts"] == 1
    assert failed["error"].startswith("its worker died mid-run (1 attempt, --max_retries 0): ActorDiedError")
    assert not (out_dir / failed["run_dir"] / "metrics.json").exists()
    capsys.readouterr()
    sweep.main(argv)  # the same command: only the failed run
    assert f"{RUNS} runs in the grid, {RUNS - 1} already finished" in capsys.readouterr().err
    assert_same_rows(out_dir, reference)
    assert not (out_dir / "failed.csv").exists()
    # The killed worker's scratch directory is gone too (removed by the next worker to start).
    assert not [d for d in SCRATCH.iterdir() if d.name.startswith(f"{killed}-")]


def test_gpus_per_run_on_a_cluster_without_gpus(ray_session, tiny_dir, tmp_path):
    with pytest.raises(UserError, match="the Ray cluster has 0 GPUs: none fits --gpus_per_run 1"):
        sweep.main([*sweep_flags(tiny_dir, tmp_path), "--backend", "ray", "--gpus_per_run", "1"])

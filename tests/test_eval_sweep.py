"""`python -m eval.sweep` and `python -m eval.plot` on the tiny checkpoint: the grid, SIGKILL mid-way and
resume to the same table, parallel workers that die with their parent, and the figures and summary."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from errors import UserError
from eval import plot, sweep
from eval.results import TRAILING_COLUMNS
from tests.conftest import ROOT
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    finished,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    read_results,
    single_thread,
)

# 2 strategies × 2 budgets × 1 task: the full cache once, recent_global at two budgets (three runs). Before
# recent_global exists, full alone (one run).
STRATEGIES = ["full", "recent_global"]
TIMING_COLUMNS = [c for c in TRAILING_COLUMNS if c not in ("run_id", "run_dir")]


def sweep_flags(tiny_dir, out_dir) -> list[str]:
    # Windows of 800 tokens: a run takes about a second, so a kill lands between runs' starts and ends.
    return ["--strategies", *STRATEGIES, "--budgets", "0.5", "0.25", "--tasks", "fidelity",
            "--checkpoint_path", str(tiny_dir), "--text_file", str(PYDOC_EXCERPT), "--seq_len", "800",
            "--prefill_tokens", "32", "--out_dir", str(out_dir)]


def comparable(out_dir) -> pd.DataFrame:
    return read_results(out_dir / "results.csv").drop(columns=TIMING_COLUMNS)


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """The sweep run once, uninterrupted, in this process."""
    out_dir = tmp_path_factory.mktemp("reference")
    with single_thread():  # module-scoped: set up before the autouse fixture applies
        sweep.main(sweep_flags(tiny_dir, out_dir))
    return out_dir


def test_grid_has_the_baseline_once_and_validates_before_running(tiny_dir, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"strategies: [full, keep_it_odd]\nbudgets: [0.5, 0.25]\ntasks: [fidelity, niah_single]\n"
                    f"seeds: [0, 1]\nargs: {{checkpoint_path: {tiny_dir}, seq_len: 400}}\n")
    args, rest = sweep.parse_sweep(["--grid", str(grid), "--seeds", "3", "--out_dir", str(tmp_path)])
    jobs = sweep.plan_jobs(sweep.grid_jobs(args, rest))
    assert len(jobs) == 2 * 1 * (1 + 2)  # tasks × seeds (the command line wins) × (full + 2 budgets)
    assert all("--seed" in job and job[job.index("--seed") + 1] == "3" for job, _ in jobs)
    assert len({path for _, path in jobs}) == len(jobs)
    with pytest.raises(UserError, match="set by the sweep"):
        sweep.parse_sweep(["--cache_strategy", "l2"])
    with pytest.raises(UserError, match="unknown task"):
        sweep.main(["--tasks", "nope", "--out_dir", str(tmp_path)])
    with pytest.raises(UserError, match="CUDA is not available"):
        sweep.main(["--devices", "cuda:0", "--out_dir", str(tmp_path)])


def test_sigkill_mid_way_then_resume_gives_the_same_table(tiny_dir, reference, tmp_path):
    out_dir, log = tmp_path / "results", tmp_path / "log"
    command = [sys.executable, "-m", "eval.sweep", *sweep_flags(tiny_dir, out_dir), "--workers", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as f:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while finished(out_dir) == 0:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # the sweep's process only: its workers must follow it
        proc.wait()
        for _ in range(200):
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("workers outlived the killed sweep")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    done = finished(out_dir)
    total = len(STRATEGIES) * 2 - 1
    assert total == 1 or 1 <= done < total, done
    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{total} runs in the grid, {done} already finished" in resumed.stderr
    pd.testing.assert_frame_equal(comparable(out_dir), comparable(reference), check_exact=False, rtol=1e-5)
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert f"{total} runs in the grid, {total} already finished" in again.stderr


def test_plots_and_summary(reference, tmp_path):
    out_dir = tmp_path / "results"
    shutil.copytree(reference, out_dir)
    # A debug_ run's statistics carry attention loss per layer: fake one from a finished run.
    source = next(out_dir.glob("*/fidelity/*/metrics.json")).parent
    fake = source.with_name("debug_recent_global-b0.5-s0-0000000000")
    shutil.copytree(source, fake)
    metrics = json.loads((fake / "metrics.json").read_text())
    metrics.update(strategy="debug_recent_global", budget=0.5, attention_loss=0.1, run_id="0000000000")
    metrics["per_layer"]["attention_loss_per_layer"] = [0.05, 0.15]
    (fake / "metrics.json").write_text(json.dumps(metrics))
    paths = plot.main(["--out_dir", str(out_dir)])
    names = {p.name for p in paths}
    model = source.parent.parent.name
    assert {f"quality_{model}_fidelity.png", f"attention_loss_per_layer_{model}.png", "summary.md"} <= names
    assert (f"kl_position_{model}.png" in names) == (len(STRATEGIES) > 1)
    for p in paths:
        assert p.stat().st_size > 1000 if p.suffix == ".png" else "| full |" in p.read_text()
    summary = (out_dir / "summary.md").read_text()
    assert "## fidelity" in summary and "full kl_mean" in summary and "debug_recent_global" in summary
    with pytest.raises(UserError, match="no finished runs"):
        plot.main(["--out_dir", str(tmp_path)])


def test_local_runs_on_gpus_are_planned_with_the_dtype_they_will_run_in():
    """A run's directory hashes its resolved dtype: `--dtype auto` on --devices cuda:N must be planned as
    bfloat16 (what the GPU runs resolve to), or a resumed sweep would look for them in the CPU's directory."""
    import argparse

    from eval.sweep import local_flags

    assert local_flags(argparse.Namespace(devices="cuda:0,cuda:1"), ["--max_new_tokens", "4"])[-2:] == [
        "--dtype", "bfloat16"]
    assert local_flags(argparse.Namespace(devices="cuda:0"), ["--dtype", "float32"]) == ["--dtype", "float32"]
    assert local_flags(argparse.Namespace(devices="cpu"), []) == []
    assert local_flags(argparse.Namespace(devices=None), []) == []
    with pytest.raises(UserError, match="mixes device kinds"):
        local_flags(argparse.Namespace(devices="cpu,cuda:0"), [])

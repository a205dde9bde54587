"""python -m eval.compare: two runs on the items both scored. The means and the paired difference are checked
against numpy on hand-written run directories (items out of order, one item in one run only, one run with
other task options), and the bad inputs against the refusal contract."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval import compare
from eval.uncertainty import paired_difference
from tests.bad_input_matrix import EntryPoint, refused

ENTRY = EntryPoint("python -m eval.compare", compare.main, compare.build_parser, lambda w: [], ())


def write_run(path, items: dict[int, dict], flags: dict, task_options: dict | None = None, seed: int = 0):
    """A run directory as python -m eval leaves it, reduced to what compare reads: items keyed by content
    (context_ids), their metrics, and config.json's flags and identity."""
    path.mkdir(parents=True)
    lines = [json.dumps({"index": i, "metrics": m, "context_ids": [i, i + 1], "question_ids": None})
             for i, m in items.items()]
    (path / "items.jsonl").write_text("\n".join(lines) + "\n")
    identity = {"task_options": task_options or {"seq_len": 640}, "seed": seed}
    (path / "config.json").write_text(json.dumps({"flags": flags, "identity": identity}))
    return path


KL_RUN = {3: 0.30, 1: 0.10, 2: 0.25, 0: 0.05, 9: 7.0}  # item 9 is not in the reference: never paired
KL_REF = {0: 0.04, 1: 0.12, 2: 0.20, 3: 0.31}
FLAGS = {"cache_strategy": ["heavy_hitter"], "max_cache_length": [0.25], "out_dir": "a", "batch_size": 4}


@pytest.fixture
def two_runs(tmp_path):
    run = write_run(tmp_path / "chunked", {i: {"kl_mean": v, "top1": 1.0} for i, v in KL_RUN.items()},
                    FLAGS | {"prefill_chunk": 64})
    reference = write_run(tmp_path / "oneshot", {i: {"kl_mean": v} for i, v in KL_REF.items()},
                          FLAGS | {"prefill_chunk": None, "out_dir": "b", "batch_size": 1})
    return run, reference


def test_means_and_difference_are_over_the_items_both_scored(two_runs, capsys):
    run, reference = two_runs
    (row,) = compare.main([str(run), str(reference)])  # top1 is the run's only: not a metric of both
    paired = sorted(KL_REF)
    ours, theirs = np.array([KL_RUN[i] for i in paired]), np.array([KL_REF[i] for i in paired])
    assert row["metric"] == "kl_mean" and row["items"] == 4
    assert row["run"].estimate == pytest.approx(ours.mean(), abs=1e-12)
    assert row["reference"].estimate == pytest.approx(theirs.mean(), abs=1e-12)
    assert row["difference"].estimate == pytest.approx((ours - theirs).mean(), abs=1e-12)
    expected = paired_difference(ours, theirs)  # the same items in the same pairs give the same resamples
    assert (row["difference"].low, row["difference"].high) == pytest.approx((expected.low, expected.high))
    assert row["difference"].low <= row["difference"].estimate <= row["difference"].high
    out = capsys.readouterr().out
    # what tells the runs apart (the batch size too: batched rows equal batch 1 only within a tolerance), and
    # not where they were written
    assert "flags that differ: batch_size: 4 vs 1; prefill_chunk: 64 vs None\n" in out
    assert "| kl_mean | 4 |" in out


def test_other_task_options_do_not_pair(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", {0: {"kl_mean": 0.1}}, FLAGS)
    other = write_run(tmp_path / "other", {0: {"kl_mean": 0.2}}, FLAGS, task_options={"seq_len": 1024})
    line = refused(ENTRY, [str(run), str(other)], tmp_path, capsys, monkeypatch)
    assert "no item of" in line and "task options and seed" in line


@pytest.mark.parametrize(("damage", "fragment"), [
    (lambda d: (d / "items.jsonl").unlink(), "no items.jsonl"),
    (lambda d: (d / "items.jsonl").write_text('{"index": 0, "metrics": {"kl_mean": 0.1}}\n{"index": 1, "met'),
     "line 2 is not JSON (truncated?)"),
    (lambda d: (d / "items.jsonl").write_text(""), "holds no item"),
], ids=["no items", "truncated", "empty"])
def test_a_run_without_readable_items_is_refused(damage, fragment, two_runs, tmp_path, capsys, monkeypatch):
    run, reference = two_runs
    damage(reference)
    line = refused(ENTRY, [str(run), str(reference)], tmp_path, capsys, monkeypatch)
    assert str(reference) in line and fragment in line, line


def test_a_damaged_finished_run_is_refused(two_runs, tmp_path, capsys, monkeypatch):
    """A finished run whose items.jsonl lost its last line still reads, but is damaged: not compared."""
    run, reference = two_runs
    (reference / "predictions.jsonl").write_text("")
    np.savez_compressed(reference / "kept_positions.npz")
    metrics = {"model": "tiny", "task": "fidelity", "strategy": "full", "budget": 1.0, "identity": "0123456789",
               "n_items": len(KL_REF)}
    (reference / "metrics.json").write_text(json.dumps(metrics))
    assert compare.main([str(run), str(reference)])[0]["items"] == 4  # sound: compared
    (reference / "metrics.json").write_text(json.dumps(metrics | {"n_items": len(KL_REF) + 1}))
    line = refused(ENTRY, [str(run), str(reference)], tmp_path, capsys, monkeypatch)
    assert f"{reference} is damaged (items.jsonl holds 4 items, metrics.json counts 5)" in line, line
    (reference / "metrics.json").write_text('{"identity": ')
    line = refused(ENTRY, [str(run), str(reference)], tmp_path, capsys, monkeypatch)
    assert f"{reference} is damaged (metrics.json: Expecting value" in line, line


def test_an_unknown_metric_is_refused_with_the_ones_recorded(two_runs, tmp_path, capsys, monkeypatch):
    run, reference = two_runs
    line = refused(ENTRY, [str(run), str(reference), "--metrics", "kl_means"], tmp_path, capsys, monkeypatch)
    assert "'kl_means' is not a per-item metric of both runs; they record: kl_mean" in line, line

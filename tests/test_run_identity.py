"""Results you can trust: runs keyed by what they computed, results that survive an interrupted --overwrite,
damaged run directories skipped, atomic writes, presets and grids typed like the command line, and prompts
read from any existing file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import generate
from atomic_files import atomic_write, check_writable
from cache_spec import parse_args_with_preset
from errors import UserError
from eval import cli, plot, results, sweep
from tests.conftest import ROOT
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    read_results,
    write_tiny_checkpoint,
)


def flags(checkpoint: Path, out_dir: Path, text: Path = PYDOC_EXCERPT, *more: str) -> list[str]:
    return ["--tasks", "fidelity", "--checkpoint_path", str(checkpoint), "--text_file", str(text),
            "--seq_len", "96", "--prefill_tokens", "16", "--out_dir", str(out_dir), "--no-baseline",
            "--cache_strategy", "recent_global", "--max_cache_length", "0.5", *more]


def run_dirs(out_dir: Path) -> list[Path]:
    return sorted(p.parent for p in out_dir.glob("*/*/*/metrics.json") if not p.parent.name.startswith("."))


def table(out_dir: Path) -> pd.DataFrame:
    return read_results(out_dir / "results.csv")


# ---- content-addressed runs -----------------------------------------------------------------------------


def test_another_model_at_the_same_path_is_run_again_not_reused(tmp_path, capsys):
    model = write_tiny_checkpoint(tmp_path / "model", seed=0)
    (first,) = cli.main(flags(model, tmp_path / "out"))
    assert len(first["identity"]) == 16 and table(tmp_path / "out")["identity"].tolist() == [first["identity"]]
    (again,) = cli.main(flags(model, tmp_path / "out"))
    assert again == first and "skip (finished)" in capsys.readouterr().err
    write_tiny_checkpoint(model, seed=1)  # other weights under the same name
    cli.load_model.cache_clear()
    (second,) = cli.main(flags(model, tmp_path / "out"))
    assert "rerun (changed since the finished run: model file)" in capsys.readouterr().err
    assert second["identity"] != first["identity"] and second["kl_mean"] != first["kl_mean"]
    (run,) = run_dirs(tmp_path / "out")  # replaced in place: one run, one row, no stale numbers
    assert json.loads((run / "metrics.json").read_text())["identity"] == second["identity"]
    rows = table(tmp_path / "out")
    assert len(rows) == 1 and rows["identity"][0] == second["identity"]
    assert rows["kl_mean"][0] == pytest.approx(second["kl_mean"])


def test_an_edited_text_file_is_run_again(tmp_path, capsys):
    model = write_tiny_checkpoint(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(PYDOC_EXCERPT.read_text())
    (first,) = cli.main(flags(model, tmp_path / "out", text))
    text.write_text(PYDOC_EXCERPT.read_text()[500:])  # edited in place
    (second,) = cli.main(flags(model, tmp_path / "out", text))
    assert "changed since the finished run: --text_file" in capsys.readouterr().err
    assert second["identity"] != first["identity"] and second["kl_mean"] != first["kl_mean"]
    assert len(run_dirs(tmp_path / "out")) == 1 and len(table(tmp_path / "out")) == 1


def calibrate(setting: str, checkpoint: Path, out: Path, variant: int) -> None:
    """A calibration file for `setting` that fits the tiny checkpoint, from the command that writes such files;
    variants 0 and 1 differ in content."""
    import calibrate_duo
    import calibrate_qfilters
    import train_gates

    if setting == "gates_path":
        train_gates.main(["--checkpoint_path", str(checkpoint), "--out", str(out), "--steps", "2", "--seq_len", "32",
                          "--max_train_tokens", "256", "--seed", str(variant)])
    else:
        command = {"duo_heads_path": calibrate_duo, "qfilters_path": calibrate_qfilters}[setting]
        extra = ["--global_tokens", "2", "--recent_window", "8"] if setting == "duo_heads_path" else []
        command.main(["--checkpoint_path", str(checkpoint), "--out", str(out), "--seq_len", "48",
                      "--windows", str(1 + variant), *extra])


CALIBRATED = {"gates_path": "gated", "duo_heads_path": "duo_attention", "qfilters_path": "qfilters"}


def test_every_calibration_setting_is_covered_below():
    assert set(CALIBRATED) == {s.name for s in results.calibration_settings().values()}


@pytest.mark.parametrize("setting", sorted(CALIBRATED))
def test_a_recalibrated_file_is_run_again(tmp_path, capsys, setting):
    """A calibration file is an input of the run: replaced by another calibration (same path, new content),
    the finished run is not passed off as the new file's; left at its default, the shipped folder is hashed."""
    model = write_tiny_checkpoint(tmp_path / "model")
    path = tmp_path / ("calibration.safetensors" if setting == "gates_path" else "calibration.json")
    first_file, second_file = tmp_path / "first", tmp_path / "second"
    calibrate(setting, model, first_file, 0)
    calibrate(setting, model, second_file, 1)
    assert first_file.read_bytes() != second_file.read_bytes()
    run = [*flags(model, tmp_path / "out"), "--cache_strategy", CALIBRATED[setting], f"--{setting}", str(path)]
    path.write_bytes(first_file.read_bytes())
    (first,) = cli.main(run)
    path.write_bytes(second_file.read_bytes())  # recalibrated in place
    capsys.readouterr()
    (second,) = cli.main(run)
    assert f"changed since the finished run: --{setting}" in capsys.readouterr().err
    assert second["identity"] != first["identity"]
    assert len(run_dirs(tmp_path / "out")) == 1 and len(table(tmp_path / "out")) == 1
    args = cli.parse_args(run[:-2])  # the default: the shipped files
    ((task, config, _),) = cli.plan(args)
    shipped = results.calibration_settings()[setting.removesuffix("_path")].shipped_files
    assert results.input_fingerprints(config, task.options)["data"][setting.removesuffix("_path")] \
        == results.path_fingerprint(shipped) != {}


def test_a_checkpoint_replaced_between_runs_of_one_process_is_loaded_again(tmp_path):
    """A sweep's worker loads the model once for its runs: when the checkpoint at the same path is replaced
    between two runs, the second runs on the new weights (it records their hash), not on the loaded ones."""
    model = write_tiny_checkpoint(tmp_path / "model", seed=0)
    cli.load_model.cache_clear()
    (old,) = cli.main(flags(model, tmp_path / "out"))
    write_tiny_checkpoint(tmp_path / "model", seed=1)
    (new,) = cli.main(flags(model, tmp_path / "out"))
    cli.load_model.cache_clear()
    (fresh,) = cli.main(flags(model, tmp_path / "fresh"))
    assert new["identity"] == fresh["identity"] != old["identity"]
    assert new["kl_mean"] == pytest.approx(fresh["kl_mean"], abs=1e-6) and new["kl_mean"] != old["kl_mean"]


def test_identity_covers_model_data_and_code(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "model")
    args = cli.parse_args(flags(model, tmp_path / "out"))
    ((task, config, path),) = cli.plan(args)
    inputs = results.input_fingerprints(config, task.options)
    assert set(inputs["model"]) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert inputs["data"]["text_file"]["sha256"] == results.file_sha256(PYDOC_EXCERPT)
    assert len(inputs["code"]["sources_sha256"]) == 64 and inputs["code"]["torch"].startswith("2.13")
    identity = results.run_identity(config, task.name, task.options, "float32")
    changed = {**inputs, "code": {**inputs["code"], "sources_sha256": "0" * 64}}
    assert results.content_id(identity, inputs) != results.content_id(identity, changed)


# ---- --overwrite never loses the finished result --------------------------------------------------------


def test_overwrite_interrupted_in_process_keeps_the_old_result(tmp_path, monkeypatch):
    model = write_tiny_checkpoint(tmp_path / "model")
    cli.main(flags(model, tmp_path / "out"))
    (run,) = run_dirs(tmp_path / "out")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    csv_before = (tmp_path / "out" / "results.csv").read_bytes()

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("eval.tasks.fidelity.teacher_force", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(flags(model, tmp_path / "out", PYDOC_EXCERPT, "--overwrite"))
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert (tmp_path / "out" / "results.csv").read_bytes() == csv_before
    assert [p.name for p in run.parent.iterdir()] == [run.name]  # the half-written attempt is gone


def as_from_a_shell() -> None:
    """In the child before exec: SIGINT handled and unblocked, as for a command started from a shell. A child
    inherits an ignored or blocked SIGINT, and Python then never raises KeyboardInterrupt: the pytest-xdist
    workers of a full run were seen with SIGINT ignored part-way through (2026-12-02), and this test failed
    there only."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_signal_during_overwrite_leaves_the_old_result(tmp_path, sig):
    model = write_tiny_checkpoint(tmp_path / "model")
    out = tmp_path / "out"
    long_run = flags(model, out, PYDOC_EXCERPT, "--seq_len", "1000", "--limit", "4")  # seconds: time to interrupt
    cli.main(long_run)
    (run,) = run_dirs(out)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    csv_before = (out / "results.csv").read_bytes()
    proc = subprocess.Popen([sys.executable, "-m", "eval", *long_run, "--overwrite"], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_shell)
    deadline = time.monotonic() + 120
    while not list(run.parent.glob(f".{run.name}.tmp*")):  # the new attempt has started writing
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.02)
    time.sleep(0.1)  # into the computation (it lasts ~3 s here on a quiet machine)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    err = proc.stderr.read()
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before, (code, err)
    assert (out / "results.csv").read_bytes() == csv_before
    if sig == signal.SIGINT:
        assert code == 130 and err.strip().splitlines()[-1] == "error: interrupted", err
        assert [p.name for p in run.parent.iterdir()] == [run.name]  # temporaries removed on the way out
    else:
        assert code == -signal.SIGKILL
    assert len(results.load_runs(out)) == 1  # a leftover of the killed writer is not a run
    cli.main(long_run)  # finished with the same inputs: skipped, and the killed writer's leftovers cleared
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


# ---- damaged run directories ----------------------------------------------------------------------------


def test_a_damaged_run_never_blocks_the_others(tmp_path, capsys):
    model = write_tiny_checkpoint(tmp_path / "model")
    out = tmp_path / "out"
    cli.main(flags(model, out))
    cli.main(flags(model, out)[:-1] + ["0.25"])
    damaged = next(d for d in run_dirs(out) if "-b0.5-" in d.name)
    good = next(d for d in run_dirs(out) if "-b0.25-" in d.name)
    (damaged / "metrics.json").write_text('{"model": "tiny", "task": ')
    capsys.readouterr()
    runs = results.load_runs(out)
    assert [r["run_dir"] for r in runs] == [str(good.relative_to(out))]
    assert f"warning: skipping damaged run {damaged}" in capsys.readouterr().err
    figures = plot.main(["--out_dir", str(out)])
    assert (out / "summary.md") in figures and f"skipping damaged run {damaged}" in capsys.readouterr().err
    (good / "predictions.jsonl").write_bytes(b"\xff\x00")  # a damaged curve: that plot skips it too
    (damaged / "metrics.json").unlink()
    plot.main(["--out_dir", str(out)])
    assert f"skipping damaged run {good}" in capsys.readouterr().err
    # The damaged run is simply run again by eval (its metrics are unreadable, so it is not finished).
    (metrics,) = cli.main(flags(model, out))
    assert json.loads((damaged / "metrics.json").read_text())["identity"] == metrics["identity"]


# ---- atomic writes --------------------------------------------------------------------------------------


def test_atomic_write_refuses_replaces_and_cleans_up(tmp_path):
    target = tmp_path / "a" / "b.json"
    atomic_write(target, "one")
    with pytest.raises(UserError, match="--overwrite"):
        atomic_write(target, "two")
    atomic_write(target, "two", overwrite=True)
    assert target.read_text() == "two"
    with pytest.raises(UserError, match="directory"):
        atomic_write(tmp_path / "a", "x", overwrite=True)
    with pytest.raises(UserError, match="directory"):
        check_writable(tmp_path / "a", overwrite=True)

    class Boom(Exception):
        pass

    from atomic_files import atomic_target

    with pytest.raises(Boom), atomic_target(target, overwrite=True) as tmp:
        tmp.write_text("half")
        raise Boom
    assert target.read_text() == "two" and sorted(p.name for p in target.parent.iterdir()) == ["b.json"]


def test_stats_json_into_a_directory_fails_before_generating(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(generate, "load_checkpoint", lambda *a, **k: loaded.append(1))
    with pytest.raises(UserError, match="is a directory"):
        generate.main(["--prompt", "Hi", "--stats_json", str(tmp_path), "--overwrite"])
    assert not loaded


# ---- one schema, and precedence: command line > preset (or grid) > defaults ----------------------------


def test_preset_values_are_typed_and_the_command_line_wins(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("cache_strategy: heavy_hitter\nattn_thresholding: true\nmax_cache_length: 0.5\n"
                      "hybrid_policies: full\n")
    parser = generate.build_parser()
    args = parse_args_with_preset(parser, ["--prompt", "x", "--cache_config", str(preset)])
    assert args.cache_strategy == ["heavy_hitter"] and args.attn_thresholding is True
    assert args.max_cache_length == [0.5] and args.hybrid_policies == ["full"]  # a scalar is one item
    assert args.global_tokens == 4  # not in the preset: the default
    args = parse_args_with_preset(parser, ["--prompt", "x", "--cache_config", str(preset), "--max_cache_length",
                                           "0.25"])
    assert args.max_cache_length == [0.25] and args.cache_strategy == ["heavy_hitter"]
    preset.write_text("attn_thresholding: false\n")
    assert parse_args_with_preset(parser, ["--prompt", "x", "--cache_config", str(preset)]).attn_thresholding is False


def test_grid_values_are_typed_and_the_command_line_wins(tmp_path):
    grid = tmp_path / "g.yaml"
    # niah_single reads --chat and --query_aware (fidelity, the default task, reads neither: the sweep refuses them)
    grid.write_text("strategies: recent_global\nbudgets: 0.5\nseeds: 1\ntasks: niah_single\n"
                    "args: {chat: true, query_aware: true, seq_len: 64, feed_long_prompts: true}\n")
    args, rest = sweep.parse_sweep(["--grid", str(grid)])
    assert args.strategies == ["recent_global"] and args.budgets == [0.5] and args.seeds == [1]
    # each run of the sweep names its task (grid_jobs); without one, fidelity would refuse --seq_len 64 with its
    # default --prefill_tokens 128
    parsed = cli.parse_args([*rest, "--tasks", "niah_single"])
    assert parsed.chat is True and parsed.query_aware is True and parsed.seq_len == 64 and parsed.feed_long_prompts
    args, rest = sweep.parse_sweep(["--grid", str(grid), "--budgets", "0.25", "--no-chat", "--no-query_aware"])
    parsed = cli.parse_args([*rest, "--tasks", "niah_single"])
    assert args.budgets == [0.25] and parsed.chat is False and parsed.query_aware is False
    assert args.strategies == ["recent_global"]  # from the grid; the default is full


def test_a_source_moved_into_a_package_still_changes_the_identity(tmp_path):
    """A module moved below the root (cache_tova.py -> strategies/tova.py) keeps counting: an edit to it
    changes the code version, so runs computed by the old code are not reused."""
    (tmp_path / "cache.py").write_text("A = 1\n")
    (tmp_path / "strategies").mkdir()
    moved = tmp_path / "strategies" / "tova.py"
    moved.write_text("B = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("C = 1\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "site.py").write_text("D = 1\n")
    before = results.code_version(tmp_path)["sources_sha256"]
    assert [p.relative_to(tmp_path).as_posix() for p in results.compute_sources(tmp_path)] == \
        ["cache.py", "strategies/tova.py"]
    (tmp_path / "tests" / "test_x.py").write_text("C = 2\n")  # tests compute no result
    (tmp_path / ".venv" / "site.py").write_text("D = 2\n")
    assert results.code_version(tmp_path)["sources_sha256"] == before
    moved.write_text("B = 2\n")
    assert results.code_version(tmp_path)["sources_sha256"] != before


def test_the_kernels_and_the_word_list_are_in_the_identity(tmp_path):
    """The CPU's C/C++ kernels compute bf16 and quantized attention, and the RULER-style tasks draw their items
    from eval/data/words.txt: an edit to either changes the code version; prose and tests' data do not."""
    for rel, text in [("cache.py", "A = 1\n"), ("kernels.c", "int a;\n"), ("ops.cpp", "int b;\n"),
                      ("common.h", "int c;\n"), ("eval/data/words.txt", "apple\n"), ("README.md", "x\n"),
                      ("tests/data/text.txt", "y\n"), ("benchmarks/k.c", "int d;\n")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert [p.relative_to(tmp_path).as_posix() for p in results.compute_sources(tmp_path)] == \
        ["cache.py", "common.h", "eval/data/words.txt", "kernels.c", "ops.cpp"]
    before = results.code_version(tmp_path)["sources_sha256"]
    for rel in ("README.md", "tests/data/text.txt", "benchmarks/k.c"):
        (tmp_path / rel).write_text("changed\n")
    assert results.code_version(tmp_path)["sources_sha256"] == before
    for rel in ("kernels.c", "eval/data/words.txt"):
        (tmp_path / rel).write_text("changed\n")
        assert results.code_version(tmp_path)["sources_sha256"] != before
        before = results.code_version(tmp_path)["sources_sha256"]
    hashed = {p.relative_to(ROOT).as_posix() for p in results.compute_sources()}
    assert {"cpu_bf16_kernels.c", "cpu_quantized_attention.c", "eval/data/words.txt"} <= hashed


def test_every_strategy_file_is_in_the_identity():
    from strategies import CACHE_STRATEGIES

    hashed = set(results.compute_sources())
    for cls in CACHE_STRATEGIES.values():
        assert Path(sys.modules[cls.__module__].__file__).resolve() in hashed, cls.__module__


def test_a_run_with_other_settings_is_another_line_in_tables_and_plots():
    """A strategy run with a non-default setting of its own or of its prompt rule is labelled with it, so the
    results table and the summary (eval.plot groups runs by label and budget, pooling seeds) never pool it with the
    default runs; a default run, typed or not, keeps the bare name."""
    def label(*argv: str) -> str:
        return results.strategy_label(cli.parse_args(["--tasks", "fidelity", *argv]))

    assert label("--cache_strategy", "cam") == label("--cache_strategy", "cam", "--cam_merge_window", "32") == "cam"
    assert label("--cache_strategy", "cam", "--cam_no_merge") == "cam cam_no_merge"
    assert label("--cache_strategy", "debug_heavy_hitter", "--snapkv_window", "4") == \
        "debug_heavy_hitter snapkv_window=4"
    assert label("--cache_strategy", "l2", "--prompt_compression_strategy", "heavy_hitter", "--snapkv_window", "8") == \
        "l2 snapkv_window=8"


def test_hashes_that_look_like_numbers_are_read_back_as_written(tmp_path):
    """A run_id of digits and an identity of digits around one `e` (both seen: about one run in a hundred) are
    written verbatim to results.csv, and read back as the same text by read_results (pandas alone reads them
    as an integer and as inf)."""
    from tests.eval_helpers import read_results

    out = tmp_path / "out"
    _, first = cli.main(flags(write_tiny_checkpoint(tmp_path / "model", seed=0), out, PYDOC_EXCERPT, "--baseline"))
    numeric = {"run_id": "0012345678", "identity": "95e8404937768391"}
    for run, values in zip(run_dirs(out), [numeric, {"run_id": "0000000001", "identity": "1234567890123456"}],
                           strict=True):
        metrics = json.loads((run / "metrics.json").read_text())
        (run / "metrics.json").write_text(json.dumps({**metrics, **values}))
    written = (results.write_results_table(out)).read_text()
    assert "0012345678" in written and "95e8404937768391" in written
    table = read_results(out / "results.csv")
    assert sorted(table["run_id"]) == ["0000000001", "0012345678"]
    assert sorted(table["identity"]) == ["1234567890123456", "95e8404937768391"]
    assert pd.read_csv(out / "results.csv")["identity"].dtype != object  # what the helper is for

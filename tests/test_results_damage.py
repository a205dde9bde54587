"""A run directory counts as finished only when every file a finished run has is there and parses, and
items.jsonl holds the items metrics.json counts: a damaged one is never skipped as finished (eval and the
sweep run it again, saying why in one line) and results.csv lists it with a warning (its metrics.json is
whole). And the sweep's size check."""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from errors import run_cli
from eval import cli, results, sweep
from tests.eval_helpers import PYDOC_EXCERPT, one_thread  # noqa: F401  (autouse: one torch thread)


def flags(tiny_dir: Path, out_dir: Path) -> list[str]:
    return ["--tasks", "fidelity", "--checkpoint_path", str(tiny_dir), "--text_file", str(PYDOC_EXCERPT),
            "--seq_len", "60", "--prefill_tokens", "20", "--limit", "2", "--out_dir", str(out_dir), "--no-baseline"]


@pytest.fixture(scope="module")
def finished(tiny_dir, tmp_path_factory) -> Path:
    """An out_dir with one finished two-window run of the full cache."""
    out = tmp_path_factory.mktemp("finished") / "out"
    cli.main(flags(tiny_dir, out))
    return out


def run_dir(out: Path) -> Path:
    (path,) = [p.parent for p in out.glob("*/*/*/metrics.json")]
    return path


def cut_last_line(file: Path) -> None:
    file.write_text("".join(file.read_text().splitlines(keepends=True)[:-1]))


def cut_in_half(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def corrupt_deflate(file: Path) -> None:
    """The first member's deflate stream starts with a block of the reserved type (header bits 11): zlib
    refuses it before any CRC is checked, as it does a byte flipped inside a compressed member."""
    data = bytearray(file.read_bytes())
    with zipfile.ZipFile(file) as archive:
        info = archive.infolist()[0]
    assert info.compress_type == zipfile.ZIP_DEFLATED
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data[info.header_offset + 30 + name_length + extra_length] = 0xFF
    file.write_bytes(bytes(data))


DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "items.jsonl cut at a line": (lambda r: cut_last_line(r / "items.jsonl"), "items.jsonl holds 1 items, "
                                                                               "metrics.json counts 2"),
    "items.jsonl cut mid-line": (lambda r: cut_in_half(r / "items.jsonl"), "is not JSON (truncated?)"),
    "items.jsonl deleted": (lambda r: (r / "items.jsonl").unlink(), "items.jsonl is missing"),
    "kept positions deleted": (lambda r: (r / "kept_positions.npz").unlink(), "kept_positions.npz is missing"),
    "kept positions truncated": (lambda r: cut_in_half(r / "kept_positions.npz"), ""),
    "kept positions' deflate stream corrupt": (lambda r: corrupt_deflate(r / "kept_positions.npz"),
                                               "invalid block type"),
    "predictions cut mid-line": (lambda r: cut_in_half(r / "predictions.jsonl"), "predictions.jsonl line"),
    "config.json garbage": (lambda r: (r / "config.json").write_bytes(b"\xff{"), "config.json"),
}


@pytest.fixture
def out(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "out"))


def test_the_undamaged_run_is_finished(out, capsys):
    path = run_dir(out)
    assert results.is_finished(path)
    assert results.damage(path, results.read_metrics(path)) is None
    assert len(results.load_runs(out)) == 1 and capsys.readouterr().err == ""


@pytest.mark.parametrize("case", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_run_is_not_finished_and_the_table_says_so(case, out, capsys):
    edit, fragment = DAMAGES[case]
    path = run_dir(out)
    edit(path)
    problem = results.damage(path, results.read_metrics(path))
    assert problem is not None and fragment in problem, problem
    assert not results.is_finished(path)
    assert len(results.load_runs(out)) == 1  # its metrics.json is whole: listed, with a warning
    assert capsys.readouterr().err.splitlines() == [
        f"warning: damaged run {path}: {problem}; listed from its metrics.json, not counted as finished (eval and "
        "the sweep run it again)"]


def test_a_corrupt_deflate_stream_is_a_clear_read_error(out):
    path = run_dir(out)
    corrupt_deflate(path / results.KEPT_FILE)
    with pytest.raises(ValueError, match="kept_positions.npz: .*invalid block type"):
        results.read_items(path)


@pytest.mark.parametrize("case", ["items.jsonl cut at a line", "kept positions deleted"])
def test_eval_reruns_a_damaged_run_saying_why(case, out, tiny_dir, capsys):
    path = run_dir(out)
    before = json.loads((path / "metrics.json").read_text())
    DAMAGES[case][0](path)
    capsys.readouterr()
    cli.main(flags(tiny_dir, out))
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "damaged" in line] == [
        line for line in err.splitlines() if line.startswith("rerun (damaged run: ")], err
    assert sum("damaged" in line for line in err.splitlines()) == 1, err
    assert results.is_finished(path)
    after = json.loads((path / "metrics.json").read_text())
    assert after["kl_mean"] == before["kl_mean"] and after["n_items"] == 2


def sweep_flags(tiny_dir: Path, out: Path) -> list[str]:
    return ["--strategies", "full", "--tasks", "fidelity", "--checkpoint_path", str(tiny_dir), "--text_file",
            str(PYDOC_EXCERPT), "--seq_len", "60", "--prefill_tokens", "20", "--limit", "2", "--out_dir", str(out)]


def test_the_sweep_reruns_a_damaged_run_saying_why(out, tiny_dir, capsys):
    """The sweep's run of the same configuration is the same directory as eval's; the sweep (local, and Ray,
    which is handed the same pending list) runs it again."""
    path = run_dir(out)
    (path / "kept_positions.npz").unlink()
    capsys.readouterr()
    sweep.main(sweep_flags(tiny_dir, out))
    err = capsys.readouterr().err.splitlines()
    assert f"rerun (damaged run: kept_positions.npz is missing): {path}" in err, err
    assert "1 runs in the grid, 0 already finished" in err, err
    assert results.is_finished(path) and len(results.load_runs(out)) == 1


def test_the_ray_backend_is_handed_the_damaged_run(out, tiny_dir, capsys, monkeypatch):
    """Ray's driver gets the same pending list as the local backend (no cluster started here)."""
    from eval import sweep_ray

    path = run_dir(out)
    cut_last_line(path / "items.jsonl")
    handed = []
    monkeypatch.setattr(sweep_ray, "import_ray", lambda: None)
    monkeypatch.setattr(sweep_ray, "run_ray", lambda pending, sweep_args, bar: handed.extend(pending) or {})
    sweep.main([*sweep_flags(tiny_dir, out), "--backend", "ray"])
    assert [p for _, p in handed] == [path]
    assert f"rerun (damaged run: items.jsonl holds 1 items, metrics.json counts 2): {path}" in \
        capsys.readouterr().err.splitlines()


def test_a_grid_above_the_threshold_needs_yes(tmp_path, tiny_dir, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "CONFIRM_ABOVE", 2)
    out = tmp_path / "out"
    argv = [*sweep_flags(tiny_dir, out), "--seeds", "0", "1", "2"]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(sweep.main, argv)
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2
    assert err == ["3 runs in the grid, 0 already finished",
                   "error: the grid would start 3 runs (more than 2); check it and pass --yes to start them"]
    assert not out.exists()
    started = []
    monkeypatch.setattr(cli, "run_job", lambda job, device, progress: started.append(job))
    sweep.main([*argv, "--yes"])
    assert len(started) == 3

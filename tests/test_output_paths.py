"""Every OS error on an output path is one line, before any work where it can be known, and nothing is
half-written: the previous result stays byte-identical (atomic_files.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from atomic_files import atomic_target, atomic_write, check_writable, temp_dir_beside, write_json_atomic
from errors import UserError


def refused(call) -> str:
    with pytest.raises(UserError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message
    return message


def test_an_empty_path_is_refused(tmp_path):
    assert "empty" in refused(lambda: check_writable("", False, "--stats_json"))


def test_a_dangling_symlink_is_refused_before_any_work(tmp_path):
    link = tmp_path / "stats.json"
    link.symlink_to(tmp_path / "gone" / "stats.json")
    message = refused(lambda: check_writable(link, True, "--stats_json"))
    assert "symbolic link" in message and "missing" in message
    assert link.is_symlink() and not (tmp_path / "gone").exists()


def test_a_parent_that_is_a_file_is_named(tmp_path):
    (tmp_path / "report").write_text("not a directory")
    message = refused(lambda: check_writable(tmp_path / "report" / "sub" / "stats.json", False, "--stats_json"))
    assert f"{tmp_path / 'report'} is a file, not a directory" in message
    assert (tmp_path / "report").read_text() == "not a directory"


def test_a_name_too_long_for_the_file_system_is_one_line(tmp_path):
    message = refused(lambda: check_writable(tmp_path / ("x" * 300 + ".json"), False, "--stats_json"))
    assert "cannot write --stats_json" in message and "too long" in message.lower()


def test_a_read_only_file_system_is_one_line(tmp_path, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):  # what the probe meets on a read-only mount (root ignores chmod)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    message = refused(lambda: check_writable(tmp_path / "stats.json", False, "--stats_json"))
    assert message == f"cannot write --stats_json {tmp_path / 'stats.json'}: Read-only file system"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_a_full_disk_while_writing_keeps_the_previous_result(tmp_path, code):
    target = tmp_path / "metrics.json"
    target.write_text('{"old": 1}\n')
    before = target.read_bytes()

    def fill_the_disk():
        with atomic_target(target, overwrite=True) as tmp:
            tmp.write_text('{"new": ')
            raise OSError(code, os.strerror(code))

    message = refused(fill_the_disk)
    assert os.strerror(code) in message and "nothing was replaced" in message
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]  # no temporary file left


def test_a_full_disk_at_fsync_keeps_the_previous_result(tmp_path, monkeypatch):
    target = tmp_path / "stats.json"
    target.write_text("{}\n")

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    message = refused(lambda: write_json_atomic(target, {"a": 1}, overwrite=True))
    assert "No space left" in message
    assert target.read_text() == "{}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]


def test_other_errors_of_the_block_are_not_disguised(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(FileNotFoundError), atomic_target(target) as tmp:
        tmp.write_text("x")
        Path(tmp_path / "missing-input").read_text()  # a bug or an input problem, not the output's
    assert not target.exists()


def test_an_existing_result_is_not_replaced_without_overwrite(tmp_path):
    target = tmp_path / "stats.json"
    atomic_write(target, "first\n")
    assert "--overwrite" in refused(lambda: atomic_write(target, "second\n"))
    assert target.read_text() == "first\n"


def test_run_directories_are_readable_by_others(tmp_path):
    new = temp_dir_beside(tmp_path / "run")
    assert new.stat().st_mode & 0o777 == 0o755


def test_generate_refuses_a_dangling_stats_json_before_loading_the_model(tmp_path, capsys):
    import generate
    from errors import run_cli

    link = tmp_path / "stats.json"
    link.symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(SystemExit) as e:
        run_cli(generate.main, ["--prompt", "hi", "--max_new_tokens", "2", "--stats_json", str(link)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --stats_json") and "symbolic link" in err[0]
    assert link.is_symlink() and not (tmp_path / "nowhere.json").exists()


@pytest.mark.parametrize("flags, words", [
    (["--stats_json", ""], "--stats_json: the path is empty"),
    (["--seed", str(1 << 64)], "--seed must be in [0, 2^32)"),
    (["--seed", "-1"], "--seed must be in [0, 2^32)"),
    (["--top_k", "5"], "--top_k restricts sampling"),
])
def test_generate_refuses_values_that_pass_the_type_check_but_not_the_maths(flags, words, capsys):
    import generate
    from errors import run_cli

    with pytest.raises(SystemExit) as e:
        run_cli(generate.main, ["--prompt", "hi", "--max_new_tokens", "2", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_a_tiny_temperature_samples_the_argmax_instead_of_nan():
    import torch

    from generate import sample

    logits = torch.tensor([[1.0, 3.0, 2.0, -1e4]])
    token = sample(logits, 1e-40, None, torch.Generator().manual_seed(0))
    assert token.item() == 1


@pytest.mark.parametrize("entry", ["eval", "eval.bench", "eval.sweep"])
def test_an_out_dir_that_is_a_file_is_named_so_before_any_work(tmp_path, entry):
    """mkdir's own error ("File exists") would not say what is wrong; the file is left as it was."""
    from eval.bench.cli import main as bench
    from eval.cli import main as evaluate
    from eval.sweep import main as sweep

    blocker = tmp_path / "results"
    blocker.write_text("a file")
    main, flags = {"eval": (evaluate, ["--tasks", "fidelity"]), "eval.bench": (bench, ["--quick"]),
                   "eval.sweep": (sweep, ["--strategies", "l2", "--budgets", "0.5", "--tasks", "fidelity"])}[entry]
    assert refused(lambda: main([*flags, "--out_dir", str(blocker)])) == f"--out_dir {blocker} is not a directory"
    assert blocker.read_text() == "a file"

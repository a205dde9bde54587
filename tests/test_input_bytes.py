"""Inputs are read from exactly the bytes that were hashed: a local data file replaced by another of the
same size and modification time (what `cp -p`, `rsync -a` or unpacking an archive produce) is read anew,
never served from a cache keyed by path, size and time; a file replaced after its run hashed it is
refused; local files are parsed from their bytes, with errors that name the file, the line and the
reason."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pandas as pd
import pytest

from errors import UserError
from eval import cli
from eval.data import haystack, input_bytes, input_fingerprint, load_rows, read_text_file
from tests.eval_helpers import one_thread  # noqa: F401  (an autouse fixture: one torch thread)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def replace_keeping_size_and_mtime(path: Path, content: bytes) -> None:
    """Overwrite `path` with `content` of the same length and give it back its modification time."""
    st = path.stat()
    assert len(content) == st.st_size and content != path.read_bytes()
    path.write_bytes(content)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_a_replaced_dataset_of_the_same_size_and_mtime_is_read_anew(tmp_path, suffix):
    path = tmp_path / f"rows{suffix}"

    def write(target: Path, answer: str) -> bytes:
        rows = [{"q": "one?", "a": answer}, {"q": "two?", "a": "2"}]
        if suffix == ".jsonl":
            write_jsonl(target, rows)
        elif suffix == ".json":
            target.write_text(json.dumps(rows))
        elif suffix == ".csv":
            pd.DataFrame(rows).to_csv(target, index=False)
        else:
            pd.DataFrame(rows).to_parquet(target)
        return target.read_bytes()

    write(path, "red")
    assert load_rows(str(path))[0] == {"q": "one?", "a": "red"}  # a cache keyed by path, size, mtime fills here
    replace_keeping_size_and_mtime(path, write(tmp_path / f"other{suffix}", "tan"))
    assert load_rows(str(path)) == [{"q": "one?", "a": "tan"}, {"q": "two?", "a": "2"}]


def test_a_replaced_text_file_and_haystack_are_read_anew(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("alpha line\nbeta line\n")
    assert read_text_file(path) == "alpha line\nbeta line\n"
    assert haystack(str(path))[0] == ["alpha line", "beta line"]
    replace_keeping_size_and_mtime(path, b"gamma line\ndelta lin\n")
    assert read_text_file(path) == "gamma line\ndelta lin\n"
    assert haystack(str(path))[0] == ["gamma line", "delta lin"]


def test_the_hashed_bytes_are_the_bytes_read_and_a_later_replacement_is_refused(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, [{"q": "one?", "a": "red"}])
    old = path.read_bytes()
    assert input_fingerprint(path) == {"size": len(old), "sha256": hashlib.sha256(old).hexdigest()}
    assert input_bytes(path) == old
    replace_keeping_size_and_mtime(path, old.replace(b"red", b"tan"))
    with pytest.raises(UserError, match=r"rows.jsonl changed after this run hashed it"):
        load_rows(str(path))
    new = path.read_bytes()
    assert input_fingerprint(path)["sha256"] == hashlib.sha256(new).hexdigest()  # hashed again: read anew
    assert load_rows(str(path)) == [{"q": "one?", "a": "tan"}]


def test_the_eval_entry_reruns_on_the_new_rows(tiny_dir, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    write_jsonl(rows, [{"q": "one?", "a": "red"}, {"q": "two?", "a": "2"}])
    flags = ["--checkpoint_path", str(tiny_dir), "--tasks", "qa", "--dataset", str(rows), "--prompt_column", "q",
             "--answer_column", "a", "--max_new_tokens", "1", "--out_dir", str(tmp_path / "out"), "--no-baseline"]
    cli.main(flags)
    replace_keeping_size_and_mtime(rows, rows.read_bytes().replace(b"red", b"tan"))
    capsys.readouterr()
    cli.main(flags)
    assert "rerun (changed since the finished run: --dataset)" in capsys.readouterr().err
    (run,) = (tmp_path / "out").glob("*/qa/*/predictions.jsonl")
    answers = [json.loads(line)["answers"] for line in run.read_text().splitlines()]
    assert answers == [["tan"], ["2"]]
    config = json.loads((run.parent / "config.json").read_text())
    assert config["inputs"]["data"]["dataset"]["sha256"] == hashlib.sha256(rows.read_bytes()).hexdigest()


# ---- parse errors: the file, the place, the reason ---------------------------------------------------------

BAD_FILES = {
    "malformed line": ("rows.jsonl", b'{"q": "a"}\n\n{"q": b}\n', r"rows.jsonl line 3: not valid JSON: Expecting"),
    "a row that is a list": ("rows.jsonl", b'{"q": "a"}\n[1, 2]\n', r"rows.jsonl line 2: a row must be a JSON object"),
    "array item not an object": ("rows.json", b'[{"q": "a"}, 3]', r"rows.json item 1: a row must be a JSON object"),
    "malformed array": ("rows.json", b'[{"q": "a"},\n {"q": }]', r"rows.json: not valid JSON at line 2"),
    "not UTF-8": ("rows.jsonl", b'{"q": "\xff"}\n', r"rows.jsonl is not UTF-8 text \(byte 7\)"),
    "empty array": ("rows.json", b"[]", r"dataset is empty"),
    "blank lines only": ("rows.jsonl", b"\n \n", r"dataset is empty"),
    "empty csv": ("rows.csv", b"", r"dataset is empty"),
    "garbage parquet": ("rows.parquet", b"not parquet at all", r"cannot read dataset .*rows.parquet"),
}


@pytest.mark.parametrize("case", list(BAD_FILES), ids=list(BAD_FILES))
def test_a_bad_local_dataset_is_one_line_naming_the_file_and_the_place(tmp_path, case):
    name, content, message = BAD_FILES[case]
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=message) as info:
        load_rows(str(tmp_path / name))
    assert "\n" not in str(info.value)


def test_a_directory_is_not_reported_as_missing(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    for call in (lambda: load_rows(str(tmp_path / "d.jsonl")), lambda: load_rows(str(tmp_path)),
                 lambda: read_text_file(tmp_path), lambda: haystack(str(tmp_path))):
        with pytest.raises(UserError, match="is a directory, not a file"):
            call()
    with pytest.raises(UserError, match="dataset file not found"):
        load_rows(str(tmp_path / "nope.jsonl"))


def test_rows_have_every_column_as_datasets_gives_them(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, [{"q": "one?"}, {"q": "two?", "a": ["2", "two"]}])
    assert load_rows(str(path)) == [{"q": "one?", "a": None}, {"q": "two?", "a": ["2", "two"]}]
    csv = tmp_path / "rows.csv"
    csv.write_text("q,a,n\none?,1,\ntwo?,2,3.5\n")
    assert load_rows(str(csv)) == [{"q": "one?", "a": 1, "n": None}, {"q": "two?", "a": 2, "n": 3.5}]
    assert type(load_rows(str(csv))[0]["a"]) is int  # an index answer stays an index (choice_label)

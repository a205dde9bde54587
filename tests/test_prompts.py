"""prompts.py: --prompt and --prompts_file read whole before any model loads; special files and damaged
prompts files are one line naming the file (and line), in prompts.py and through generate.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import generate
from errors import UserError, run_cli
from prompts import collect_prompts, read_prompt, read_prompts_file


def write(path: Path, content: str | bytes) -> str:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(path)


@pytest.fixture
def fifo(tmp_path) -> str:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return str(path)


def test_special_files_are_refused_as_prompts(fifo):
    """Reading them would block (a FIFO) or give nothing; /dev/null was once taken for the text '/dev/null'."""
    with pytest.raises(UserError, match=r"^--prompt /dev/null is a character device, not a prompt file$"):
        read_prompt("/dev/null")
    with pytest.raises(UserError, match=rf"^--prompt {fifo} is a FIFO, not a prompt file$"):
        read_prompt(fifo)
    with pytest.raises(UserError, match=r"^--prompts_file /dev/zero is a character device, not a file$"):
        read_prompts_file("/dev/zero")
    with pytest.raises(UserError, match="is a FIFO"):
        read_prompts_file(fifo)


def test_read_prompt_keeps_its_rules(tmp_path, monkeypatch):
    notes = write(tmp_path / "notes.md", "Kurze Notiz.\n")
    assert read_prompt(notes) == "Kurze Notiz.\n"
    monkeypatch.chdir(tmp_path)
    assert read_prompt("notes.md") == "Kurze Notiz.\n"  # a relative name, from the working directory
    assert read_prompt("summarize notes.txt") == "summarize notes.txt"
    assert read_prompt("x" * 5000) == "x" * 5000  # too long for a file name: text
    assert read_prompt("a\0b") == "a\0b"
    # "" is the working directory as a path: still the empty prompt.
    for bad, message in [(str(tmp_path / "missing.txt"), "not found"), ("  ", "^the prompt is empty$"),
                         ("", "^the prompt is empty$"), (str(tmp_path), "directory"),
                         (write(tmp_path / "b.txt", b"\xff"), "not UTF-8")]:
        with pytest.raises(UserError, match=message):
            read_prompt(bad)


def test_a_text_prompts_file_is_one_prompt_per_line(tmp_path):
    path = write(tmp_path / "p.txt", "What is a KV cache?\r\nWhy evict?\nÜber Caches\n")
    assert read_prompts_file(path) == ["What is a KV cache?", "Why evict?", "Über Caches"]
    assert read_prompts_file(write(tmp_path / "q", "no newline at the end")) == ["no newline at the end"]


def test_a_jsonl_prompts_file_reads_the_prompt_of_each_row(tmp_path):
    rows = [{"prompt": "one\nwith a newline"}, {"prompt": "two", "id": 7}]
    path = write(tmp_path / "p.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert read_prompts_file(path) == ["one\nwith a newline", "two"]


BAD_FILES = {
    "empty": ("p.txt", "", "is empty"),
    "an empty line": ("p.txt", "one\n\nthree\n", "p.txt line 2 is empty (one prompt per line)"),
    "a blank line": ("p.txt", "one\n   \n", "p.txt line 2 is empty"),
    "not UTF-8": ("p.txt", b"ok\n\xff\n", "is not UTF-8 text (byte 3)"),
    "jsonl not JSON": ("p.jsonl", '{"prompt": "a"}\n{"prompt": \n', "p.jsonl line 2 is not JSON"),
    "jsonl row without prompt": ("p.jsonl", '{"prompt": "a"}\n{"text": "b"}\n',
                                 'p.jsonl line 2: a row must be an object with a string "prompt" (no "prompt")'),
    "jsonl prompt not a string": ("p.jsonl", '{"prompt": 3}\n', '"prompt" is int'),
    "jsonl row a list": ("p.jsonl", '["a"]\n', "(not an object)"),
    "jsonl empty prompt": ("p.jsonl", '{"prompt": " "}\n', "p.jsonl line 1: the prompt is empty"),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_a_bad_prompts_file_is_one_line_naming_the_file_and_line(case, tmp_path):
    name, content, message = BAD_FILES[case]
    path = write(tmp_path / name, content)
    with pytest.raises(UserError) as info:
        read_prompts_file(path)
    assert message in str(info.value) and str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_missing_and_directory_prompts_files(tmp_path):
    with pytest.raises(UserError, match="--prompts_file not found"):
        read_prompts_file(str(tmp_path / "nope.txt"))
    with pytest.raises(UserError, match="is a directory"):
        read_prompts_file(str(tmp_path))
    with pytest.raises(UserError, match="^--prompts_file: the path is empty$"):  # not the working directory
        read_prompts_file("")


def test_prompt_flags_combine_in_order(tmp_path):
    path = write(tmp_path / "p.txt", "b\nc\n")
    assert collect_prompts(["a"], path) == ["a", "b", "c"]
    assert collect_prompts(None, path) == ["b", "c"]
    assert collect_prompts(["a"], None) == ["a"]
    with pytest.raises(UserError, match="give a prompt"):
        collect_prompts(None, None)


# ---- generate.py ------------------------------------------------------------------------------------------



def tripwire(*args: object, **kwargs: object) -> None:
    raise AssertionError("a model was loaded before the prompts were read")


@pytest.mark.parametrize("case", ["no prompt", "dev null prompt", "prompts file empty line", "jsonl without prompt"])
def test_generate_refuses_bad_prompts_before_loading(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load_checkpoint", tripwire)
    argv, message = {
        "no prompt": ([], "give a prompt: --prompt TEXT"),
        "dev null prompt": (["--prompt", "/dev/null"], "--prompt /dev/null is a character device"),
        "prompts file empty line": (["--prompt", "Hi", "--prompts_file", write(tmp_path / "p.txt", "a\n\nb\n")],
                                    "p.txt line 2 is empty"),
        "jsonl without prompt": (["--prompts_file", write(tmp_path / "p.jsonl", '{"q": 1}\n')],
                                 'p.jsonl line 1: a row must be an object with a string "prompt"')}[case]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(generate.main, [*argv, "--max_new_tokens", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert message in err, err


def test_generate_decodes_every_prompt_of_a_file(tiny_dir, tmp_path, capsys):
    """--prompt and --prompts_file together are the rows --prompt repeated gives, in the same order."""
    path = write(tmp_path / "p.jsonl", '{"prompt": "hello"}\n{"prompt": "cache"}\n')
    common = ["--checkpoint_path", str(tiny_dir), "--no-chat", "--max_new_tokens", "3", "--batch_size", "3"]
    capsys.readouterr()
    from_file = generate.main(["--prompt", "kv", "--prompts_file", path, *common])
    rows_from_file = capsys.readouterr().out.split("---- statistics ----")[0]
    repeated = generate.main(["--prompt", "kv", "--prompt", "hello", "--prompt", "cache", *common])
    rows_repeated = capsys.readouterr().out.split("---- statistics ----")[0]
    assert from_file["rows"] == 3 and "---- row 2 ----" in rows_from_file
    assert rows_from_file == rows_repeated
    for key in ("prompt_tokens", "generated_tokens", "cache_bytes"):
        assert from_file[key] == repeated[key]

"""generate.py's prompts: `--prompt` (text, or the path of a text file; repeatable) and `--prompts_file` (many
prompts in one file), read whole before any model loads, every refusal one line naming the file and line.

A prompts file is one prompt per line, or, named *.jsonl, one JSON object per line with a string "prompt".
Refused: a missing, empty or non-UTF-8 file, an empty line, a row that is not such an object. Special files
(/dev/null, a FIFO, a device, a socket) are refused as prompts and prompts files: reading one blocks, never
ends, or yields nothing, and /dev/null used to be taken for the six-character prompt "/dev/null".
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from errors import UserError

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket"}


def _kind(path: Path) -> str | None:
    """'file', 'directory', a special kind in words, or None when nothing is there (or it cannot be a path)."""
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):  # missing, too long for a file name, a NUL byte
        return None
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _read_text(path: Path, what: str) -> str:
    """The UTF-8 text of a regular file (checked by the caller)."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def read_prompt(prompt: str) -> str:
    """The prompt text: the content of `prompt` when it names an existing file (any extension, read as
    UTF-8), else `prompt` itself. A single word ending in .txt that is not a file is a missing file,
    while text that merely mentions one ("summarize notes.txt") is a prompt."""
    if not prompt.strip():  # before it is a path: Path("") is the working directory
        raise UserError("the prompt is empty")
    path = Path(prompt)
    kind = _kind(path)
    if kind == "directory":
        raise UserError(f"--prompt {prompt} is a directory, not a prompt file")
    if kind not in (None, "file"):
        raise UserError(f"--prompt {prompt} is {kind}, not a prompt file")
    if kind == "file":
        text = _read_text(path, "prompt file")
        if not text.strip():
            raise UserError(f"prompt file {path} is empty")
        return text
    if prompt.endswith(".txt") and not any(c.isspace() for c in prompt):
        raise UserError(f"prompt file not found: {prompt}")
    return prompt


def read_prompts_file(name: str) -> list[str]:
    """The prompts of a --prompts_file: its lines, or the "prompt" of each row of a .jsonl."""
    if not name.strip():
        raise UserError("--prompts_file: the path is empty")
    path = Path(name)
    kind = _kind(path)
    if kind is None:
        raise UserError(f"--prompts_file not found: {name}")
    if kind != "file":
        raise UserError(f"--prompts_file {name} is {'a directory' if kind == 'directory' else kind}, not a file")
    lines = _read_text(path, "--prompts_file").splitlines()
    if not lines:
        raise UserError(f"--prompts_file {path} is empty")
    jsonl = path.suffix.lower() == ".jsonl"
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            raise UserError(f"{path} line {number} is empty (one prompt per line)")
        prompts.append(_jsonl_prompt(line, path, number) if jsonl else line)
    return prompts


def _jsonl_prompt(line: str, path: Path, number: int) -> str:
    try:
        row = json.loads(line)
    except ValueError:
        raise UserError(f"{path} line {number} is not JSON") from None
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if not isinstance(prompt, str):
        got = "not an object" if not isinstance(row, dict) else (
            "no \"prompt\"" if "prompt" not in row else f"\"prompt\" is {type(prompt).__name__}")
        raise UserError(f"{path} line {number}: a row must be an object with a string \"prompt\" ({got})")
    if not prompt.strip():
        raise UserError(f"{path} line {number}: the prompt is empty")
    return prompt


def collect_prompts(prompt_args: list[str] | None, prompts_file: str | None) -> list[str]:
    """Every prompt asked for, in order: the --prompt values, then the --prompts_file's."""
    if not prompt_args and prompts_file is None:
        raise UserError("give a prompt: --prompt TEXT (or a file's path) or --prompts_file PATH")
    texts = [read_prompt(p) for p in prompt_args or []]
    return texts + (read_prompts_file(prompts_file) if prompts_file is not None else [])

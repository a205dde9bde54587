"""Where evaluation text and examples come from, all offline by default: CPython's own reference
documentation (`pydoc_data.topics`), a text file, or rows of a local JSON/JSONL/CSV/parquet file (or a
dataset on the hub when online, loaded with `datasets`).

A local file is read once into memory and parsed from those bytes, never through another library's
cache: `datasets` keys its cache of a local file by path, size and modification time, so a file replaced
by one of the same size and time (`cp -p`, `rsync -a`, an unpacked archive) was served from the old
rows. `input_fingerprint` hashes a file's bytes and keeps them; the run then parses exactly those bytes
(`input_bytes`), so the hash recorded with a result is the hash of what it read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from errors import UserError
from file_stamps import file_signature

DATA_DIR = Path(__file__).resolve().parent / "data"
LOCAL_FORMATS = (".json", ".jsonl", ".csv", ".parquet")
HUB_HOST = "huggingface.co"
# RULER's "noise" haystack: sentences that carry no information (https://arxiv.org/abs/2404.06654).
NOISE_SENTENCES = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def pydoc_corpus() -> str:
    """CPython's reference documentation as one text (about 113k SmolLM2 tokens).

    It differs between Python versions: runs record its sha256, and tests pin an excerpt.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---- local files: hashed and parsed from the same bytes --------------------------------------------------


@dataclass(frozen=True)
class _Snapshot:
    data: bytes
    stat: tuple[int, ...]  # file_signature of the file the bytes were read from


# The bytes of each input file as last hashed by input_fingerprint (one entry per file, replaced when it
# is hashed again: every run hashes its inputs before it reads them).
_SNAPSHOTS: dict[str, _Snapshot] = {}


def _checked_file(path: Path, what: str) -> None:
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory, not a file")
    if not path.exists():
        raise UserError(f"{what} not found: {path}")


def _read(path: Path, what: str) -> _Snapshot:
    """The file's bytes in one read, with the signature of the file they came from."""
    _checked_file(path, what)
    try:
        with path.open("rb") as f:
            before = file_signature(os.fstat(f.fileno()))
            data = f.read()
            after = file_signature(os.fstat(f.fileno()))
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if before != after:  # rewritten in place while being read: the bytes may be a mix of two versions
        raise UserError(f"{what} {path} changed while it was being read; run again")
    return _Snapshot(data, before)


def input_fingerprint(path: str | Path, what: str = "input file") -> dict:
    """{"size", "sha256"} of a local input file, hashed from bytes read now and kept, so that the run
    that records this hash parses exactly these bytes (input_bytes)."""
    path = Path(path)
    snapshot = _read(path, what)
    _SNAPSHOTS[str(path.resolve())] = snapshot
    return {"size": len(snapshot.data), "sha256": hashlib.sha256(snapshot.data).hexdigest()}


def input_bytes(path: str | Path, what: str = "input file") -> bytes:
    """A local input file's content: the bytes input_fingerprint hashed when the file is still the one it
    read; read now when it was never hashed. A file replaced after it was hashed is refused: the hash the
    run records would not be the hash of what it read."""
    path = Path(path)
    _checked_file(path, what)
    hashed = _SNAPSHOTS.get(str(path.resolve()))
    if hashed is None:
        return _read(path, what).data
    try:
        current = file_signature(path.stat())
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if current != hashed.stat:
        raise UserError(f"{what} {path} changed after this run hashed it (its result would be labelled with "
                        "another file's identity); run again")
    return hashed.data


def read_text_file(path: str | Path, what: str = "text file") -> str:
    path = Path(path)
    data = input_bytes(path, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # scoring replacement characters would measure nothing real
        raise UserError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise UserError(f"{what} is empty: {path}")
    return text


def word_list() -> list[str]:
    """Lowercase English words (shipped in eval/data/words.txt) for needle keys and word lists."""
    return (DATA_DIR / "words.txt").read_text().split()


# ---- datasets ------------------------------------------------------------------------------------------


def _hub_reachable(timeout: float = 3.0) -> bool:
    try:
        socket.create_connection((HUB_HOST, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _json_error(e: json.JSONDecodeError) -> str:
    return f"{e.msg} at column {e.colno}"


def _json_rows(text: str, source: str) -> list[dict]:
    """A JSON array of objects, or JSON Lines (one object per line; blank lines skipped): `datasets`
    reads both from .json and .jsonl files alike."""
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"dataset {source}: not valid JSON at line {e.lineno}: {_json_error(e)}") from None
        where = [f"item {i}" for i in range(len(rows))]
    else:
        rows, where = [], []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"dataset {source} line {number}: not valid JSON: {_json_error(e)}") from None
            where.append(f"line {number}")
    for row, place in zip(rows, where, strict=True):
        if not isinstance(row, dict):
            raise UserError(f"dataset {source} {place}: a row must be a JSON object, got {type(row).__name__} "
                            f"{json.dumps(row)[:60]}")
    # As `datasets` does: every row has every column, None where a row lacks it.
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return [{c: row.get(c) for c in columns} for row in rows]


def _table_rows(data: bytes, suffix: str, source: str) -> list[dict]:
    """CSV (read by pandas, as `datasets` does) or parquet, as rows of Python values (lists, None)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if suffix == ".csv":
            return pa.Table.from_pandas(pd.read_csv(io.BytesIO(data)), preserve_index=False).to_pylist()
        return pq.read_table(io.BytesIO(data)).to_pylist()
    except pd.errors.EmptyDataError:
        raise UserError(f"dataset is empty: {source}") from None
    except (ValueError, pa.ArrowException, pd.errors.ParserError) as e:  # UnicodeDecodeError is a ValueError
        raise UserError(f"cannot read dataset {source}: {str(e).splitlines()[0]}") from None


def local_rows(path: Path) -> list[dict]:
    """The rows of a local JSON/JSONL/CSV/parquet file, parsed from its bytes (input_bytes)."""
    suffix = path.suffix.lower()
    if suffix not in LOCAL_FORMATS:
        _checked_file(path, "dataset file")
        raise UserError(f"unsupported dataset file {path}; use one of {', '.join(LOCAL_FORMATS)}")
    data = input_bytes(path, "dataset file")
    if suffix in (".csv", ".parquet"):
        rows = _table_rows(data, suffix, str(path))
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"dataset {path} is not UTF-8 text (byte {e.start})") from None
        rows = _json_rows(text, str(path))
    if not rows:
        raise UserError(f"dataset is empty: {path}")
    return rows


def hub_rows(source: str, config: str | None, split: str) -> list[dict]:
    """A dataset on the Hugging Face hub, through `datasets` (online, or its local cache when offline)."""
    import datasets

    datasets.disable_progress_bars()
    # Offline, load_dataset retries the hub for ~25 s before failing; say so at once instead.
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
    if not offline and not _hub_reachable():
        raise UserError(
            f"cannot reach the Hugging Face hub to load dataset {source!r} (offline?); use a local "
            "JSON/CSV/parquet file, or set HF_HUB_OFFLINE=1 to load it from the local cache"
        )
    try:
        rows = datasets.load_dataset(source, config, split=split)
    except Exception as e:  # datasets raises many types (network, cache, parser): report one line
        raise UserError(f"cannot load dataset {source!r} (split {split!r}): {str(e).splitlines()[0]}") from None
    if len(rows) == 0:
        raise UserError(f"dataset is empty: {source}")
    return list(rows)


def load_rows(source: str, config: str | None = None, split: str = "train") -> list[dict]:
    """Rows of a local JSON/JSONL/CSV/parquet file, or of a dataset on the hub (needs the network).
    A local file has one table: `config` and `split` name parts of hub datasets only."""
    path = Path(source)
    if path.suffix.lower() in LOCAL_FORMATS or path.exists():
        return local_rows(path)
    return hub_rows(source, config, split)


def check_columns(rows: list[dict], columns: dict[str, str | None], source: str) -> None:
    """Every requested column (flag name -> column) must exist in the rows."""
    available = list(rows[0])
    for flag, column in columns.items():
        if column is not None and column not in available:
            raise UserError(f"unknown column {column!r} for --{flag} in {source}; columns: {', '.join(available)}")


def haystack(source: str) -> tuple[list[str], str]:
    """Filler for the RULER-style tasks as (units, joiner): `pydoc` (lines of CPython's documentation),
    `noise` (RULER's repeated sentences) or a text file's lines. Needles go between units."""
    if source == "noise":
        return [s.strip() + "." for s in NOISE_SENTENCES.split(".") if s.strip()], " "
    text = pydoc_corpus() if source == "pydoc" else read_text_file(source, "haystack file")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"haystack {source} has no text")
    return lines, "\n"

"""Where evaluation text and examples come from, all offline by default: CPython's own reference
documentation (`pydoc_data.topics`), a text file, or rows loaded with `datasets` from a local
JSON/CSV/parquet file (or a hub name when online)."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

from errors import UserError

DATA_DIR = Path(__file__).resolve().parent / "data"
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
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


def read_text_file(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"text file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise UserError(f"cannot read text file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:  # scoring replacement characters would measure nothing real
        raise UserError(f"text file {path} is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise UserError(f"text file is empty: {path}")
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


def load_rows(source: str, config: str | None = None, split: str = "train") -> list[dict]:
    """Rows of a local JSON/JSONL/CSV/parquet file, or of a dataset on the hub (needs the network)."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(source)
    if path.suffix.lower() in LOCAL_FORMATS or path.exists():
        if not path.is_file():
            raise UserError(f"dataset file not found: {source}")
        fmt = LOCAL_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise UserError(f"unsupported dataset file {source}; use one of {', '.join(LOCAL_FORMATS)}")
        if path.stat().st_size == 0:
            raise UserError(f"dataset is empty: {source}")
        try:
            rows = datasets.load_dataset(fmt, data_files=str(path), split="train")
        except Exception as e:  # datasets wraps parser errors in many types; report one line
            if "corresponds to no data" in str(e):  # e.g. a JSON file holding []
                raise UserError(f"dataset is empty: {source}") from None
            raise UserError(f"cannot read dataset {source}: {str(e).splitlines()[0]}") from None
    else:
        # Offline, load_dataset retries the hub for ~25 s before failing; say so at once instead.
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        if not offline and not _hub_reachable():
            raise UserError(
                f"cannot reach the Hugging Face hub to load dataset {source!r} (offline?); use a local "
                "JSON/CSV/parquet file, or set HF_HUB_OFFLINE=1 to load it from the local cache"
            )
        try:
            rows = datasets.load_dataset(source, config, split=split)
        except Exception as e:
            raise UserError(f"cannot load dataset {source!r} (split {split!r}): {str(e).splitlines()[0]}") from None
    if len(rows) == 0:
        raise UserError(f"dataset is empty: {source}")
    return list(rows)


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
    text = pydoc_corpus() if source == "pydoc" else read_text_file(source)
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"haystack {source} has no text")
    return lines, "\n"

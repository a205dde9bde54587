"""Whether a file is still the one read before, without reading it again: its stat signature. Results, inputs
and calibration files read once per process (eval's hashes, a task's bytes, a model's gates) are read again
when it changes."""

from __future__ import annotations

import os
from pathlib import Path


def file_signature(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is replaced or rewritten. ctime is part of it: `cp -p`, `rsync -a` and
    os.utime restore the modification time, but nothing but the kernel sets ctime."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def file_stamp(path: Path) -> tuple:
    """The file's resolved path and signature (OSError where it cannot be read): another stamp means other
    content."""
    return str(path.resolve()), *file_signature(path.stat())

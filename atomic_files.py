"""Writes that never leave a half-written or lost result: every output file and run directory goes through
here.

- `check_writable(path, overwrite)` before the expensive work: the target is not a directory, is not
  replaced without `overwrite`, and a file can really be created beside it (a probe, not `os.access`,
  which says yes to root on any directory).
- `atomic_write(path, data, overwrite)` / `atomic_target(path, overwrite)`: the content goes to a temporary
  file beside the target (same file system), is flushed to disk, then renamed over the target in one
  step. The temporary file is removed on every exit path, Ctrl-C included; SIGKILL can leave a hidden
  `.NAME.tmp*` file, which `remove_leftovers` clears.
- `replace_dir(new, target)`: a complete new directory swapped in for the old one (atomically on Linux),
  the old one removed only after the swap.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from errors import UserError

TMP_MARK = ".tmp"  # hidden temporaries are named .<target name>.tmp<random>
OLD_MARK = ".old"  # a replaced run directory between the swap and its removal
_RENAME_EXCHANGE = 2  # renameat2 flag (Linux ≥ 3.15): swap two paths atomically
_AT_FDCWD = -100


# Errors of the disk rather than of the path: raised while a result is being written, they become one line
# (the temporary file is removed and the previous result, if any, is left as it was).
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.ENAMETOOLONG)


def refuse_replacing(path: str | Path, overwrite: bool, flag: str = "output") -> Path:
    """`path`, unless it cannot be a result file: empty, a directory, a symbolic link (a dangling one would
    pass every check and only fail once the work is done), below a regular file, or (without `overwrite`)
    an existing file: then a UserError."""
    if str(path) == "":
        raise UserError(f"{flag}: the path is empty")
    path = Path(path)
    try:
        return _refuse_replacing(path, overwrite, flag)
    except OSError as e:  # e.g. a name too long for the file system: even stat() refuses it
        raise UserError(f"cannot write {flag} {path}: {e.strerror or e}") from None


def _refuse_replacing(path: Path, overwrite: bool, flag: str) -> Path:
    if path.is_symlink():
        target = "a missing file" if not path.exists() else os.readlink(path)
        raise UserError(f"{flag} {path} is a symbolic link (to {target}); give the real path")
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory, not a file")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"cannot write {flag} {path}: {parent} is a file, not a directory")
            break
    if path.exists() and not overwrite:
        raise UserError(f"{path} exists; pass --overwrite to replace it")
    return path


def check_writable(path: str | Path, overwrite: bool, flag: str = "output") -> Path:
    """Fail now (UserError) if `path` could not be written later; creates missing parent directories."""
    path = refuse_replacing(path, overwrite, flag)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}{TMP_MARK}"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {flag} {path}: {e.strerror or e}") from None
    return path


@contextlib.contextmanager
def atomic_target(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends normally its file replaces `path`.

    Without `overwrite` an existing target is refused (UserError), also one that appeared while the
    block ran: the final step is then a hard link, which fails instead of replacing.
    """
    path = refuse_replacing(Path(path), overwrite)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{TMP_MARK}")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        try:
            yield tmp
        except OSError as e:
            if e.errno not in _WRITE_ERRNOS:
                raise
            raise UserError(f"cannot write {path}: {e.strerror or e}; nothing was replaced") from None
        try:
            _fsync_file(tmp)  # a full disk can surface only here, when the data reaches it
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror or e}; nothing was replaced") from None
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; results are meant to be shared
        try:
            if overwrite:
                os.replace(tmp, path)
            else:
                _link_or_replace(tmp, path)
        except FileExistsError:
            raise UserError(f"{path} exists; pass --overwrite to replace it") from None
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror or e}") from None
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _link_or_replace(tmp: Path, path: Path) -> None:
    """Put `tmp` at `path` unless something is there: a hard link fails instead of replacing. File
    systems without hard links get a check and a rename (a narrow race instead of none)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS):
            raise
        if path.exists():
            raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
        os.replace(tmp, path)


def atomic_write(path: str | Path, data: str | bytes, overwrite: bool = False) -> Path:
    """Write `data` (text as UTF-8) to `path` atomically; see atomic_target."""
    with atomic_target(path, overwrite) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be fsynced
        _fsync_file(path)


# ---- directories ----------------------------------------------------------------------------------------


def temp_dir_beside(target: Path) -> Path:
    """A new hidden directory next to `target`, to be filled and then swapped in with replace_dir."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # The writer's pid in the name: remove_leftovers spares the directories of live writers.
    new = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}{TMP_MARK}{os.getpid()}-"))
    os.chmod(new, 0o755)  # mkdtemp makes it owner-only; its files are 0644 to be shared, so must it be
    return new


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: Path, target: Path) -> None:
    """Make the complete directory `new` be `target`; an old `target` is removed only once `new` is in place.

    With an atomic exchange there is no moment without a result. Without one, the old directory is
    first renamed to a hidden `.old` name that `recover_dir` restores if the process dies in between.
    """
    if not target.exists():
        os.replace(new, target)
    elif _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old result
    else:
        old = target.with_name(f".{target.name}{OLD_MARK}{os.getpid()}")
        os.replace(target, old)
        os.replace(new, target)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(target.parent)


def recover_dir(target: Path) -> None:
    """Restore `target` from a `.old` copy left by a process killed mid-swap; drop other leftovers."""
    if not target.parent.is_dir():
        return
    olds = sorted(target.parent.glob(f".{target.name}{OLD_MARK}*"))
    if olds and not target.exists():
        os.replace(olds.pop(), target)
    for leftover in olds:
        shutil.rmtree(leftover, ignore_errors=True)


def _writer_alive(leftover: Path, name: str) -> bool:
    pid = leftover.name.removeprefix(f".{name}{TMP_MARK}").split("-")[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(directory: Path, name: str) -> None:
    """Remove temporary directories of `name` in `directory` left by killed writers (not live ones)."""
    for leftover in directory.glob(f".{name}{TMP_MARK}*"):
        if leftover.is_dir() and not _writer_alive(leftover, name):
            shutil.rmtree(leftover, ignore_errors=True)


def write_json_atomic(path: str | Path, payload: dict, overwrite: bool) -> None:
    """The JSON file replaces `path` in one step once complete; an existing file only with `overwrite`."""
    atomic_write(path, json.dumps(payload, indent=2) + "\n", overwrite=overwrite)

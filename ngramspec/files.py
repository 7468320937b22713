"""Reading and writing files: the one regular-file opener for inputs and the one atomic writer
for outputs.

An input that must be a regular file (a cache file, a trace, a chat log) is opened with
`open_regular`: a FIFO, a device or a directory is refused at once instead of blocking forever
(a FIFO with no writer) or never ending (``/dev/zero``); `read_limited` reads a whole small
input (a prompt) that way, or from standard input (``-``), never more than a bound.
`same_file` tells an output that would overwrite an input (links included).

Every file ngramspec writes goes through `atomic_write_bytes`, so it is replaced whole or not at
all: the data goes to a temporary file in the same directory (rename(2) is atomic only within
one file system), is flushed and fsync'ed, then renamed over the target, and the directory is
fsync'ed so the rename itself survives a power loss. On failure the temporary file is removed;
the temporaries that killed writers left behind are removed by the next write to the same file.
Only regular files are written: a symbolic link's target is replaced, a device or directory is
refused (`NotRegularFileError`).

Notes
-----
Thread-safety: stateless; concurrent writers to one path each leave a complete file (the last
rename wins).
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import tempfile
from typing import BinaryIO, Union

try:
    import fcntl
except ImportError:     # pragma: no cover - non-POSIX
    fcntl = None

__all__ = ["NotRegularFileError", "atomic_write_bytes", "file_kind", "open_regular",
           "read_limited", "same_file"]

PathLike = Union[str, "os.PathLike[str]"]

_FILE_KINDS = {stat.S_IFDIR: "directory", stat.S_IFCHR: "character device",
               stat.S_IFBLK: "block device", stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket"}


class NotRegularFileError(OSError):
    """A path names something other than a regular file.

    A directory, a device, a FIFO or a socket, which a load would block on and a save must not
    replace. An `OSError` with the errno, message and path.
    """


def file_kind(mode: int) -> str:
    """What a ``stat`` mode that is not a regular file's names (``"FIFO"``, ``"directory"``)."""
    return _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")


def not_regular(mode: int, message: str, path: str) -> NotRegularFileError:
    """The error for a non-regular file of ``mode`` at ``path``: ``is a FIFO: <message>``."""
    return NotRegularFileError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL,
                               f"is a {file_kind(mode)}: {message}", path)


def open_regular(path, what: str) -> BinaryIO:
    """``open(path, "rb")`` for a regular file only.

    Parameters
    ----------
    path : str or os.PathLike
    what : str
        What the file holds, for the message (``"traces"``: "traces are read from regular
        files only").

    Returns
    -------
    binary file object

    Raises
    ------
    FileNotFoundError, OSError
        The file cannot be opened.
    NotRegularFileError
        A directory, FIFO, device or socket.
    """
    path = os.fspath(path)
    # O_NONBLOCK: opening a FIFO must not wait for a writer; then only regular files are read
    # (a FIFO, /dev/zero or /dev/urandom would block or never end)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(st.st_mode, f"{what} are read from regular files only", path)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_limited(path, what: str, limit: int) -> bytes:
    """The whole content of a regular file (`open_regular`), or of standard input for ``-``,
    refused when longer than ``limit`` bytes (read no further than one byte past it).

    Parameters
    ----------
    path : str or os.PathLike
        ``"-"`` alone reads standard input (a pipe, a terminal: waiting for it is asked for).
    what : str
        What the file holds, for the messages (``"prompts"``).
    limit : int
        Bytes.

    Raises
    ------
    ValueError
        Longer than ``limit``.
    NotRegularFileError, OSError
        As `open_regular`.
    """
    if os.fspath(path) == "-":
        data = sys.stdin.buffer.read(limit + 1)
    else:
        with open_regular(path, what) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > limit:
                raise ValueError(f"{size} bytes: {what} are read up to {limit} bytes")
            data = fh.read(limit + 1)       # it may have grown since
    if len(data) > limit:
        raise ValueError(f"more than {limit} bytes: {what} are read up to {limit} bytes")
    return data


def same_file(path_a, path_b) -> bool:
    """Whether two paths name one file (the same device and inode: symbolic and hard links
    included); False when either does not exist."""
    try:
        return os.path.samestat(os.stat(path_a), os.stat(path_b))
    except (OSError, ValueError):
        return False


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Replace the file at `path` with `data` atomically.

    Temporary file in the same directory, flush, fsync, rename, fsync the directory. On any
    failure the temporary file is removed and the old file, if any, is left untouched. A new file
    gets the usual 0666 & ~umask mode; an existing file keeps its mode. A symbolic link is
    followed and its target replaced (the link stays). Temporary files of earlier saves to the
    same file that a killed process left behind are removed (`_remove_stale_temps`).

    Parameters
    ----------
    path : str or os.PathLike
    data : bytes

    Raises
    ------
    NotRegularFileError
        A directory, device, FIFO or socket at the path (or at the link's target); it is not
        touched.
    OSError
        The write, fsync or rename failed.

    Notes
    -----
    Memory: none beyond `data`.

    Thread-safety: concurrent writers to one path each leave a complete file (the last rename
    wins); use `merge_into_dynamic` to combine counts.
    """
    _write_regular(_resolve_target(path), data)


def _resolve_target(path: PathLike, what: str = "outputs") -> str:
    """The real path a save to ``path`` writes: symbolic links resolved (a dangling link gives
    its target, which the save creates). Raises `NotRegularFileError` if something other than a
    regular file is there."""
    path = os.fspath(path)
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return real
    if not stat.S_ISREG(st.st_mode):
        where = path if real == os.path.abspath(path) else f"{path} (-> {real})"
        raise not_regular(st.st_mode, f"{what} are saved to regular files only", where)
    return real


def _temp_prefix(real: str) -> str:
    return "." + os.path.basename(real) + "."


def _is_our_temp(name: str, prefix: str) -> bool:
    # tempfile.mkstemp(prefix=prefix, suffix=_TEMP_SUFFIX) names: prefix, 8 characters of
    # tempfile's alphabet (lower-case letters, digits, "_"), suffix
    if not (name.startswith(prefix) and name.endswith(_TEMP_SUFFIX)):
        return False
    middle = name[len(prefix):-len(_TEMP_SUFFIX)]
    return len(middle) == 8 and all(c in _TEMP_ALPHABET for c in middle)


_TEMP_SUFFIX = ".tmp"
_TEMP_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")


def _write_regular(real: str, data: bytes) -> None:
    """atomic_write_bytes to an already resolved path (see `_resolve_target`)."""
    directory = os.path.dirname(real)
    try:
        mode = os.stat(real).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    _remove_stale_temps(real)
    fd, tmp = _locked_temp(real)
    try:
        with os.fdopen(fd, "wb") as f:      # closing it releases the temp file's lock
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _locked_temp(real: str):
    """A new temporary file beside ``real`` (same file system: rename(2) is only atomic within
    one), exclusively flock'ed for as long as its descriptor is open, so that a concurrent
    save's `_remove_stale_temps` leaves it alone. Returns ``(fd, name)``."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(real), suffix=_TEMP_SUFFIX,
                                   dir=os.path.dirname(real))
        if fcntl is None:       # pragma: no cover - non-POSIX: no locks, no stale-temp removal
            return fd, tmp
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Another save may have taken it for stale and removed it between mkstemp and flock
            # (it locks before unlinking, so it is gone by now if it did): take a new one then.
            if os.fstat(fd).st_nlink > 0:
                return fd, tmp
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)


def _remove_stale_temps(real: str) -> None:
    """Remove the temporary files that killed saves to ``real`` left beside it (a save killed
    between writing and renaming leaves one as large as the cache). Only names that our saves
    give their temporaries for this very file are considered, only regular files, and only
    those no live save holds locked: a save keeps its temporary flock'ed until the rename."""
    if fcntl is None:           # pragma: no cover - cannot tell a live writer's file apart
        return
    directory = os.path.dirname(real)
    prefix = _temp_prefix(real)
    try:
        names = [n for n in os.listdir(directory) if _is_our_temp(n, prefix)]
    except OSError:
        return
    for name in names:
        stale = os.path.join(directory, name)
        try:
            fd = os.open(stale, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:         # gone already, a symbolic link, unreadable: not ours to judge
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:     # a live save is writing it
                continue
            # Locked by us now; unlink only if the name still refers to this very file.
            if os.path.samestat(os.fstat(fd), os.stat(stale, follow_symlinks=False)):
                os.unlink(stale)
        except OSError:
            pass
        finally:
            os.close(fd)


def _fsync_dir(directory: str) -> None:
    # Persist the rename. Not possible on every platform/file system (Windows has no O_RDONLY
    # directory handles); the data itself is already on disk then.
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)

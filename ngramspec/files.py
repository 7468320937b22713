"""Opening an input file that must be a regular file: a FIFO, a device or a directory named as
a cache file, a trace or a chat log is refused at once instead of blocking forever (a FIFO
with no writer) or never ending (``/dev/zero``).

Notes
-----
Thread-safety: stateless.
"""
from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

__all__ = ["NotRegularFileError", "file_kind", "open_regular"]

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

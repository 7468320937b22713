"""The two files of ``ngramspec run-batch``: the request lines read, the result file owned.

* `request_lines`: the input streamed as bytes, split on ``\\n`` only (a ``\\r`` inside a line
  is the line's own byte, as JSON allows), each line's number kept; a line longer than the
  body limit is reported by its length and never held in memory.
* `ResultFile`: the output, locked (``flock``) for the whole run so that a second run on the
  same file fails at once instead of writing every result twice; its lines are checked to be
  this command's result lines before anything in it is changed, so that ``-o`` naming some
  other file (a settings file, the request file itself) is refused with the file untouched.
  Only a cut last line that is itself the start of a result line (a write cut by ``kill -9``)
  is ever removed, and only when the run begins writing.

Notes
-----
Memory: one line at a time (the input's lines are bounded by the body limit; a result line is
one response).

Thread-safety: a `ResultFile` is used by one thread (the run's event loop); the lock keeps
other processes (and other `ResultFile` objects) off the file.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from typing import Iterator, Optional, Set, Tuple, Union

from ngramspec.files import open_regular, same_file

try:
    import fcntl
except ImportError:     # pragma: no cover - non-POSIX: no lock
    fcntl = None

__all__ = ["LineTooLong", "ResultFile", "request_lines"]

#: Every result line starts so (``json.dumps`` of `ngramspec.server.batch`'s result dict).
RESULT_PREFIX = b'{"id": "batch_req_'
_CHUNK = 1 << 16
_BOM = b"\xef\xbb\xbf"


class LineTooLong:
    """An input line over the limit: its length in bytes (the line itself was skipped)."""

    def __init__(self, size: int):
        self.size = size


def request_lines(path: str, max_line: int) -> Iterator[Tuple[int, Union[bytes, LineTooLong]]]:
    """``(line number, bytes)`` of each non-blank line of the file at ``path`` (1-based; the
    ``\\n`` and a first line's UTF-8 byte-order mark removed), or ``(line number,
    LineTooLong)`` for a line longer than ``max_line`` bytes, which is skipped unread.

    Raises
    ------
    OSError
        The file cannot be read; `ngramspec.files.NotRegularFileError` for a FIFO or device.
    """
    with open_regular(path, "batch requests") as fh:
        lineno = 0
        while True:
            raw = fh.readline(max_line + 2)     # the line, its "\n" and one byte to tell
            if not raw:
                return
            lineno += 1
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if not raw.endswith(b"\n") and len(raw) > max_line:
                yield lineno, LineTooLong(len(raw) + _skip_line(fh))
                continue
            raw = raw.rstrip(b"\n")
            if raw.strip():
                yield lineno, raw


def _skip_line(fh) -> int:
    """Read past the rest of a line, a chunk at a time; the bytes skipped (its "\\n" not
    counted)."""
    n = 0
    while True:
        chunk = fh.readline(_CHUNK)
        if not chunk:
            return n
        if chunk.endswith(b"\n"):
            return n + len(chunk) - 1
        n += len(chunk)


class ResultFile:
    """``run-batch``'s output file: locked, checked, then appended to.

    Parameters
    ----------
    path : str
        The output (``-o``); created when missing.
    input_path : str
        The request file (``-i``); an output that is the same file (the same device and inode:
        symbolic and hard links included) is refused.

    Attributes
    ----------
    done_ids : set of str
        The custom_ids the file already answers.
    done_lines : set of int
        Input line numbers of the id-less lines it answers (a line without a usable custom_id).

    Raises
    ------
    ValueError
        The output is the input, is locked by another run, or holds a line that is not a
        result line (nothing in it changed then).
    OSError
        It cannot be opened; `ngramspec.files.NotRegularFileError` for a directory, FIFO or
        device.

    Notes
    -----
    Memory: the custom_ids; the file is read one line at a time.

    Thread-safety: one thread at a time; the exclusive ``flock`` held until `close` keeps
    every other run off the file.
    """

    def __init__(self, path: str, input_path: str):
        self.path = path
        self.done_ids: Set[str] = set()
        self.done_lines: Set[int] = set()
        self.error: Optional[OSError] = None
        self._refuse_input(input_path)
        self._created = not os.path.lexists(path)
        # O_NONBLOCK: a FIFO must not block the open; only a regular file is kept
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), 0o666)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"-o {path}: is not a regular file: results are written to "
                                 f"regular files only")
            os.set_blocking(fd, True)
            self._lock(fd)
            # read through a buffered duplicate; written with os.write (a failed write leaves
            # nothing buffered behind to fail again at close)
            with open(os.dup(fd), "rb") as reader:
                self._end = self._scan(reader)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _refuse_input(self, input_path: str) -> None:
        if same_file(input_path, self.path):
            raise ValueError(f"-o {self.path} is the input file -i {input_path} (the same "
                             "file): results must go to another file")

    def _lock(self, fd: int) -> None:
        if fcntl is None:       # pragma: no cover - non-POSIX
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise ValueError(f"-o {self.path}: another run-batch is writing this file (it is "
                             "locked); wait for it to finish, or choose another -o") from None

    def _scan(self, fh) -> int:
        """Read the existing results, a line at a time; the offset after the last complete
        line. Each line's first bytes are checked before the rest is read, so another kind of
        file is refused without reading it whole."""
        end, n = 0, 0
        while True:
            raw = fh.readline(len(RESULT_PREFIX))
            if not raw:
                return end
            n += 1
            if raw.strip() and not (raw.startswith(RESULT_PREFIX) or
                                    (RESULT_PREFIX.startswith(raw) and not raw.endswith(b"\n"))):
                raise self._foreign(n)
            if not raw.endswith(b"\n"):
                raw += fh.readline()
            if not raw.endswith(b"\n"):
                return end              # a result line cut mid-write: dropped by `start`
            end += len(raw)
            if raw.strip():
                self._take(raw, n)

    def _foreign(self, n: int) -> ValueError:
        return ValueError(f"-o {self.path}: line {n} is not a batch result line (id "
                          "batch_req_*, custom_id, and response or error): is it the output of "
                          "another command? It was left as it was")

    def _take(self, raw: bytes, n: int) -> None:
        obj = _result_line(raw)
        if obj is None:
            raise self._foreign(n)
        cid = obj["custom_id"]
        if isinstance(cid, str):
            self.done_ids.add(cid)
        else:
            line = (obj.get("error") or {}).get("line")
            if isinstance(line, int):
                self.done_lines.add(line)

    def is_done(self, cid: Optional[str], lineno: int) -> bool:
        """Whether the file already answers this input line."""
        return cid in self.done_ids if cid is not None else lineno in self.done_lines

    def start(self) -> None:
        """Drop a cut last result line (the only change ever made to what was there) and
        append from there on."""
        os.ftruncate(self._fd, self._end)
        os.lseek(self._fd, self._end, os.SEEK_SET)

    def write(self, obj: dict) -> bool:
        """Append one result line (one unbuffered write). False, and nothing written any more,
        once a write failed (a full disk: `error` holds it, the run stops)."""
        if self.error is not None:
            return False
        try:
            line = json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n"
        except UnicodeEncodeError:  # an unpaired surrogate (a custom_id's "\ud800"): escaped
            line = json.dumps(obj).encode("ascii") + b"\n"
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            self.error = exc
            return False
        return True

    def close(self) -> None:
        """Release the lock and the file; a file this object created and nothing was written
        to is removed (a run that failed before its first result leaves no empty file)."""
        if self._fd < 0:
            return
        try:
            if self._created and os.fstat(self._fd).st_size == 0 and \
                    os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                os.unlink(self.path)        # still locked: no other run is using it
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = -1


def _result_line(raw: bytes) -> Optional[dict]:
    """The result dict of one output line, or None if it is not one."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    rid, cid = obj.get("id"), obj.get("custom_id", 0)
    if not (isinstance(rid, str) and rid.startswith("batch_req_")):
        return None
    if not (cid is None or isinstance(cid, str)):
        return None
    if obj.get("response") is None and obj.get("error") is None:
        return None
    return obj

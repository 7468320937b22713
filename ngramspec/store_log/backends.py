"""Store-log backends without a server: in-process (tests, benchmarks) and a directory (the
processes of one host).

A backend is an append-only log of byte entries, bounded (the oldest entries trimmed), that
any number of readers follow by position:

* ``append(blobs, max_entries, max_bytes)`` adds entries in order and trims the log to at most
  `max_entries` entries (`MemoryLog`) or about `max_bytes` bytes (`DirectoryLog`);
* ``read(after, count)`` returns ``(entries, position, gap)``: up to `count` blobs after
  position `after` (None: from the oldest kept), the position after them, and whether entries
  were trimmed before this reader got to them;
* ``close()``;
* ``name``: what it is called in the replica's messages (its ``--store`` spec, a path, a URL).

A backend that cannot be reached raises `LogUnavailable`; the replica retries.
"""
from __future__ import annotations

import os
import struct
import threading
from typing import Protocol, runtime_checkable

__all__ = ["DirectoryLog", "LogUnavailable", "MemoryLog", "StoreLog", "memory_log"]


@runtime_checkable
class StoreLog(Protocol):
    """What a replica needs of a store-log backend (the module's docstring describes each
    part); `MemoryLog`, `DirectoryLog` and `ngramspec.store_log.redis_log.RedisLog` have it."""

    name: str

    def append(self, blobs, max_entries: int, max_bytes: int = 0) -> None: ...

    def read(self, after, count: int): ...

    def close(self) -> None: ...


class LogUnavailable(ConnectionError):
    """The log could not be reached or written (the replica keeps drafting and retries)."""


class MemoryLog:
    """An in-process log (tests and ``python bench fleet``).

    Positions are entry numbers since the log was made.

    Notes
    -----
    Memory: the kept entries (`append`'s bound).

    Thread-safety: a lock protects the list; any number of appending and reading threads.
    """

    def __init__(self, name: str = "MemoryLog"):
        self.name = name
        self._entries: list = []
        self._base = 0                      # number of the first kept entry
        self._lock = threading.Lock()

    def append(self, blobs, max_entries: int, max_bytes: int = 0) -> None:
        with self._lock:
            self._entries.extend(blobs)
            extra = len(self._entries) - max(1, max_entries)
            if extra > 0:
                del self._entries[:extra]
                self._base += extra

    def read(self, after, count: int):
        with self._lock:
            start = self._base if after is None else after
            gap = start < self._base
            start = max(start, self._base)
            out = self._entries[start - self._base:start - self._base + count]
            return out, start + len(out), gap

    def close(self) -> None:
        pass


_NAMED: dict = {}
_NAMED_LOCK = threading.Lock()


def memory_log(name: str) -> MemoryLog:
    """The process's in-process log called `name` (``memory:NAME``), made on first use."""
    with _NAMED_LOCK:
        if name not in _NAMED:
            _NAMED[name] = MemoryLog(f"memory:{name}")
        return _NAMED[name]


_FRAME = struct.Struct("<I")
#: Largest entry a directory log frames (bytes): a frame header above it is garbage.
MAX_ENTRY_BYTES = 1 << 28
#: Segments a directory log keeps: trimming drops whole segments, so the log holds between
#: (SEGMENTS - 1) / SEGMENTS and 1 times its byte bound.
SEGMENTS = 8
_READ_CHUNK = 1 << 20


class DirectoryLog:
    """A log in a directory, for the processes of one host (``dir:PATH``).

    Entries are framed (u32 length + bytes) in numbered segment files ``NNNNNNNNNNNN.seg``.
    A writer appends under an exclusive ``flock`` of ``PATH/lock`` with one ``write`` on an
    ``O_APPEND`` descriptor, starts a new segment when the newest holds ``max_bytes /
    SEGMENTS``, and deletes the oldest past `SEGMENTS`. Readers take no lock: they read
    whole frames only (a frame still being written is read on the next call) and jump to the
    oldest segment when theirs was deleted (a gap). Positions are ``(segment, offset)``.

    A frame whose length is above `MAX_ENTRY_BYTES` (a foreign or broken file) makes the
    reader skip the rest of that segment; the entry is returned as ``None`` (counted as
    skipped by the replica).

    Notes
    -----
    Memory: one read chunk (1 MiB, or one entry when larger) per call.

    Thread-safety: processes and threads coordinate through the file lock; one object may be
    used by several threads.
    """

    def __init__(self, path):
        self.path = self.name = os.fspath(path)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise LogUnavailable(f"{self.path}: {exc.strerror}") from exc

    def _segments(self) -> list:
        try:
            names = os.listdir(self.path)
        except OSError as exc:
            raise LogUnavailable(f"{self.path}: {exc.strerror}") from exc
        return sorted(int(n[:-4]) for n in names if n.endswith(".seg") and n[:-4].isdigit())

    def _seg_path(self, number: int) -> str:
        return os.path.join(self.path, f"{number:012d}.seg")

    def append(self, blobs, max_entries: int = 0, max_bytes: int = 1 << 30) -> None:
        import fcntl
        data = b"".join(_FRAME.pack(len(b)) + bytes(b) for b in blobs)
        if not data:
            return
        seg_bytes = max(4096, max_bytes // SEGMENTS)
        try:
            lock_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
                segs = self._segments() or [1]
                newest = segs[-1]
                if os.path.exists(self._seg_path(newest)) and \
                        os.path.getsize(self._seg_path(newest)) >= seg_bytes:
                    newest += 1
                    segs.append(newest)
                fd = os.open(self._seg_path(newest), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                             0o644)
                try:
                    view = memoryview(data)
                    while view:                  # a short write continues where it stopped
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                for old in segs[:-SEGMENTS]:
                    try:
                        os.unlink(self._seg_path(old))
                    except FileNotFoundError:
                        pass
            finally:
                os.close(lock_fd)      # releases the flock
        except OSError as exc:
            raise LogUnavailable(f"{self.path}: {exc.strerror or exc}") from exc

    def read(self, after, count: int):
        segs = self._segments()
        if not segs:
            return [], after, False
        seg, off = after if after is not None else (segs[0], 0)
        gap = False
        if seg < segs[0]:
            seg, off, gap = segs[0], 0, after is not None
        out: list = []
        while len(out) < count:
            try:
                with open(self._seg_path(seg), "rb") as f:
                    f.seek(off)
                    off = self._frames(f, off, count - len(out), out)
            except FileNotFoundError:      # trimmed while we read: start at the oldest
                segs = self._segments()
                if not segs or segs[0] <= seg:
                    break
                seg, off, gap = segs[0], 0, True
                continue
            except OSError as exc:
                raise LogUnavailable(f"{self.path}: {exc.strerror or exc}") from exc
            newer = [s for s in self._segments() if s > seg]
            if len(out) < count and newer and self._at_end(seg, off):
                seg, off = newer[0], 0
                continue
            break
        return out, (seg, off), gap

    def _at_end(self, seg: int, off: int) -> bool:
        try:
            return off >= os.path.getsize(self._seg_path(seg))
        except FileNotFoundError:
            return True

    @staticmethod
    def _frames(f, off: int, count: int, out: list) -> int:
        """Append up to `count` whole frames from `f` (at `off`) to `out`; the new offset."""
        buf = f.read(_READ_CHUNK)
        pos = 0
        while count > 0 and len(buf) - pos >= _FRAME.size:
            (n,) = _FRAME.unpack_from(buf, pos)
            if n > MAX_ENTRY_BYTES:              # not a frame: give up on this segment
                out.append(None)
                f.seek(0, os.SEEK_END)
                return f.tell()
            if len(buf) - pos - _FRAME.size < n:
                if pos == 0 and n + _FRAME.size > len(buf):
                    more = f.read(n + _FRAME.size - len(buf))
                    buf += more
                    if len(buf) - _FRAME.size >= n:
                        continue
                break
            out.append(buf[pos + _FRAME.size:pos + _FRAME.size + n])
            pos += _FRAME.size + n
            count -= 1
        return off + pos

    def close(self) -> None:
        pass

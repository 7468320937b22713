"""llama.cpp's n-gram cache files: load, atomic save, and the dynamic cache that outlives a run.

File format (``common_ngram_cache_save`` / ``_load``; little-endian), one record per n-gram::

    int32 tokens[4]     the n-gram, 1..4 token ids, unused tail = -1
    int32 N             number of distinct next tokens, > 0
    N x (int32 token, int32 count)    count > 0

Records are loaded in file order, which fixes the tie order of the drafts (spec 6.4), and files
written by llama.cpp (``llama-lookup-create``, ``llama-lookup-merge``, ``llama-lookup``) load
as they are. Saving writes llama.cpp's record order.

A save never leaves a broken file in place of a good one: the data goes to a temporary file in
the same directory, is flushed and fsync'ed, then renamed over the target (atomic on POSIX), and
the directory is fsync'ed so the rename itself survives a power loss.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterable, Iterator, Sequence, Union

from ngramspec._cache import CacheFileError, NgramCache

__all__ = ["CacheFileError", "NgramCache", "load_cache", "save_cache", "atomic_write_bytes",
           "merge_into_dynamic", "build_static_cache", "as_path"]

PathLike = Union[str, "os.PathLike[str]"]

# n-gram sizes of llama.cpp's caches: context/dynamic 1..4 (LLAMA_NGRAM_MIN/MAX), static 2.
NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2


def as_path(name: str, value, also: str = "") -> str:
    """`value` (str or os.PathLike) as a str path; a TypeError naming the parameter `name`
    otherwise (`also` names what else that parameter accepts)."""
    if isinstance(value, (str, os.PathLike)):
        return os.fsdecode(os.fspath(value))
    raise TypeError(f"{name} must be a file path (str or os.PathLike){also}, got "
                    f"{type(value).__name__}")


def load_cache(path: PathLike) -> NgramCache:
    """Load an n-gram cache file.

    Raises FileNotFoundError (or another OSError) if it cannot be read, and `CacheFileError`
    (a ValueError naming the file and the byte offset) if it is truncated or corrupt.

    Memory: the file's bytes are held while parsing, on top of the cache itself (roughly 5x
    the file size).

    Thread-safety: parsing runs without the GIL; the returned cache is new and unshared.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    return NgramCache.from_bytes(data, source=path)


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file in the same directory, flush,
    fsync, rename, fsync the directory. On any failure the temp file is removed and the old
    file, if any, is left untouched. A new file gets the usual 0666 & ~umask mode; an existing
    file keeps its mode."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    # same directory: rename(2) is only atomic within one file system
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


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


def save_cache(cache: NgramCache, path: PathLike) -> None:
    """Write ``cache`` to ``path`` in llama.cpp's format, atomically (see `atomic_write_bytes`).

    Memory: the serialized file (20 bytes per n-gram + 8 per entry) is built in memory first.

    Thread-safety: serialization runs without the GIL and only reads ``cache``.
    """
    atomic_write_bytes(path, cache.to_bytes())


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive advisory lock on ``path + '.lock'`` (POSIX), so that two processes merging
    into the same dynamic cache do not lose each other's counts. No-op where flock is missing."""
    try:
        import fcntl
    except ImportError:     # pragma: no cover - non-POSIX
        yield
        return
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)    # closing releases the lock


def merge_into_dynamic(path: PathLike, tokens: Union[Sequence[int], NgramCache],
                       ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX) -> NgramCache:
    """Merge one generation's n-grams into the dynamic cache file ``path`` (created if absent).

    ``tokens`` is the generation's token stream (prompt + output): its n-grams of size
    ngram_min..ngram_max are counted (``common_ngram_cache_update``) and added to the file's
    counts (``common_ngram_cache_merge``), as llama.cpp's ``lookup`` example does at exit. An
    `NgramCache` (e.g. `NgramCacheProposer.context_cache`) is merged as it is. Returns the
    merged cache. The file is rewritten atomically under an exclusive lock, so a crash leaves
    the previous version and concurrent merges do not lose counts.

    Memory: the whole dynamic cache is loaded, merged and re-serialized.

    Thread-safety: safe across threads and processes (file lock); the returned cache is new.
    """
    path = os.fspath(path)
    if isinstance(tokens, NgramCache):
        add = tokens
    else:
        add = NgramCache()
        add.update(tokens, ngram_min, ngram_max)
    with _locked(path):
        try:
            cache = load_cache(path)
        except FileNotFoundError:
            cache = NgramCache()
        cache.merge(add)
        save_cache(cache, path)
    return cache


def build_static_cache(sequences: Iterable[Sequence[int]], ngram_size: int = NGRAM_STATIC,
                       progress=None) -> NgramCache:
    """A static cache as ``llama-lookup-create`` builds it: the ``ngram_size``-grams (2) of
    each sequence, none crossing from one sequence to the next. ``progress(i)`` is called
    after the i-th sequence (1-based) if given.

    Memory: one cache; each sequence is converted to int32 once.

    Thread-safety: hashing runs without the GIL; the returned cache is new.
    """
    cache = NgramCache()
    for i, seq in enumerate(sequences, 1):
        cache.update(seq, ngram_size, ngram_size)
        if progress is not None:
            progress(i)
    return cache

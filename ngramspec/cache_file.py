"""llama.cpp's n-gram cache files: load, atomic save, and the dynamic cache that outlives a run.

File format (``common_ngram_cache_save`` / ``_load``; little-endian), one record per n-gram::

    int32 tokens[4]     the n-gram, 1..4 token ids, unused tail = -1
    int32 N             number of distinct next tokens, > 0
    N x (int32 token, int32 count)    count > 0

Records are loaded in file order, which fixes the tie order of the drafts
(``common_ngram_cache_draft`` breaks ties in the iteration order of libstdc++'s
``unordered_map``, set by the insertion history), and files
written by llama.cpp (``llama-lookup-create``, ``llama-lookup-merge``, ``llama-lookup``) load
as they are. Saving writes llama.cpp's record order.

A save never leaves a broken file in place of a good one: the data goes to a temporary file in
the same directory, is flushed and fsync'ed, then renamed over the target (atomic on POSIX), and
the directory is fsync'ed so the rename itself survives a power loss. Saves write regular files
only (a symbolic link's target is replaced, a device or directory is refused), and the next
save removes the temporary files of saves that were killed before their rename.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import Iterable, Iterator, Sequence, Union

from ngramspec._cache import CacheFileError, NgramCache
from ngramspec.files import NotRegularFileError, not_regular, open_regular

try:
    import fcntl
except ImportError:     # pragma: no cover - non-POSIX
    fcntl = None

__all__ = ["CacheFileError", "NgramCache", "load_cache", "save_cache", "atomic_write_bytes",
           "merge_into_dynamic", "build_static_cache", "as_path", "NotRegularFileError"]

PathLike = Union[str, "os.PathLike[str]"]

# n-gram sizes of llama.cpp's caches: context/dynamic 1..4 (LLAMA_NGRAM_MIN/MAX), static 2.
NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2


def as_path(name: str, value, also: str = "") -> str:
    """`value` as a str path.

    Parameters
    ----------
    name : str
        The parameter to name in the error.
    value : str or os.PathLike
    also : str
        What else the parameter accepts, appended to the error (``" or an NgramCache"``).

    Returns
    -------
    str

    Raises
    ------
    TypeError
        `value` is not a path.
    """
    if isinstance(value, (str, os.PathLike)):
        return os.fsdecode(os.fspath(value))
    raise TypeError(f"{name} must be a file path (str or os.PathLike){also}, got "
                    f"{type(value).__name__}")


def load_cache(path: PathLike) -> NgramCache:
    """Load an n-gram cache file (``common_ngram_cache_load``).

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    NgramCache
        A new cache, its records in file order.

    Raises
    ------
    FileNotFoundError, OSError
        The file cannot be read.
    NotRegularFileError
        A directory, FIFO, device or socket (which would block or never end).
    CacheFileError
        A truncated or corrupt file (a ValueError naming the file and the byte offset).

    Notes
    -----
    Memory: the file's bytes are held while parsing, on top of the cache itself (roughly 5x the
    file size).

    Thread-safety: parsing runs without the GIL; the returned cache is new and unshared.
    """
    path = os.fspath(path)
    with open_regular(path, "n-gram caches") as f:
        data = f.read()
    return NgramCache.from_bytes(data, source=path)


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


def _resolve_target(path: PathLike) -> str:
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
        raise not_regular(st.st_mode, "n-gram caches are saved to regular files only", where)
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


def save_cache(cache: NgramCache, path: PathLike) -> None:
    """Write `cache` to `path` in llama.cpp's format (``common_ngram_cache_save``), atomically.

    Parameters
    ----------
    cache : NgramCache
    path : str or os.PathLike
        Checked (`NotRegularFileError`) before the cache is serialized; written as
        `atomic_write_bytes` does.

    Raises
    ------
    NotRegularFileError, OSError
        As `atomic_write_bytes`.

    Notes
    -----
    Memory: the serialized file (20 bytes per n-gram + 8 per entry) is built in memory first.

    Thread-safety: serialization runs without the GIL and only reads `cache`.
    """
    real = _resolve_target(path)
    _write_regular(real, cache.to_bytes())


@contextlib.contextmanager
def _locked(real: str) -> Iterator[None]:
    """An exclusive advisory lock on ``real + '.lock'`` (POSIX), so that two processes merging
    into the same dynamic cache do not lose each other's counts. ``real`` is the resolved path
    (`_resolve_target`), so two paths to one file (a symbolic link and its target) take the
    same lock. No-op where flock is missing."""
    if fcntl is None:       # pragma: no cover - non-POSIX
        yield
        return
    # O_NOFOLLOW: a symbolic link planted at the lock's name is not followed (and not created)
    fd = os.open(real + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)    # closing releases the lock


def merge_into_dynamic(path: PathLike, tokens: Union[Sequence[int], NgramCache],
                       ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX) -> NgramCache:
    """Merge one generation's n-grams into the dynamic cache file `path` (created if absent).

    As llama.cpp's ``lookup`` example does at exit: the n-grams of `tokens` are counted
    (``common_ngram_cache_update``) and added to the file's counts (``common_ngram_cache_merge``).
    The file is rewritten atomically under an exclusive lock, so a crash leaves the previous
    version and concurrent merges do not lose counts. A symbolic link is followed (its target is
    updated) and the lock is taken on the target, so merges through different paths to one file
    exclude each other too.

    Parameters
    ----------
    path : str or os.PathLike
    tokens : sequence of int or NgramCache
        The generation's token stream (prompt + output), or a cache to merge as it is (e.g.
        ``NgramCacheProposer.context_cache``).
    ngram_min, ngram_max : int
        n-gram sizes counted from `tokens` (llama.cpp's ``LLAMA_NGRAM_MIN`` / ``_MAX``: 1 and 4).

    Returns
    -------
    NgramCache
        The merged cache, as written.

    Raises
    ------
    NotRegularFileError
        Anything but a regular file at the path.
    CacheFileError, OSError
        The existing file is corrupt or cannot be read or written.

    Notes
    -----
    Memory: the whole dynamic cache is loaded, merged and re-serialized.

    Thread-safety: safe across threads and processes (file lock); the returned cache is new.
    """
    if isinstance(tokens, NgramCache):
        add = tokens
    else:
        add = NgramCache()
        add.update(tokens, ngram_min, ngram_max)
    real = _resolve_target(path)
    with _locked(real):
        try:
            cache = load_cache(real)
        except FileNotFoundError:
            cache = NgramCache()
        cache.merge(add)
        _write_regular(real, cache.to_bytes())
    return cache


def build_static_cache(sequences: Iterable[Sequence[int]], ngram_size: int = NGRAM_STATIC,
                       progress=None) -> NgramCache:
    """A static cache as ``llama-lookup-create`` builds it.

    Parameters
    ----------
    sequences : iterable of sequence of int
        Each sequence's `ngram_size`-grams are counted; none crosses from one sequence to the
        next.
    ngram_size : int
        ``LLAMA_NGRAM_STATIC`` (2) by default.
    progress : callable, optional
        ``progress(i)`` is called after the i-th sequence (1-based).

    Returns
    -------
    NgramCache

    Notes
    -----
    Memory: one cache; each sequence is converted to int32 once.

    Thread-safety: hashing runs without the GIL; the returned cache is new.
    """
    cache = NgramCache()
    for i, seq in enumerate(sequences, 1):
        cache.update(seq, ngram_size, ngram_size)
        if progress is not None:
            progress(i)
    return cache

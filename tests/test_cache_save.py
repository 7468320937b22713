"""Saving n-gram cache files (issue 20, points 6 and 7): regular files only, symbolic links
followed, one lock per real file, temporaries of killed saves removed by the next save."""
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ngramspec._cache import NgramCache
from ngramspec.cache_file import (NotRegularFileError, _locked, _resolve_target,
                                  atomic_write_bytes, load_cache, merge_into_dynamic, save_cache)

from clitools import cli
from conftest import ROOT


def small_cache(tokens=(3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5)):
    c = NgramCache()
    c.update(list(tokens))
    return c


def temps(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


# --------------------------------------------------------------------------------------------
# Point 6: regular files only, links followed, the lock on the real file
# --------------------------------------------------------------------------------------------

def test_save_through_a_symlink_updates_its_target(tmp_path):
    target = tmp_path / "real.bin"
    link = tmp_path / "link.bin"
    save_cache(small_cache(), target)
    link.symlink_to("real.bin")
    save_cache(small_cache([7, 8, 7, 8]), link)
    assert link.is_symlink() and os.readlink(link) == "real.bin"
    assert load_cache(target).to_dict() == small_cache([7, 8, 7, 8]).to_dict()
    merge_into_dynamic(link, [7, 8])
    assert link.is_symlink()
    assert load_cache(target).to_dict()[(7,)] == {8: 3}
    assert sorted(os.listdir(tmp_path)) == ["link.bin", "real.bin", "real.bin.lock"]


def test_save_through_a_dangling_symlink_creates_the_target(tmp_path):
    (tmp_path / "sub").mkdir()
    link = tmp_path / "link.bin"
    link.symlink_to(tmp_path / "sub" / "new.bin")
    save_cache(small_cache(), link)
    assert link.is_symlink()
    assert load_cache(tmp_path / "sub" / "new.bin").to_dict() == small_cache().to_dict()


@pytest.mark.parametrize("kind", ["fifo", "directory", "link-to-fifo", "char-device"])
def test_save_refuses_what_is_not_a_regular_file(tmp_path, kind):
    path = tmp_path / "x.bin"
    if kind == "fifo":
        os.mkfifo(path)
        what = "FIFO"
    elif kind == "directory":
        path.mkdir()
        what = "directory"
    elif kind == "link-to-fifo":
        os.mkfifo(tmp_path / "fifo")
        path.symlink_to("fifo")
        what = "FIFO"
    else:
        # A link to /dev/null: the check must refuse it before any temporary file is made (as
        # root, the old code replaced the device node itself with a regular file).
        path.symlink_to("/dev/null")
        what = "character device"
    before = os.lstat(path)
    # the n-gram cache's saves and the one atomic writer (any output) refuse it alike
    for save, kind in ((lambda: save_cache(small_cache(), path), "n-gram caches"),
                       (lambda: atomic_write_bytes(path, b""), "outputs"),
                       (lambda: merge_into_dynamic(path, [1, 2, 3]), "n-gram caches")):
        with pytest.raises(NotRegularFileError, match=f"is a {what}: {kind} are saved "
                                                      f"to regular files only") as info:
            save()
        assert str(path) in str(info.value)
        assert isinstance(info.value, OSError)
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert temps(tmp_path) == []


def test_cli_merge_to_a_fifo_is_one_line_exit_2(tmp_path, capsys):
    src = tmp_path / "in.bin"
    save_cache(small_cache(), src)
    fifo = tmp_path / "out.bin"
    os.mkfifo(fifo)
    r = cli(capsys, "cache", "merge", src, "-o", fifo)
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and str(fifo) in r.stderr and "FIFO" in r.stderr, r.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_two_paths_to_one_file_take_one_lock(tmp_path):
    """A merge through a symbolic link waits for the lock held on its target (and the other
    way round): both paths lock the resolved file."""
    target = tmp_path / "dyn.bin"
    link = tmp_path / "alias.bin"
    link.symlink_to(target)
    for held, other in ((target, link), (link, target)):
        done = threading.Event()
        with _locked(_resolve_target(held)):
            t = threading.Thread(target=lambda: (merge_into_dynamic(other, [1, 2]), done.set()))
            t.start()
            assert not done.wait(0.5), "the merge did not wait for the lock"
        t.join(30)
        assert done.is_set()
    assert load_cache(target).to_dict()[(1,)] == {2: 2}
    assert sorted(os.listdir(tmp_path)) == ["alias.bin", "dyn.bin", "dyn.bin.lock"]


# --------------------------------------------------------------------------------------------
# Point 7: the temporaries of killed saves are removed by the next save, live ones are not
# --------------------------------------------------------------------------------------------

# A child that saves a 20k-token cache to argv[1] and stops after writing its temporary file:
# "kill" SIGKILLs itself there, "hang" waits (a live writer) after printing "written".
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from ngramspec._cache import NgramCache
    from ngramspec.cache_file import save_cache
    real_fsync = os.fsync
    def stop(fd):
        real_fsync(fd)
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("written", flush=True)
        time.sleep(600)
    os.fsync = stop
    c = NgramCache()
    c.update(list(range(20000)))
    save_cache(c, sys.argv[1])
""")


def test_next_save_removes_the_temporary_of_a_killed_save(tmp_path):
    path = tmp_path / "c.bin"
    save_cache(small_cache(), path)
    good = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), "kill"], timeout=120,
                          cwd=ROOT)
    assert proc.returncode == -9
    left = temps(tmp_path)
    assert len(left) == 1 and left[0].startswith(".c.bin.")     # what kill -9 leaves behind
    assert os.path.getsize(tmp_path / left[0]) > 20000 * 20
    assert path.read_bytes() == good
    save_cache(small_cache([1, 2]), path)
    assert temps(tmp_path) == []
    assert load_cache(path).to_dict() == small_cache([1, 2]).to_dict()


def test_merge_removes_stale_temporaries_and_keeps_others(tmp_path):
    path = tmp_path / "dyn.bin"
    stale = tmp_path / ".dyn.bin.ab_3xyz9.tmp"
    stale.write_bytes(b"x" * 1000)
    keep = [".dyn.bin.abc.tmp",            # not mkstemp's 8 random characters
            "dyn.bin.ab_3xyz9.tmp",        # no leading dot
            ".dyn.bin.AB_3XYZ9.tmp",       # not mkstemp's alphabet
            ".other.bin.ab_3xyz9.tmp",     # another file's temporary
            ".dyn.bin.ab_3xyz9.tmp.tmp"]
    for name in keep:
        (tmp_path / name).write_bytes(b"y")
    (tmp_path / ".dyn.bin.dir12345.tmp").mkdir()           # not a regular file
    (tmp_path / ".dyn.bin.lnk12345.tmp").symlink_to(tmp_path / ".dyn.bin.abc.tmp")
    merge_into_dynamic(path, [1, 2, 3])
    assert not stale.exists()
    assert sorted(keep + [".dyn.bin.dir12345.tmp", ".dyn.bin.lnk12345.tmp"]) == temps(tmp_path)


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    path = tmp_path / "c.bin"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), "hang"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "written\n"
        live = temps(tmp_path)
        assert len(live) == 1
        save_cache(small_cache(), path)                 # another writer saves meanwhile
        assert temps(tmp_path) == live                  # ... and leaves the live one alone
        assert load_cache(path).to_dict() == small_cache().to_dict()
    finally:
        proc.kill()
        proc.wait(30)
    # killed now: its temporary is stale, and the next save removes it
    atomic_write_bytes(path, small_cache([4, 5]).to_bytes())
    assert temps(tmp_path) == []
    assert load_cache(path).to_dict() == small_cache([4, 5]).to_dict()


def test_concurrent_saves_never_remove_each_others_temporaries(tmp_path):
    """Four threads save to one file 25 times each while removing stale temporaries: no save
    fails (a removed live temporary would make its rename fail) and none is left over."""
    path = tmp_path / "c.bin"
    errors = []

    def work(i):
        try:
            for k in range(25):
                save_cache(small_cache([i, k, i, k]), path)
        except Exception as exc:    # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert temps(tmp_path) == []
    assert load_cache(path).to_dict() in [small_cache([i, k, i, k]).to_dict()
                                          for i in range(4) for k in range(25)]


@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "directory"])
def test_loading_reads_regular_files_only(tmp_path, what):
    """A FIFO without a writer, an endless device or a directory as a cache file: a clear
    error at once, naming the path, instead of blocking or reading forever."""
    from ngramspec.cache_file import load_cache
    if what == "fifo":
        path = tmp_path / "cache.bin"
        os.mkfifo(path)
    elif what == "directory":
        path = tmp_path
    else:
        path = what
    with pytest.raises(NotRegularFileError, match="read from regular files only") as info:
        load_cache(path)
    assert str(path) in str(info.value)

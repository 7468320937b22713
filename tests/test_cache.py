"""ngram-cache (spec section 6): golden parity, cache files, the ``cache`` CLI.

The draft logic is also checked against a small Python reference written from spec 6.3; the
reference keeps its own counts (compared with the kernel's) and takes only the tie order, which
no formula describes (libstdc++'s unordered_map iteration, spec 6.4), from the real container.
"""
import gzip
import json
import os
import stat
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramspec import SpecEngine
from ngramspec._cache import CacheFileError, NgramCache, NgramCacheProposer, _draft_once
from ngramspec.cache_file import (atomic_write_bytes, build_static_cache, load_cache,
                                  merge_into_dynamic, save_cache)
from ngramspec.loop import run_recorded
from ngramspec.registry import build_proposers
from ngramspec.traces import read_requests

from conftest import GOLDEN, TRACES
from clitools import cli
from golden import check_golden, read_golden
from reference import drive_recorded

@pytest.fixture(scope="module")
def code_edit():
    return read_requests(str(TRACES / "code-edit.jsonl.gz"), 150)


CACHE_FILES = sorted(p for p in GOLDEN.glob("*.jsonl.gz") if ".cache-" in p.name)
STATIC_BIN = GOLDEN / "static-cache-code-edit.bin"


# --------------------------------------------------------------------------------------------
# Golden parity
# --------------------------------------------------------------------------------------------

def test_cache_golden_files_present():
    assert len(CACHE_FILES) == 12, f"expected 12 ngram-cache golden files in {GOLDEN}"
    assert STATIC_BIN.is_file()


@pytest.mark.parametrize("path", CACHE_FILES, ids=lambda p: p.name.replace(".jsonl.gz", ""))
def test_cache_golden(path):
    """Through the engine and the replay driver: drafts, steps, per-request figures, summary and
    llama.cpp's counters."""
    check_golden(path, GOLDEN, TRACES)


@pytest.mark.parametrize("state", ["shared", "fresh"])
def test_cache_golden_kernel_only(state, code_edit):
    """The kernel built directly (not from the registry) on the static-cache file: one loaded
    cache shared by every fresh proposer, `reset` standing in for a new proposer."""
    header, expected = read_golden(GOLDEN / f"code-edit.cache-static.{state}.jsonl.gz")
    requests = code_edit[:len(expected)]
    p = NgramCacheProposer(1, static=load_cache(STATIC_BIN))
    engine = SpecEngine.from_proposers([p])
    for req, want in zip(requests, expected):
        if state == "fresh":
            p.reset()
        loop = run_recorded(engine, 0, req.prompt, req.output, record_drafts=True)
        assert loop.drafts == want["drafts"]
        assert loop.steps == want["steps"]


# --------------------------------------------------------------------------------------------
# Python reference (spec 6.2 / 6.3), tie order from the container
# --------------------------------------------------------------------------------------------

LAX = ((2, 2, 1, 1), (66, 50, 50, 50))
STRICT = ((4, 3, 2, 2), (75, 66, 66, 66))


def i32(x):
    """int32 wraparound, as the compiled llama.cpp computes its products and sums."""
    return (x + 2**31) % 2**32 - 2**31


def ref_update(counts, seq, nmin=1, nmax=4):
    for size in range(nmin, nmax + 1):
        for i in range(size, len(seq)):
            part = counts.setdefault(tuple(seq[i - size:i]), {})
            part[seq[i]] = part.get(seq[i], 0) + 1


def ref_try_primary(counts, real, grams, part_static, thresholds):
    min_n, min_pct = thresholds
    for i in range(len(grams) - 1, -1, -1):
        part = counts.get(grams[i])
        if part is None:
            continue
        order = [t for t, _ in real.get(grams[i])]     # iteration order of the real container
        assert sorted(order) == sorted(part)
        best, maxc, maxs, total = None, 0, 0, 0
        for tok in order:
            c = part[tok]
            s = i32(100 * part_static[tok]) if tok in part_static else 1
            if i32(c * s) > i32(maxc * maxs):
                best, maxc, maxs = tok, c, s
            total = i32(total + c)
        if total < min_n[i] or i32(100 * maxc) < i32(min_pct[i] * total):
            continue
        if best is not None:
            return best
    return None


def ref_try_static(sta_counts, sta_real, gram):
    part = sta_counts.get(gram)
    if part is None:
        return None
    best, maxc, total = None, 0, 0
    for tok, _ in sta_real.get(gram):
        if part[tok] > maxc:
            best, maxc = tok, part[tok]
        total = i32(total + part[tok])
    if total < 2 or i32(100 * maxc) < i32(50 * total):
        return None
    return best


def ref_draft(ctx, ctx_real, dyn, dyn_real, sta, sta_real, inp, sampled):
    x = list(inp) + [sampled]
    if len(x) < 2:
        return []
    draft = []
    while len(draft) < 8:
        grams = [tuple(x[-s:]) for s in range(1, min(4, len(x)) + 1)]   # sizes past the start
        part_static = sta.get(grams[1], {})                             # do not exist (6.4 #3)
        t = ref_try_primary(ctx, ctx_real, grams, part_static, LAX)
        if t is None:
            t = ref_try_primary(dyn, dyn_real, grams, part_static, STRICT)
        if t is None:
            t = ref_try_static(sta, sta_real, grams[1])
        if t is None:
            break
        draft.append(t)
        x.append(t)
    return draft


tokens_st = st.lists(st.integers(0, 5), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(tokens_st, tokens_st), min_size=1, max_size=3),
       static_seq=tokens_st, dynamic_seq=tokens_st)
def test_kernel_matches_reference(requests, static_seq, dynamic_seq):
    """Random streams over a 6-token alphabet (so n-grams repeat and ties abound), several
    requests on one slot (shared state: cache_size carries over), tiny contexts included."""
    sta_counts, dyn_counts = {}, {}
    ref_update(sta_counts, static_seq, 2, 2)
    ref_update(dyn_counts, dynamic_seq, 1, 4)
    sta = NgramCache()
    sta.update(static_seq, 2, 2)
    dyn = NgramCache()
    dyn.update(dynamic_seq, 1, 4)
    assert sta.to_dict() == sta_counts and dyn.to_dict() == dyn_counts
    p = NgramCacheProposer(1, static=sta, dynamic=dyn)
    ctx, cache_size = {}, 0

    def draft(cache, sampled):
        nonlocal cache_size
        if cache_size < len(cache) + 1:
            ref_update(ctx, cache[cache_size:] + [sampled])
            cache_size = len(cache) + 1
        got = _draft_once(p, 0, np.asarray(cache, dtype=np.int32), sampled)
        real = p.context_cache(0)
        assert real.to_dict() == ctx
        assert p.cache_size(0) == cache_size
        assert got == ref_draft(ctx, real, dyn_counts, dyn, sta_counts, sta, cache, sampled)
        return got

    for prompt, output in requests:
        for _ in drive_recorded(prompt, output, draft):
            pass


# --------------------------------------------------------------------------------------------
# Proposer behaviour
# --------------------------------------------------------------------------------------------

def test_libstdcxx_iteration_order_canary():
    """Ties follow libstdc++'s unordered_map<int32, int32> iteration order (spec 6.4). This is
    the order g++/libstdc++ gives for this insertion sequence (bucket-dependent, not simply the
    reverse of insertion); another C++ library (e.g. libc++) would fail here, and the golden
    files with it."""
    c = NgramCache()
    c.update([5, 1, 5, 14, 5, 27, 5, 3, 5, 40, 5, 1, 5, 100, 5, 7, 5, 55, 5, 8, 5, 13, 5, 2], 1, 1)
    assert [t for t, _ in c.get((5,))] == [2, 13, 8, 7, 100, 55, 3, 40, 27, 14, 1]


def test_tiny_contexts_are_deterministic():
    """len(E) in {2, 3}: llama.cpp reads before the buffer (UB); here the n-gram sizes that
    would reach past the start are skipped, the shorter ones are used."""
    p = NgramCacheProposer()
    assert _draft_once(p, 0, [], 7) == []           # len(E) = 1: no draft at all
    # E = [7, 7]: 1-gram (7,) -> {7: 1} is learned from the chunk itself and drafted (lax:
    # sizes 1 needs 2 samples, so nothing yet)
    assert _draft_once(p, 0, [7], 7) == []
    p = NgramCacheProposer()
    # context learns 1-gram (7,)->7 twice and 2-gram (7,7)->7 once from [7, 7, 7]
    assert _draft_once(p, 0, [7, 7], 7) == [7] * 8
    for _ in range(3):                               # repeatable, no garbage read
        q = NgramCacheProposer()
        assert _draft_once(q, 0, [1, 2], 1) == _draft_once(NgramCacheProposer(), 0, [1, 2], 1)


def test_cache_size_is_never_reset_between_requests():
    p = NgramCacheProposer()
    long_prompt = list(range(50))
    _draft_once(p, 0, long_prompt, 3)
    assert p.cache_size(0) == 51
    before = p.context_cache(0).to_dict()
    # a new, shorter request on the same slot learns nothing until it grows past 51 tokens
    _draft_once(p, 0, [1, 2, 3, 1, 2, 3], 1)
    assert p.cache_size(0) == 51 and p.context_cache(0).to_dict() == before
    p.reset(0)
    assert p.cache_size(0) == 0 and len(p.context_cache(0)) == 0


def test_slots_are_independent_and_shared_caches_frozen():
    sta = NgramCache()
    sta.update([1, 2, 3, 1, 2, 3, 1, 2, 3], 2, 2)
    p = NgramCacheProposer(2, static=sta)
    seq = [5, 6, 7, 8] * 5
    assert _draft_once(p, 0, seq, 5) == [6, 7, 8, 5, 6, 7, 8, 5]
    assert p.cache_size(1) == 0 and len(p.context_cache(1)) == 0
    # the static cache alone drafts for slot 1 (2-gram (1, 2) -> 3 seen 3 times)
    assert _draft_once(p, 1, [1], 2)[:3] == [3, 1, 2]
    assert sta.frozen
    with pytest.raises(RuntimeError, match="read-only"):
        sta.update([1, 2])
    with pytest.raises(RuntimeError, match="read-only"):
        sta.merge(NgramCache())


def test_int32_wraparound_in_scores():
    """A static count of 30M makes 100*count wrap negative in llama.cpp's int32 arithmetic, so
    that token loses against one with a small static count."""
    sta = NgramCache.from_bytes(
        struct.pack("<4ii2i2i", 7, 8, -1, -1, 2, 1, 30_000_000, 2, 1))
    p = NgramCacheProposer(static=sta)
    # context 2-gram (7, 8) -> {1: 1, 2: 1}: 2 samples, 50 % (lax); no 3- or 4-gram matches.
    # Token 1 scores 1 * int32(100 * 30M) < 0, token 2 scores 1 * 100: token 2 wins.
    got = _draft_once(p, 0, [7, 8, 1, 7, 8, 2, 9, 7], 8)
    assert got[:1] == [2]


def test_engine_integration(tmp_path):
    eng = SpecEngine("ngram-mod,ngram-cache", lookup_cache_static=str(STATIC_BIN))
    assert [q.name for q in eng.proposers] == ["ngram-mod", "ngram-cache"]
    cache_prop = eng.proposers[1]
    assert isinstance(cache_prop, NgramCacheProposer) and cache_prop.max_draft == 8
    assert len(cache_prop.static_cache) == 32948
    # engines built one after another (fresh state) share one frozen copy of an unchanged file
    again = SpecEngine("ngram-cache", lookup_cache_static=str(STATIC_BIN))
    assert again.proposers[0].static_cache is cache_prop.static_cache
    local = tmp_path / "s.bin"
    save_cache(cache_prop.static_cache, local)
    first = SpecEngine("ngram-cache", lookup_cache_static=str(local)).proposers[0]
    extra = NgramCache()
    extra.update([1, 2, 3])
    merge_into_dynamic(local, extra)                 # rewritten file: read again
    second = SpecEngine("ngram-cache", lookup_cache_static=str(local)).proposers[0]
    assert second.static_cache is not first.static_cache and (1, 2) in second.static_cache
    with pytest.raises(FileNotFoundError):
        SpecEngine("ngram-cache", lookup_cache_static=str(tmp_path / "missing.bin"))
    # a dynamic file that does not exist yet is an empty cache (first run)
    eng = SpecEngine("ngram-cache", lookup_cache_dynamic=str(tmp_path / "dyn.bin"))
    assert len(eng.proposers[0].dynamic_cache) == 0
    (p,) = build_proposers("ngram-cache", 3, None, {"lookup_cache_static": None,
                                                    "lookup_cache_dynamic": None})
    assert p.n_slots == 3 and p.name == "ngram-cache"


def test_dynamic_cache_drafts_with_strict_thresholds(tmp_path):
    dyn_path = tmp_path / "dyn.bin"
    stream = [10, 11, 12, 13, 14] * 4
    merge_into_dynamic(dyn_path, stream)
    (p,) = build_proposers("ngram-cache", 1, None, {"lookup_cache_dynamic": str(dyn_path)})
    # nothing in the context cache matches; the dynamic 4-gram (11,12,13,14) -> 10 (3 samples)
    assert _draft_once(p, 0, [99, 11, 12, 13], 14)[:5] == [10, 11, 12, 13, 14]


def test_slots_run_in_parallel_and_one_slot_is_guarded():
    p = NgramCacheProposer(2)
    long_prompt = np.arange(50_000, dtype=np.int32) % 5000
    errors = []

    def worker(slot):
        try:
            for _ in range(3):
                p.reset(slot)
                _draft_once(p, slot, long_prompt, 1)
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors          # different slots may run at once
    assert p.cache_size(0) == p.cache_size(1) == 50_001
    # while slot 0 hashes a long context without the GIL, using slot 0 again raises
    p.reset(0)
    huge = np.arange(600_000, dtype=np.int32) % 50
    t = threading.Thread(target=_draft_once, args=(p, 0, huge, 1))
    t.start()
    seen = 0
    while t.is_alive():
        try:
            p.cache_size(0)
        except RuntimeError as exc:
            assert "concurrently" in str(exc)
            seen += 1
    t.join()
    assert seen > 0 and p.cache_size(0) == 600_001
    p.cache_size(1)            # the other slot was usable all along


# --------------------------------------------------------------------------------------------
# NgramCache and files
# --------------------------------------------------------------------------------------------

def records(data):
    off, out = 0, []
    while off < len(data):
        key = struct.unpack_from("<4i", data, off)
        (n,) = struct.unpack_from("<i", data, off + 16)
        off += 20
        out.append((key, [struct.unpack_from("<2i", data, off + 8 * i) for i in range(n)]))
        off += 8 * n
    return out


def test_file_format_bytes():
    c = NgramCache()
    c.update([5, 6, 7], 2, 2)
    assert c.to_bytes() == struct.pack("<4ii2i", 5, 6, -1, -1, 1, 7, 1)
    c.update([5, 6, 7, 5, 6, 8], 2, 2)
    assert c.to_dict() == {(5, 6): {7: 2, 8: 1}, (6, 7): {5: 1}, (7, 5): {6: 1}}


def test_load_golden_static_file(code_edit):
    cache = load_cache(STATIC_BIN)
    assert (len(cache), cache.n_entries) == (32948, 60280)
    data = STATIC_BIN.read_bytes()
    recs = records(data)
    # loading inserts in file order: the first record is the first n-gram seen, and every part
    # holds the file's counts
    assert recs[0][0] == (1, 9690, -1, -1)
    assert cache.to_dict() == {tuple(t for t in k if t != -1): dict(p) for k, p in recs}
    # the file holds the 2-grams of code-edit requests 30..149 (prompt + output)
    reqs = code_edit[30:150]
    built = build_static_cache(np.concatenate([r.prompt, r.output]) for r in reqs)
    assert built.to_dict() == cache.to_dict()


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 2**31 - 1) | st.integers(0, 4), max_size=30),
                     max_size=4))
def test_round_trip(tmp_path_factory, seqs):
    c = NgramCache()
    for s in seqs:
        c.update(s)
    path = tmp_path_factory.mktemp("rt") / "c.bin"
    save_cache(c, path)
    back = load_cache(path)
    assert back.to_dict() == c.to_dict()
    assert len(back) == len(c) and back.n_entries == c.n_entries
    # loading a file inserts in file order, so a cache loaded twice from the same bytes is
    # identical, iteration order included
    assert load_cache(path).items() == back.items()
    assert NgramCache.from_bytes(back.to_bytes()).to_dict() == c.to_dict()


def test_pickle_and_copy():
    import pickle
    c = NgramCache()
    c.update([1, 2, 3, 1, 2, 4])
    assert pickle.loads(pickle.dumps(c)).to_dict() == c.to_dict()
    d = c.copy()
    assert d.items() == c.items()
    d.update([9, 9])
    assert (9,) not in c and (9,) in d


def test_merge_adds_counts():
    a, b = NgramCache(), NgramCache()
    a.update([1, 2, 1, 3])
    b.update([1, 2, 1, 2, 7])
    want = {}
    ref_update(want, [1, 2, 1, 3])
    ref_update(want, [1, 2, 1, 2, 7])
    a.merge(b)
    assert a.to_dict() == want
    with pytest.raises(ValueError):
        a.merge(a)


def test_merge_into_dynamic_accumulates(tmp_path):
    path = tmp_path / "dyn.bin"
    merge_into_dynamic(path, [1, 2, 3, 4, 5])
    merge_into_dynamic(path, np.array([1, 2, 3, 4, 6], dtype=np.int64))
    got = load_cache(path).to_dict()
    assert got[(1, 2, 3, 4)] == {5: 1, 6: 1}
    assert got[(1,)] == {2: 2}
    # the proposer's own context cache can be merged as it is (llama.cpp's lookup does that)
    p = NgramCacheProposer()
    _draft_once(p, 0, [1, 2, 3], 4)
    merge_into_dynamic(path, p.context_cache(0))
    assert load_cache(path).to_dict()[(1,)] == {2: 3}


def test_merge_into_dynamic_concurrent_threads(tmp_path):
    path = tmp_path / "dyn.bin"
    threads = [threading.Thread(target=merge_into_dynamic, args=(path, [1, 2, 3] * 50))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert load_cache(path).to_dict()[(1,)] == {2: 200}   # no merge lost


def test_cache_writer_is_exclusive():
    """update() releases the GIL; reads meanwhile raise instead of racing the writer."""
    c = NgramCache()
    big = np.arange(600_000, dtype=np.int32) % 50
    t = threading.Thread(target=c.update, args=(big,))
    t.start()
    seen = 0
    while t.is_alive():
        try:
            c.get((1,))
        except RuntimeError as exc:
            assert "modifies" in str(exc)
            seen += 1
    t.join()
    assert seen > 0 and c.get((1,)) == [(2, 12_000)]


def test_token_validation():
    c = NgramCache()
    # the kernels' one token validator (_proposer.as_tokens): the message names the position
    with pytest.raises(ValueError, match=r"tokens\[1\] = -2 is not a token id: ids must be in "
                                         r"0 \.\. 2147483647"):
        c.update([1, -2, 3])
    with pytest.raises(ValueError, match=r"tokens\[1\] = 2147483648 is not a token id"):
        c.update([1, 2**31])
    with pytest.raises(TypeError, match="not bool"):
        c.update([1, True])
    with pytest.raises(ValueError):
        c.update([1, 2], 0, 4)
    with pytest.raises(TypeError):
        c.update([1.5, 2.0])
    with pytest.raises(ValueError):
        c.get((1, 2, 3, 4, 5))
    with pytest.raises(ValueError, match="n-gram token 1 = -3 is not a token id"):
        c.get((1, -3))


# --------------------------------------------------------------------------------------------
# Atomic save, corrupt and truncated files
# --------------------------------------------------------------------------------------------

def small_cache():
    c = NgramCache()
    c.update([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    return c


def test_atomic_save_failure_keeps_original(tmp_path, monkeypatch):
    path = tmp_path / "c.bin"
    save_cache(small_cache(), path)
    good = path.read_bytes()
    big = NgramCache()
    big.update(list(range(1000)))

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="No space"):
        save_cache(big, path)
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["c.bin"]      # the temporary file is cleaned up


def test_atomic_save_survives_a_crash(tmp_path):
    """The process is killed (SIGKILL) after the new data is written but before the rename:
    the old file is still there, whole."""
    path = tmp_path / "c.bin"
    save_cache(small_cache(), path)
    good = path.read_bytes()
    child = f"""
import os, signal
from ngramspec._cache import NgramCache
from ngramspec.cache_file import save_cache
real_fsync = os.fsync
def crash(fd):
    real_fsync(fd)
    os.kill(os.getpid(), signal.SIGKILL)
os.fsync = crash
c = NgramCache()
c.update(list(range(20000)))
save_cache(c, {str(path)!r})
"""
    proc = subprocess.run([sys.executable, "-c", child], timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == -9
    assert path.read_bytes() == good
    assert load_cache(path).to_dict() == small_cache().to_dict()


def test_save_keeps_mode_of_existing_file(tmp_path):
    path = tmp_path / "c.bin"
    path.write_bytes(b"")
    os.chmod(path, 0o640)
    save_cache(small_cache(), path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    atomic_write_bytes(path, b"")
    assert load_cache(path).to_dict() == {}       # an empty file is an empty cache


def corrupt(tmp_path, data, name="bad.bin"):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(CacheFileError) as info:
        load_cache(path)
    assert str(path) in str(info.value)
    return info.value


@pytest.mark.parametrize("cut", [1, 19, 20, 27, 33])
def test_truncated_file(tmp_path, cut):
    data = struct.pack("<4ii2i2i", 1, 2, -1, -1, 2, 3, 4, 5, 6)
    good = struct.pack("<4ii2i", 7, -1, -1, -1, 1, 8, 1)
    err = corrupt(tmp_path, good + data[:cut])
    assert err.offset == (len(good) if cut < 20 else len(good) + 20)
    assert f"byte offset {err.offset}" in str(err) and "truncated" in str(err)


@pytest.mark.parametrize("data,offset,what", [
    (struct.pack("<4ii", 1, 2, -1, -1, 0), 16, "tokens"),
    (struct.pack("<4ii", 1, 2, -1, -1, -5), 16, "tokens"),
    (struct.pack("<4ii2i", 1, 2, -1, -1, 1, 3, 0), 24, "count"),
    (struct.pack("<4ii2i", 1, 2, -1, -1, 1, -3, 1), 20, "token id"),
    (struct.pack("<4ii2i", -1, -1, -1, -1, 1, 3, 1), 0, "key"),
    (struct.pack("<4ii2i", 1, -1, 2, -1, 1, 3, 1), 0, "key"),
    (struct.pack("<4ii2i", 1, -7, -1, -1, 1, 3, 1), 0, "key"),
    (struct.pack("<4ii2i", 1, 2, -1, -1, 2**30, 3, 1), 20, "truncated"),
])
def test_corrupt_file(tmp_path, data, offset, what):
    err = corrupt(tmp_path, data)
    assert err.offset == offset
    assert what in str(err) and f"byte offset {offset}" in str(err)


def test_duplicates_keep_first_occurrence():
    """common_ngram_cache_load emplaces: a repeated n-gram record or token keeps the first."""
    data = (struct.pack("<4ii2i2i", 1, 2, -1, -1, 2, 3, 4, 3, 9)
            + struct.pack("<4ii2i", 1, 2, -1, -1, 1, 5, 7))
    assert NgramCache.from_bytes(data).to_dict() == {(1, 2): {3: 4}}


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 400))
def test_any_truncation_is_reported_or_a_record_prefix(cut):
    data = small_cache().to_bytes()
    cut = min(cut, len(data))
    bounds, off = {0}, 0
    for _, pairs in records(data):
        off += 20 + 8 * len(pairs)
        bounds.add(off)
    if cut in bounds:
        NgramCache.from_bytes(data[:cut])
    else:
        with pytest.raises(CacheFileError, match="truncated"):
            NgramCache.from_bytes(data[:cut])


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def cli_process(*argv):
    return subprocess.run([sys.executable, "-m", "ngramspec", *map(str, argv)],
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cli_create_from_traces_matches_golden_static(tmp_path):
    out = tmp_path / "static.bin"
    r = cli_process("cache", "create", "--traces", TRACES / "code-edit.jsonl.gz", "--skip", 30,
            "--limit", 120, "--output", out, "--progress")
    assert r.returncode == 0, r.stderr
    assert "[##############################]" in r.stderr and "32948 2-grams" in r.stderr
    assert load_cache(out).to_dict() == load_cache(STATIC_BIN).to_dict()


def test_cli_create_small_traces_and_info_and_merge(tmp_path, capsys):
    traces = tmp_path / "t.jsonl.gz"
    with gzip.open(traces, "wt") as f:
        for i, (p, o) in enumerate([([1, 2, 3], [4, 1, 2]), ([2, 3], [])]):
            f.write(json.dumps({"id": f"r{i}", "prompt": p, "output": o}) + "\n")
    out = tmp_path / "s.bin"
    r = cli(capsys, "cache", "create", "--traces", traces, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "[" not in r.stderr                    # no bar when stderr is not a terminal
    # 2-grams within each request only: (1,2)->3, (2,3)->4, (3,4)->1, (4,1)->2; nothing across
    assert load_cache(out).to_dict() == {(1, 2): {3: 1}, (2, 3): {4: 1}, (3, 4): {1: 1},
                                         (4, 1): {2: 1}}
    r = cli(capsys, "cache", "info", out)
    assert r.returncode == 0 and "n-grams" in r.stdout and "4" in r.stdout
    merged = tmp_path / "m.bin"
    r = cli(capsys, "cache", "merge", out, out, "-o", merged)
    assert r.returncode == 0, r.stderr
    assert load_cache(merged).to_dict()[(1, 2)] == {3: 2}


@pytest.mark.parametrize("argv,needle", [
    (["create", "--traces", "/nonexistent/t.jsonl", "-o", "{tmp}/x.bin"], "/nonexistent"),
    (["create", "--text", "{tmp}/x.txt", "--model", "{tmp}/none.gguf", "-o", "{tmp}/x.bin"],
     "none.gguf"),
    (["create", "--text", "{tmp}/nonexistent.txt", "-o", "{tmp}/x.bin"], "nonexistent.txt"),
    (["create", "--traces", "{tmp}/bad.bin", "-o", "{tmp}/x.bin", "--model", "m.gguf"],
     "--model"),
    (["info", "{tmp}/bad.bin"], "byte offset 16"),
    (["merge", "{tmp}/bad.bin", "-o", "{tmp}/x.bin"], "byte offset 16"),
    (["create", "-o", "{tmp}/x.bin"], "required"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, needle):
    (tmp_path / "bad.bin").write_bytes(struct.pack("<4ii", 1, 2, -1, -1, 0))
    (tmp_path / "x.txt").write_text("hello")
    r = cli(capsys, "cache", *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not (tmp_path / "x.bin").exists()


def test_cli_text_needs_llama_cpp_or_tokenizes(tmp_path, capsys, monkeypatch):
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x\n" * 20)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        r = cli(capsys, "cache", "create", "--text", text, "--model", tmp_path / "m.gguf",
                "-o", tmp_path / "x.bin")
        assert r.returncode == 2 and "llama-cpp-python" in r.stderr
        return
    model = _find_gguf()
    if model is None:
        pytest.skip("no GGUF model available")
    out = tmp_path / "x.bin"
    # small slices, so that the overlap between them is exercised
    monkeypatch.setattr("ngramspec.cli.cache._TEXT_CHUNK", 7)
    r = cli(capsys, "cache", "create", "--text", text, "-o", out)   # the embedded model
    assert r.returncode == 0, r.stderr
    import llama_cpp
    toks = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False).tokenize(
        text.read_bytes(), add_bos=True, special=True)
    want = NgramCache()
    want.update(toks, 2, 2)
    # one pass over the whole text and the overlapping slices insert in the same order
    assert out.read_bytes() == want.to_bytes()


def _find_gguf():
    try:
        from ngramspec.llama.model import default_model_path
    except ImportError:
        return None
    try:
        return default_model_path()
    except Exception:
        return None


def test_a_file_that_is_no_cache_is_called_so(tmp_path):
    """A text file (no record parses) is reported as not an n-gram cache file, not as a
    truncated one; a real cache cut short is still reported as truncated."""
    from ngramspec.cache_file import load_cache, save_cache
    text = tmp_path / "notes.txt"
    text.write_text("hello world this is text\n")
    with pytest.raises(CacheFileError, match="not an n-gram cache file"):
        load_cache(text)
    c = NgramCache()
    c.update(np.arange(1, 40, dtype=np.int32) % 7, 1, 4)
    good = tmp_path / "good.bin"
    save_cache(c, good)
    cut = tmp_path / "cut.bin"
    cut.write_bytes(good.read_bytes()[:-3])
    with pytest.raises(CacheFileError, match="truncated file") as info:
        load_cache(cut)
    assert "not an n-gram cache file" not in str(info.value)

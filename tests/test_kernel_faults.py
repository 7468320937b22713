"""The kernels under memory pressure, misuse and absurd sizes (issue 20, points 1-4).

Every reproducer runs in a child process, so a crash (SIGSEGV, heap corruption, abort) or a
hang fails the test instead of killing pytest. Children inherit the environment: under
``.ci/asan`` they run on the AddressSanitizer build, which checks that no state left behind by a
failure corrupts memory later.

Two ways to make allocations fail:

* ``RLIMIT_AS`` lowered a little above the process's current size (realistic: whatever
  allocation needs new address space fails, in any module, ngram-cache's C++ containers
  included; but only large allocations reliably hit it, and not under ASan, whose allocator
  reserves its own address space up front);
* the kernels' fault-injection hook (``ngramspec._proposer._fail_allocation``): exactly the k-th
  allocation through _proposer's allocator (every kernel module but _cache's C++ containers)
  fails, so random k over the allocations a workload makes reaches every allocation site, small
  ones included, on any build (ASan too).
"""
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from ngramspec import SpecEngine
from ngramspec import MapProposer, ModPool, ModProposer, PyProposer, SimpleProposer
from ngramspec._proposer import _fail_allocation
from ngramspec._suffix import SuffixProposer

from conftest import ROOT

# Small parameters so short contexts draft; every proposer of the package.
PARAMS = {
    "ngram-simple": dict(ngram_simple_size_n=3, ngram_simple_size_m=8),
    "ngram-map-k": dict(ngram_map_k_size_n=3, ngram_map_k_size_m=8),
    "ngram-map-k4v": dict(ngram_map_k4v_size_n=3, ngram_map_k4v_size_m=8),
    "ngram-mod": dict(ngram_mod_n_match=4, ngram_mod_n_min=1, ngram_mod_n_max=8),
    "ngram-suffix": dict(ngram_suffix_max_context=4096, ngram_suffix_global_tokens=8192),
    "ngram-cache": dict(),
}
TYPES = list(PARAMS)
# The types whose allocations go through the fault-injection hook (ngram-cache's go through
# C++ operator new: covered by the RLIMIT_AS tests).
HOOKED = [t for t in TYPES if t != "ngram-cache"]
UNDER_ASAN = "asan" in os.environ.get("LD_PRELOAD", "")

PRELUDE = """
import json, resource, sys, threading
import numpy as np
from ngramspec import SpecEngine
from ngramspec import MapProposer
from ngramspec._proposer import _fail_allocation

SOFT, HARD = resource.getrlimit(resource.RLIMIT_AS)

def vm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

def limit_memory(extra):
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + extra, HARD))

def unlimit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (SOFT, HARD))
"""


def run_child(code, timeout=240):
    """Run `code` (after PRELUDE and WORKLOAD) in a fresh interpreter in the repository root; its stdout."""
    proc = subprocess.run([sys.executable, "-c", PRELUDE + WORKLOAD + textwrap.dedent(code)],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        died = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        pytest.fail(f"child process failed ({died}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-4000:]}")
    return proc.stdout


def check_drafts(drafts, vocab, max_draft):
    """Drafts of a workload over ids < vocab: every token a real id, no draft too long."""
    for d in drafts:
        assert len(d) <= max_draft
        assert all(0 <= t < vocab for t in d), d


# ---------------------------------------------------------------------------------------------
# 1. allocation failures leave consistent state
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(UNDER_ASAN, reason="RLIMIT_AS does not bound ASan's allocator")
def test_suffix_draft_after_memory_error_issue_reproducer():
    """The issue's reproducer: a draft that re-indexes an outgrown context runs out of memory;
    the next draft on the slot used to write the whole context into a too-small automaton."""
    out = run_child("""
        e = SpecEngine("ngram-suffix", ngram_suffix_max_context=1 << 22,
                       ngram_suffix_global_tokens=0)
        ctx = np.random.default_rng(0).integers(0, 40, 6_000_000).astype(np.int32)
        e.begin(0, ctx[:10])
        limit_memory(100 << 20)
        try:
            e.draft(0, ctx, 5)
            print("no MemoryError")
        except MemoryError:
            print("MemoryError")
        unlimit_memory()
        d = e.draft(0, ctx, 5)
        assert d.size == 0 or (d.min() >= 0 and d.max() < 40), d
        ref = SpecEngine("ngram-suffix", ngram_suffix_max_context=1 << 22,
                         ngram_suffix_global_tokens=0)
        ref.begin(0, ctx[:10])
        print(json.dumps(dict(stats=e.proposers[0].slot_stats(0),
                              ref=(ref.draft(0, ctx, 5), ref.proposers[0].slot_stats(0))[1])))
    """)
    first, stats = out.splitlines()
    assert first == "MemoryError"
    stats = json.loads(stats)
    assert stats["stats"] == stats["ref"]          # as if the failed call never happened
    assert stats["ref"]["indexed"] == 1 << 21


@pytest.mark.skipif(UNDER_ASAN, reason="RLIMIT_AS does not bound ASan's allocator")
@pytest.mark.parametrize("typ", TYPES)
def test_memory_pressure_every_proposer(typ):
    """Each proposer's first draft over a long new context (and k4v's begin, which indexes the
    prompt) under a tight RLIMIT_AS: MemoryError or a draft, never a crash; afterwards the same
    slot keeps drafting valid tokens from a fresh begin, and an engine that never failed drafts
    the same on ngram-simple, whose state begin() rebuilds."""
    out = run_child(f"""
        typ, params = {typ!r}, {PARAMS[typ]!r}
        params = dict(params)
        if typ == "ngram-suffix":
            params["ngram_suffix_max_context"] = 1 << 22
        e = SpecEngine(typ, n_slots=2, **params)
        rng = np.random.default_rng(1)
        big = np.tile(rng.integers(0, 1000, 200_000), 15).astype(np.int32)   # 3M, repetitive
        small = rng.integers(0, 50, 400).astype(np.int32)
        small = np.concatenate([small, small, small])
        e.begin(0, small)
        e.draft(0, small, 7)
        errors = 0
        limit_memory(4 << 20)
        for call in (lambda: e.begin(1, big), lambda: e.draft(1, big, 3),
                     lambda: e.draft(0, big, 3)):
            try:
                call()
            except MemoryError:
                errors += 1
        unlimit_memory()

        def follow_up(e):
            drafts = []
            for slot in (0, 1):
                e.begin(slot, small)
                ctx = small.copy()
                for i in range(60):
                    d = e.draft(slot, ctx, int(small[i % len(small)]))
                    drafts.append(d.tolist())
                    if len(d):
                        e.accept(slot, 0)
                    ctx = np.append(ctx, small[i % len(small)]).astype(np.int32)
                d = e.draft(slot, big, 3)        # the big context once more, with memory
                drafts.append(d.tolist())
                if len(d):
                    e.accept(slot, 0)
            return drafts
        follow = follow_up(e)
        ref = follow_up(SpecEngine(typ, n_slots=2, **params)) if typ == "ngram-simple" else []
        print(json.dumps(dict(errors=errors, follow=follow, ref=ref,
                              max_draft=max(p.max_draft for p in e.proposers))))
    """)
    res = json.loads(out)
    # mod allocates nothing after __init__, map-k one small key record per draft call (the
    # fault-injection tests below reach those): the others need hundreds of MB here
    if typ not in ("ngram-mod", "ngram-map-k"):
        assert res["errors"] >= 1
    check_drafts(res["follow"], 1000, res["max_draft"])
    assert any(res["follow"])
    if typ == "ngram-simple":
        assert res["follow"] == res["ref"]


# A server-like workload over several slots: requests that repeat themselves (so every
# proposer drafts), contexts growing token by token, a context that shrinks without begin,
# and the ngram-suffix store evicting (small budget). Allocations: every kernel's growth paths.
WORKLOAD = """
def build(typ, params, n_slots):
    if typ == "ngram-map-k4v":               # statistics scans through the ScanIndex too
        return SpecEngine.from_proposers(
            [MapProposer(3, 8, key_only=False, n_slots=n_slots, stat_index_min=16)], n_slots)
    return SpecEngine(typ, n_slots=n_slots, **params)

def workload(e, seed, n_req=6, vocab=60, on_error=None):
    rng = np.random.default_rng(seed)
    drafts = []
    for r in range(n_req):
        slot = r % e.n_slots
        base = rng.integers(0, vocab, 40 + 30 * r)
        prompt = np.concatenate([base, base[: 20 + 10 * r], rng.integers(0, vocab, 5)])
        prompt = prompt.astype(np.int32)
        out = np.tile(base, 3)[: 120 + 40 * r].astype(np.int32)
        ctx = prompt
        try:
            e.begin(slot, prompt)
        except MemoryError:
            on_error()
        i = 0
        while i < len(out) - 1:
            try:
                d = e.draft(slot, ctx, int(out[i]))
            except MemoryError:
                on_error()
                d = np.empty(0, np.int32)
            drafts.append(d.tolist())
            k = 0
            while k < len(d) and i + 1 + k < len(out) and d[k] == out[i + 1 + k]:
                k += 1
            if len(d):
                try:
                    e.accept(slot, k)
                except MemoryError:
                    on_error()
            ctx = np.concatenate([ctx, out[i: i + 1 + k]]).astype(np.int32)
            i += 1 + k
        if r == 3:                           # a context that shrank without begin()
            try:
                d = e.draft(slot, prompt[: len(prompt) // 2], int(out[0]))
                drafts.append(d.tolist())
                if len(d):
                    e.accept(slot, 0)
            except MemoryError:
                on_error()
    # short prompts, then contexts far past them: the automata and indexes grow in one step,
    # past ngram-suffix's max_context (4096 in these tests) on slot 0, and on slot 1 from a
    # context that does not extend the prompt (the slot starts over); then begin() again
    long = np.tile(rng.integers(0, vocab, 300), 20).astype(np.int32)
    for slot, prompt, ctxs in ((0, long[:10], (long[:5990], long[:5991])),
                               (1, long[:10], (long[5:1505], long[5:1506])),
                               (1, long[:20], ())):
        try:
            e.begin(slot, prompt)
        except MemoryError:
            on_error()
        for ctx in ctxs:
            try:
                d = e.draft(slot, ctx, int(long[len(ctx)]))
                drafts.append(d.tolist())
                if len(d):
                    e.accept(slot, 0)
            except MemoryError:
                on_error()
    return drafts
"""


@pytest.mark.parametrize("typ", HOOKED)
def test_fault_injection_random_allocation_failures(typ):
    """Allocation number k (random, 8 seeds) of a workload fails: every failure surfaces as a
    MemoryError (nothing swallowed), no crash; afterwards the same engine runs a second workload
    with valid drafts, and ngram-simple drafts exactly what an engine that never failed does.
    Construction is inside the armed window too: a failed __init__ is retried."""
    out = run_child(f"""
        typ, params = {typ!r}, {PARAMS[typ]!r}
        if typ == "ngram-suffix":
            params = dict(params, ngram_suffix_max_context=4096, ngram_suffix_global_tokens=600,
                          ngram_suffix_max_draft=16)
        def run(fail_at):
            errors = []
            _fail_allocation(fail_at)
            try:
                try:
                    e = build(typ, params, 3)
                except MemoryError:
                    errors.append("init")
                    _fail_allocation(None)
                    e = build(typ, params, 3)
                    _fail_allocation(0)
                drafts = workload(e, 7, on_error=lambda: errors.append("call"))
            finally:
                seen = _fail_allocation(None)
            after = workload(e, 8)
            return seen, errors, drafts, after
        n_alloc, errors, clean, after_clean = run(0)
        assert not errors
        results = []
        for seed in range(8):
            k = int(np.random.default_rng(seed).integers(1, n_alloc + 1))
            seen, errors, drafts, after = run(k)
            results.append(dict(k=k, errors=len(errors), after=after,
                                same_after=after == after_clean))
        print(json.dumps(dict(n_alloc=n_alloc, results=results, after_clean=after_clean,
                              max_draft=max(p.max_draft for p in build(typ, params, 1).proposers))))
    """)
    res = json.loads(out)
    assert res["n_alloc"] >= 8
    assert any(res["after_clean"])
    for r in res["results"]:
        assert r["errors"] == 1, r["k"]      # exactly the injected failure, reported
        check_drafts(r["after"], 60, res["max_draft"])
        if typ == "ngram-simple":            # begin() rebuilds everything it keeps
            assert r["same_after"], r["k"]


@pytest.mark.parametrize("typ", HOOKED)
def test_fault_injection_every_allocation_of_a_short_run(typ):
    """Exhaustive on a short workload, construction included: each of its allocations fails
    once, in turn; each failure is reported once, and the engine (or a new one, when
    construction failed) runs on."""
    out = run_child(f"""
        typ, params = {typ!r}, {PARAMS[typ]!r}
        if typ == "ngram-suffix":
            params = dict(params, ngram_suffix_max_context=4096, ngram_suffix_global_tokens=300)
        _fail_allocation(0)
        workload(build(typ, params, 2), 3, n_req=3)
        n = _fail_allocation(None)
        reported = 0
        for k in range(1, n + 1):
            errors = []
            e = None
            _fail_allocation(k)
            try:
                e = build(typ, params, 2)
                workload(e, 3, n_req=3, on_error=lambda: errors.append(1))
            except MemoryError:
                errors.append(1)
            finally:
                _fail_allocation(None)
            reported += len(errors) == 1
            workload(e if e is not None else build(typ, params, 2), 4, n_req=3)
        print(json.dumps(dict(n=n, reported=reported)))
    """)
    res = json.loads(out)
    assert res["n"] >= 1 and res["reported"] == res["n"]


# ---------------------------------------------------------------------------------------------
# 2. sizes from user input
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_slots", [2**62, 2**63 - 1, 2**64, 10**30])
def test_huge_n_slots_every_proposer(n_slots):
    """SuffixProposer(n_slots=2**62) used to overflow malloc's size and crash: every proposer
    and the engine give an error naming n_slots."""
    out = run_child(f"""
        from ngramspec import MapProposer, ModProposer, SimpleProposer
        from ngramspec._suffix import SuffixProposer
        from ngramspec._cache import NgramCacheProposer
        n = {n_slots}
        msgs = []
        for make in (lambda: SimpleProposer(n_slots=n), lambda: MapProposer(n_slots=n),
                     lambda: MapProposer(n_slots=n, key_only=False),
                     lambda: ModProposer(n_slots=n), lambda: SuffixProposer(n_slots=n),
                     lambda: NgramCacheProposer(n_slots=n),
                     lambda: SpecEngine("ngram-simple,ngram-mod", n_slots=n),
                     lambda: SpecEngine("ngram-suffix", n_slots=n)):
            try:
                make()
                msgs.append("no error")
            except (MemoryError, ValueError, OverflowError) as exc:
                msgs.append(f"{{type(exc).__name__}}: {{exc}}")
        print(json.dumps(msgs))
    """)
    for msg in json.loads(out):
        assert msg.startswith(("MemoryError", "ValueError")) and "n_slots" in msg, msg


def test_context_longer_than_int32_positions():
    """Token positions are 32-bit in the kernels: a 2**31-token context is refused up front
    (np.zeros maps it lazily: no 8 GiB is touched)."""
    try:
        huge = np.zeros(2**31, dtype=np.int32)
    except MemoryError:
        pytest.skip("no 8 GiB of address space")
    e = SpecEngine("ngram-simple")
    with pytest.raises(ValueError, match=r"context holds 2147483648 tokens: at most 2147483647"):
        e.draft(0, huge, 1)
    with pytest.raises(ValueError, match=r"prompt holds 2147483648 tokens"):
        e.begin(0, huge)
    del huge
    e.begin(0, [1, 2, 3])                    # the slot is untouched
    assert e.draft(0, [1, 2, 3], 1).size == 0


# ---------------------------------------------------------------------------------------------
# 3. __init__ runs once
# ---------------------------------------------------------------------------------------------

class _Echo(PyProposer):
    def __init__(self):
        super().__init__("echo", 2, 4)

    def on_draft(self, slot, inp, sampled):
        return inp[-2:]


REINIT = {
    "SimpleProposer": (lambda: SimpleProposer(size_n=3, size_m=8, n_slots=2),
                       lambda p: p.__init__(size_n=5, size_m=100, n_slots=64)),
    "MapProposer-k": (lambda: MapProposer(size_n=3, size_m=8, n_slots=2),
                      lambda p: p.__init__(size_n=5, size_m=100, n_slots=64)),
    "MapProposer-k4v": (lambda: MapProposer(size_n=3, size_m=8, key_only=False, n_slots=2),
                        lambda p: p.__init__(size_n=2, size_m=100, key_only=True, n_slots=64)),
    "ModProposer": (lambda: ModProposer(n_match=4, n_min=1, n_max=8, n_slots=2),
                    lambda p: p.__init__(n_match=2, n_max=200, n_slots=64)),
    "SuffixProposer": (lambda: SuffixProposer(n_slots=2, max_draft=8),
                       lambda p: p.__init__(n_slots=64, max_draft=4000)),
    "PyProposer": (_Echo, lambda p: PyProposer.__init__(p, "echo", 64, 100)),
}


def _counts(e):
    return [{k: v for k, v in s.items() if not k.startswith("t_")} for s in e.stats()]


def _run_engine(e, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 30, 50)
    ctx = np.concatenate([base, base, base[:10]]).astype(np.int32)
    drafts = []
    for slot in range(2):
        e.begin(slot, ctx)
        for i in range(10):
            d = e.draft(slot, ctx[: len(ctx) - 10 + i], int(ctx[len(ctx) - 10 + i]))
            drafts.append(d.tolist())
            if len(d):
                e.accept(slot, 1 if len(d) > 1 else 0)
    return drafts


@pytest.mark.parametrize("name", list(REINIT))
def test_reinit_refused_every_proposer(name):
    """Re-running __init__ on a proposer an engine holds used to reallocate its per-slot state
    under the engine (SIGSEGV): it raises, and the proposer keeps working unchanged."""
    make, reinit = REINIT[name]
    p = make()
    e = SpecEngine.from_proposers([p], n_slots=2)
    ref = SpecEngine.from_proposers([make()], n_slots=2)
    assert _run_engine(e) == _run_engine(ref)
    with pytest.raises(RuntimeError, match=r"is already initialised"):
        reinit(p)
    assert p.n_slots == 2 and p.max_draft == ref.proposers[0].max_draft
    assert _run_engine(e, 1) == _run_engine(ref, 1)


def test_reinit_refused_ngram_cache_engine_and_harmless_on_pool():
    from ngramspec._cache import NgramCacheProposer
    p = NgramCacheProposer(n_slots=2)
    e = SpecEngine.from_proposers([p], n_slots=2)
    before = _run_engine(e)
    with pytest.raises(RuntimeError, match=r"NgramCacheProposer is already initialised"):
        p.__init__(n_slots=64)
    assert p.n_slots == 2
    _run_engine(e, 1)
    assert before                                    # it drafted through all this

    e = SpecEngine("ngram-simple,ngram-mod", n_slots=2, ngram_simple_size_n=3)
    ref = SpecEngine("ngram-simple,ngram-mod", n_slots=2, ngram_simple_size_n=3)
    assert _run_engine(e) == _run_engine(ref)
    with pytest.raises(RuntimeError, match=r"SpecEngine is already initialised"):
        e.__init__("ngram-suffix", n_slots=64)
    assert e.n_slots == 2 and e.types == ["ngram-simple", "ngram-mod"]
    assert _run_engine(e, 1) == _run_engine(ref, 1)
    assert _counts(e) == _counts(ref)

    pool = ModPool()                                 # __cinit__ only: __init__ is object's
    m = ModProposer(n_match=4, n_min=1, pool=pool, n_slots=2)
    SpecEngine.from_proposers([m], n_slots=2).begin(0, np.arange(100))
    used = pool.used
    pool.__init__()
    assert pool.used == used > 0


# class, positional __init__ arguments
INIT = {
    "SimpleProposer": (SimpleProposer, (3, 8, 1, 2)),
    "MapProposer-k": (MapProposer, (3, 8, 1, True, 2)),
    "MapProposer-k4v": (MapProposer, (3, 8, 1, False, 2)),
    "ModProposer": (ModProposer, (4, 1, 8, None, 2)),
    "SuffixProposer": (SuffixProposer, (2, 8)),
    "SpecEngine": (SpecEngine, ("ngram-simple,ngram-mod,ngram-suffix", 2)),
}


@pytest.mark.parametrize("name", list(INIT))
def test_failed_init_leaves_an_unusable_but_safe_object(name):
    """Each allocation of __init__ fails in turn: MemoryError, and the half-built object has no
    slots (an engine refuses it, its methods raise instead of reading NULL); __init__ may then
    run again and gives a working object."""
    cls, args = INIT[name]
    _fail_allocation(0)
    try:
        cls(*args)
    finally:
        n = _fail_allocation(None)
    assert n >= 2
    as_engine = (lambda o: o) if cls is SpecEngine else (
        lambda o: SpecEngine.from_proposers([o], n_slots=2))
    expected = _run_engine(as_engine(cls(*args)))
    for k in range(1, n + 1):
        bare = cls.__new__(cls)
        _fail_allocation(k)
        try:
            with pytest.raises(MemoryError):
                cls.__init__(bare, *args)
        finally:
            _fail_allocation(None)
        assert bare.n_slots == 0
        if cls is SpecEngine:
            with pytest.raises(IndexError):
                bare.draft(0, [1, 2, 3], 4)
        else:
            with pytest.raises(ValueError, match="slots"):
                SpecEngine.from_proposers([bare], n_slots=1)
        try:
            bare.memory_bytes()
        except RuntimeError as exc:
            assert "is not initialised" in str(exc)
        cls.__init__(bare, *args)                    # a second try works
        assert _run_engine(as_engine(bare)) == expected


# ---------------------------------------------------------------------------------------------
# 4. two threads on one slot
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shared", ["engine", "proposer"])
@pytest.mark.parametrize("typ", TYPES)
def test_two_threads_on_one_slot_are_refused(typ, shared):
    """Two threads drive slot 0 at once, through one engine (the engine's slot flag) or through
    two engines sharing the proposers (the proposers' slot flags). Calls that find the slot
    busy raise RuntimeError and leave it alone; no crash, no hang, no other error. Long new
    contexts make the kernels release the GIL, so the calls do overlap."""
    out = run_child(f"""
        from ngramspec.registry import build_proposers
        typ, params, shared = {typ!r}, {PARAMS[typ]!r}, {shared!r}
        params = dict(params)
        if typ == "ngram-suffix":
            params["ngram_suffix_max_context"] = 1 << 20
        if shared == "engine":
            e1 = e2 = SpecEngine(typ, n_slots=1, **params)
        else:
            props = build_proposers(typ, 1, None, params)
            e1, e2 = SpecEngine.from_proposers(props), SpecEngine.from_proposers(props)
        base = np.random.default_rng(0).integers(0, 500, 400_000).astype(np.int32)
        base = np.concatenate([base, base])
        busy, other, done = [0], [], [0]
        start = threading.Barrier(2)
        def drive(e, seed):
            start.wait()
            rng = np.random.default_rng(seed)
            for r in range(12):
                n = int(rng.integers(100_000, len(base)))
                ctx = base[:n]
                for call in (lambda: e.begin(0, ctx), lambda: e.draft(0, ctx, int(base[n]))):
                    try:
                        d = call()
                        if d is not None and len(d):
                            e.accept(0, 0)
                    except RuntimeError as exc:
                        if "used concurrently" not in str(exc):
                            other.append(repr(exc))
                        busy[0] += 1
                    except ValueError as exc:      # accept() after the other thread's draft
                        if "without a pending" not in str(exc):
                            other.append(repr(exc))
                    except Exception as exc:
                        other.append(repr(exc))
            done[0] += 1
        ts = [threading.Thread(target=drive, args=(e, s)) for e, s in ((e1, 1), (e2, 2))]
        for t in ts: t.start()
        for t in ts: t.join()
        # the slot still works from one thread
        e1.begin(0, base[:1000])
        e1.draft(0, base[:1000], int(base[1000]))
        print(json.dumps(dict(busy=busy[0], other=other, done=done[0])))
    """, timeout=300)
    res = json.loads(out)
    assert res["done"] == 2
    assert res["other"] == []
    assert res["busy"] > 0                   # the threads did collide, and were refused


def test_suffix_proposer_direct_calls_refused_concurrently():
    """SuffixProposer's own begin/draft (no engine) use the same slot flags."""
    p = SuffixProposer(n_slots=1, global_tokens=0, max_context=1 << 20)
    big = np.random.default_rng(0).integers(0, 500, 300_000).astype(np.int32)
    errors, refused = [], []
    go = threading.Event()

    def beginner():
        go.set()
        for _ in range(6):
            try:
                p.begin(0, big)
            except RuntimeError as exc:
                refused.append(str(exc))

    t = threading.Thread(target=beginner)
    t.start()
    go.wait()
    while t.is_alive():
        try:
            p.draft(0, big[:100], 1)
        except RuntimeError as exc:
            refused.append(str(exc))
        except Exception as exc:              # pragma: no cover - reported below
            errors.append(repr(exc))
    t.join()
    assert errors == []
    assert refused and all("ngram-suffix slot 0 used concurrently" in m for m in refused)

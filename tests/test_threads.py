"""Threads (issue 4, item 2): one engine, one thread per slot, one shared ModPool.

* a stress run with a thread resetting the pool meanwhile: no crash, no deadlock, every draft
  well-formed, the statistics add up;
* without resets, every slot drafts exactly what a single-threaded run drafts;
* long kernels release the GIL: two threads doing begin() on long prompts beat a serial run;
* every public class states its thread-safety contract in its docstring.

The runs that could hang go to a subprocess with a timeout, so a deadlock fails the test instead
of hanging CI (``faulthandler`` dumps every thread's stack first, to show where).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ngramspec
from ngramspec import ModPool, SpecEngine

from conftest import ROOT

TESTS = os.path.dirname(os.path.abspath(__file__))
N_SLOTS = 8
# Slot s only ever uses tokens t with t % 8 == s. ngram-mod's pool index is the low 22 bits of
# h = sum_i t_i * A^(n-1-i) (mod 2^64), A = 6364136223846793005 = 5 (mod 8), so
# h = s * sum_k 5^k = s * (3n - 2) (mod 8) when every t_i = s (mod 8) and n is odd; 3n - 2 is
# then odd, i.e. invertible mod 8, so the eight slots write and read eight disjoint residue
# classes of pool entries. That holds for the draft chain too (its window holds the key and the
# drafted tokens, all from the slot's class). Hence, with no reset, a slot cannot see another
# slot's n-grams: its drafts depend on its own calls only, whatever the interleaving. Resets
# keep the classes disjoint as well, so even under resets every drafted token is the slot's.
N_MATCH = 3
ALPHABET = 6          # distinct tokens per slot: 8 * x + slot for x < ALPHABET
PARAMS = dict(ngram_simple_size_n=6, ngram_simple_size_m=8,
              ngram_map_k4v_size_n=3, ngram_map_k4v_size_m=8, ngram_map_k4v_min_hits=2,
              ngram_mod_n_match=N_MATCH, ngram_mod_n_min=2, ngram_mod_n_max=12)
TYPES = "ngram-simple,ngram-map-k4v,ngram-mod"
COUNTERS = ("calls_b", "calls_g", "calls_a", "gen_drafts", "acc_drafts", "gen_tokens",
            "acc_tokens", "acc_per_pos")


class _Buffer:
    """A growing int32 token buffer, passed to the engine as zero-copy views (as a server's
    KV-cache token list would be)."""

    def __init__(self, tokens):
        self.a = np.empty(max(64, 2 * len(tokens)), dtype=np.int32)
        self.n = len(tokens)
        self.a[:self.n] = tokens

    def extend(self, tokens):
        need = self.n + len(tokens)
        if need > len(self.a):
            grown = np.empty(2 * need, dtype=np.int32)
            grown[:self.n] = self.a[:self.n]
            self.a = grown
        self.a[self.n:need] = tokens
        self.n = need

    def view(self):
        return self.a[:self.n]


def _drive_slot(eng, slot, seed, n_requests, n_steps, low_acceptance, out):
    """One slot's requests, as llama-server's loop would run them. Appends
    ("draft", tokens) / ("begin", length) events to `out` and checks every draft's shape.

    low_acceptance: accept counts drawn from 0 .. len(draft) (ngram-mod's 5-low-drafts reset
    of the shared pool happens); otherwise from ceil(len/4) .. len, never a low draft.
    """
    rng = random.Random(seed * 7919 + slot)
    alphabet = [8 * x + slot for x in range(ALPHABET)]
    max_draft = max(PARAMS["ngram_simple_size_m"], PARAMS["ngram_map_k4v_size_m"],
                    PARAMS["ngram_mod_n_max"])
    ctx = []
    for _ in range(n_requests):
        mode = rng.random()
        if ctx and mode < 0.35:        # the conversation goes on: a longer prompt
            prompt = ctx + [rng.choice(alphabet) for _ in range(rng.randint(0, 20))]
        elif ctx and mode < 0.55:      # a shorter prompt sharing a prefix
            prompt = ctx[:rng.randint(0, len(ctx))]
        else:                          # an unrelated prompt: a noisy repeated phrase
            phrase = [rng.choice(alphabet) for _ in range(rng.randint(3, 12))]
            prompt = [t if rng.random() > 0.05 else rng.choice(alphabet)
                      for t in phrase * rng.randint(1, 30)]
        eng.begin(slot, np.array(prompt, dtype=np.int32))
        out.append(("begin", len(prompt)))
        buf = _Buffer(prompt)
        period = rng.randint(3, 12)
        sampled = rng.choice(alphabet)
        for _ in range(n_steps):
            d = eng.draft(slot, buf.view(), sampled)
            if d.dtype != np.int32 or d.ndim != 1 or len(d) > max_draft:
                raise AssertionError(f"slot {slot}: malformed draft {d!r}")
            if len(d) and (d % 8 != slot).any():
                raise AssertionError(f"slot {slot}: drafted another slot's tokens {d.tolist()}")
            out.append(("draft", d.tolist()))
            k = 0
            if len(d):
                lo = 0 if low_acceptance else math.ceil(len(d) / 4)
                k = rng.randint(lo, len(d))
                eng.accept(slot, k)
            buf.extend([sampled] + d[:k].tolist())
            v = buf.view()
            sampled = int(v[-period]) if len(v) >= period and rng.random() < 0.85 \
                else rng.choice(alphabet)
        ctx = buf.view().tolist()


def _run_threads(eng, seed, n_requests, n_steps, low_acceptance, extra=None):
    """One thread per slot (plus `extra` target, stopped when the slots are done)."""
    sys.setswitchinterval(1e-5)       # switch threads as often as possible
    logs = {s: [] for s in range(eng.n_slots)}
    errors = []
    start = threading.Barrier(eng.n_slots + (extra is not None))
    done = threading.Event()

    def slot_main(slot):
        try:
            start.wait()
            _drive_slot(eng, slot, seed, n_requests, n_steps, low_acceptance, logs[slot])
        except BaseException as exc:  # reported by the main thread
            errors.append((slot, repr(exc)))

    def extra_main():
        try:
            start.wait()
            extra(done)
        except BaseException as exc:
            errors.append(("extra", repr(exc)))

    threads = [threading.Thread(target=slot_main, args=(s,)) for s in range(eng.n_slots)]
    if extra is not None:
        helper = threading.Thread(target=extra_main)
        helper.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    if extra is not None:
        helper.join()
    return logs, errors


def _counters(stats):
    return [{k: s[k] for k in ("type",) + COUNTERS} for s in stats]


def _check_counters(eng, logs):
    """The statistics add up to the calls the threads made (they are updated under the GIL)."""
    stats = eng.stats()
    drafts = [e[1] for log in logs.values() for e in log if e[0] == "draft"]
    begins = sum(e[0] == "begin" for log in logs.values() for e in log)
    nonempty = [d for d in drafts if d]
    assert stats[0]["calls_g"] == len(drafts)
    for prev, s in zip(stats, stats[1:]):
        assert s["calls_g"] == prev["calls_g"] - prev["gen_drafts"]  # reached when none drafted
    for s in stats:
        assert s["calls_b"] == begins
        assert s["calls_a"] == s["gen_drafts"]
        assert sum(s["acc_per_pos"]) == s["acc_tokens"]
        assert (s["acc_per_pos"] or [0])[0] == s["acc_drafts"]
    assert sum(s["gen_drafts"] for s in stats) == len(nonempty)
    assert sum(s["gen_tokens"] for s in stats) == sum(map(len, nonempty))
    return stats


# ---------------------------------------------------------------------------------------------
# entry points of the subprocesses
# ---------------------------------------------------------------------------------------------

def stress_main(seconds: float) -> None:
    """Slots hammer the engine while a thread resets the shared pool and reads statistics."""
    import faulthandler
    faulthandler.dump_traceback_later(seconds + 100, exit=True)
    pool = ModPool()
    eng = SpecEngine(TYPES, n_slots=N_SLOTS, pool=pool, **PARAMS)
    resets = [0]

    def resetter(done):
        while not done.is_set():
            pool.reset()
            resets[0] += 1
            eng.stats()
            assert 0 <= pool.used <= pool.size
            time.sleep(0.0002)

    t0 = time.perf_counter()
    rounds = 0
    all_logs = {s: [] for s in range(N_SLOTS)}
    while time.perf_counter() - t0 < seconds or rounds == 0:
        logs, errors = _run_threads(eng, rounds, n_requests=4, n_steps=120, low_acceptance=True,
                                    extra=resetter)
        if errors:
            raise AssertionError(f"thread errors: {errors}")
        for s in logs:
            all_logs[s] += logs[s]
        rounds += 1
    stats = _check_counters(eng, all_logs)
    print(json.dumps({"rounds": rounds, "resets": resets[0],
                      "gen_drafts": {s["type"]: s["gen_drafts"] for s in stats}}))


def determinism_main() -> None:
    """The same slot streams, once one slot after another in one thread, once with a thread
    per slot: the drafts, statistics and pool fill must be identical."""
    import faulthandler
    faulthandler.dump_traceback_later(240, exit=True)
    results = []
    for threaded in (False, True):
        pool = ModPool()
        eng = SpecEngine(TYPES, n_slots=N_SLOTS, pool=pool, **PARAMS)
        if threaded:
            logs, errors = _run_threads(eng, 1, n_requests=6, n_steps=150, low_acceptance=False)
            if errors:
                raise AssertionError(f"thread errors: {errors}")
        else:
            logs = {s: [] for s in range(N_SLOTS)}
            for s in range(N_SLOTS):
                _drive_slot(eng, s, 1, 6, 150, False, logs[s])
        stats = _check_counters(eng, logs)
        results.append((logs, _counters(stats), pool.used))
    (serial, s_stats, s_used), (threaded, t_stats, t_used) = results
    for s in range(N_SLOTS):
        assert threaded[s] == serial[s], f"slot {s}: drafts differ from the single-threaded run"
    assert t_stats == s_stats
    assert t_used == s_used
    assert s_stats[-1]["type"] == "ngram-mod" and s_stats[-1]["gen_drafts"] > 100, s_stats
    print(json.dumps({"drafts": sum(len(v) for v in serial.values()), "pool_used": s_used,
                      "gen_drafts": {s["type"]: s["gen_drafts"] for s in s_stats}}))


def _subprocess(call: str, timeout: float) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS, str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import test_threads as t; t.{call}"
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{call} did not finish in {timeout} s (deadlock?)\n{exc.stderr or ''}")
    assert proc.returncode == 0, (f"{call} exited with {proc.returncode}\n"
                                  f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

def test_slot_threads_with_concurrent_pool_resets():
    info = _subprocess("stress_main(3.0)", timeout=180)
    assert info["resets"] > 10
    assert info["gen_drafts"]["ngram-mod"] > 0


def test_slot_threads_draft_as_a_single_thread_does():
    info = _subprocess("determinism_main()", timeout=240)
    assert info["pool_used"] > 0


def _begin_many(eng, prompt, times):
    for _ in range(times):
        eng.begin(0, prompt)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _parallel_ratio(jobs) -> float:
    """Wall time of the jobs on one thread each, over their wall time one after another."""
    t0 = time.perf_counter()
    for job in jobs:
        job()
    serial = time.perf_counter() - t0
    threads = [threading.Thread(target=job) for job in jobs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) / serial


@pytest.mark.skipif(_cpus() < 2, reason="needs two CPUs")
def test_long_begins_run_in_parallel():
    """ngram-mod's begin() inserts the prompt without the GIL: two threads, each with its own
    engine and pool, finish two long begins clearly faster than one thread doing both.

    Wall-clock speedups need two idle cores: each attempt also times a workload known to run
    in parallel (hashlib releases the GIL on large buffers). Unless that reference shows a clear
    speedup while begin() shows none, a slow run means a busy machine: the test skips rather
    than guess (test_long_kernels_release_the_gil checks the GIL release on any machine)."""
    rng = np.random.default_rng(0)
    # 2M-token prompts that repeat a 4000-token block: the pool slots they hash to stay in the
    # caches, so the insertion is compute-bound. Random 2M-token prompts write all over two
    # 16 MiB pools, and on a 2-vCPU VM that memory traffic alone stops two cores from scaling.
    prompts = [np.tile(rng.integers(0, 50_000, 4000).astype(np.int32), 500) for _ in range(2)]
    engines = [SpecEngine("ngram-mod", pool=ModPool()) for _ in range(2)]
    for eng, p in zip(engines, prompts):  # warm up: page in both pools
        eng.begin(0, p)
    blobs = [p.tobytes() * 6 for p in prompts]
    begins = [lambda e=e, p=p: _begin_many(e, p, 3) for e, p in zip(engines, prompts)]
    hashes = [lambda b=b: hashlib.sha256(b).digest() for b in blobs]
    seen = []
    for _ in range(6):
        reference, ours = _parallel_ratio(hashes), _parallel_ratio(begins)
        seen.append((round(reference, 2), round(ours, 2)))
        if ours < 0.8:
            return
    ref_median = float(np.median([r for r, _ in seen]))
    our_median = float(np.median([o for _, o in seen]))
    # Serialized threads give ~1.0 whatever the machine; a busy machine gives noisy ratios for
    # both workloads. Fail only when hashlib consistently ran in parallel and begin() did not.
    if ref_median < 0.75 and our_median > ref_median + 0.25:
        pytest.fail(f"two begin() calls on two threads are not faster than serial while hashlib "
                    f"is: (reference, begin) parallel/serial ratios {seen}")
    pytest.skip(f"no clear parallel speedup measurable on this machine now: (hashlib reference, "
                f"begin) parallel/serial ratios {seen}")


def _longest_gil_hold(call) -> tuple[float, float]:
    """Run `call()` while another thread loops on Python code; return the longest stretch of
    the call in which that thread made no progress, and the call's duration. A call that holds
    the GIL throughout stops the other thread for (almost) all of it, however loaded the
    machine; one that releases it leaves only scheduling gaps."""
    marks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            marks.append(time.perf_counter())

    t = threading.Thread(target=ticker)
    t.start()
    while not marks:
        time.sleep(0.001)
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    t.join()
    inside = [t0] + [m for m in marks if t0 < m < t1] + [t1]
    return float(np.diff(inside).max()), t1 - t0


# Long enough for a clear measurement (0.1 .. 1 s per call), short enough for CI.
LONG = {"ngram-mod": 12_000_000, "ngram-simple": 4_000_000, "ngram-map-k4v": 20_000_000}


def test_gil_probe_detects_a_call_holding_the_gil():
    """The probe's negative control: ModPool.get hashes its key with the GIL held."""
    key = np.ones(40_000_000, dtype=np.int32)
    pool = ModPool()        # made outside: its page faults are not part of the control
    gap, seconds = _longest_gil_hold(lambda: pool.get(key))
    assert gap > 0.5 * seconds


@pytest.mark.parametrize("what", ["ngram-mod begin", "ngram-simple first draft",
                                  "ngram-map-k4v first draft"])
def test_long_kernels_release_the_gil(what):
    typ, call = what.split(" ", 1)
    tokens = np.random.default_rng(1).integers(0, 50_000, LONG[typ]).astype(np.int32)
    eng = SpecEngine(typ)
    if call == "begin":
        work = lambda: eng.begin(0, tokens)  # noqa: E731
    else:
        eng.begin(0, tokens[:10])
        work = lambda: eng.draft(0, tokens, 7)  # noqa: E731 - indexes every position
    gap, seconds = _longest_gil_hold(work)
    assert seconds > 0.03, f"{what} took only {seconds:.3f} s: too short to tell"
    assert gap < 0.5 * seconds, f"{what} stopped the other thread for {gap:.3f} of {seconds:.3f} s"


# (exceptions need no contract; a partial developer build may lack an optional extension
# module listed in __all__)
PUBLIC_CLASSES = sorted(name for name in ngramspec.__all__
                        if inspect.isclass(getattr(ngramspec, name, None))
                        and not issubclass(getattr(ngramspec, name), BaseException))


@pytest.mark.parametrize("name", PUBLIC_CLASSES)
def test_public_classes_document_thread_safety(name):
    doc = inspect.getdoc(getattr(ngramspec, name)) or ""
    assert "Thread-safety" in doc, f"{name}'s docstring has no Thread-safety paragraph"


def test_public_class_list_is_complete():
    assert {"SpecEngine", "ModPool", "ModProposer", "MapProposer", "SimpleProposer",
            "Proposer", "PyProposer"} <= set(PUBLIC_CLASSES)

"""Kernel and engine benchmarks, grouped by context size (1k, 8k, 32k, 48k, 128k tokens).

Every figure is the engine's call from Python (argument checks, kernel, returned array), on
contexts cut from the real code-edit traces (see `benchlib`).

* ``draft-steady <size>``: the proposer's incremental state is warm (begin on the request's
  prompt, then the replayed steps up to the size); one round is the next draft calls of that
  replay, each followed by accept where the server would call it. A draft call changes the
  state, so every round gets a freshly prepared engine (pedantic setup, not timed) and the same
  calls; the per-call figure is round time / calls (``extra_info["calls"]``).
* ``draft-first <size>``: the first draft after begin on a prompt of that size (catches up
  whatever begin left to the first call, e.g. ngram-map's index of the prompt).
* ``begin <size>``: begin on a prompt of that size, fresh engine (empty pool) each round;
  ``begin-rewrite``: ngram-map's begin when the history was rewritten (index cleanup).
* ``pool``: ModPool reset and allocation. ``call-overhead``: draft on a 16-token context
  (no proposer can draft): the fixed cost of a call.
* Memory: ModPool bytes for 1/16/64 slots and each proposer's per-slot memory (its own
  accounting and the resident-set growth, in a subprocess per configuration).
"""
import numpy as np
import pytest

import benchlib
from benchlib import MIB, PROMPT_LOOKUP, PROPOSERS, SIZES
from ngramspec import ModPool, SpecEngine

NAMES = list(PROPOSERS)
# llama-cpp-python's prompt lookup costs milliseconds per call beyond 8k: benchmarked here at
# 1k and 8k only (bench/kernel_report.py covers every size).
STEADY = [(n, s) for s in SIZES for n in NAMES] + [(PROMPT_LOOKUP, s) for s in ("1k", "8k")]
BEGIN_SIZES = ["1k", "8k", "32k", "128k"]


def occurs_in(draft, context):
    """Whether `draft` is a contiguous run of `context`."""
    if len(draft) == 0 or len(draft) > len(context):
        return len(draft) == 0
    windows = np.lib.stride_tricks.sliding_window_view(context, len(draft))
    return bool(np.any(np.all(windows == draft, axis=1)))


@pytest.mark.parametrize("name,size", STEADY, ids=[f"{s}-{n}" for n, s in STEADY])
def test_draft_steady(benchmark, contexts, engines, rounds, results, name, size):
    benchmark.group = f"draft-steady {size}"
    ctx = contexts[size]
    factory = engines.factory(name)
    plan = benchlib.make_plan(factory, ctx)
    calls = len(plan.steps)
    assert calls > 0
    # The same calls on a freshly prepared engine give the same drafts (what the rounds rely on).
    assert benchlib.run_checked(benchlib.prepare(factory, ctx, plan), plan) == plan.drafted
    # Code-edit output copies its prompt: every proposer drafts somewhere in the window.
    assert plan.drafted > 0, f"{name} drafted nothing at {size}"
    benchmark.extra_info.update(calls=calls, drafts=sum(1 for n in plan.lengths if n),
                                drafted_tokens=plan.drafted,
                                mean_context=round(plan.mean_context))
    n = benchmark.pedantic(benchlib.run,
                           setup=lambda: ((benchlib.prepare(factory, ctx, plan), plan.steps), {}),
                           rounds=rounds(30 if name != PROMPT_LOOKUP else 5), warmup_rounds=0)
    assert n == calls
    if benchmark.stats is not None:
        us = benchmark.stats.stats.min / calls * 1e6
        benchmark.extra_info["us_per_call_min"] = round(us, 4)
        results["steady"][(name, size)] = us


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("name", NAMES)
def test_draft_first(benchmark, contexts, engines, rounds, name, size):
    benchmark.group = f"draft-first {size}"
    ctx = contexts[size]
    factory = engines.factory(name)
    prompt = ctx.tokens[:ctx.size]
    sampled = int(ctx.tokens[ctx.size])

    def setup():
        engine = factory()
        engine.begin(0, prompt)
        return (engine,), {}

    draft = benchmark.pedantic(lambda engine: engine.draft(0, prompt, sampled), setup=setup,
                               rounds=rounds(30))
    assert draft.dtype == np.int32 and len(draft) <= 64
    if name in ("simple", "map-k", "map-k4v"):      # these copy a run of the context
        assert occurs_in(draft, prompt)


@pytest.mark.parametrize("size", BEGIN_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_begin(benchmark, contexts, engines, rounds, name, size):
    benchmark.group = f"begin {size}"
    prompt = contexts[size].tokens[:SIZES[size]]
    factory = engines.factory(name)

    def setup():
        return (factory(),), {}

    def begin(engine):
        engine.begin(0, prompt)
        return engine

    engine = benchmark.pedantic(begin, setup=setup, rounds=rounds(20))
    assert all(s["calls_b"] == 1 for s in engine.stats())
    if benchlib.uses_pool(name):
        # every n-gram of the prompt went into the pool (no reset: far below 25 % occupancy)
        assert 0 < engine.pool.used <= len(prompt) - 24


@pytest.mark.parametrize("size", BEGIN_SIZES)
@pytest.mark.parametrize("name", ["map-k", "map-k4v"])
def test_begin_rewrite(benchmark, contexts, engines, rounds, name, size):
    """begin() after the slot's history was rewritten: llama.cpp clears the 2**18 index."""
    benchmark.group = f"begin-rewrite {size}"
    ctx = contexts[size]
    factory = engines.factory(name)
    plan = benchlib.make_plan(factory, ctx)
    prompt = ctx.tokens[:ctx.size // 2]

    def setup():
        engine = benchlib.prepare(factory, ctx, plan)
        benchlib.run(engine, plan.steps)
        return (engine,), {}

    engine = setup()[0][0]
    before = engine.proposers[0].n_keys(0)
    engine.begin(0, prompt)
    assert engine.proposers[0].n_keys(0) <= before
    benchmark.pedantic(lambda engine: engine.begin(0, prompt), setup=setup, rounds=rounds(20))


def test_pool_reset(benchmark, rounds):
    benchmark.group = "pool"
    pool = ModPool()
    engine = SpecEngine("ngram-mod", pool=pool)
    engine.begin(0, np.arange(1000, dtype=np.int32))
    assert pool.used > 0
    benchmark.pedantic(pool.reset, rounds=rounds(50))
    assert pool.used == 0 and pool.get(np.arange(24, dtype=np.int32)) == -1


def test_pool_alloc(benchmark, rounds):
    benchmark.group = "pool"
    pool = benchmark.pedantic(ModPool, rounds=rounds(20))
    assert pool.nbytes == 16 * MIB and pool.used == 0


@pytest.mark.parametrize("name", [*NAMES, PROMPT_LOOKUP])
def test_call_overhead(benchmark, engines, rounds, name):
    """1000 draft calls on a 16-token context, where no n-gram proposer can draft."""
    benchmark.group = "call-overhead (1000 calls)"
    engine = engines.factory(name)()
    ctx = np.arange(100, 116, dtype=np.int32)
    engine.begin(0, ctx)

    def calls():
        draft = engine.draft
        total = 0
        for _ in range(1000):
            total += len(draft(0, ctx, 7))
        return total

    total = benchmark.pedantic(calls, rounds=rounds(30), warmup_rounds=1)
    assert total == 0
    assert engine.stats()[0]["calls_g"] >= 1000


# ------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------

SLOTS = (1, 16, 64)
# Per-slot bounds asserted below (bytes), from the kernels' documented layouts: ngram-map has
# a 2**18 x uint32 index (1 MiB) plus 112-byte key records; ngram-mod a few counters and an
# (n_match + n_max)-token buffer; ngram-simple's state must stay O(context). Each gets the
# engine's n_max-token output buffer on top.
CTX_BYTES_PER_TOKEN = 32


def per_slot_bound(name, n_ctx):
    simple = 1 * MIB + CTX_BYTES_PER_TOKEN * n_ctx
    mapk = MIB + 64 * 1024 + CTX_BYTES_PER_TOKEN * n_ctx
    mod = 4096
    return {"simple": simple, "map-k": mapk, "map-k4v": mapk, "mod": mod,
            "chain": simple + 2 * mapk + mod}[name]


@pytest.mark.parametrize("slots", SLOTS)
def test_modpool_fixed_size(slots):
    """One 16 MiB table whatever the number of slots, shared by every ngram-mod slot."""
    engine = SpecEngine(PROPOSERS["chain"], n_slots=slots)
    mods = [p for p in engine.proposers if p.name == "ngram-mod"]
    assert len(mods) == 1 and mods[0].pool is engine.pool
    assert engine.pool.nbytes == 16 * MIB and engine.pool.size == 1 << 22
    mod_only = SpecEngine("ngram-mod", n_slots=slots)
    assert mod_only.memory_bytes() <= slots * per_slot_bound("mod", 0)


@pytest.fixture(scope="module")
def memory(contexts, tmp_path_factory, smoke):
    """Memory probes of every proposer for 1, 16 and 64 slots, each slot serving the 8k
    request (begin + replayed steps), one subprocess per configuration."""
    configs = [(name, slots) for name in NAMES for slots in SLOTS]
    steps = 64 if smoke else 256
    return benchlib.memprobe_many(configs, contexts["8k"], steps, tmp_path_factory.mktemp("mem"))


@pytest.mark.parametrize("slots", SLOTS)
@pytest.mark.parametrize("name", NAMES)
def test_memory_per_slot(memory, name, slots):
    probe = next(m for m in memory if m["name"] == name and m["slots"] == slots)
    per_slot = probe["memory_bytes"] / slots
    assert 0 < per_slot <= per_slot_bound(name, probe["context"]), probe
    # what the process really grew by is accounted for (calloc'ed index pages that were never
    # touched may make it smaller, never much larger)
    assert probe["rss_engine"] <= probe["memory_bytes"] * 1.1 + 4 * MIB, probe
    if benchlib.uses_pool(name):
        assert probe["pool_nbytes"] == 16 * MIB
        assert 15.5 * MIB <= probe["rss_pool"] <= 17 * MIB, probe
    else:
        assert probe["pool_nbytes"] == 0

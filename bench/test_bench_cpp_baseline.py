"""The C++ baseline is llama.cpp-faithful and drives like an engine (fast; runs in smoke mode).

The full check over every golden file is ``python bench cpp-baseline`` (~20 s); here a few
requests of a few files, and the benchmark plans replayed through both ngramspec and C++.
"""
import numpy as np
import pytest

import benchlib
import cpp_baseline
from llamacpp_baseline import CppEngine, timer_overhead_ns


@pytest.mark.parametrize("name", [
    "code-edit.simple-default.shared", "code-edit.map-k-small.fresh",
    "chat.map-k4v-small.shared", "model-generated.mod-small.shared-2slots",
    "agentic.chain.shared"])
def test_golden_prefix(name):
    path = cpp_baseline.GOLDEN / f"{name}.jsonl.gz"
    res = cpp_baseline.check_file(path, max_requests=4)
    assert res["draft_calls"] > 0


def test_golden_counters():
    path = cpp_baseline.GOLDEN / "model-generated.mod-default.fresh.jsonl.gz"
    res = cpp_baseline.check_file(path)
    assert res["requests"] == 40


@pytest.mark.parametrize("name", ["simple", "map-k", "map-k4v", "mod", "chain"])
def test_same_plan_as_ngramspec(name, corpus, engines):
    """On a benchmark context both engines make the same calls: same draft lengths, same
    accepts; the C++ engine reports a time for each of its draft calls."""
    ctx = corpus.context("1k", benchlib.SIZES["1k"])
    ours = benchlib.make_plan(engines.factory(name), ctx, k=20)
    theirs = benchlib.make_plan(benchlib.cpp_factory(name), ctx, k=20)
    assert ours.lengths == theirs.lengths
    assert [s[2] for s in ours.warm + ours.steps] == [s[2] for s in theirs.warm + theirs.steps]
    engine = benchlib.prepare(benchlib.cpp_factory(name), ctx, theirs)
    ns = benchlib.run_timed(engine, theirs.steps)
    assert len(ns) == len(theirs.steps) and (ns > 0).all()


def test_engine_validation():
    with pytest.raises(ValueError, match="ngram-cache"):
        CppEngine("ngram-cache")
    with pytest.raises(ValueError, match="ngram_mod_n_match"):
        CppEngine("ngram-mod", ngram_mod_n_match=0)
    e = CppEngine("ngram-simple", n_slots=2)
    with pytest.raises(ValueError, match="slot"):
        e.draft(2, np.arange(10, dtype=np.int32), 1)
    assert len(e.draft(0, np.arange(10, dtype=np.int32), 1)) == 0
    assert 0 < timer_overhead_ns(1000) < 10_000

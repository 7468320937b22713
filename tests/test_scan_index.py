"""ngram-map-k4v's ScanIndex (statistics scans through occurrence chains) gives exactly the
drafts, key records and statistics of the plain scan it replaces.

The default threshold (2048 positions) is lowered so short random streams use the index on
nearly every scan; the plain scan (threshold above any context) is the baseline, itself checked
against the pure-Python reference by test_kernels_vs_reference.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngramspec import SpecEngine
from ngramspec import MapProposer

NEVER = 2**40


def engine(threshold, n, m, min_hits, n_slots=2):
    return SpecEngine.from_proposers(
        [MapProposer(n, m, min_hits, key_only=False, n_slots=n_slots, stat_index_min=threshold)],
        n_slots=n_slots)


def drive(eng, script):
    """Run (kind, slot, tokens, sampled, acc) steps; returns every draft and the statistics."""
    ctx = {}
    out = []
    for kind, slot, tokens, sampled, acc in script:
        if kind == "begin":
            ctx[slot] = list(tokens)
            eng.begin(slot, np.asarray(tokens, dtype=np.int32))
            continue
        if kind == "shrink":                 # a shorter context without begin()
            ctx[slot] = ctx.get(slot, [])[:len(tokens)]
        d = eng.draft(slot, np.asarray(ctx.get(slot, []), dtype=np.int32), sampled)
        out.append(d.tolist())
        ctx.setdefault(slot, []).append(sampled)
        if len(d):
            k = min(acc, len(d))
            eng.accept(slot, k)
            ctx[slot].extend(d[:k].tolist())
        ctx[slot].extend(tokens)
    return out, counters(eng)


def counters(eng):
    return [{k: v for k, v in s.items() if not k.startswith("t_")} for s in eng.stats()]


@st.composite
def scripts(draw):
    alphabet = draw(st.integers(2, 5))
    tok = st.integers(0, alphabet - 1)
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        slot = draw(st.integers(0, 1))
        steps.append(("begin", slot, draw(st.lists(tok, max_size=120)), 0, 0))
        for _ in range(draw(st.integers(1, 40))):
            kind = draw(st.sampled_from(["draft"] * 8 + ["shrink"]))
            grow = draw(st.lists(tok, max_size=6))
            steps.append((kind, slot, grow if kind == "draft" else [0] * draw(st.integers(0, 80)),
                          draw(tok), draw(st.integers(0, 8))))
    return steps


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts(), n=st.integers(1, 4), m=st.integers(1, 6), min_hits=st.integers(1, 2),
       threshold=st.integers(1, 12))
def test_index_matches_plain_scan(script, n, m, min_hits, threshold):
    want = drive(engine(NEVER, n, m, min_hits), script)
    got = drive(engine(threshold, n, m, min_hits), script)
    assert got == want


def test_long_context_uses_the_index_and_counts_it():
    """An 18k-token stream with repeats: same drafts with the default threshold and without the
    index, and the index shows in memory_bytes."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 3000, 4000).astype(np.int32)
    text = np.concatenate([base, rng.integers(0, 3000, 6000).astype(np.int32), base, base])
    runs = []
    for threshold in (NEVER, 2048):
        eng = engine(threshold, 4, 16, 1, n_slots=1)
        eng.begin(0, text[:8000])
        drafts = [eng.draft(0, text[:L], int(text[L])).tolist() for L in range(8000, 17900, 7)]
        runs.append((drafts, counters(eng), eng.memory_bytes()))
    assert runs[0][:2] == runs[1][:2]
    assert sum(map(len, runs[0][0])) > 0
    assert runs[1][2] > runs[0][2] + 4 * 8000   # at least prev[] over the indexed positions


def test_stat_index_min_is_validated():
    with pytest.raises(ValueError, match="stat_index_min"):
        MapProposer(key_only=False, stat_index_min=0)

"""The statistics' timers (TSC ticks on x86, converted to microseconds when read) agree with
the wall clock around the calls they time."""
from __future__ import annotations

import time

import numpy as np

from ngramspec import SpecEngine


def test_begin_time_matches_the_wall_clock():
    tokens = np.random.default_rng(3).integers(0, 50_000, 3_000_000).astype(np.int32)
    eng = SpecEngine("ngram-mod")
    t0 = time.perf_counter()
    eng.begin(0, tokens)
    wall_us = (time.perf_counter() - t0) * 1e6
    timed = eng.stats()[0]["t_begin_us"]
    # the timed interval lies inside the wall interval; the call is almost all of it
    assert 0.5 * wall_us <= timed <= 1.02 * wall_us + 50, (timed, wall_us)


def test_draft_and_accept_times_add_up():
    eng = SpecEngine("ngram-simple", ngram_simple_size_n=2, ngram_simple_size_m=4)
    ctx = np.tile(np.arange(50, dtype=np.int32), 40)
    eng.begin(0, ctx[:100])
    for L in range(100, 1900, 5):
        if len(eng.draft(0, ctx[:L], int(ctx[L]))):
            eng.accept(0, 1)
    s = eng.stats()[0]
    assert s["calls_g"] == 360 and s["calls_a"] > 0
    assert 0 <= s["t_draft_us"] < 1_000_000 and 0 <= s["t_accept_us"] < 1_000_000

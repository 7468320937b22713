"""What the validation tests share (tests/test_validation*.py): llama.cpp's n-gram types, their
default chain, a token stream every proposer finds matches in, and an engine with a pending draft."""
from __future__ import annotations

import numpy as np

from ngramspec import SpecEngine

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
CHAIN = ",".join(NGRAM_TYPES)


def repetitive(n: int = 400, period: int = 37, seed: int = 0) -> np.ndarray:
    """A token stream that repeats with noise, so every proposer finds matches."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 50_000, period)
    out = np.resize(base, n).astype(np.int32)
    noise = rng.random(n) < 0.05
    out[noise] = rng.integers(0, 50_000, int(noise.sum()))
    return out


def engine_with_pending_draft(n_max=None):
    """An ngram-simple engine whose slot 0 has a pending draft; returns (engine, draft)."""
    eng = SpecEngine("ngram-simple", n_slots=2, ngram_simple_size_n=2, ngram_simple_size_m=6)
    ctx = np.tile(np.arange(10, 18, dtype=np.int32), 10)
    eng.begin(0, ctx)
    draft = eng.draft(0, ctx, 10, n_max=n_max)
    assert len(draft) > 0
    return eng, draft

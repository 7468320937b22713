"""Hypothesis strategies shared by the kernel-vs-reference and state-machine tests."""
from __future__ import annotations

from hypothesis import strategies as st

from reference import PRIORITY


@st.composite
def alphabets(draw, k_max: int = 6, kinds=("small", "small", "wide", "colliding", "many")):
    """Token alphabets of 2 .. `k_max` ids, one of `kinds`:

    - ``small``: 0 .. k-1, so n-grams repeat;
    - ``many``: 20 .. 60 ids, few chance matches: drafts come from copied spans only;
    - ``wide``: any int32 ids; ``huge``: ids near 2^31 (the uint32 / uint64 hash wraparound);
    - ``colliding``: ids that differ by multiples of 2^22, which change neither the low 18 bits
      of the map hash nor the low 22 bits of the mod hash (the same ngram-mod pool entry and
      ngram-map index slot).
    """
    k = draw(st.integers(2, k_max))
    kind = draw(st.sampled_from(kinds))
    if kind == "small":
        return list(range(k))
    if kind == "many":
        return list(range(draw(st.integers(20, 60))))
    if kind in ("wide", "huge"):
        lo = 0 if kind == "wide" else 2**31 - 64
        return draw(st.lists(st.integers(lo, 2**31 - 1), min_size=k, max_size=k, unique=True))
    bases = draw(st.lists(st.integers(0, 2**22 - 1), min_size=1, max_size=3, unique=True))
    return [b + j * 2**22 for j in range(k) for b in bases][:k]


@st.composite
def configs(draw, size_m: int = 8, n_match: int = 6, n_min: int = 8, n_max: int = 12):
    """``(types, params)``: a chain of 1 .. 4 proposer types and small parameters for all of them
    (at most the given `size_m`, `n_match`, `n_min`, `n_max`)."""
    types = draw(st.lists(st.sampled_from(PRIORITY), min_size=1, max_size=4, unique=True))
    params = {}
    for pre in ("ngram_simple", "ngram_map_k", "ngram_map_k4v"):
        params[pre + "_size_n"] = draw(st.integers(1, 4))
        params[pre + "_size_m"] = draw(st.integers(1, size_m))
    for pre in ("ngram_map_k", "ngram_map_k4v"):
        params[pre + "_min_hits"] = draw(st.integers(1, 3))
    params["ngram_mod_n_match"] = draw(st.integers(1, n_match))
    params["ngram_mod_n_min"] = draw(st.integers(0, n_min))
    # n_min > n_max together is refused by the registry (it would never draft)
    params["ngram_mod_n_max"] = draw(st.integers(params["ngram_mod_n_min"], n_max))
    return types, params

"""ngram-cache under hash flooding (issue 20, point 5), and the exactness of its tables.

llama.cpp's n-gram hash sends every (x, x) and (x, x, y, y) to 0, and a part's token hash is
the identity, so in std::unordered_map crafted tokens or cache files make every insertion scan
one long bucket. `NgramCache` keeps those containers' iteration orders (which break ties and
order saved files) but finds keys through a keyed index: each crafted input must cost about
what a random input of the same size costs. Times are compared within one test (best of
three, interleaved), never against absolute seconds.
"""
import struct
import time

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ngramspec import SpecEngine
from ngramspec._cache import NgramCache, _StdCache

# Crafted inputs take O(n^2) in llama.cpp's containers: at these sizes 5 to 20 s, against
# tens of milliseconds for random input. The bound leaves room for a loaded machine.
MAX_RATIO = 8


def best_of_three(*jobs):
    """Run the jobs in turn three times; the best time of each."""
    best = [float("inf")] * len(jobs)
    for _ in range(3):
        for i, job in enumerate(jobs):
            t0 = time.perf_counter()
            job()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def assert_not_flooded(crafted, random_):
    t_crafted, t_random = best_of_three(crafted, random_)
    assert t_crafted <= MAX_RATIO * t_random, (t_crafted, t_random)


def doubled(n):
    """1 1 2 2 3 3 ...: every 2-gram (x, x) and 4-gram (x, x, y, y) has llama.cpp hash 0."""
    return np.repeat(np.arange(1, n + 1, dtype=np.int32), 2)


def random_like(tokens, seed=0):
    return np.random.default_rng(seed).integers(1, tokens.max() + 1, tokens.size,
                                                dtype=np.int32)


def colliding_followers(n):
    """n distinct tokens that all fall into one bucket of a part holding n tokens (multiples
    of the bucket count libstdc++ has then), and that bucket count."""
    ref = _StdCache()
    ref.load([((0,), [(t, 1) for t in range(1, n + 1)])])
    buckets = ref.bucket_count((0,))
    return [buckets * k for k in range(1, n + 1)], buckets


def records_file(records):
    out = bytearray()
    for ngram, pairs in records:
        key = list(ngram) + [-1] * (4 - len(ngram))
        out += struct.pack("<4ii", *key, len(pairs))
        for tok, cnt in pairs:
            out += struct.pack("<ii", tok, cnt)
    return bytes(out)


# --------------------------------------------------------------------------------------------
# Flooding: crafted inputs cost what random ones do
# --------------------------------------------------------------------------------------------

def test_update_with_colliding_ngrams():
    crafted = doubled(12000)
    rnd = random_like(crafted)
    assert_not_flooded(lambda: NgramCache().update(crafted), lambda: NgramCache().update(rnd))


def test_load_of_a_crafted_file():
    c = NgramCache()
    c.update(doubled(12000))
    crafted = c.to_bytes()
    r = NgramCache()
    r.update(random_like(doubled(12000)))
    rnd = r.to_bytes()
    assert abs(len(crafted) - len(rnd)) < 0.1 * len(rnd)
    assert_not_flooded(lambda: NgramCache.from_bytes(crafted),
                       lambda: NgramCache.from_bytes(rnd))


def test_part_with_colliding_tokens():
    """One n-gram followed by 20000 tokens in one bucket, from a file and from a stream."""
    toks, buckets = colliding_followers(20000)
    assert buckets > 20000
    rnd_toks = np.random.default_rng(1).choice(2 ** 31 - 1, 20000, replace=False).tolist()
    crafted_file = records_file([((7,), [(t, 1) for t in toks])])
    random_file = records_file([((7,), [(t, 1) for t in rnd_toks])])
    loaded = NgramCache.from_bytes(crafted_file)
    assert loaded._bucket_count((7,)) == buckets          # really one bucket
    assert_not_flooded(lambda: NgramCache.from_bytes(crafted_file),
                       lambda: NgramCache.from_bytes(random_file))
    # the stream 7 t1 7 t2 7 t3 ...: the part of (7,) gets every t
    crafted_stream = np.ravel([[7, t] for t in toks]).astype(np.int32)
    random_stream = np.ravel([[7, t] for t in rnd_toks]).astype(np.int32)
    assert_not_flooded(lambda: NgramCache().update(crafted_stream, 1, 1),
                       lambda: NgramCache().update(random_stream, 1, 1))


def test_first_draft_on_a_crafted_prompt():
    crafted = doubled(10000)
    rnd = random_like(crafted)

    def first_draft(prompt):
        def run():
            e = SpecEngine("ngram-cache")
            e.begin(0, prompt)
            e.draft(0, prompt, 1)
        return run

    assert_not_flooded(first_draft(crafted), first_draft(rnd))


# --------------------------------------------------------------------------------------------
# Exactness: the iteration orders of llama.cpp's own containers
# --------------------------------------------------------------------------------------------

def assert_same(cache, ref):
    assert cache.items() == ref.items()           # outer and inner order, counts
    assert cache._bucket_count() == ref.bucket_count()
    for ngram, _ in ref.items()[:50]:
        assert cache._bucket_count(ngram) == ref.bucket_count(ngram)


def test_crafted_inputs_keep_llamacpp_order():
    for tokens in (doubled(3000), np.ravel([[7, t] for t in colliding_followers(3000)[0]])):
        c, r = NgramCache(), _StdCache()
        c.update(tokens)
        r.update(tokens)
        assert_same(c, r)
        loaded = _StdCache()
        loaded.load(r.items())              # file order = iteration order
        assert_same(NgramCache.from_bytes(c.to_bytes()), loaded)


tokens_st = st.one_of(
    st.lists(st.integers(0, 3), max_size=300),            # many repeats and ties
    st.lists(st.integers(0, 60), max_size=600),
    st.lists(st.integers(0, 2 ** 31 - 1), max_size=200),  # all distinct
    st.lists(st.sampled_from([0, 97, 194, 291, 388, 5, 102]), max_size=400),  # same buckets
)
op_st = st.one_of(
    st.tuples(st.just("update"), st.integers(0, 2), tokens_st, st.integers(1, 4),
              st.integers(1, 4)),
    st.tuples(st.just("merge"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("copy"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("clear"), st.integers(0, 2)),
    st.tuples(st.just("reload"), st.integers(0, 2), st.integers(0, 2)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, min_size=1, max_size=12))
@example([("update", 0, [0, 0, 1, 0, 0, 1], 1, 4), ("reload", 0, 0), ("merge", 1, 0),
          ("copy", 2, 1), ("clear", 1), ("update", 1, [5, 5, 5], 1, 2), ("merge", 2, 1)])
def test_operations_match_llamacpp_containers(ops):
    """Any sequence of update / merge / copy / clear / load on three caches leaves every
    cache in exactly the state libstdc++'s unordered_map reaches: same items in the same
    outer and inner order, same bucket counts."""
    caches = [NgramCache() for _ in range(3)]
    refs = [_StdCache() for _ in range(3)]
    for op in ops:
        if op[0] == "update":
            _, i, toks, a, b = op
            lo, hi = min(a, b), max(a, b)
            caches[i].update(toks, lo, hi)
            refs[i].update(toks, lo, hi)
        elif op[0] == "merge":
            _, i, j = op
            if i != j:
                caches[i].merge(caches[j])
                refs[i].merge(refs[j])
        elif op[0] == "copy":
            _, i, j = op
            caches[i] = caches[j].copy()
            refs[i] = refs[j].copy()
        elif op[0] == "clear":
            caches[op[1]].clear()
            refs[op[1]].clear()
        else:   # load cache j's file into a new cache i (file order = j's iteration order)
            _, i, j = op
            data, records = caches[j].to_bytes(), refs[j].items()
            caches[i] = NgramCache.from_bytes(data)
            refs[i] = _StdCache()
            refs[i].load(records)
    for c, r in zip(caches, refs):
        assert_same(c, r)

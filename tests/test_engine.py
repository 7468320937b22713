"""SpecEngine, ModPool and statistics: the API's semantics (spec sections 1, 5, 7)."""
import re

import numpy as np
import pytest

from ngramspec import ModPool, SpecEngine, acceptance_line, statistics_line
from ngramspec import MapProposer, ModProposer, PyProposer, SimpleProposer
from ngramspec._engine import Engine


def test_token_type_is_int32():
    e = SpecEngine("ngram-simple", ngram_simple_size_n=2, ngram_simple_size_m=2)
    ctx = np.array([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 1, 2], dtype=np.int32)
    d = e.draft(0, ctx, 3)
    assert d.dtype == np.int32 and d.dtype == np.intc
    assert d.tolist() == [4, 5]


def test_pool_is_fixed_16_mib_and_shared():
    pool = ModPool()
    assert pool.size == 4 * 1024 * 1024
    assert pool.nbytes == 16 * 1024 * 1024
    e = SpecEngine("ngram-mod", n_slots=8, pool=pool, ngram_mod_n_match=4)
    assert e.pool is pool
    assert all(p.pool is pool for p in e.proposers)
    e.begin(3, np.arange(100, dtype=np.int32))
    assert pool.used == 96 and pool.occupancy == pytest.approx(96 / pool.size)
    pool.reset()
    assert pool.used == 0 and pool.get([0, 1, 2, 3]) == -1


def test_rolling_hash_lands_on_llamacpp_slots():
    """begin() inserts with the rolling hash; ModPool.get recomputes llama.cpp's hash."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 50000, 3000).astype(np.int32)
    for n in (1, 3, 24, 100):
        pool = ModPool()
        SpecEngine("ngram-mod", pool=pool, ngram_mod_n_match=n).begin(0, prompt)
        table = {}                              # llama.cpp: recomputed hash, last writer wins
        for i in range(len(prompt) - n):
            table[llama_mod_slot(prompt[i:i + n])] = int(prompt[i + n])
        assert pool.used == len(table)
        for i in range(len(prompt) - n):
            key = prompt[i:i + n]
            assert pool.get(key) == table[llama_mod_slot(key)]


def llama_mod_slot(tokens):
    h = 0
    for t in tokens:
        h = (h * 6364136223846793005 + int(t)) % 2**64
    return h % 2**22


def test_priority_order_and_first_nonempty_wins():
    e = SpecEngine("ngram-mod,ngram-simple", ngram_simple_size_n=2, ngram_simple_size_m=3,
                   ngram_mod_n_match=2, ngram_mod_n_min=1, ngram_mod_n_max=5)
    assert e.types == ["ngram-simple", "ngram-mod"]
    prompt = np.array([7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7], dtype=np.int32)
    e.begin(0, prompt)
    d = e.draft(0, prompt, 8)
    assert d.tolist() == [9, 10, 11]               # ngram-simple drafted: ngram-mod not called
    s = {x["type"]: x for x in e.stats()}
    assert s["ngram-simple"]["calls_g"] == 1 and s["ngram-mod"]["calls_g"] == 0
    e.accept(0, 2)
    s = {x["type"]: x for x in e.stats()}
    assert s["ngram-simple"]["calls_a"] == 1 and s["ngram-mod"]["calls_a"] == 0
    assert s["ngram-simple"]["acc_per_pos"] == [1, 1]


def test_n_max_truncates_after_the_proposer_ran():
    e = SpecEngine("ngram-mod", ngram_mod_n_match=2, ngram_mod_n_min=1, ngram_mod_n_max=8)
    prompt = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 1], dtype=np.int32)
    e.begin(0, prompt)
    d = e.draft(0, prompt, 2, n_max=3)
    assert d.tolist() == [3, 4, 5]
    assert e.proposers[0].slot_state(0)[1] == 8     # n_draft_last is the untruncated length
    assert e.stats()[0]["gen_tokens"] == 3
    with pytest.raises(ValueError, match="n_accepted"):
        e.accept(0, 4)
    e.accept(0, 3)
    assert e.draft(0, prompt, 2, n_max=0).size == 0     # no call at all
    assert e.stats()[0]["calls_g"] == 1


def test_mod_low_acceptance_resets_shared_pool():
    pool = ModPool()
    e = SpecEngine("ngram-mod", n_slots=2, pool=pool, ngram_mod_n_match=2, ngram_mod_n_min=1,
                   ngram_mod_n_max=4)
    e.begin(1, np.array([50, 51, 52, 53, 54], dtype=np.int32))
    prompt = np.array([1, 2, 3, 4, 5, 1], dtype=np.int32)
    e.begin(0, prompt)
    for k in range(5):
        assert pool.used > 0
        assert e.draft(0, prompt, 2).size > 0
        e.accept(0, 0)
    assert pool.used == 0                           # 5th poor draft wiped every slot's n-grams
    assert e.proposers[0].slot_state(0) == (0, 4, 0)


def test_accept_requires_a_pending_draft():
    e = SpecEngine("ngram-simple")
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        e.accept(0, 0)


def test_py_proposer_in_chain():
    class Echo(PyProposer):
        def __init__(self):
            super().__init__("echo", 2, 4)
            self.seen = []

        def on_begin(self, slot, prompt):
            self.seen.append(("begin", slot, prompt.tolist()))

        def on_draft(self, slot, inp, sampled):
            return [sampled, sampled]

        def on_accept(self, slot, n, is_other):
            self.seen.append(("accept", slot, n, is_other))

    echo = Echo()
    e = SpecEngine.from_proposers([SimpleProposer(n_slots=2), echo], n_slots=2)
    e.begin(1, [5, 6])
    assert e.draft(1, [5, 6], 9).tolist() == [9, 9]
    e.accept(1, 1)
    assert echo.seen == [("begin", 1, [5, 6]), ("accept", 1, 1, False)]
    assert e.stats()[1]["type"] == "echo" and e.stats()[1]["acc_tokens"] == 1


def test_statistics_line_format():
    e = SpecEngine("ngram-simple", ngram_simple_size_n=2, ngram_simple_size_m=3)
    line = e.stats_lines()[0]
    assert line == ("statistics     ngram-simple: #calls(b,g,a) =    0      0      0, "
                    "#gen drafts =      0, #acc drafts =     0, #gen tokens =      0, "
                    "#acc tokens =     0, dur(b,g,a) = 0.000, 0.000, 0.000 ms")
    s = {"type": "ngram-mod", "calls_b": 3, "calls_g": 120, "calls_a": 4, "gen_drafts": 4,
         "acc_drafts": 3, "gen_tokens": 200, "acc_tokens": 130, "acc_per_pos": [3, 2, 1],
         "t_begin_us": 1500, "t_draft_us": 2, "t_accept_us": 12345}
    assert statistics_line(s) == (
        "statistics        ngram-mod: #calls(b,g,a) =    3    120      4, #gen drafts =      4, "
        "#acc drafts =     3, #gen tokens =    200, #acc tokens =   130, #mean acc len = 33.50, "
        "#acc rate/pos = (0.750, 0.500, 0.250), dur(b,g,a) = 1.500, 0.002, 12.345 ms")
    assert acceptance_line(130, 200, 4) == (
        "draft acceptance = 0.65000 (  130 accepted /   200 generated), mean len = 33.50")


def test_memory_bytes_per_slot():
    m = MapProposer(n_slots=4)
    assert m.memory_bytes() >= 4 * 262144 * 4
    assert ModProposer(n_slots=64).memory_bytes() < 64 * 1024
    assert SimpleProposer(n_slots=64, indexed=False).memory_bytes() == 0


def test_simple_index_memory_follows_distinct_ngrams():
    """ngram-simple's position index (_posindex.pxd over _hashtable.pxd): 4 bytes per indexed
    position plus 16 to 32 bytes per distinct n-gram (8-byte entries, at most half full), as
    its docstring says; an untouched slot holds nothing."""
    rng = np.random.default_rng(3)
    n, L = 3, 20_000
    for text, distinct in ((rng.integers(0, 50_000, L), L - n - 1),      # all distinct
                           (np.tile(np.arange(50), L // 50), 50)):         # 50 n-grams
        p = SimpleProposer(n, 4, n_slots=2)
        eng = SpecEngine.from_proposers([p])
        text = text.astype(np.int32)
        eng.begin(0, text)
        eng.draft(0, text, 1)
        positions = L - n                    # indexed: 0 .. L-n-1
        mem = p.memory_bytes()
        assert 4 * positions + 16 * distinct <= mem <= 8 * (positions + 1024) + 32 * max(
            distinct, 4096 // 2)


@pytest.mark.parametrize("n", [1, 2, 5, 12])
def test_simple_index_matches_scan(n):
    rng = np.random.default_rng(n)
    seq = rng.integers(0, 3, 4000).astype(np.int32)
    fast = SpecEngine.from_proposers([SimpleProposer(n, 4)])
    scan = SpecEngine.from_proposers([SimpleProposer(n, 4, indexed=False)])
    for e in (fast, scan):
        e.begin(0, seq[:100])
    for L in range(100, 4000, 7):
        a = fast.draft(0, seq[:L], int(seq[L]))
        b = scan.draft(0, seq[:L], int(seq[L]))
        assert a.tolist() == b.tolist()
        if L == 2000:                           # a shorter context without begin(): rebuilt
            assert fast.draft(0, seq[:300], 1).tolist() == scan.draft(0, seq[:300], 1).tolist()


@pytest.mark.parametrize("spec", ["ngram-map-k", "ngram-map-k4v"])
def test_map_reindex_option_makes_a_new_prompt_fresh(spec):
    from ngramspec.replay import replay
    from ngramspec.traces import read_requests
    from conftest import TRACES
    reqs = read_requests(str(TRACES / "code-edit.jsonl.gz"), 3)
    key = spec.replace("-", "_") + "_reindex"
    fresh = replay(reqs, spec, {}, state="fresh").requests
    shared = replay(reqs, spec, {key: 1}, state="shared").requests
    compat = replay(reqs, spec, {}, state="shared").requests
    for f, s in zip(fresh, shared):
        assert f["steps"] == s["steps"]
    assert compat[1]["steps"] != fresh[1]["steps"]     # llama.cpp's stale state differs

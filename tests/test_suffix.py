"""ngram-suffix (issue 7): the Cython kernel against its pure-Python reference, bounded memory,
the shared global store under threads, and the parameter contract.

* hypothesis: random small-alphabet requests (repeats, continued prompts, fresh ones) on one or
  two slots, every parameter varied (tiny budgets and contexts included, so eviction and
  re-indexing happen): every draft must equal the reference's;
* a long stream of requests keeps the global store and every slot within their budgets;
* one thread per slot on one proposer: no crash or deadlock (in a subprocess with a timeout),
  drafts deterministic when the store is off, never another slot's tokens when it is on.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import drive_recorded  # noqa: E402
from reference_suffix import ReferenceSuffix  # noqa: E402

suffix = pytest.importorskip("ngramspec._suffix", reason="extension not built "
                             "(python setup.py build_ext --inplace)")
from ngramspec._suffix import SuffixProposer, sam_bytes  # noqa: E402
from ngramspec.registry import TYPES, build_proposers  # noqa: E402

from conftest import ROOT  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                       HealthCheck.data_too_large])


def replay(prop, slot, prompt, output, accept=None):
    """The golden replay loop for one request; yields every draft (as a list)."""
    prop.begin(slot, np.asarray(prompt, dtype=np.int32))

    def draft(cache, sampled):
        return [int(t) for t in prop.draft(slot, np.asarray(cache, dtype=np.int32), sampled)]

    yield from drive_recorded(prompt, output, draft, lambda k: prop.accept(slot, k), accept)


# ---------------------------------------------------------------------------------------------
# kernel == reference
# ---------------------------------------------------------------------------------------------

@st.composite
def token_runs(draw, alphabet, max_len):
    """A token list with repeats: random tokens, copies of earlier stretches, periodic runs."""
    out = []
    while len(out) < max_len:
        kind = draw(st.sampled_from(["random", "copy", "loop"]))
        if kind == "random" or not out:
            out += draw(st.lists(st.sampled_from(alphabet), min_size=1, max_size=12))
        elif kind == "copy":
            i = draw(st.integers(0, len(out) - 1))
            out += out[i:i + draw(st.integers(1, 40))]
        else:
            period = out[-draw(st.integers(1, min(4, len(out)))):]
            out += period * draw(st.integers(1, 6))
        if draw(st.integers(0, 5)) == 0:
            break
    return out[:max_len]


@st.composite
def scenarios(draw):
    k = draw(st.integers(2, 5))
    alphabet = draw(st.sampled_from([list(range(k)), [7, 2 ** 31 - 1, 40000, 3, 9][:k]]))
    n_slots = draw(st.integers(1, 3))
    params = dict(
        max_draft=draw(st.sampled_from([1, 3, 8, 16])),
        min_prob=draw(st.sampled_from([0.0, 0.005, 0.1, 0.6])),
        gain_cost=draw(st.sampled_from([0.0, 0.02, 0.3])),
        draft_cost=draw(st.sampled_from([0.0, 0.0078125, 0.1])),
        max_context=draw(st.sampled_from([256, 300, 65536])),
        global_tokens=draw(st.sampled_from([0, 2, 30, 200, 1 << 20])),
        global_prompt=draw(st.sampled_from([0, 4])),
        _count_depth=draw(st.sampled_from([1, 2, 32])),
    )
    requests, prev = [], []
    for _ in range(draw(st.integers(1, 6))):
        how = draw(st.sampled_from(["fresh", "continue", "repeat"]))
        if how == "continue" and prev:          # an agent's next turn
            prompt = prev[0] + prev[1] + draw(token_runs(alphabet, 30))
        elif how == "repeat" and prev:           # the same prompt again
            prompt = list(prev[0])
        else:
            prompt = draw(token_runs(alphabet, 320))
        output = draw(token_runs(alphabet, 120))
        slot = draw(st.integers(0, n_slots - 1))
        accept = draw(st.sampled_from([None, None, None, 0, 1]))
        requests.append((slot, prompt, output, accept))
        prev = (prompt, output)
    return n_slots, params, requests


@settings(max_examples=150, **SETTINGS)
@given(scenarios(), st.lists(st.booleans(), min_size=6, max_size=6))
def test_kernel_matches_reference(scenario, ends):
    """Drafts, store and calibration (one for all slots) as the reference's, with requests
    ended by `end` or by their slot's next `begin`."""
    n_slots, params, requests = scenario
    kern = SuffixProposer(n_slots, **params)
    ref = ReferenceSuffix(n_slots, **params)
    for r, (slot, prompt, output, accept) in enumerate(requests):
        got = list(replay(kern, slot, prompt, output, accept))
        want = list(replay(ref, slot, prompt, output, accept))
        assert got == want, f"request {r}"
        if ends[r]:
            kern.end(slot)
            ref.end(slot)
        acc, tried = kern.calibration()
        assert acc.ravel().tolist() == ref.acc[:acc.size], f"request {r}"
        assert tried.ravel().tolist() == ref.tried[:tried.size], f"request {r}"
        assert kern.global_text().tolist() == ref.store.sam.text, f"request {r}"
        assert [kern.slot_stats(s)["indexed"] for s in range(n_slots)] == \
            [len(rs.loc.text) for rs in ref.slots], f"request {r}"


# ---------------------------------------------------------------------------------------------
# draft_tree: the chain first, then the next-best branches (issue 29, SGLang's draft tree)
# ---------------------------------------------------------------------------------------------

def replay_trees(prop, requests, seed):
    """The requests' golden replay with a draft_tree call after every draft, the chain kept
    whole or cut and the budget drawn from `seed`; yields (chain, n_chain, budget, tokens,
    parents)."""
    rng = random.Random(seed)
    for slot, prompt, output, accept in requests:
        for d in replay(prop, slot, prompt, output, accept):
            n_chain = rng.randint(0, len(d)) if rng.random() < 0.3 else len(d)
            budget = rng.choice([0, 1, 3, 8, 16, 40])
            tokens, parents = prop.draft_tree(slot, n_chain, budget)
            yield d, n_chain, budget, [int(t) for t in tokens], [int(p) for p in parents]


def tree_depths(parents):
    """Each token's depth (1 under the root); asserts that parents come first."""
    depth = []
    for i, p in enumerate(parents):
        assert -1 <= p < i, f"token {i} hangs off {p}: parents come first"
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


@settings(max_examples=80, **SETTINGS)
@given(scenarios(), st.integers(0, 2 ** 32 - 1))
def test_tree_kernel_matches_reference(scenario, seed):
    """The kernel's trees are the reference's (a slow model of the same best-first rule), and
    drafting trees changes none of the chains."""
    n_slots, params, requests = scenario
    kern = SuffixProposer(n_slots, **params)
    got = list(replay_trees(kern, requests, seed))
    assert got == list(replay_trees(ReferenceSuffix(n_slots, **params), requests, seed))
    plain = SuffixProposer(n_slots, **params)
    assert [g[0] for g in got] == [d for r in requests for d in replay(plain, *r)]


@settings(max_examples=80, **SETTINGS)
@given(scenarios(), st.integers(0, 2 ** 32 - 1))
def test_trees_are_well_formed(scenario, seed):
    """Parents before children, at most `budget` tokens (so depth <= budget), distinct
    siblings, the same tree when asked twice. With one source (no store): the kept chain's
    first token comes first (the root offers it before any sibling), and a smaller budget's tree
    is the larger one's first nodes (best first: each node is chosen whatever comes after)."""
    n_slots, params, requests = scenario
    kern = SuffixProposer(n_slots, **params)
    rng = random.Random(seed)
    for slot, prompt, output, accept in requests:
        for d in replay(kern, slot, prompt, output, accept):
            n_chain = rng.randint(0, len(d))
            budget = rng.choice([0, 2, 8, 40])
            tokens, parents = kern.draft_tree(slot, n_chain, budget)
            again = kern.draft_tree(slot, n_chain, budget)
            assert tokens.tolist() == again[0].tolist() and parents.tolist() == again[1].tolist()
            # written into a host's buffers instead (SGLang's step): the same tree, nothing
            # written outside its place
            out = (np.full(budget + 9, -7, dtype=np.int32), np.full(budget + 9, -7, np.int32))
            assert kern.draft_tree(slot, n_chain, budget, out, 5) == len(tokens)
            for buf, want in zip(out, (tokens, parents)):
                assert buf[5:5 + len(want)].tolist() == want.tolist()
                assert set(buf[:5].tolist() + buf[5 + budget:].tolist()) == {-7}
            assert tokens.dtype == parents.dtype == np.int32 and len(tokens) == len(parents)
            assert len(tokens) <= budget
            assert max(tree_depths(parents.tolist()), default=0) <= budget
            if params["global_tokens"] < 2:
                if min(n_chain, budget) >= 1:
                    assert tokens[0] == d[0] and parents[0] == -1
                if n_chain <= budget:
                    big = kern.draft_tree(slot, n_chain, 40)
                    assert big[0][:len(tokens)].tolist() == tokens.tolist()
                    assert big[1][:len(tokens)].tolist() == parents.tolist()
            kids = [(int(p), int(t)) for p, t in zip(parents, tokens)]
            assert len(set(kids)) == len(kids), "two equal siblings"


def test_tree_spends_the_budget_on_siblings():
    """After "1 2" the text went on with 3 (three times), 4 (twice) and 5 (once), each time
    followed by a token seen once. With a fresh calibration (every probability 1/2): the chain
    takes 3 (path 1/2), the tree adds 4 next (1/2 * 2/3), then 3's continuation (1/4), then 5
    (1/6, tied with 4's continuation: the root came first)."""
    prop = SuffixProposer(1, max_draft=1, min_prob=0.0, gain_cost=0.0, draft_cost=0.0,
                          global_tokens=0)
    text = [7, 1, 2, 3, 8, 1, 2, 4, 10, 1, 2, 3, 11, 1, 2, 5, 12, 1, 2, 4, 13, 1, 2, 3, 14, 1]
    prop.begin(0, text)
    assert prop.draft(0, text, 2).tolist() == [3]
    tokens, parents = prop.draft_tree(0, 1, 4)
    assert tokens.tolist() == [3, 4, 14, 5] and parents.tolist() == [-1, -1, 0, -1]
    tokens, parents = prop.draft_tree(0, 0, 2)        # the chain cut: its token still first
    assert tokens.tolist() == [3, 4] and parents.tolist() == [-1, -1]


def test_tree_without_a_match_starts_from_the_most_frequent_tokens():
    """The last token (42) occurs nowhere before it: no draft, no context to go on from. The
    engine verifies the whole budget anyway, so the tree starts from the empty context: the
    request's tokens by count (5 three times, 6 twice, then the latest first), each going on as
    anywhere else. With a fresh calibration (1/2): 5 (path 1/2), its latest continuation 8
    (1/4), then 6 (min(1/2 * 2 / 6, 1/2 * 2 / 3) = 1/6)."""
    prop = SuffixProposer(1, max_draft=4, min_prob=0.0, gain_cost=0.0, draft_cost=0.0,
                          global_tokens=0)
    text = [5, 6, 5, 7, 5, 8, 6, 9, 42]
    prop.begin(0, text)
    assert prop.draft(0, text[:-1], 42).tolist() == []
    tokens, parents = prop.draft_tree(0, 0, 3)
    assert tokens.tolist() == [5, 8, 6] and parents.tolist() == [-1, 0, -1]
    tokens, parents = prop.draft_tree(0, 0, 20)
    assert len(tokens) == 20
    assert [t for t, p in zip(tokens.tolist(), parents.tolist()) if p == -1] == [5, 6, 42, 9, 8, 7]


def test_draft_tree_checks_its_arguments():
    p = SuffixProposer(2)
    p.begin(1, [5, 6, 7, 5, 6])
    p.draft(1, [5, 6, 7, 5, 6], 7)
    before = p.memory_bytes()
    p.draft_tree(1, 0, 40)
    assert p.memory_bytes() - before == 2 * 41 * 76   # the slot's node buffers, kept
    p.draft_tree(1, 0, 8)
    assert p.memory_bytes() - before == 2 * 41 * 76
    with pytest.raises(ValueError, match="draft_tree\\(\\) on slot 0 without a draft"):
        p.draft_tree(0, 0, 4)
    p.begin(0, [5, 6, 7, 5, 6])
    with pytest.raises(ValueError, match="without a draft"):
        p.draft_tree(0, 0, 4)                # begun, not drafted yet
    d = p.draft(0, [5, 6, 7, 5, 6], 7)
    with pytest.raises(ValueError, match=f"n_chain = {len(d) + 1} is out of range: allowed 0 "
                                         f"\\.\\. {len(d)}"):
        p.draft_tree(0, len(d) + 1, 4)
    with pytest.raises(ValueError, match="budget = 4097 is out of range: allowed 0 .. 4096"):
        p.draft_tree(0, 0, 4097)
    with pytest.raises(IndexError, match="slot = 2"):
        p.draft_tree(2, 0, 4)
    assert p.draft_tree(0, len(d), 0)[0].tolist() == []
    buf = np.zeros((2, 4), dtype=np.int32)
    with pytest.raises(ValueError, match=r"offset = 5 is out of range: allowed 0 \.\. 4 \(out's "
                                         r"tokens holds 8, the tree up to 4\)"):
        p.draft_tree(0, 0, 4, (buf, buf), 5)
    with pytest.raises(ValueError, match="offset = -1 is out of range"):
        p.draft_tree(0, 0, 4, (buf, buf), -1)
    with pytest.raises(TypeError, match="out's parents must be a writable C-contiguous int32"):
        p.draft_tree(0, 0, 4, (buf, buf.astype(np.int64)))
    with pytest.raises(TypeError, match="out's tokens must be a writable C-contiguous int32"):
        p.draft_tree(0, 0, 2, (buf[:, ::2], buf))
    with pytest.raises(TypeError, match="out must be a"):
        p.draft_tree(0, 0, 2, [buf, buf])
    p.begin(0, [1, 2, 3])
    with pytest.raises(ValueError, match="without a draft"):
        p.draft_tree(0, 0, 4)                # the tree of the last request is gone


# ---------------------------------------------------------------------------------------------
# prefetch: reading ahead for many slots at once changes nothing (issue 36)
# ---------------------------------------------------------------------------------------------

class Prefetching:
    """A proposer whose every draft is preceded by a `prefetch` of all its slots: the drafting
    slot with its true next token, the others with `rng`'s tokens (wrong ones: harmless too)."""

    def __init__(self, prop, rng):
        self.prop, self.rng = prop, rng

    def __getattr__(self, name):
        return getattr(self.prop, name)

    def draft(self, slot, context, sampled):
        slots = list(range(self.prop.n_slots))
        tokens = [sampled if s == slot else self.rng.choice([0, 1, 7, 2 ** 31 - 1])
                  for s in slots]
        self.prop.prefetch(slots, tokens)
        return self.prop.draft(slot, context, sampled)


@settings(max_examples=80, **SETTINGS)
@given(scenarios(), st.integers(0, 2 ** 32 - 1))
def test_prefetch_changes_no_draft_tree_or_statistic(scenario, seed):
    """Drafts, trees, calibration and store with a `prefetch` of every slot before each draft
    are those of a proposer that never prefetches (it only reads)."""
    n_slots, params, requests = scenario
    fetching = Prefetching(SuffixProposer(n_slots, **params), random.Random(seed))
    plain = SuffixProposer(n_slots, **params)
    assert list(replay_trees(fetching, requests, seed)) == list(
        replay_trees(plain, requests, seed))
    for a, b in zip(fetching.prop.calibration(), plain.calibration()):
        assert a.tolist() == b.tolist()
    assert fetching.prop.global_text().tolist() == plain.global_text().tolist()


def test_prefetch_reads_only_slots_it_may_and_checks_its_arguments():
    p = SuffixProposer(3)
    text = [5, 6, 7, 5, 6, 7, 5, 6]
    assert p.prefetch([0, 1, 2], [7, 7, 7]) == 0                # idle slots: nothing to read
    assert p.prefetch([], []) == 0
    p.begin(1, text)
    p.draft(1, text, 7)
    assert p.prefetch([1], [5]) > 0
    assert p.prefetch([0, 2], [5, 5]) == 0
    p.end(1)                                                    # idle again
    assert p.prefetch([1], [5]) == 0
    with pytest.raises(ValueError, match="slots\\[1\\] = 3 is out of range: allowed 0 .. 2"):
        p.prefetch([0, 3], [1, 1])
    with pytest.raises(ValueError, match="slots"):
        p.prefetch([-1], [1])
    with pytest.raises(ValueError, match="tokens\\[0\\] = -5"):
        p.prefetch([0], [-5])
    with pytest.raises(ValueError, match="tokens: 1 tokens for 2 slots: one each"):
        p.prefetch([0, 1], [1])
    with pytest.raises(TypeError, match="tokens"):
        p.prefetch([0], ["a"])


PREFETCH_THREAD_SCRIPT = """
import sys, threading
sys.path.insert(0, {root!r})
import numpy as np
from ngramspec._suffix import SuffixProposer

rng = np.random.default_rng(3)
prompts = [rng.integers(0, 50, n).astype(np.int32) for n in (6000, 20000, 70000, 9000, 40000)]

def run(p):
    for pr in prompts:                 # long prompts: begin indexes them without the GIL,
        p.begin(1, pr)                 # growing (reallocating) slot 1's automaton
        p.draft(1, pr, 7)
    return p.draft(1, prompts[-1], 7).tolist()

fetching = SuffixProposer(4, max_context=1 << 17)
for s in (0, 2, 3):
    fetching.begin(s, prompts[0][:3000])
    fetching.draft(s, prompts[0][:3000], 7)
out = {{}}
t = threading.Thread(target=lambda: out.setdefault("draft", run(fetching)))
t.start()
calls = reads = 0
while t.is_alive():
    reads += fetching.prefetch([0, 1, 2, 3], [7, 7, 7, 7])
    calls += 1
t.join()
print(calls, reads, out["draft"] == run(SuffixProposer(4, max_context=1 << 17)))
"""


def test_prefetch_beside_a_thread_growing_a_slot():
    """A thread begins long prompts on slot 1 (indexed without the GIL, its arrays reallocated)
    while the main thread prefetches every slot over and over: it runs (no error, no crash),
    reads the other slots, and slot 1's drafts are a lone proposer's. (Which slots it skips,
    busy or idle ones, this cannot tell: reading a slot mid-begin did not fault here either;
    `test_prefetch_reads_only_slots_it_may_and_checks_its_arguments` checks the idle ones.)"""
    out = subprocess.run([sys.executable, "-c", PREFETCH_THREAD_SCRIPT.format(root=str(ROOT))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    calls, reads, same = out.stdout.split()
    assert int(calls) > 10 and int(reads) > 0 and same == "True"


def test_draft_tree_out_of_memory_leaves_the_slot_usable():
    from ngramspec._proposer import _fail_allocation
    p = SuffixProposer(1)
    p.begin(0, [5, 6, 7, 5, 6])
    d = p.draft(0, [5, 6, 7, 5, 6], 7)
    _fail_allocation(1)                      # the node buffer's allocation fails
    try:
        with pytest.raises(MemoryError, match="budget = 8: out of memory for the tree's nodes"):
            p.draft_tree(0, len(d), 8)
    finally:
        _fail_allocation(None)
    tokens, parents = p.draft_tree(0, len(d), 8)
    assert tokens[:len(d)].tolist() == d.tolist()


@pytest.mark.parametrize("budget", [50, 333])
def test_eviction_matches_reference(budget):
    """Many requests through a small store: oldest whole sequences go first, as specified."""
    rng = np.random.default_rng(budget)
    kern = SuffixProposer(1, max_draft=4, global_tokens=budget, global_prompt=3)
    ref = ReferenceSuffix(1, max_draft=4, global_tokens=budget, global_prompt=3)
    for r in range(150):
        prompt = rng.integers(0, 4, rng.integers(1, 12)).tolist()
        output = rng.integers(0, 4, rng.integers(1, 70)).tolist()
        assert list(replay(kern, 0, prompt, output)) == list(replay(ref, 0, prompt, output))
        assert kern.global_text().tolist() == ref.store.sam.text, f"request {r}"
    assert kern.global_stats()["evictions"] == ref.store.evictions > 20


@settings(max_examples=40, **SETTINGS)
@given(st.data())
def test_context_that_does_not_grow(data):
    """A context that does not extend the slot's last one (a restarted or shrunk KV cache, no
    begin) is indexed afresh, as the reference does."""
    alphabet = [0, 1, 2]
    kern, ref = SuffixProposer(1, max_draft=8), ReferenceSuffix(1, max_draft=8)
    for _ in range(data.draw(st.integers(1, 8))):
        ctx = data.draw(token_runs(alphabet, 80))
        sampled = data.draw(st.sampled_from(alphabet))
        d = [int(t) for t in kern.draft(0, np.asarray(ctx, dtype=np.int32), sampled)]
        assert d == ref.draft(0, ctx, sampled)
        if d and data.draw(st.booleans()):
            k = data.draw(st.integers(0, len(d)))
            kern.accept(0, k)
            ref.accept(0, k)


@pytest.mark.parametrize("n", [0, 255, 256, 257, 511, 512, 513])
def test_prompts_around_max_context(n):
    prompt = (np.arange(n, dtype=np.int32) * 7) % 5
    kern = SuffixProposer(1, max_context=256)
    ref = ReferenceSuffix(1, max_context=256)
    output = [1, 2, 3, 4] * 80
    assert list(replay(kern, 0, prompt, output)) == list(replay(ref, 0, prompt, output))
    assert kern.slot_stats(0)["indexed"] <= 256


def test_copies_a_loop_past_the_end_of_the_text():
    """A periodic context is drafted whole, not one period per step."""
    prop = SuffixProposer(1, max_draft=64, min_prob=0.0, gain_cost=0.0, draft_cost=0.0)
    loop = [5, 6, 7] * 20
    prop.begin(0, np.asarray(loop[:-1], dtype=np.int32))
    d = prop.draft(0, np.asarray(loop[:-1], dtype=np.int32), loop[-1]).tolist()
    assert len(d) == 64 and d == (loop * 30)[len(loop):len(loop) + 64]


def test_global_store_carries_outputs_across_requests():
    prop = SuffixProposer(1, min_prob=0.0, gain_cost=0.0, draft_cost=0.0)
    out = list(range(100, 140))
    for prompt in ([1, 2, 3], [4, 5, 6]):
        drafts = list(replay(prop, 0, prompt, out))
    # second request: after the first output token the rest of the old output is drafted (but
    # its last token: the target's final token never reaches a proposer)
    assert drafts[0] == out[1:-1]


# ---------------------------------------------------------------------------------------------
# bounded memory
# ---------------------------------------------------------------------------------------------

def test_memory_stays_bounded_over_a_long_stream():
    rng = np.random.default_rng(7)
    budget, max_context, n_slots = 3000, 1024, 2
    prop = SuffixProposer(n_slots, max_draft=16, max_context=max_context, global_tokens=budget,
                          global_prompt=50)
    bound = (sam_bytes(budget) + n_slots * sam_bytes(max_context)
             + n_slots * (65536 + 17 * 3 * 4 + 17 * 2 * 2))   # + Slot structs, buffers
    phrases = [rng.integers(0, 500, 30).astype(np.int32) for _ in range(20)]
    seen_evictions = 0
    for r in range(400):
        slot = r % n_slots
        prompt = np.concatenate([phrases[i] for i in rng.integers(0, 20, 8)])
        output = np.concatenate([phrases[i] for i in rng.integers(0, 20, 6)] +
                                [rng.integers(0, 500, 40).astype(np.int32)])
        if r % 50 == 0:      # now and then a context longer than max_context
            output = np.concatenate([output] + [phrases[i] for i in rng.integers(0, 20, 40)])
        for _ in replay(prop, slot, prompt, output.tolist()):
            pass
        g = prop.global_stats()
        assert g["tokens"] <= budget and g["capacity"] <= budget
        seen_evictions = g["evictions"]
        for s in range(n_slots):
            st_ = prop.slot_stats(s)
            assert st_["indexed"] <= max_context and st_["capacity"] <= max_context
        assert prop.memory_bytes() <= bound
    assert seen_evictions > 10


def test_sam_bytes_matches_the_documented_bound():
    # 108 bytes per token for a power of two, at most 124 (hash table rounded up)
    for n in (1024, 65536, 1 << 20):
        assert sam_bytes(n) == 108 * n + 20
    for n in (1000, 3000, 65537, 100000):
        assert 108 * n < sam_bytes(n) <= 124 * n + 20


# ---------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------

THREAD_SCRIPT = textwrap.dedent("""
    import faulthandler, json, sys, threading
    import numpy as np
    sys.path.insert(0, {root!r})
    from ngramspec._suffix import SuffixProposer
    faulthandler.dump_traceback_later(50, exit=True)
    N = 4
    def requests(slot):
        # slot s only uses tokens t with t % N == s: no stored sequence of another slot can
        # match its context, so any drafted token of another class is cross-talk
        rng = np.random.default_rng(slot)
        words = [(rng.integers(0, 40, 12) * N + slot).astype(np.int32) for _ in range(8)]
        for r in range(60):
            prompt = np.concatenate([words[i] for i in rng.integers(0, 8, 30)])
            output = np.concatenate([words[i] for i in rng.integers(0, 8, 12)])
            yield prompt, output
    def run(prop, slot, log):
        for prompt, output in requests(slot):
            prop.begin(slot, prompt)
            cache, sampled, produced = list(prompt), int(output[0]), 1
            while produced < len(output):
                d = prop.draft(slot, np.asarray(cache, dtype=np.int32), sampled)
                log.append(d.tolist())
                toks, pars = prop.draft_tree(slot, len(d), 12)   # reads both sources too
                log.append(toks.tolist())
                k = 0
                while k < len(d) and produced + k < len(output) and d[k] == output[produced + k]:
                    k += 1
                if len(d):
                    prop.accept(slot, k)
                cache += [sampled] + output[produced:produced + k].tolist()
                produced += k
                if produced >= len(output):
                    break
                sampled = int(output[produced]); produced += 1
    result = {{}}
    for budget in (0, 1 << 20, 400):
        prop = SuffixProposer(N, max_draft=32, global_tokens=budget)
        logs = [[] for _ in range(N)]
        threads = [threading.Thread(target=run, args=(prop, s, logs[s])) for s in range(N)]
        for t in threads: t.start()
        for t in threads: t.join()
        one = SuffixProposer(N, max_draft=32, global_tokens=budget)
        run(one, 0, [])                      # slot 0's requests alone
        result[str(budget)] = dict(
            n_drafts=sum(len(l) for l in logs),
            foreign=sum(1 for s in range(N) for d in logs[s] for t in d if t % N != s),
            cal=prop.calibration_stats(), cal_one_slot=one.calibration_stats(),
            tokens=prop.global_stats()["tokens"])
    print(json.dumps(result))
""")


def test_threads_share_the_global_store_and_the_calibration():
    """Four threads drafting (and drafting trees) on four slots at once: no cross-talk in the
    drafts or trees, the store within its budget, and one calibration that learned from every thread's outcomes (about
    four times what slot 0's requests alone teach it; none lost while another thread folded)."""
    out = subprocess.run([sys.executable, "-c", THREAD_SCRIPT.format(root=str(ROOT))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for budget, r in res.items():
        assert r["n_drafts"] > 1000
        assert r["foreign"] == 0, budget
        assert int(budget) == 0 or r["tokens"] <= int(budget)
        cal, one = r["cal"], r["cal_one_slot"]
        assert cal["dropped"] <= cal["outcomes"] // 100, budget
        assert cal["outcomes"] + cal["dropped"] > 3 * one["outcomes"] > 0, budget


def test_docstrings_state_memory_and_thread_safety():
    for text in (suffix.__doc__, SuffixProposer.__doc__):
        assert "Memory" in text and "Thread-safety" in text


# ---------------------------------------------------------------------------------------------
# parameters and the engine
# ---------------------------------------------------------------------------------------------

def build_ngram_suffix(n_slots, params):
    (p,) = build_proposers("ngram-suffix", n_slots, None, params)
    return p


def test_factory_defaults_and_ranges():
    p = build_ngram_suffix(3, {})
    assert (p.name, p.n_slots, p.max_draft) == ("ngram-suffix", 3, 256)
    assert build_ngram_suffix(1, {"ngram_suffix_max_draft": 7}).max_draft == 7
    for param in TYPES["ngram-suffix"].params:
        name, lo, hi = param.name, param.lo, param.hi
        assert name.startswith("ngram_suffix_") and lo <= param.default <= hi
        for bad in (lo - 1, hi + 1):
            with pytest.raises(ValueError, match=f"{name} = .* allowed {lo} .. {hi}"):
                build_ngram_suffix(1, {name: bad})
        with pytest.raises(TypeError, match=name):
            build_ngram_suffix(1, {name: "3"})
    with pytest.raises(TypeError):
        build_ngram_suffix(1, {"ngram_suffix_max_draft": 2.5})


def test_python_methods_check_their_arguments():
    p = SuffixProposer(2)
    with pytest.raises(IndexError, match="slot = 2"):
        p.begin(2, np.zeros(3, dtype=np.int32))
    # the kernels' one validator (_proposer.as_tokens / as_token / check_int) gives the errors
    with pytest.raises(ValueError, match=r"prompt\[1\] = -1 is not a token id"):
        p.begin(0, np.array([1, -1], dtype=np.int32))
    with pytest.raises(TypeError, match="bytes are not token ids"):
        p.begin(0, b"abc")
    with pytest.raises(ValueError, match="sampled = -5 is not a token id"):
        p.draft(0, np.array([1, 2], dtype=np.int32), -5)
    with pytest.raises(ValueError, match=r"context\[0\] = -2 is not a token id"):
        p.draft(0, [-2, 2], 5)
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        p.accept(0, 0)                      # as every proposer (Proposer.accept)
    with pytest.raises(ValueError, match=r"min_prob = nan is out of range: allowed 0.0 .. 1.0"):
        SuffixProposer(1, min_prob=float("nan"))
    with pytest.raises(TypeError, match="max_draft must be an integer"):
        SuffixProposer(1, max_draft=2.5)
    p.begin(0, [5, 6, 7, 5, 6])              # any 1-D integer sequence, as the engine takes
    draft = p.draft(0, [5, 6, 7, 5, 6], 7)
    assert draft.dtype == np.int32 and len(draft) > 0
    allowed = rf"n_accepted = -1 is out of range: allowed 0 \.\. {len(draft)}"
    with pytest.raises(ValueError, match=allowed):
        p.accept(0, -1)


def test_through_the_engine():
    core = pytest.importorskip("ngramspec._engine")
    rng = np.random.default_rng(3)
    words = [rng.integers(0, 50, 8).astype(np.int32) for _ in range(6)]
    reqs = [(np.concatenate([words[i] for i in rng.integers(0, 6, 20)]),
             np.concatenate([words[i] for i in rng.integers(0, 6, 10)]).tolist())
            for _ in range(5)]
    direct = SuffixProposer(1, max_draft=32)
    engine = core.Engine([SuffixProposer(1, max_draft=32)], n_slots=1)
    for prompt, output in reqs:
        assert [list(map(int, d)) for d in replay(engine, 0, prompt, output)] == \
            list(replay(direct, 0, prompt, output))

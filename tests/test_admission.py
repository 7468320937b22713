"""The scheduler's cache-aware admission (ngramspec.llama.admission), without a model."""
from types import SimpleNamespace

import numpy as np
import pytest

from ngramspec.llama.admission import MIN_GAIN, best_slot, plan
from ngramspec.loop import common_prefix

RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(0, 1000, size=n).astype(np.int32) for n in (300, 200, 250, 120)]


def slot(tokens, last_used=0):
    cached = np.zeros(1024, dtype=np.int32)
    cached[:len(tokens)] = tokens
    return SimpleNamespace(cached=cached, n_cached=len(tokens), last_used=last_used)


def req(prompt, t_submit=0.0):
    return SimpleNamespace(prompt=prompt, t_submit=t_submit)


def per_token(seconds):
    return lambda n: n * seconds


def test_common_prefix():
    # the loop's one prefix function, as admission uses it on a slot's cached tokens
    a = np.array([1, 2, 3, 4, 5], dtype=np.int32)
    assert common_prefix(a, np.array([1, 2, 3, 9], dtype=np.int32)) == 3
    assert common_prefix(a[:2], np.array([1, 2, 3], dtype=np.int32)) == 2   # only n_cached counts
    assert common_prefix(a, np.array([1, 2], dtype=np.int32)) == 2
    assert common_prefix(a[:0], a) == 0
    assert common_prefix(a, np.array([7], dtype=np.int32)) == 0


def test_best_slot_longest_prefix_then_least_recently_used():
    s0, s1, s2 = slot(PROMPTS[0], 3), slot(PROMPTS[1][:50], 1), slot(PROMPTS[1], 2)
    assert best_slot(PROMPTS[1], [s0, s1, s2]) == (s2, 200)
    cold = np.array([5000], dtype=np.int32)
    assert best_slot(cold, [s0, s1, s2])[0] is s1


def test_fifo_into_the_slot_holding_the_prompt():
    s = [slot(p, i) for i, p in enumerate(PROMPTS)]
    q = [req(PROMPTS[2]), req(PROMPTS[0])]
    got = plan(q, s, [], now=0.0, prompt_seconds=per_token(1.0))
    assert [(r.prompt is p, sl, lcp) for (r, sl, lcp), p in zip(got, (PROMPTS[2], PROMPTS[0]))] \
        == [(True, s[2], 250), (True, s[0], 300)]


def test_request_waits_for_the_busy_slot_that_holds_its_prompt_and_others_go_first():
    # Slot A (busy) runs a request of prompt 0; the free slot holds prompt 1. A second request
    # of prompt 0 would decode 300 tokens again in the free slot: it waits; a request of prompt
    # 1 behind it is admitted into the free slot meanwhile.
    free = [slot(PROMPTS[1])]
    q = [req(PROMPTS[0], t_submit=10.0), req(PROMPTS[1], t_submit=10.1)]
    got = plan(q, free, [PROMPTS[0]], now=10.5, prompt_seconds=per_token(0.01))
    assert len(got) == 1 and got[0][0] is q[1] and got[0][2] == 200


def test_the_wait_is_bounded_by_the_cost_of_decoding_the_prompt_again():
    free = [slot(PROMPTS[1])]
    q = [req(PROMPTS[0], t_submit=10.0)]
    # 299 tokens at 10 ms: 2.99 s of re-processing; waited 2.5 s -> still waits, 3.5 s -> goes
    assert plan(q, free, [PROMPTS[0]], now=12.5, prompt_seconds=per_token(0.01)) == []
    got = plan(q, free, [PROMPTS[0]], now=13.5, prompt_seconds=per_token(0.01))
    assert [(r, sl, lcp) for r, sl, lcp in got] == [(q[0], free[0], 0)]


def test_small_gains_do_not_wait():
    # The busy slot shares only MIN_GAIN - 1 more tokens than the free one: admit at once.
    shared = PROMPTS[0][:100]
    free = [slot(shared)]
    busy_prompt = np.concatenate([PROMPTS[0][:100 + MIN_GAIN - 1], [4000]]).astype(np.int32)
    got = plan([req(PROMPTS[0])], free, [busy_prompt], now=0.0, prompt_seconds=per_token(1.0))
    assert [lcp for _, _, lcp in got] == [100]


def test_two_requests_of_one_prompt_in_one_pass_do_not_both_take_slots():
    # An empty server receives two requests of prompt 0 at once (and one of prompt 1): the first
    # is admitted, the second waits for its slot rather than decode the same prompt in parallel.
    free = [slot(PROMPTS[0], 0), slot(PROMPTS[1], 1), slot(PROMPTS[2], 2)]
    q = [req(PROMPTS[0]), req(PROMPTS[0]), req(PROMPTS[1])]
    got = plan(q, free, [], now=0.0, prompt_seconds=per_token(1.0))
    assert [(r is q[0] or r is q[2], lcp) for r, _, lcp in got] == [(True, 300), (True, 200)]


@pytest.mark.parametrize("n_free", [0, 1, 3])
def test_never_more_admissions_than_free_slots(n_free):
    free = [slot(PROMPTS[i]) for i in range(n_free)]
    q = [req(PROMPTS[i % 4]) for i in range(10)]
    got = plan(q, free, [], now=0.0, prompt_seconds=per_token(0.0))
    assert len(got) == n_free
    assert len({id(sl) for _, sl, _ in got}) == n_free


def test_a_request_reuses_only_its_owners_caches():
    # Issue 34: a shared cache is an oracle of other clients' prompts. A slot left by owner
    # "a" shares nothing with a request of owner "b" (nor with one that turns cache_prompt off),
    # and "b" does not wait for "a"'s busy slot either.
    a_slot, empty = slot(PROMPTS[0], 1), slot([], 2)
    a_slot.owner, empty.owner = "a", None
    mine = SimpleNamespace(prompt=PROMPTS[0], t_submit=0.0, cache_owner="a", cache_prompt=True)
    theirs = SimpleNamespace(prompt=PROMPTS[0], t_submit=0.0, cache_owner="b",
                             cache_prompt=True)
    off = SimpleNamespace(prompt=PROMPTS[0], t_submit=0.0, cache_owner="a", cache_prompt=False)
    assert best_slot(PROMPTS[0], [a_slot, empty], mine) == (a_slot, 300)
    assert best_slot(PROMPTS[0], [a_slot, empty], theirs) == (a_slot, 0)   # LRU, nothing kept
    assert best_slot(PROMPTS[0], [a_slot, empty], off)[1] == 0
    # a busy slot of owner "a" holds the prompt: "a" waits for it, "b" is admitted at once
    free = [slot(PROMPTS[1])]
    waits = plan([mine], free, [PROMPTS[0]], now=0.0, prompt_seconds=per_token(1.0),
                 owners=["a"])
    goes = plan([theirs], free, [PROMPTS[0]], now=0.0, prompt_seconds=per_token(1.0),
                owners=["a"])
    assert waits == [] and len(goes) == 1 and goes[0][2] == 0

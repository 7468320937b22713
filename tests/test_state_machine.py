"""Stateful fuzzing (issue 4, item 4): the engine against the pure-Python reference.

A hypothesis state machine drives a `SpecEngine` and a `reference.RefChain` with the same calls:
requests on several slots (new, longer, shorter or identical prompts on a slot that already
served one), draft / accept steps as llama-server makes them, drafts cut by the server's n_max,
resets of the shared ngram-mod pool, and rejected calls (which must change nothing). Every draft
and, after every step, the pool's fill and llama.cpp's statistics must agree.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import PRIORITY, RefChain  # noqa: E402
from strategies import alphabets, configs  # noqa: E402

from ngramspec import SpecEngine  # noqa: E402

MAX_SLOTS = 3
STAT_KEYS = ("type", "calls_b", "calls_g", "calls_a", "gen_drafts", "acc_drafts", "gen_tokens",
             "acc_tokens", "acc_per_pos")


def _trim(stats):
    out = []
    for s in stats:
        s = {k: s[k] for k in STAT_KEYS}
        pos = list(s["acc_per_pos"])
        while pos and pos[-1] == 0:  # trailing zeros are a representation detail
            pos.pop()
        s["acc_per_pos"] = pos
        out.append(s)
    return out


class EngineVsReference(RuleBasedStateMachine):

    @initialize(cfg=configs(size_m=6, n_match=5, n_min=6, n_max=10),
                alphabet=alphabets(5, ("small", "small", "huge", "colliding")),
                n_slots=st.integers(1, MAX_SLOTS),
                order=st.randoms(use_true_random=False))
    def setup(self, cfg, alphabet, n_slots, order):
        types, params = cfg
        shuffled = list(types)
        order.shuffle(shuffled)  # the engine applies llama.cpp's priority whatever the order
        self.types, self.params = types, params
        self.eng = SpecEngine(",".join(shuffled), n_slots=n_slots, **params)
        self.ref = RefChain(types, n_slots, params)
        self.alphabet = alphabet
        self.n_slots = n_slots
        self.ctx = [[] for _ in range(n_slots)]          # the slot's KV-cache tokens
        self.sampled = [alphabet[0]] * n_slots
        self.pending = [None] * n_slots                   # the draft awaiting accept
        self.log = []                                     # calls so far, shown on a failure

    # -- helpers -------------------------------------------------------------------------------

    def _slot(self, i):
        return i % self.n_slots

    def _tokens(self, idx):
        return [self.alphabet[i % len(self.alphabet)] for i in idx]

    def _fail(self, what):
        raise AssertionError(f"{what}\n types={self.types} params={self.params} "
                             f"alphabet={self.alphabet}\n calls={self.log[-40:]}")

    # -- rules ---------------------------------------------------------------------------------

    @rule(i=st.integers(0, MAX_SLOTS - 1),
          kind=st.sampled_from(["new", "longer", "shorter", "same"]),
          idx=st.lists(st.integers(0, 4), max_size=80), cut=st.floats(0, 1),
          first=st.integers(0, 4))
    def new_request(self, i, kind, idx, cut, first):
        """begin() with the next request's full prompt on a slot (any earlier draft dropped)."""
        s = self._slot(i)
        old = self.ctx[s] + [self.sampled[s]]
        if kind == "longer":
            prompt = old + self._tokens(idx)
        elif kind == "shorter":
            prompt = old[:int(cut * len(old))]
        elif kind == "same":
            prompt = list(self.ctx[s])
        else:
            prompt = self._tokens(idx)
        self.log.append(("begin", s, len(prompt)))
        self.eng.begin(s, np.array(prompt, dtype=np.int32))
        self.ref.begin(s, prompt)
        self.ctx[s] = prompt
        self.sampled[s] = self._tokens([first])[0]
        self.pending[s] = None

    @rule(i=st.integers(0, MAX_SLOTS - 1), n_max=st.one_of(st.none(), st.integers(0, 8)),
          nxt=st.integers(0, 4), as_list=st.booleans())
    def draft(self, i, n_max, nxt, as_list):
        s = self._slot(i)
        if self.pending[s] is not None:
            return  # llama-server accepts every non-empty draft before the next draft
        ctx = self.ctx[s]
        arg = ctx if as_list else np.array(ctx, dtype=np.int32)
        self.log.append(("draft", s, len(ctx), self.sampled[s], n_max))
        got = self.eng.draft(s, arg, self.sampled[s], n_max=n_max)
        want = self.ref.draft(s, ctx, self.sampled[s], n_max=n_max)
        if got.dtype != np.int32 or got.tolist() != list(want):
            self._fail(f"draft mismatch on slot {s}: engine {got.tolist()} reference {want}")
        if len(want):
            self.pending[s] = list(want)
        else:  # no draft: the target emits one token
            self.ctx[s] = ctx + [self.sampled[s]]
            self.sampled[s] = self._tokens([nxt])[0]

    @rule(i=st.integers(0, MAX_SLOTS - 1), frac=st.floats(0, 1), nxt=st.integers(0, 4))
    def accept(self, i, frac, nxt):
        s = self._slot(i)
        d = self.pending[s]
        if d is None:
            return
        k = int(round(frac * len(d)))
        self.log.append(("accept", s, k))
        self.eng.accept(s, k)
        self.ref.accept(s, k)
        self.pending[s] = None
        self.ctx[s] = self.ctx[s] + [self.sampled[s]] + d[:k]
        self.sampled[s] = self._tokens([nxt])[0]

    @rule(i=st.integers(0, MAX_SLOTS - 1), frac=st.floats(0, 1))
    def accept_greedy(self, i, frac):
        """The realistic accept: the target's continuation is the context's own earlier text
        (what makes n-gram drafts succeed), so the accepted prefix is a true common prefix."""
        s = self._slot(i)
        d = self.pending[s]
        if d is None:
            return
        full = self.ctx[s] + [self.sampled[s]]
        start = int(frac * len(full))
        truth = full[start:start + len(d) + 1]
        k = 0
        while k < len(d) and k < len(truth) and d[k] == truth[k]:
            k += 1
        self.log.append(("accept", s, k))
        self.eng.accept(s, k)
        self.ref.accept(s, k)
        self.pending[s] = None
        self.ctx[s] = full + d[:k]
        self.sampled[s] = truth[k] if k < len(truth) else self.alphabet[0]

    @rule(i=st.integers(0, MAX_SLOTS - 1),
          plan=st.lists(st.tuples(st.integers(0, 4), st.floats(0, 1),
                                  st.one_of(st.none(), st.none(), st.integers(0, 8))),
                        min_size=1, max_size=25))
    def generate(self, i, plan):
        """A burst of llama-server iterations on one slot: draft, then accept the common prefix
        with a continuation copied from the context (or, for odd steps, a random count)."""
        s = self._slot(i)
        for step, (nxt, frac, n_max) in enumerate(plan):
            if self.pending[s] is None:
                self.draft(i, n_max, nxt, step % 3 == 2)
            if self.pending[s] is not None:
                if step % 2:
                    self.accept(i, frac, nxt)
                else:
                    self.accept_greedy(i, frac)


    @precondition(lambda self: "ngram-mod" in self.types)
    @rule()
    def reset_pool(self):
        """An external reset of the shared ngram-mod pool (as another engine's low-acceptance
        reset, or an operator, would do)."""
        self.log.append(("reset",))
        self.eng.pool.reset()
        self.ref.pool.reset()

    @rule(i=st.integers(0, MAX_SLOTS - 1),
          which=st.sampled_from(["accept-none", "accept-too-many", "sampled", "context-id",
                                 "prompt-2d", "slot", "n_max"]))
    def rejected_call(self, i, which):
        """A bad call raises and leaves every slot and counter as it was."""
        s = self._slot(i)
        d = self.pending[s]
        ctx = np.array(self.ctx[s], dtype=np.int32)
        before = self.eng.stats()
        if which == "accept-none" and d is None:
            call, exc = (lambda: self.eng.accept(s, 0)), ValueError
        elif which == "accept-too-many" and d is not None:
            call, exc = (lambda: self.eng.accept(s, len(d) + 1)), ValueError
        elif which == "sampled" and d is None:
            call, exc = (lambda: self.eng.draft(s, ctx, -1)), ValueError
        elif which == "context-id" and d is None:
            bad = np.append(ctx, np.int32(-1))
            call, exc = (lambda: self.eng.draft(s, bad, self.sampled[s])), ValueError
        elif which == "prompt-2d":
            call, exc = (lambda: self.eng.begin(s, ctx.reshape(1, -1))), ValueError
        elif which == "slot":
            call, exc = (lambda: self.eng.draft(self.n_slots, ctx, 0)), IndexError
        elif which == "n_max" and d is None:
            call, exc = (lambda: self.eng.draft(s, ctx, self.sampled[s], n_max=-1)), ValueError
        else:
            return
        self.log.append(("rejected", s, which))
        with pytest.raises(exc):
            call()
        if self.eng.stats() != before:
            self._fail(f"a rejected {which} call changed the statistics")

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def same_pool_fill(self):
        if getattr(self, "eng", None) is not None and self.eng.pool is not None:
            if self.eng.pool.used != self.ref.pool.used:
                self._fail(f"pool fill differs: engine {self.eng.pool.used} "
                           f"reference {self.ref.pool.used}")

    @invariant()
    def same_statistics(self):
        if getattr(self, "eng", None) is not None:
            got, want = _trim(self.eng.stats()), _trim(self.ref.stats())
            if got != want:
                self._fail(f"statistics differ:\n engine    {got}\n reference {want}")


EngineVsReference.TestCase.settings = settings(
    max_examples=int(os.environ.get("NGRAMSPEC_STATE_EXAMPLES", "80")),
    stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestEngineVsReference = EngineVsReference.TestCase

"""Predicted Outputs: a request's expected output as its first draft source.

OpenAI's ``prediction: {"type": "content", "content": ...}`` tells the server what most of the
output will be (the file a code edit rewrites). `PredictionDrafter` follows the output through
the prediction: while the output agrees it drafts the prediction's continuation (8 tokens, then
twice as many after each draft accepted whole, up to 64); after the
output leaves it (an inserted line, a changed name, a deleted block) it finds its place again
by the output's last tokens, looked up in an index of the prediction's n-grams, preferring the
nearest occurrence at or after the current place (an edit moves forward through a file).

`PredictedEngine` puts a drafter in front of a request's proposer chain: the prediction drafts
first, the chain drafts where the prediction has nothing. Verification is the target's, so the
output is whatever it would be without a prediction (greedy: the same tokens; sampled: the same
distribution); a prediction only changes how many tokens each step verifies.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Dict, List, Optional, Tuple

import numpy as np

from ngramspec.draft_engine import NO_DRAFT, as_engine
from ngramspec.tokens import token_array
from ngramspec.validation import check_int

__all__ = ["PredictionDrafter", "PredictedEngine", "PREDICTION_N_MATCH", "PREDICTION_N_MAX"]

#: Longest output suffix looked up to find the place again; shorter ones are tried after it,
#: down to 3 tokens (1-2 tokens are too common in code to say where the output is: with 2, a
#: third of the drafted tokens were wrong guesses on code-edit traces, bench/prediction).
PREDICTION_N_MATCH = 4
_MIN_MATCH = 3
#: Draft length after a miss, doubled after each draft accepted whole, up to the longest
#: (ngram-mod's default n_max): a long agreeing run costs few steps, while the draft that runs
#: into an edit is short. On the code-edit traces' first 40 requests (bench/prediction) this
#: took the cpu-embedded profile from 1.35x (always 64) to 1.63x for 18.7x instead of 19.2x
#: on the gpu profile (a verified token costs ~0.55 decodes on a CPU, ~0.01 on a GPU).
PREDICTION_N_START = 8
PREDICTION_N_MAX = 64
_EMPTY = np.empty(0, dtype=np.int32)
_EMPTY.setflags(write=False)


class PredictionDrafter:
    """Drafts one request's output from its predicted text (the ``prediction`` field).

    Parameters
    ----------
    prediction : 1-D sequence of int
        The predicted output's token ids.
    n_max : int, >= 1
        Longest draft.
    n_match : int, >= 3
        Longest output suffix looked up to find the place in the prediction again.
    n_start : int, 1 .. n_max
        Draft length after a draft that was not accepted whole (and at the start); it doubles
        after each draft accepted whole, up to `n_max`.

    Attributes
    ----------
    pos : int
        Where the output is in the prediction: the index of the token expected next.
    gen_tokens, acc_tokens : int
        Prediction tokens drafted and verified, and accepted by the target (OpenAI's
        ``accepted_prediction_tokens``; the difference is ``rejected_prediction_tokens``); a
        proposer's counts, named as `ngramspec.stats` names them.

    Notes
    -----
    Memory: the prediction (4 bytes per token) and an index of its n-grams of 3 ..
    ``n_match`` tokens (a dict entry and a list slot per position and length); built once.

    Thread-safety: not thread-safe; one request's decode thread drives it. Per step the work is
    O(draft) when the output follows the prediction, and O(n_match log k) dict/bisect lookups
    to find the place again.
    """

    __slots__ = ("tokens", "n_max", "n_match", "pos", "gen_tokens", "acc_tokens", "_index",
                 "_start", "_n_draft", "_cap", "n_start")

    def __init__(self, prediction, *, n_max: int = PREDICTION_N_MAX,
                 n_match: int = PREDICTION_N_MATCH, n_start: int = PREDICTION_N_START):
        self.tokens = np.array(token_array(prediction, "prediction"), dtype=np.int32)
        self.n_max = n_max = check_int("n_max", n_max, 1)
        self.n_match = n_match = check_int("n_match", n_match, _MIN_MATCH)
        n_start = check_int("n_start", n_start, 1, n_max)
        self.pos = 0
        self.gen_tokens = self.acc_tokens = 0
        self._start = -1
        self.n_start = n_start
        self._cap = n_start
        # (n-gram) -> sorted positions just past it: where the prediction continues after it
        index: Dict[Tuple[int, ...], List[int]] = {}
        toks = self.tokens.tolist()
        for n in range(_MIN_MATCH, n_match + 1):
            for end in range(n, len(toks) + 1):
                index.setdefault(tuple(toks[end - n:end]), []).append(end)
        self._index = index

    def _relocate(self, tail: List[int]) -> int:
        """The prediction position after the longest suffix of ``tail`` found in it (-1: none),
        the nearest at or after `pos`, else the last one before it."""
        for n in range(min(self.n_match, len(tail)), _MIN_MATCH - 1, -1):
            ends = self._index.get(tuple(tail[-n:]))
            if ends:
                i = bisect_left(ends, self.pos)
                return ends[i] if i < len(ends) else ends[-1]
        return -1

    def draft(self, context, sampled: int, n_max: Optional[int] = None) -> np.ndarray:
        """The prediction's continuation after ``context + [sampled]`` (maybe empty).

        Parameters
        ----------
        context : 1-D int array
            The tokens in the target's KV cache (prompt and verified output).
        sampled : int
            The last output token, not yet in `context`.
        n_max : int, optional
            A bound below the drafter's own `n_max`.

        Returns
        -------
        numpy.ndarray
            int32 draft; a view of the prediction (read-only by convention).
        """
        toks = self.tokens
        bound = self._cap if n_max is None else min(self._cap, int(n_max))
        self._start = -1
        if bound <= 0:
            return _EMPTY
        if self.pos < len(toks) and toks[self.pos] == sampled:
            start = self.pos + 1
        else:
            tail = context[-(self.n_match - 1):].tolist() + [int(sampled)]
            start = self._relocate(tail)
            if start < 0:
                return _EMPTY
        draft = toks[start:start + bound]
        if len(draft):
            self._start, self._n_draft = start, len(draft)
        return draft

    def accept(self, n_accepted: int) -> None:
        """The target accepted ``n_accepted`` tokens of the last non-empty draft."""
        if self._start < 0:
            raise RuntimeError("accept() without a non-empty draft")
        self._cap = min(self.n_max, 2 * self._cap) if n_accepted >= self._n_draft \
            else self.n_start
        self.pos = self._start + n_accepted
        self.acc_tokens += n_accepted
        self._start = -1


class PredictedEngine:
    """A request's engine: its prediction drafts first, then the proposer chain.

    A `ngramspec.draft_engine.DraftEngine` (its optional parts are the chain's); the chain sees llama-server's calls exactly as without a prediction, except
    that it is not asked for a draft on steps the prediction drafts (as a lower-priority
    proposer of llama.cpp's chain is not).

    Parameters
    ----------
    drafter : PredictionDrafter
    engine : DraftEngine, optional
        The request's chain (default `NO_DRAFT`: the prediction alone).

    Attributes
    ----------
    accepted_prediction_tokens, rejected_prediction_tokens : int
        OpenAI's counts: prediction tokens the output took, and prediction tokens verified and
        refused (each costs a verified position, as OpenAI bills them).

    Notes
    -----
    Memory: the drafter's.

    Thread-safety: as the chain's: one thread per slot; the drafter belongs to one request.
    """

    __slots__ = ("drafter", "engine", "_from_prediction", "_n_draft")

    speculates = True

    def __init__(self, drafter: PredictionDrafter, engine=NO_DRAFT):
        self.drafter = drafter
        self.engine = as_engine(engine)
        self._from_prediction = False
        self._n_draft = 0

    @property
    def accepted_prediction_tokens(self) -> int:
        return self.drafter.acc_tokens

    @property
    def rejected_prediction_tokens(self) -> int:
        return self.drafter.gen_tokens - self.drafter.acc_tokens

    @property
    def proposers(self) -> tuple:
        """The chain's proposers (the prediction is none of them)."""
        return self.engine.proposers

    def last_proposer(self, slot) -> int:
        """The chain's last proposer; -1 when the prediction drafted."""
        return -1 if self._from_prediction else self.engine.last_proposer(slot)

    def end(self, slot) -> None:
        self.engine.end(slot)

    def set_vocab(self, n_vocab) -> None:
        self.engine.set_vocab(n_vocab)

    def stats(self) -> list:
        return self.engine.stats()

    def stats_lines(self) -> list:
        return self.engine.stats_lines()

    def begin(self, slot, prompt) -> None:
        """The chain's ``begin`` (the prediction needs none)."""
        self.engine.begin(slot, prompt)

    def draft(self, slot, context, sampled, n_max=None) -> np.ndarray:
        """The prediction's draft, else the chain's."""
        draft = self.drafter.draft(context, sampled, n_max)
        self._from_prediction = len(draft) > 0
        if not self._from_prediction and self.engine.speculates:
            draft = self.engine.draft(slot, context, sampled, n_max)
        self._n_draft = len(draft)
        return draft

    def accept(self, slot, n_accepted) -> None:
        """Report the accepted length to whichever drafted."""
        if self._from_prediction:
            self.drafter.gen_tokens += self._n_draft
            self.drafter.accept(int(n_accepted))
            self._from_prediction = False
        else:
            self.engine.accept(slot, n_accepted)

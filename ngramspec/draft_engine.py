"""The one engine contract above the kernels: what a driver may ask of a request's drafter.

`ngramspec.engine.SpecEngine` (llama-server's proposer chain), `ngramspec.prediction.
PredictedEngine` (a prediction in front of a chain) and `NO_DRAFT` (plain decoding) implement
`DraftEngine`; the loop, the policy, the live driver and the scheduler call its members and
never ask an engine what it has. A driver given ``None`` for "no speculation" turns it into
`NO_DRAFT` once, at its boundary (`as_engine`).

The optional parts of a *proposer* (a member of an engine's chain) are declared here too, as
small Protocols checked with ``isinstance``: learning when a request ends, checking a target
model, reporting a draft's probabilities.

Imports nothing of the kernels or llama_cpp (the loop's layer).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np

__all__ = ["DraftEngine", "EngineDefaults", "NoDraftEngine", "NO_DRAFT", "as_engine", "LearnsAtEnd",
           "ChecksTarget", "ReportsDraftProbs"]

_EMPTY = np.empty(0, dtype=np.int32)
_EMPTY.setflags(write=False)


@runtime_checkable
class DraftEngine(Protocol):
    """A request's drafter, driven as llama-server drives its proposers.

    Required: ``begin(slot, prompt)`` once per request, ``draft(slot, context, sampled, n_max)``
    per step, ``accept(slot, n_accepted)`` after every non-empty draft (also with 0).

    Declared optional parts (every implementation has them; the defaults of an engine without
    the feature are given):

    - ``speculates``: False for an engine that never drafts (no draft call is made);
    - ``proposers``: the chain, in priority order (``()``);
    - ``last_proposer(slot)``: the index in `proposers` of the last non-empty draft's proposer
      (-1: none);
    - ``end(slot)``: the slot's request is over (learners learn from it; nothing);
    - ``set_vocab(n_vocab)``: drafts must stay below `n_vocab` (nothing);
    - ``stats()`` / ``stats_lines()``: the proposers' counters (``[]``);
    - ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``: Predicted Outputs' counts
      (0).
    """

    speculates: bool
    proposers: Tuple[Any, ...]
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int

    def begin(self, slot: int, prompt) -> None: ...

    def draft(self, slot: int, context, sampled: int,
              n_max: Optional[int] = None) -> np.ndarray: ...

    def accept(self, slot: int, n_accepted: int) -> None: ...

    def end(self, slot: int) -> None: ...

    def last_proposer(self, slot: int) -> int: ...

    def set_vocab(self, n_vocab: Optional[int]) -> None: ...

    def stats(self) -> List[Dict[str, Any]]: ...

    def stats_lines(self) -> List[str]: ...


class EngineDefaults:
    """`DraftEngine`'s optional parts with their defaults, for an engine written on top of
    ``begin`` / ``draft`` / ``accept`` (a test's scripted engine, a wrapper): subclass it and
    define those three.

    Notes
    -----
    Memory: none. Thread-safety: stateless.
    """

    __slots__ = ()
    speculates = True
    proposers: Tuple[Any, ...] = ()
    accepted_prediction_tokens = 0
    rejected_prediction_tokens = 0

    def end(self, slot: int) -> None:
        """Nothing to learn."""

    def last_proposer(self, slot: int) -> int:
        return -1

    def set_vocab(self, n_vocab: Optional[int]) -> None:
        """Drafts nothing, so nothing to bound."""

    def stats(self) -> List[Dict[str, Any]]:
        return []

    def stats_lines(self) -> List[str]:
        return []


class NoDraftEngine(EngineDefaults):
    """The engine of plain decoding: never drafts, has no proposers, counts nothing.

    Notes
    -----
    Memory: none. Thread-safety: stateless, shared by every driver (`NO_DRAFT`).
    """

    __slots__ = ()
    speculates = False

    def begin(self, slot: int, prompt) -> None:
        """Nothing to ingest."""

    def draft(self, slot: int, context, sampled: int, n_max: Optional[int] = None) -> np.ndarray:
        """Always the empty draft (a driver makes no draft call: `speculates` is False)."""
        return _EMPTY

    def accept(self, slot: int, n_accepted: int) -> None:
        raise RuntimeError("accept() without a non-empty draft: this engine never drafts")


#: The one no-draft engine.
NO_DRAFT = NoDraftEngine()


def as_engine(engine) -> DraftEngine:
    """`engine`, or `NO_DRAFT` for None (a public API's "no speculation")."""
    return NO_DRAFT if engine is None else engine


@runtime_checkable
class LearnsAtEnd(Protocol):
    """A proposer that learns from a finished request (ngram-suffix's global store)."""

    def end(self, slot: int) -> None: ...


@runtime_checkable
class ChecksTarget(Protocol):
    """A proposer that must agree with the target model (a draft model's vocabulary)."""

    def check_target(self, llm) -> None: ...


@runtime_checkable
class ReportsDraftProbs(Protocol):
    """A proposer that knows its last draft's per-token probabilities (ngram-suffix)."""

    def draft_probs(self, slot: int) -> Tuple[Sequence[float], Sequence[int]]: ...

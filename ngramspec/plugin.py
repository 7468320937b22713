"""ngramspec chains as a llama-cpp-python draft model.

::

    from llama_cpp import Llama
    from ngramspec.plugin import NgramspecDraftModel

    llm = Llama(model_path="model.gguf", n_ctx=4096, logits_all=True,
                draft_model=NgramspecDraftModel("ngram-mod,ngram-simple", n_ctx=4096))
    llm.create_completion(prompt, max_tokens=256, temperature=0.0)

Pass ``logits_all=True``: llama-cpp-python (0.3.x) switches to all-position logits when a draft
model is set, but sizes its score buffer from the ``logits_all`` argument, so without it any
context longer than ``n_batch`` tokens fails with a numpy broadcast error.

llama-cpp-python's ``Llama.generate`` calls the draft model with ``input_ids`` = the tokens in the
KV cache plus the last sampled token, i.e. ``inp + [sampled]`` in the spec's notation, and never
says how much of the previous draft it accepted. The plug-in infers it from consecutive calls: when
the new input extends the previous one by the previous draft's first ``k`` tokens plus one token,
those ``k + 1`` tokens are the target's verdict on the previous draft, which the request's
`ngramspec.loop.SlotLoop` verifies (``engine.accept(k)`` after a non-empty draft, also for
``k = 0``) before it drafts again. Any other input starts a new request (a new loop:
``engine.begin(prompt)`` with ``inp``). A draft whose request ended (EOS, ``max_tokens``) before
the next call gets no accept, as llama-cpp-python gives no signal for it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel

from .loop import SlotLoop

__all__ = ["NgramspecDraftModel"]


class NgramspecDraftModel(LlamaDraftModel):
    """A ``LlamaDraftModel`` that drafts with an ngramspec proposer chain.

    Parameters
    ----------
    spec_type : str
        Comma-separated spec types (``"ngram-mod"``, ``"ngram-map-k4v,ngram-simple"``, ...),
        instantiated in llama.cpp's fixed priority order. Ignored when ``engine`` is given.
    engine : ngramspec.SpecEngine, optional
        An existing engine to drive (its slot ``slot`` is used).
    slot : int
        Engine slot used for every request.
    n_ctx : int, optional
        The ``Llama``'s context size. When given, drafts are bounded as llama-server bounds them,
        ``n_ctx - L - 2`` (llama-cpp-python itself only cuts them to the free context).
    **params
        Proposer parameters forwarded to ``SpecEngine`` (``ngram_mod_n_match=24``, ...).

    Attributes
    ----------
    engine : ngramspec.SpecEngine
    n_calls, n_requests : int
        Draft calls seen, and how many of them started a new request.

    Notes
    -----
    Memory: the engine's (the ngram-mod pool is 16 MiB), plus a copy of the last input and draft.

    Thread-safety: not thread-safe; like the ``Llama`` it is attached to, one generation at a time.
    """

    def __init__(self, spec_type: str = "ngram-mod", *, engine=None, slot: int = 0,
                 n_ctx: Optional[int] = None, **params: Any):
        if engine is None:
            from . import SpecEngine
            engine = SpecEngine(spec_type, n_slots=max(1, int(slot) + 1), pool=None, **params)
        self.engine = engine
        self.slot = int(slot)
        self.n_ctx = None if n_ctx is None else int(n_ctx)
        self.n_calls = 0
        self.n_requests = 0
        self._prev: Optional[np.ndarray] = None      # last input_ids seen (inp + [sampled])
        self._loop: Optional[SlotLoop] = None         # the request in progress

    def _accepted(self, ids: np.ndarray) -> Optional[int]:
        """Draft tokens accepted since the previous call; None when ``ids`` starts a new request."""
        prev, loop = self._prev, self._loop
        if prev is None or loop is None:
            return None
        draft = loop.pending_draft
        n, p = ids.size, prev.size
        k = n - p - 1
        if k < 0 or k > draft.size:
            return None
        if not (np.array_equal(ids[:p], prev) and np.array_equal(ids[p:p + k], draft[:k])):
            return None
        return k

    def __call__(self, input_ids, /, **kwargs: Any) -> np.ndarray:
        ids = np.array(input_ids, dtype=np.int32)  # a copy: Llama reuses its input_ids buffer
        self.n_calls += 1
        if ids.size < 2:  # nothing in the cache yet: no context to draft from
            self._prev, self._loop = None, None
            return np.empty(0, dtype=np.intc)
        k = self._accepted(ids)
        if k is None:
            self._loop = SlotLoop(self.engine, self.slot, ids[:-1], int(ids[-1]),
                                  n_ctx=self.n_ctx or 0)
            self.n_requests += 1
        else:
            # The target of the previous step: the accepted draft tokens, then its own token.
            # llama-cpp-python may have cut the draft, so only the first k count as verified.
            self._loop.verify(ids[self._prev.size:], n_verified=k)
        draft = self._loop.propose()
        self._prev = ids
        return draft.astype(np.intc)

    def stats(self) -> List[Dict[str, Any]]:
        """The engine's per-proposer counters (llama.cpp's statistics)."""
        return self.engine.stats()

    def stats_lines(self) -> List[str]:
        """llama.cpp's ``statistics <type>: ...`` lines."""
        return list(self.engine.stats_lines())

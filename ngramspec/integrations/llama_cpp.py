"""ngramspec chains as a llama-cpp-python draft model.

::

    from ngramspec.integrations.llama_cpp import NgramspecDraftModel
    from ngramspec.llama.repack import load_llama

    # load_llama = llama_cpp.Llama(...) that turns llama.cpp's weight repacking off on CPUs
    # with AMX, whose repacked kernel crashes on multi-token batches (ngramspec.llama.repack).
    llm = load_llama("model.gguf", n_ctx=4096, logits_all=True, verbose=False,
                     draft_model=NgramspecDraftModel("ngram-mod,ngram-simple", n_ctx=4096))
    llm.create_completion(prompt, max_tokens=256, temperature=0.0)

This is for keeping llama-cpp-python's own loop, which copies the logits of every position into
numpy (``logits_all``): measured 0.90x plain llama-cpp-python's speed for a whole 256-token call
on this project's CPU, 0.44x on an AMX Xeon (bench/results/repack.md, issue 14). For speed use
``ngramspec.llama.live.generate_speculative`` (1.18x in the same runs).

Pass ``logits_all=True``: llama-cpp-python (0.3.x) switches to all-position logits when a draft
model is set, but sizes its score buffer from the ``logits_all`` argument, so without it any
context longer than ``n_batch`` tokens fails with a numpy broadcast error.

llama-cpp-python's ``Llama.generate`` calls the draft model with ``input_ids`` = the tokens in the
KV cache plus the last sampled token (what llama-server's ``common_speculative_draft`` gets as its
prompt and ``id_last``), and never says how much of the previous draft it accepted. The plug-in
infers it from consecutive calls: when the new input extends the previous one by the previous
draft's first ``k`` tokens plus one token, those ``k + 1`` tokens are the target's verdict on the
previous draft, which the request's `ngramspec.loop.SlotLoop` verifies (``engine.accept(k)`` after
a non-empty draft, also for ``k = 0``) before it drafts again. Any other input starts a new request
(a new loop: ``engine.begin(prompt)`` with ``inp``). A draft whose request ended (EOS,
``max_tokens``) before the next call gets no accept, as llama-cpp-python gives no signal for it.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel

from ngramspec.engine import SpecEngine
from ngramspec.llama.repack import warn_if_amx_repack
from ngramspec.loop import SlotLoop
from ngramspec.tokens import token_array
from ngramspec.validation import check_int

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
        Engine slot used for every request (``0 .. engine.n_slots - 1`` with `engine`).
    n_ctx : int, optional
        The ``Llama``'s context size. When given (> 0), drafts are bounded as llama-server
        bounds them, ``n_ctx - L - 2`` (llama-cpp-python itself only cuts them to the free
        context); None or 0: no bound.

    Raises
    ------
    ValueError, TypeError
        A `slot` or `n_ctx` out of range or not an integer (`ngramspec.validation`); on a call,
        an id outside ``0 .. 2**31-1`` (``input_ids[pos] = ...``).
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

    On its first call it warns once (``RuntimeWarning``) when the ``Llama`` it drafts for was
    loaded with llama.cpp's extra buffer types on a CPU with AMX (:mod:`ngramspec.llama.repack`;
    build the ``Llama`` with :func:`ngramspec.llama.repack.load_llama` instead, which also
    `attach`-es the draft model). llama-cpp-python never tells a draft model its ``Llama``: one
    that was not attached is taken as built with llama-cpp-python's defaults (extra buffer
    types on), so it warns on any AMX host.

    Thread-safety: not thread-safe; like the ``Llama`` it is attached to, one generation at a time.
    """

    def __init__(self, spec_type: str = "ngram-mod", *, engine=None, slot: int = 0,
                 n_ctx: Optional[int] = None, **params: Any):
        slot = check_int("slot", slot, 0, None if engine is None else engine.n_slots - 1)
        self.n_ctx = None if n_ctx is None else check_int("n_ctx", n_ctx, 0)
        if engine is None:
            engine = SpecEngine(spec_type, n_slots=slot + 1, pool=None, **params)
        self.engine = engine
        self.slot = slot
        self.n_calls = 0
        self.n_requests = 0
        self._prev: Optional[np.ndarray] = None      # last input_ids seen (inp + [sampled])
        self._loop: Optional[SlotLoop] = None         # the request in progress
        self._llm: Optional[weakref.ref] = None       # the Llama of `attach`

    def attach(self, llm) -> None:
        """Bind this draft model to the ``Llama`` whose ``draft_model`` it is (`load_llama`
        does it); its first call then checks that ``Llama``'s weight repacking.

        Raises
        ------
        ValueError
            ``llm.draft_model`` is not this draft model.
        """
        if getattr(llm, "draft_model", None) is not self:
            raise ValueError("attach(llm): llm.draft_model is not this draft model")
        self._llm = weakref.ref(llm)    # the Llama holds this object: no cycle through it

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
        # checked as given (a cast would wrap an int64 id to 32 bits), then copied: Llama
        # reuses its input_ids buffer
        ids = np.array(token_array(input_ids, "input_ids"))
        if self.n_calls == 0:
            # stacklevel 3: Llama.generate, the caller
            warn_if_amx_repack(self._llm() if self._llm is not None else None, stacklevel=3)
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

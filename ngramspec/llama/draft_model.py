"""``draft-simple``: a second (small) GGUF model as the lowest-priority member of the chain.

Semantics follow llama.cpp's ``common_speculative_impl_draft_simple``:

* greedy drafting of up to ``--spec-draft-n-max`` tokens (default 3);
* drafting stops *before* a token whose probability is below ``--spec-draft-p-min`` (default 0.0,
  which never stops). The probability is llama.cpp's: the softmax over the draft sampler's top-10
  logits (its chain is ``top_k(10)``), not over the whole vocabulary;
* a draft shorter than ``--spec-draft-n-min`` (default 0) is dropped;
* ``begin`` and ``accept`` are no-ops; the spec-type registry places ``draft-simple`` after every
  n-gram type, so a draftless draft always takes precedence.

The draft model's KV cache follows the target's tokens incrementally: the proposer remembers which
tokens each slot's cache holds, and on every draft call keeps the common prefix with
``inp + [sampled]``, removes the rest (``llama_memory_seq_rm``) and decodes only the new tokens.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, Optional

import numpy as np

from ngramspec._proposer import PyProposer, check_int
from ngramspec.loop import common_prefix
from ngramspec.registry import TYPES

from .decoder import Decoder, context_params
from .model import default_threads, require_llama_cpp
from .repack import model_params, warn_if_amx_repack

__all__ = ["DraftModelProposer", "VocabMismatchError", "build_draft_simple",
           "check_draft_model_file", "check_vocab_compatible"]

NAME = "draft-simple"
#: llama.cpp's draft sampler is ``top_k(10)``; p_min is compared with the probability after it.
TOP_K = 10
_PARAMS = {p.name: p for p in TYPES[NAME].params}


class VocabMismatchError(ValueError):
    """The draft model's vocabulary differs from the target's."""


def _model_ptr(obj):
    """``llama_model *`` of a ``Llama``, an internal ``LlamaModel`` or a raw pointer."""
    ptr = getattr(obj, "model", obj)
    if ptr is None:
        raise ValueError("the model has been closed")
    return ptr


def _vocab_summary(model_ptr) -> Dict[str, Any]:
    import llama_cpp as lc
    vocab = lc.llama_model_get_vocab(model_ptr)
    return {"type": int(lc.llama_vocab_type(vocab)),
            "n_tokens": int(lc.llama_vocab_n_tokens(vocab)),
            "bos": int(lc.llama_vocab_bos(vocab)), "eos": int(lc.llama_vocab_eos(vocab)),
            "add_bos": bool(lc.llama_vocab_get_add_bos(vocab)), "_vocab": vocab}


def check_vocab_compatible(target, draft) -> None:
    """Refuse a draft model whose vocabulary differs from the target's.

    Draft tokens are handed to the target as ids, so the two vocabularies must be the same: same
    tokenizer type, size, BOS/EOS ids and BOS policy, and the same text for every token id. (This
    is stricter than llama.cpp's compatibility check, which tolerates a size difference of up to
    128 tokens; ngramspec does not translate between vocabularies.)

    Parameters
    ----------
    target, draft : llama_cpp.Llama, llama_cpp._internals.LlamaModel or llama_model pointer

    Raises
    ------
    VocabMismatchError
        Naming the first difference found.
    """
    import llama_cpp as lc
    a, b = _vocab_summary(_model_ptr(target)), _vocab_summary(_model_ptr(draft))
    for key, what in (("type", "tokenizer type"), ("n_tokens", "vocabulary size"),
                      ("bos", "BOS token id"), ("eos", "EOS token id"),
                      ("add_bos", "add-BOS setting")):
        if a[key] != b[key]:
            raise VocabMismatchError(
                f"draft model vocabulary differs from the target's: {what} "
                f"{b[key]} (draft) != {a[key]} (target); use a draft model of the same family")
    va, vb = a["_vocab"], b["_vocab"]
    if va is vb:
        return
    for tok in range(a["n_tokens"]):
        ta, tb = lc.llama_vocab_get_text(va, tok), lc.llama_vocab_get_text(vb, tok)
        if ta != tb:
            raise VocabMismatchError(
                f"draft model vocabulary differs from the target's: token {tok} is {tb!r} "
                f"(draft) but {ta!r} (target); use a draft model of the same family")


def check_draft_model_file(target, path: str, repack="auto") -> None:
    """Refuse a draft GGUF whose vocabulary differs from ``target``'s, reading its vocabulary
    only (no weights), so a mismatch fails before a draft model or a cache is set up.

    Raises
    ------
    ValueError
        The file does not exist; `VocabMismatchError` naming the first difference.
    """
    require_llama_cpp()
    from llama_cpp import _internals   # llama-cpp-python's model wrapper (no public one)
    if not os.path.isfile(path):
        raise ValueError(f"draft model file not found: {path}")
    mp = model_params(repack)
    mp.vocab_only = True
    vocab_model = _internals.LlamaModel(path_model=path, params=mp, verbose=False)
    try:
        check_vocab_compatible(target, vocab_model)
    finally:
        vocab_model.close()


class DraftModelProposer(PyProposer):
    """Greedy drafts from a second GGUF model (llama.cpp's ``draft-simple``).

    Parameters
    ----------
    model : str or llama_cpp.Llama
        Draft GGUF path, or an already loaded ``Llama`` (only its weights are used: the proposer
        creates its own context, so the same ``Llama`` may also be the target).
    n_slots : int
        Engine slots; slot ``i`` uses sequence ``i`` of the draft context.
    n_max : int
        ``--spec-draft-n-max``: longest draft (default 3).
    n_min : int
        ``--spec-draft-n-min``: shorter drafts are dropped (default 0).
    p_min : float
        ``--spec-draft-p-min``: drafting stops before a token whose top-10 probability is lower
        (default 0.0).
    n_ctx : int
        Draft KV cache size per slot (tokens); a slot whose context outgrows it gets no drafts.
    n_batch : int
        Largest draft-model decode (the catch-up after n-gram drafts, the first prompt).
    n_threads : int, optional
        Draft-model threads (default: :func:`ngramspec.llama.model.default_threads`).
    repack : {"auto", "on", "off"}
        Weight repacking of a draft model loaded from a path (``use_extra_bufts``, see
        :mod:`ngramspec.llama.repack`; ``auto`` is off on AMX hosts). A ``Llama`` passed in
        keeps its own.

    Raises
    ------
    ValueError
        Out-of-range parameters, or a model that cannot be loaded.

    Notes
    -----
    Memory: the draft model's weights (shared with a ``Llama`` passed in) plus a KV cache of
    ``n_slots * n_ctx`` positions and one token list of ``n_ctx`` int32 per slot.

    Thread-safety: not thread-safe. The engine calls it with the GIL held; the llama.cpp decode
    inside may release the GIL, so one engine (and this proposer) must be driven by one thread at a
    time.
    """

    def __init__(self, model, n_slots: int = 1, *, n_max: int = 3, n_min: int = 0,
                 p_min: float = 0.0, n_ctx: int = 4096, n_batch: int = 512,
                 n_threads: Optional[int] = None, repack="auto"):
        # the draft-simple entries of the registry, reported by this constructor's keywords
        n_max, n_min, p_min, n_ctx, n_batch = (
            _PARAMS[name].check(value, label) for name, value, label in (
                ("spec_draft_n_max", n_max, "n_max"), ("spec_draft_n_min", n_min, "n_min"),
                ("spec_draft_p_min", p_min, "p_min"), ("ctx_size_draft", n_ctx, "n_ctx"),
                ("batch_size_draft", n_batch, "n_batch")))
        n_slots = check_int("n_slots", n_slots, 1)
        if n_threads is not None:
            n_threads = _PARAMS["threads_draft"].check(n_threads, "n_threads")
        # llama.cpp checks the bound only after the first drafted token: n_max = 0 drafts one.
        n_max = max(1, n_max)
        super().__init__(NAME, int(n_slots), n_max)
        require_llama_cpp()  # the ImportError that names the live extra
        from llama_cpp import _internals

        self.n_max, self.n_min, self.p_min = n_max, n_min, p_min
        if isinstance(model, (str, os.PathLike)):
            path = os.fspath(model)
            if not os.path.isfile(path):
                raise ValueError(f"draft model file not found: {path}")
            mparams = model_params(repack)
            self._model = _internals.LlamaModel(path_model=path, params=mparams, verbose=False)
            self.llm = None
        elif hasattr(model, "_model") and hasattr(model, "model"):
            warn_if_amx_repack(model, stacklevel=3)
            self._model = model._model
            self.llm = model  # keeps the weights alive
        else:
            raise ValueError("model_draft must be a GGUF path or a llama_cpp.Llama")
        threads = int(n_threads or default_threads())
        # Non-unified KV: every slot (sequence) gets n_ctx positions of its own.
        cparams = context_params(n_ctx=n_ctx * int(n_slots), n_batch=n_batch,
                                 n_seq_max=int(n_slots), n_threads=threads, unified=False)
        self._ctx = _internals.LlamaContext(model=self._model, params=cparams, verbose=False)
        self._dec = Decoder(self._ctx.ctx, self._model.model, n_batch)
        self.n_ctx = self._dec.n_ctx
        # Tokens held by each slot's sequence of the draft KV cache: _cache[s][:_n[s]].
        self._cache = [np.empty(self.n_ctx, dtype=np.int32) for _ in range(int(n_slots))]
        self._n = [0] * int(n_slots)
        # A slot's own p_min (a server request's speculation.p_min), None: self.p_min.
        self._slot_p_min = [None] * int(n_slots)
        self._checked = set()

    @property
    def model_ptr(self):
        """``llama_model *`` of the draft model (for :func:`check_vocab_compatible`)."""
        return self._model.model

    def set_p_min(self, slot: int, p_min: Optional[float]) -> None:
        """The p_min of ``slot``'s drafts from now on (a request's own, set at its start); None
        restores the proposer's ``p_min``.

        Raises
        ------
        ValueError
            ``slot`` outside ``0 .. n_slots - 1`` or ``p_min`` outside ``--spec-draft-p-min``'s
            range.
        """
        slot = check_int("slot", slot, 0, len(self._slot_p_min) - 1)
        if p_min is not None:
            p_min = _PARAMS["spec_draft_p_min"].check(p_min, "p_min")
        self._slot_p_min[slot] = p_min

    def check_target(self, target) -> None:
        """Raise :class:`VocabMismatchError` unless ``target`` shares this model's vocabulary."""
        key = ctypes.cast(_model_ptr(target), ctypes.c_void_p).value
        if key in self._checked:  # the full check reads every token's text: do it once per target
            return
        check_vocab_compatible(target, self._model)
        self._checked.add(key)

    def _sync(self, slot, inp, last=None):
        """Make ``slot``'s KV cache hold ``inp`` (+ ``last``); return the logits of its last token.

        The common prefix with what the cache holds stays; the rest is removed and only the new
        tokens are decoded. The last token is always (re)decoded: its logits start a draft.
        """
        total = inp.size + (last is not None)
        cache, n_cache = self._cache[slot], self._n[slot]
        p = common_prefix(cache[:n_cache], inp)
        if last is not None and p == inp.size and n_cache > p and cache[p] == last:
            p += 1
        p = min(p, total - 1)
        new = np.empty(total - p, dtype=np.int32)
        new[:inp.size - p] = inp[p:]
        if last is not None:
            new[-1] = last
        dec = self._dec
        dec.set_seq(slot)
        # Unconditional: after a failed decode the cache may hold positions _n does not list.
        dec.seq_rm(p, slot)
        self._n[slot] = p
        logits = dec.decode(new, p, all_logits=False)[0]
        cache[p:total] = new
        self._n[slot] = total
        return logits

    def on_begin(self, slot, prompt):
        # llama.cpp's draft-simple begin() is a no-op; the prompt pass of the draft model is done
        # here instead of at the first draft so that it counts as prompt processing (begin time),
        # not as drafting. A prompt longer than the draft context is left to on_draft (no drafts).
        prompt = np.asarray(prompt, dtype=np.int32)
        if 0 < prompt.size <= self.n_ctx:
            self._sync(slot, prompt)

    def on_accept(self, slot, n_accepted, is_other):
        # No-op as in llama.cpp: the next draft call re-syncs the cache from the target's tokens.
        return None

    def on_draft(self, slot, inp, sampled):
        inp = np.asarray(inp, dtype=np.int32)
        total = inp.size + 1
        # Positions total-1 .. total+n-2 get decoded (the last drafted token is not): they must fit.
        n_draft = min(self.n_max, self.n_ctx - total + 1)
        if n_draft < max(1, self.n_min):
            return []
        logits = self._sync(slot, inp, int(sampled))
        dec, cache, n_cache = self._dec, self._cache[slot], total
        result = []
        p_min = self._slot_p_min[slot]
        if p_min is None:
            p_min = self.p_min
        while True:
            tok = int(np.argmax(logits))
            if p_min > 0.0:
                top = logits[np.argpartition(logits, -TOP_K)[-TOP_K:]].astype(np.float64)
                if 1.0 / np.exp(top - top.max()).sum() < p_min:
                    break  # llama.cpp stops before a low-confidence token, not after it
            result.append(tok)
            if len(result) >= n_draft:
                break
            self._n[slot] = n_cache
            logits = dec.decode(np.array([tok], dtype=np.int32), n_cache, all_logits=False)[0]
            cache[n_cache] = tok
            n_cache += 1
        self._n[slot] = n_cache
        if len(result) < self.n_min:
            return []
        return result


def build_draft_simple(n_slots: int, values: Dict[str, Any]) -> DraftModelProposer:
    """Builder for the ``draft-simple`` spec type (called by ``ngramspec.registry``).

    Parameters
    ----------
    n_slots : int
        Engine slots.
    values : dict
        Every keyword of the registry, checked: ``model_draft`` (GGUF path or
        ``llama_cpp.Llama``, required), ``spec_draft_n_max``, ``spec_draft_n_min``,
        ``spec_draft_p_min``, ``ctx_size_draft``, ``batch_size_draft``, ``threads_draft``,
        ``repack_draft``.
    """
    model = values.get("model_draft")
    if model is None:
        raise ValueError("spec type draft-simple needs a draft model (--model-draft / model_draft)")
    return DraftModelProposer(model, n_slots, n_max=values["spec_draft_n_max"],
                              n_min=values["spec_draft_n_min"], p_min=values["spec_draft_p_min"],
                              n_ctx=values["ctx_size_draft"], n_batch=values["batch_size_draft"],
                              n_threads=values["threads_draft"], repack=values["repack_draft"])

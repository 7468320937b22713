"""The llama-cpp adapter: one batch decoder over a llama.cpp context, and the target context's
per-request life cycle (prompt pass with llama-server's exact-prompt cache, reset, finish).

Talks to llama.cpp through llama-cpp-python's low-level C API (``llama_decode`` on the package's
one batch, `ngramspec.llama.batch.MultiSeqBatch`; ``llama_get_logits``,
``llama_memory_seq_rm``). Used by the live generation driver (`ngramspec.llama.live`), the draft
model (`ngramspec.llama.draft_model`) and the calibration (`ngramspec.llama.calibration`); it
knows nothing of drafting.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ngramspec.draft_engine import ChecksTarget

from .batch import MultiSeqBatch
from .context import context_params
from .model import require_llama_cpp
from .request_checks import Bounds, check_prompt

__all__ = ["Decoder", "check_engine_models", "context_params", "finish_request", "prompt_pass",
           "reset_context", "target_and_prompt", "target_decoder"]


class Decoder:
    """One sequence's decodes on one context, through the package's one ``llama_batch`` wrapper
    (`ngramspec.llama.batch.MultiSeqBatch`).

    Parameters
    ----------
    ctx, model : llama_context pointer, llama_model pointer
    n_batch : int
        Largest batch one ``llama_decode`` call gets.
    seq_id : int
        Sequence the batch's tokens go to (`set_seq` changes it).
    min_run : int
        Fewest tokens and rows of logits per ``llama_decode`` (2 under the deterministic mode:
        `ngramspec.llama.deterministic`; a one-token decode is padded).

    Notes
    -----
    Memory: one batch of ``n_batch`` tokens and, as the target decoder, a copy of the cached
    prompt.

    Thread-safety: not thread-safe; one decoder per thread and context.
    """

    def __init__(self, ctx, model, n_batch: int, seq_id: int = 0, min_run: int = 1):
        lc = require_llama_cpp()
        self._lc = lc
        self.ctx = ctx
        self.vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        # Per-sequence capacity: a context with several non-unified sequences splits n_ctx.
        self.n_ctx = int(lc.llama_n_ctx_seq(ctx))
        self.n_batch = int(n_batch)
        self.mem = lc.llama_get_memory(ctx)
        self.batch: Optional[MultiSeqBatch] = MultiSeqBatch(self.n_batch, min_run=min_run)
        self._seq = int(seq_id)
        # Prompt cache of the target decoder (see prompt_pass): the prompt whose KV is kept.
        self.cached_prompt: Optional[np.ndarray] = None
        self.cached_first = -1

    def set_seq(self, seq_id: int) -> None:
        """The sequence of the next decodes."""
        self._seq = int(seq_id)

    def close(self) -> None:
        """Release the batch (its arrays are numpy's: nothing for llama.cpp to free)."""
        self.batch = None

    def clear(self) -> None:
        if self.mem is not None:
            self._lc.llama_memory_clear(self.mem, True)

    def pos_max(self, seq_id: int = 0) -> int:
        """Largest position held for ``seq_id`` (-1 when empty)."""
        return int(self._lc.llama_memory_seq_pos_max(self.mem, seq_id))

    def seq_rm(self, p0: int, seq_id: int = 0) -> None:
        """Drop positions ``p0 ..`` of ``seq_id`` from the KV cache."""
        if not self._lc.llama_memory_seq_rm(self.mem, seq_id, p0, -1):
            raise RuntimeError("this model's KV cache cannot drop a partial sequence "
                               "(recurrent/hybrid models are not supported by the live driver)")

    def decode(self, tokens, pos0: int, all_logits: bool) -> np.ndarray:
        """Decode ``tokens`` at positions ``pos0 ..``; return the logits as a (n_out, n_vocab) view.

        Long inputs are split into ``n_batch`` chunks; with ``all_logits=False`` only the last
        token's row is produced. The view is valid until the next decode on this context.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("empty batch")
        if pos0 + n > self.n_ctx:
            raise ValueError(f"decode past the context: {pos0} + {n} > n_ctx {self.n_ctx}")
        if all_logits and n > self.n_batch:
            raise ValueError(f"batch of {n} tokens with all logits exceeds n_batch {self.n_batch}")
        arr = np.asarray(tokens, dtype=np.int32)
        batch = self.batch
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            batch.clear()
            batch.add(self._seq, arr[start:start + m], pos0 + start,
                      "all" if all_logits else "last" if start + m == n else "none")
            rows = batch.decode(self.ctx)
        if all_logits:
            return rows[:m]           # a padded batch's pad rows follow
        last = int(np.count_nonzero(batch.logits[:m])) - 1   # the last token's row
        return rows[last:last + 1]

    def is_eog(self, token: int) -> bool:
        return bool(self._lc.llama_vocab_is_eog(self.vocab, int(token)))


def target_decoder(llm) -> Decoder:
    """The `Decoder` of a ``llama_cpp.Llama``'s own context, made once and cached on ``llm``.

    Its ``n_ctx`` is the context size asked for (llama.cpp pads it to a multiple of 256).
    Thread-safety: as ``llm``, one request at a time.
    """
    # One decoder per Llama, cached on it: the batch is allocated once, not per request.
    dec = getattr(llm, "_ngramspec_decoder", None)
    if dec is None or dec.ctx is not llm.ctx:
        # a Llama loaded for the deterministic mode (load_model(deterministic=True)) decodes
        # by its rules: two or more tokens and rows of logits per decode
        dec = Decoder(llm.ctx, llm.model, llm.n_batch,
                      min_run=getattr(llm, "_ngramspec_min_run", 1))
        # llama.cpp pads the context to a multiple of 256 (--ctx-size 8 gets 256 positions):
        # honour the size asked for, so drafts and the stop are bounded by it.
        asked = int(getattr(getattr(llm, "context_params", None), "n_ctx", 0) or 0)
        if 0 < asked < dec.n_ctx:
            dec.n_ctx = asked
        # the deterministic mode pads a one-token decode: its pad needs the next cell
        if dec.batch.min_run > 1:
            dec.n_ctx = min(dec.n_ctx, int(dec._lc.llama_n_ctx_seq(llm.ctx)) - dec.batch.min_run
                            + 1)
        llm._ngramspec_decoder = dec
    return dec


def target_and_prompt(llm, prompt_tokens):
    """``llm``'s target `Decoder` and ``prompt_tokens`` as an int32 array, checked against the
    model's vocabulary and context (`ngramspec.llama.request_checks.check_prompt`)."""
    dec = target_decoder(llm)
    bounds = Bounds(dec.n_vocab, dec.n_ctx, f"the context (n_ctx = {dec.n_ctx}); raise --ctx-size")
    return dec, check_prompt(bounds, prompt_tokens)


def reset_context(llm, dec: Decoder) -> None:
    """Empty the KV cache of ``llm``'s context and forget the cached prompt."""
    # The driver owns the context for the request: drop the KV cache and the high-level Llama's
    # record of it, so a later Llama.generate call does not trust a stale prefix.
    dec.clear()
    dec.cached_prompt = None
    llm.reset()


def prompt_pass(llm, dec: Decoder, prompt: np.ndarray):
    """First output token of ``prompt``; returns ``(token, reused)``.

    A request with exactly the previous request's prompt reuses its KV cache and first token (as
    llama-server's prompt cache does), so a ``--compare`` pair or a test suite pays for one
    prompt pass. Only an exact match is reused: the result is then bit-identical to a fresh pass
    (re-decoding a 1-token suffix would take llama.cpp's single-token kernels and could change
    the logits in their last bits).
    """
    cached = dec.cached_prompt
    if (cached is not None and cached.size == prompt.size and np.array_equal(cached, prompt)
            and llm.n_tokens == 0  # nobody has used the Llama's own API since
            and dec.pos_max() == prompt.size - 1):
        return dec.cached_first, True
    reset_context(llm, dec)
    tok = int(np.argmax(dec.decode(prompt, 0, all_logits=False)[0]))
    dec.cached_prompt, dec.cached_first = prompt.copy(), tok
    return tok, False


def finish_request(llm, dec: Decoder, n_prompt: int) -> None:
    """End a request: keep the prompt's KV cache for a repeat of it, drop the generated part."""
    if dec.cached_prompt is not None and dec.cached_prompt.size == n_prompt:
        dec.seq_rm(n_prompt)
        llm.reset()
    else:
        reset_context(llm, dec)


def check_engine_models(llm, engine) -> None:
    """Refuse an engine whose drafts could hold ids the target ``llm`` does not have.

    Used by every live driver (`generate_speculative`, the batched scheduler) before a request.

    Raises
    ------
    ValueError
        A draft model of another vocabulary, or an n-gram cache file holding a token id
        >= ``llm.n_vocab()`` (naming the file and the token).
    """
    # A draft model must share the target's vocabulary: its tokens are verified as ids. Any
    # proposer with a check_target (DraftModelProposer) is asked: the drivers need not know the
    # draft model's module.
    for prop in engine.proposers:
        if isinstance(prop, ChecksTarget):
            prop.check_target(llm)
    # So must ngram-cache's files: a cache of another tokenizer is refused (ValueError naming
    # the file and the token), and no draft holds an id the target lacks.
    engine.set_vocab(llm.n_vocab())

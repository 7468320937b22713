"""The batched scheduler's llama context: one sequence per slot on the target's weights, its
vocabulary's facts, its token pieces, and the step executor that decodes on it.

Everything of the scheduler that touches llama.cpp's C API lives here or in the executor, so
`ngramspec.llama.scheduler` only schedules.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

from . import deterministic as det_mode
from .context import context_params
from .executor import StepExecutor
from .model import load_model
from .request_checks import Bounds
from .text import token_piece_fn

__all__ = ["SlotContext"]


class SlotContext:
    """The target's weights and a context of ``n_slots`` sequences on them.

    Parameters
    ----------
    llm_or_path : llama_cpp.Llama, str, os.PathLike or None
        A loaded ``Llama`` (its weights are shared, its own context unused), a GGUF path, or
        None for the embedded model.
    n_ctx, n_slots, n_batch, n_threads : int
        Total KV cells (split evenly among the slots), sequences, tokens per decode, threads.
    deterministic : bool
        A KV stream per slot, flash attention off, each slot's context rounded up to a multiple
        of 256 cells and its last cell kept for a pad (`ngramspec.llama.deterministic`).

    Attributes
    ----------
    llm : llama_cpp.Llama
        Tokenizer and chat template (and the weights).
    ctx : llama_context_p
        The context (None once `free` ran).
    vocab, n_vocab : the model's vocabulary and its size
    n_ctx : int
        KV cells of the context (as llama.cpp made it).
    n_ctx_slot : int
        Tokens one slot (one request, prompt and output) may hold.
    eog : list of int
        The end-of-generation tokens; ``eog_set`` the same as a frozenset.
    piece : callable(int) -> bytes
        A token's text (control tokens: nothing).
    executor : StepExecutor
        Decodes a step plan on the context.
    bounds : request_checks.Bounds
        What a request is checked against (the vocabulary, a slot's context).

    Notes
    -----
    Memory: the KV cache (``n_ctx`` cells), ``n_batch`` rows of logits, the executor's batch.

    Thread-safety: the context and the executor belong to the scheduler's decode thread;
    `tokenize` and `detokenize` may be called from any thread (llama.cpp's tokenizer is
    read-only).
    """

    def __init__(self, llm_or_path, *, n_ctx: int, n_slots: int, n_batch: int, n_threads: int,
                 deterministic: bool):
        import llama_cpp as lc
        self._lc = lc
        if llm_or_path is None or isinstance(llm_or_path, (str, os.PathLike)):
            # A small context of its own: the Llama serves as tokenizer and chat template only.
            self.llm = load_model(None if llm_or_path is None else os.fspath(llm_or_path),
                                  n_ctx=64, n_batch=64, n_threads=n_threads,
                                  deterministic=deterministic)
        else:
            self.llm = llm_or_path
        det = deterministic
        if det:
            det_mode.require(self.llm, n_threads)
            n_ctx = det_mode.slot_context(n_ctx, n_slots)
        cp = context_params(n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_slots,
                            n_threads=n_threads, unified=not det,
                            flash_attn=False if det else None)
        self.ctx = lc.llama_init_from_model(self.llm.model, cp)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed (n_ctx too large for memory?)")
        self.vocab = lc.llama_model_get_vocab(self.llm.model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        self.n_ctx = int(lc.llama_n_ctx(self.ctx))
        self.n_ctx_slot = self.n_ctx // n_slots
        if det:   # the last cell of a stream is kept for the pad of a one-token step
            self.n_ctx_slot -= det_mode.MIN_RUN - 1
        self.eog = [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)]
        self.eog_set = frozenset(self.eog)
        self.piece = token_piece_fn(self.vocab)
        self.executor = StepExecutor(self.ctx, n_batch, self.eog_set,
                                     min_run=det_mode.MIN_RUN if det else 1)
        self.bounds = Bounds(self.n_vocab, self.n_ctx_slot,
                             f"a slot's context (n_ctx {self.n_ctx} / {n_slots} slots = "
                             f"{self.n_ctx_slot} tokens, one kept for the first output token)")

    def tokenize(self, text: str, special: bool = True,
                 add_bos: Optional[bool] = None) -> List[int]:
        """Token ids of ``text``; BOS is added when the model asks for it (``add_bos=None``)."""
        if add_bos is None:
            add_bos = bool(self._lc.llama_vocab_get_add_bos(self.vocab))
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (control tokens render as nothing)."""
        return b"".join(self.piece(int(t)) for t in tokens).decode("utf-8", errors="replace")

    def free(self) -> None:
        """Free the context (once)."""
        if self.ctx:
            self._lc.llama_free(self.ctx)
            self.ctx = None


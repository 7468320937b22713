"""Why two greedy outputs of one prompt differ: llama.cpp's float noise, measured on this machine.

Greedy verification emits, at every position, the argmax of the target's logits for exactly the
tokens before it. Those logits are not one fixed vector: llama.cpp computes them with other
kernels, summation orders and quantized activations depending on *how* the context was decoded —
one token per batch or many, the prompt in one pass or in chunks (a scheduler step shares its
``n_batch`` tokens among the slots), alone or beside other sequences in the batch (other matrix
shapes, another KV cell layout in a unified cache), and which SIMD kernels the CPU has (AVX2,
AVX-512, AMX). Two correct runs may therefore pick different tokens where the best candidates lie
within that noise of each other, and from there on their outputs differ.

:func:`divergence_report` decodes the common context of two outputs along each of those paths on
the caller's machine and measures how far their logits move from the plain path's, so the check
"a difference only at a near tie" holds on every CPU without a constant tuned on one of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

import numpy as np

from .batch import MultiSeqBatch
from .decoder import Decoder, context_params, finish_request, prompt_pass, reset_context, target_and_prompt

__all__ = ["DivergenceReport", "divergence_report", "first_divergence", "NOISE_PATHS"]

#: The decode paths whose logits are compared with plain decoding's (see `divergence_report`).
NOISE_PATHS = ("batched", "chunked", "multi_seq")


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where ``a`` and ``b`` differ (length included), else ``None``."""
    n = min(len(a), len(b))
    for i in range(n):
        if int(a[i]) != int(b[i]):
            return i
    return None if len(a) == len(b) else n


@dataclass
class DivergenceReport:
    """The target's view at the first position where two greedy outputs of one prompt differ.

    The reference logits (``logit_a``, ``top1``, ...) are plain decoding's: the prompt in one pass,
    then one token per decode. ``noise`` is the largest change of any logit at that position when
    the same context is decoded along the other paths a run may take (`NOISE_PATHS`): the output
    tokens in multi-token batches (verification), the whole context in uneven chunks (a scheduler
    that shares each step's batch), and beside another sequence in a unified KV cache (the batched
    scheduler's slots). A run may legitimately leave the plain output only where both chosen
    tokens' logits lie within that noise of the best one.

    Attributes
    ----------
    index : int
        Output position of the divergence.
    token_a, token_b : int
        The tokens the two runs chose there (``-1`` where a run had already stopped).
    logit_a, logit_b : float
        Their plain-path logits.
    top1, top2 : float
        The two largest plain-path logits.
    gap : float
        ``|logit_a - logit_b|``.
    noise : float
        ``max |plain - path|`` over the vocabulary and the paths.
    rel_gap : float
        ``gap / max(1, |top1|)``.
    path_noise : dict
        Each path's own ``max |plain - path|``.

    Notes
    -----
    Thread-safety: plain data, never modified by ngramspec once returned.
    """

    index: int
    token_a: int
    token_b: int
    logit_a: float
    logit_b: float
    top1: float
    top2: float
    gap: float
    noise: float
    rel_gap: float
    path_noise: Dict[str, float] = field(default_factory=dict)

    def within_noise(self) -> bool:
        """True when both chosen tokens' logits lie within ``noise`` of the best logit.

        Either run may then have picked its token legitimately: another decode path moves the
        logits by up to ``noise`` from the plain path's, enough to reorder such candidates.
        """
        if self.token_a < 0 or self.token_b < 0:
            return False
        return bool(self.top1 - min(self.logit_a, self.logit_b) <= self.noise)

    def to_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["path_noise"] = dict(self.path_noise)
        d["within_float_noise"] = self.within_noise()
        return d


def divergence_report(llm, prompt_tokens, out_a: Sequence[int],
                      out_b: Sequence[int]) -> Optional[DivergenceReport]:
    """Explain why two greedy outputs of the same prompt differ, or ``None`` when they do not.

    Decodes the common context ``prompt + out[:i]`` (``i`` = the first difference) along plain
    decoding's path and along each of `NOISE_PATHS`, and compares the logits at ``i``; see
    :class:`DivergenceReport`. Uses ``llm``'s own context (its KV cache is reset, the prompt's
    kept as `generate_plain` keeps it) and, for the multi-sequence path, a second small context
    on the same weights, freed before returning.

    Raises
    ------
    ValueError
        The prompt holds ids outside the vocabulary, or the divergence lies beyond ``llm``'s
        context.
    """
    i = first_divergence(out_a, out_b)
    if i is None:
        return None
    dec, prompt = target_and_prompt(llm, prompt_tokens)
    common = np.asarray([int(t) for t in out_a[:i]], dtype=np.int32)
    if prompt.size + common.size > dec.n_ctx:
        raise ValueError("the divergence lies beyond the model's context")
    context = np.concatenate([prompt, common])
    paths = {"chunked": _chunked(llm, dec, context), "multi_seq": _multi_seq(llm, dec, context)}
    # Last: it leaves the prompt's KV cache in place, as generate_plain does.
    plain, paths["batched"] = _plain_and_batched(llm, dec, prompt, common)
    path_noise = {name: float(np.max(np.abs(plain - row))) for name, row in paths.items()
                  if row is not None}
    ta = int(out_a[i]) if i < len(out_a) else -1
    tb = int(out_b[i]) if i < len(out_b) else -1
    la = float(plain[ta]) if ta >= 0 else float("nan")
    lb = float(plain[tb]) if tb >= 0 else float("nan")
    top = np.sort(plain)[-2:]
    top1, top2 = float(top[1]), float(top[0])
    gap = abs(la - lb) if ta >= 0 and tb >= 0 else float("inf")
    noise = max(path_noise.values(), default=0.0)
    return DivergenceReport(i, ta, tb, la, lb, top1, top2, gap, noise,
                            gap / max(1.0, abs(top1)), path_noise)


def _plain_and_batched(llm, dec: Decoder, prompt: np.ndarray, common: np.ndarray):
    """Plain decoding's logits after ``prompt + common`` and, where ``common`` is not empty, the
    same context's with ``common`` decoded in multi-token batches after the same prompt pass.

    Leaves the prompt's KV cache in place for the next request, as `generate_plain` does.
    """
    P = prompt.size
    keep_cache = False
    batched = None
    try:
        if common.size == 0:
            # Both runs chose from the prompt pass itself (its logits: prompt_pass keeps only
            # the argmax); the other paths decode the prompt in other ways.
            reset_context(llm, dec)
            return _row(dec.decode(prompt, 0, all_logits=False)), None
        # The prompt's KV (one pass, as in every run) is shared by both paths: reuse it.
        prompt_pass(llm, dec, prompt)
        for j in range(common.size):
            row = dec.decode(common[j:j + 1], P + j, all_logits=False)
        plain = _row(row)
        if common.size >= 2:
            dec.seq_rm(P)
            for lo, hi in _chunk_bounds(common.size, dec.n_batch):
                row = dec.decode(common[lo:hi], P + lo, all_logits=False)
            keep_cache = True
        else:
            dec.seq_rm(P - 1)  # re-decodes the prompt's last position: the cache is spent
            row = dec.decode(np.array([prompt[-1], common[0]], np.int32), P - 1,
                             all_logits=False)
        batched = _row(row)
        return plain, batched
    finally:
        if keep_cache:
            finish_request(llm, dec, P)
        else:
            reset_context(llm, dec)


def _chunked(llm, dec: Decoder, context: np.ndarray) -> Optional[np.ndarray]:
    """The whole context from an empty cache in three uneven chunks (a prompt decoded over
    several scheduler steps, or partly from a cache an earlier request left)."""
    n = context.size
    if n < 6:
        return None
    cuts = [0, n // 3 + 1, (2 * n) // 3 + 1, n]
    try:
        reset_context(llm, dec)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            for a, b in _chunk_bounds(hi - lo, dec.n_batch):
                row = dec.decode(context[lo + a:lo + b], lo + a, all_logits=False)
        return _row(row)
    finally:
        reset_context(llm, dec)


def _multi_seq(llm, dec: Decoder, context: np.ndarray) -> np.ndarray:
    """The context as sequence 1 of a two-sequence unified KV cache (the scheduler's layout),
    each batch led by a chunk of another sequence (the context reversed), so the cells and the
    matrix shapes differ from a lone sequence's."""
    import llama_cpp as lc
    n = context.size
    half = max(2, dec.n_batch // 2)
    threads = int(getattr(getattr(llm, "context_params", None), "n_threads", 0) or 1)
    cp = context_params(n_ctx=2 * n + 256, n_batch=2 * half, n_seq_max=2, n_threads=threads,
                        unified=True)
    ctx = lc.llama_init_from_model(llm.model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed for the multi-sequence noise path")
    try:
        batch = MultiSeqBatch(2 * half)
        other = context[::-1].copy()
        bounds = _chunk_bounds(n, half)
        for lo, hi in bounds:
            batch.clear()
            batch.add(0, other[lo:hi], lo, "none")
            batch.add(1, context[lo:hi], lo, "last" if hi == n else "none")
            out = batch.decode(ctx)
        return _row(out)
    finally:
        lc.llama_free(ctx)


def _chunk_bounds(n: int, size: int):
    """``(lo, hi)`` chunks of at most ``size`` tokens covering ``0 .. n``, the last one at least
    2 tokens long where ``n >= 2`` (a 1-token batch would take the single-token kernels)."""
    size = max(2, size)
    cuts = list(range(0, n, size)) + [n]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < 2:
        cuts[-2] -= 1
    return list(zip(cuts[:-1], cuts[1:]))


def _row(logits: np.ndarray) -> np.ndarray:
    return np.array(logits[-1], dtype=np.float64)

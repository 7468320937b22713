"""A request's sampler: llama.cpp's own sampler chain (``llama_sampler_*``) or a plain argmax.

Speculative sampling (lossless): a draftless draft is a deterministic function of the tokens seen,
so at each draft position the target's token is sampled with the request's chain exactly as plain
sampling would sample it there, and the draft token is accepted while it equals the sample. The
chain's state (the RNG of ``dist``, the penalties' history) advances once per *emitted* token —
``llama_sampler_sample`` accepts the token it returns — and sampling stops at the first mismatch,
so the emitted tokens are distributed exactly as plain sampling's (:func:`sample_run`).
"""
from __future__ import annotations

import ctypes
from typing import Iterable, Optional

import numpy as np

from ngramspec.request_params import SamplingParams

__all__ = ["Sampler", "sample_run", "LLAMA_DEFAULT_SEED"]

#: llama.cpp's "pick a random seed" value.
LLAMA_DEFAULT_SEED = 0xFFFFFFFF


class Sampler:
    """The token picker of one request.

    Greedy requests without logit changes (``SamplingParams.plain_argmax``) take the argmax of the
    raw logits, as plain greedy decoding does (``ngramspec.llama.live.generate_plain``); every other
    request gets a llama.cpp sampler chain: logit_bias (with EOG tokens banned for
    ``ignore_eos``), penalties, top_k, top_p, min_p, temperature, dist(seed) — or greedy at the end
    instead of the four last ones when ``temperature == 0``.

    Parameters
    ----------
    params : SamplingParams
    n_vocab : int
    eog_tokens : iterable of int
        End-of-generation tokens (banned when ``params.ignore_eos``).

    Notes
    -----
    Memory: the chain's samplers (the penalties keep ``repeat_last_n`` tokens).

    Thread-safety: not thread-safe; used by the scheduler's decode thread only.
    """

    def __init__(self, params: SamplingParams, n_vocab: int, eog_tokens: Iterable[int] = ()):
        import llama_cpp as lc
        self._lc = lc
        self.params = params
        self.chain = None
        if params.plain_argmax:
            return
        p = params
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        self.chain = chain
        bias = dict(p.logit_bias)
        if p.ignore_eos:
            for t in eog_tokens:
                bias[int(t)] = float("-inf")
        if bias:
            arr = (lc.llama_logit_bias * len(bias))()
            for i, (tok, b) in enumerate(sorted(bias.items())):
                arr[i].token, arr[i].bias = tok, b
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_logit_bias(
                n_vocab, len(bias), arr))
        if p.penalized:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_penalties(
                n_vocab, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty,
                p.presence_penalty))
        if p.greedy:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            return
        if p.top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(p.min_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(p.temperature))
        seed = LLAMA_DEFAULT_SEED if p.seed is None else p.seed
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))

    def accept(self, tokens: Iterable[int]) -> None:
        """Feed tokens the request has seen (the prompt) into the chain's history."""
        if self.chain is not None and self.params.penalized:
            for t in tokens:
                self._lc.llama_sampler_accept(self.chain, int(t))

    def sample(self, ctx, idx: int, logits: Optional[np.ndarray] = None) -> int:
        """Sample the token at batch index ``idx`` of the last decode, and accept it.

        ``logits`` is that row (used by the argmax path only).
        """
        if self.chain is None:
            return int(np.argmax(logits))
        return int(self._lc.llama_sampler_sample(self.chain, ctx, int(idx)))

    def close(self) -> None:
        if self.chain is not None:
            self._lc.llama_sampler_free(self.chain)
            self.chain = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def sample_run(sampler: Sampler, ctx, rows: np.ndarray, first_idx: int, draft: np.ndarray,
               limit: int, is_end) -> list:
    """The target's tokens for one slot's verification: ``[sampled] + draft`` was decoded at batch
    indices ``first_idx ..`` (logits ``rows``); sample position 0, and while the sample equals the
    draft token, the next position.

    Returns the sampled tokens: ``n_acc + 1`` of them, or fewer when the request ends first — at
    ``limit`` tokens or at a token for which ``is_end(token)`` is true (EOS) — as plain sampling
    would stop there.
    """
    m = min(len(draft), limit - 1)
    if sampler.chain is None:
        # Argmax needs no state: all rows at once, then the common prefix.
        target = np.argmax(rows[:m + 1], axis=1)
        out = []
        for i in range(m + 1):
            t = int(target[i])
            out.append(t)
            if (i < m and t != draft[i]) or len(out) >= limit or is_end(t):
                break
        return out
    out = []
    for i in range(m + 1):
        t = sampler.sample(ctx, first_idx + i)
        out.append(t)
        if (i < m and t != int(draft[i])) or len(out) >= limit or is_end(t):
            break
    return out

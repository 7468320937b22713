"""The second half of a scheduler step: decode a `ngramspec.llama.planner.StepPlan` in one
``llama_decode``, then apply the output to each run (vLLM v1's ``update_from_output``).

A generating slot samples its target tokens with its own sampler, accepting the draft while the
sample equals it (`ngramspec.llama.sampling.sample_run`: lossless), verifies them through its
`ngramspec.loop.SlotLoop` and drops the rejected KV cells (``llama_memory_seq_rm``); a prompt's
last chunk gives its first token. What the tokens mean to the request (stop rules, text, the
client) is the scheduler's, except that a step is verified only up to where the request's text
stream would cut it at a stop string (so accepted counts are of kept tokens).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import FrozenSet, List, Tuple

import numpy as np

from .batch import MultiSeqBatch
from .planner import PromptChunk, StepPlan, Verify
from .sampling import sample_run

__all__ = ["StepExecutor", "StepOutput"]

_NO_EOG: FrozenSet[int] = frozenset()


@dataclass(frozen=True)
class StepOutput:
    """The logits of one decoded plan: ``rows`` (a view valid until the next decode), the row
    and batch index where each run's output starts, and the decode's wall time."""

    rows: np.ndarray
    verify_at: Tuple[Tuple[int, int], ...]   # (row, batch index) of each Verify's first token
    chunk_at: Tuple[Tuple[int, int], ...]    # (row, batch index) of each chunk's last token
    seconds: float


class StepExecutor:
    """Decodes step plans on one llama context and verifies their runs.

    Parameters
    ----------
    ctx : llama_context pointer
        The scheduler's context (one sequence per slot, unified KV cache).
    n_batch : int
        Tokens of one decode.
    eog : frozenset of int
        The model's end-of-generation tokens.
    min_run : int
        Fewest tokens and rows of logits per decode (2 under the deterministic mode: a one-token
        run is padded, `ngramspec.llama.batch.MultiSeqBatch`).

    Notes
    -----
    Memory: one `MultiSeqBatch` of ``n_batch`` tokens.

    Thread-safety: not thread-safe; the scheduler's decode thread owns it and the context.
    """

    def __init__(self, ctx, n_batch: int, eog: FrozenSet[int], min_run: int = 1):
        import llama_cpp as lc
        self._lc = lc
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._batch = MultiSeqBatch(n_batch, min_run=min_run)
        self.n_batch, self.min_run = n_batch, min_run
        self._eog = eog

    def decode_all(self, plan: StepPlan, n_ctx_slot: int):
        """The plan's decodes, each with its output: ``(part, StepOutput)`` per ``llama_decode``
        (one, or with ``min_run > 1`` the deterministic mode's runs of one length or one
        sequence, `StepPlan.split`); an empty part is not decoded."""
        parts = plan.split(self.n_batch, n_ctx_slot, self.min_run) if self.min_run > 1 \
            else ((plan, 0),)
        for part, pad_to in parts:
            if part.n_tokens:
                yield part, self.decode(part, pad_to)

    def decode(self, plan: StepPlan, pad_to: int = 0) -> StepOutput:
        """One ``llama_decode`` of the plan's runs, logits at every draft position and at each
        prompt's last token; ``pad_to``: each verification run padded to that many tokens."""
        batch = self._batch
        batch.clear()
        starts = [batch.add(v.seq, v.tokens, v.pos0, "all", pad_to) for v in plan.verifies]
        lasts = [batch.add(c.seq, c.tokens, c.start, "last" if c.last else "none")
                 + c.stop - c.start - 1 for c in plan.chunks]
        t0 = time.perf_counter()
        rows = batch.decode(self._ctx)
        dt = time.perf_counter() - t0
        row_of = np.cumsum(batch.logits[:batch.n]) - 1  # batch index -> output row
        return StepOutput(rows, tuple((int(row_of[i]), i) for i in starts),
                          tuple((int(row_of[i]), i) for i in lasts), dt)

    def verify(self, run: Verify, out: StepOutput, at: Tuple[int, int]) -> Tuple[List[int], int]:
        """Sample and verify one generating slot's run; returns the target's tokens to emit
        (the accepted draft and the target's next token, fewer when the request ends) and the
        accepted count. The slot's KV cache and cached tokens then hold the verified context."""
        r = run.req
        loop, draft = r.loop, run.draft
        m = len(draft)
        max_tokens = r.sampling.max_tokens
        remaining = max_tokens - len(r.tokens) if max_tokens >= 0 else m + 1
        eog = self._eog if not r.sampling.ignore_eos else _NO_EOG
        row0, idx0 = at
        target = sample_run(r.sampler, self._ctx, out.rows[row0:row0 + m + 1], idx0, draft,
                            max(1, remaining), eog.__contains__)
        # A stop string ends the output inside the step: verify only the kept tokens, as
        # max_tokens bounds sample_run above, so that every count of accepted draft tokens
        # (the request's, the proposers', the prediction's) is of tokens the output keeps.
        target = target[:r.text.stop_cut(target)]
        L0 = loop.n_context
        # A draft cut by the joint choice: its verified part is what was decoded.
        n_acc = r.policy.verify(loop, np.asarray(target, dtype=np.int32), n_verified=m)
        L = loop.n_context
        if L < L0 + m + 1:  # the sampled token and the accepted draft stay; drop the rest
            self.drop(run.seq, L)
        slot = r.slot
        slot.cached[L0:L] = loop.context[L0:L]
        slot.n_cached = L
        return target[:n_acc + 1], n_acc

    def first_token(self, chunk: PromptChunk, out: StepOutput, at: Tuple[int, int]) -> int:
        """The first output token of a request whose prompt the chunk completed."""
        row, idx = at
        return chunk.req.sampler.sample(self._ctx, idx, out.rows[row])

    def drop(self, seq: int, p0: int) -> None:
        """Drop positions ``p0 ..`` of sequence ``seq`` from the KV cache."""
        self._lc.llama_memory_seq_rm(self._mem, seq, p0, -1)

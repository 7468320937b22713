"""The decode thread's state of the batched scheduler: a request while it runs, a slot, and the
`Completion` its client gets back.

`RunningRequest` is what `ngramspec.llama.planner.PlannedRequest` describes (the planner reads
it) and what the admission reads (`ngramspec.llama.admission`).
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from ngramspec.draft_engine import NO_DRAFT
from ngramspec.loop import SlotLoop
from ngramspec.policy import FIXED, DraftPolicy
from ngramspec.prediction import PredictionDrafter
from ngramspec.stats import DraftCounts

from ngramspec.request_params import SamplingParams, SpeculationParams
from ngramspec.request import Completion, RequestHandle
from .sampling import Sampler
from .text import TextStream

__all__ = ["RunningRequest", "Slot", "completion"]


class RunningRequest:
    """One submitted request, from its queueing to its end.

    Notes
    -----
    Memory: the prompt, the output tokens, the sampler and the loop once admitted.

    Thread-safety: the decode thread's; ``cancel_requested`` is set from any thread under the
    scheduler's lock, and ``handle`` is thread-safe.
    """

    def __init__(self, rid, prompt, sampling, spec, on_token, prediction, cancel,
                 cache_owner=None, cache_prompt=True):
        self.prediction: Optional[PredictionDrafter] = prediction   # Predicted Outputs
        self.cache_owner, self.cache_prompt = cache_owner, cache_prompt   # see admission
        self.id = rid
        self.prompt: np.ndarray = prompt
        self.sampling: SamplingParams = sampling
        self.spec: SpeculationParams = spec
        self.on_token = on_token
        self.handle = RequestHandle(rid, cancel)
        self.cancel_requested = False
        self.slot: Optional["Slot"] = None
        self.n_past = 0                # prompt tokens in the slot's KV cache
        self.n_cached = 0
        self.sampler: Optional[Sampler] = None
        self.loop: Optional[SlotLoop] = None
        self.policy: DraftPolicy = FIXED      # the loop's draft-length policy (engines.loop_for)
        self.text: Optional[TextStream] = None
        self.tokens: List[int] = []
        self.callback_error: Optional[BaseException] = None
        self.counts = DraftCounts()
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_first = 0.0

    def admit(self, slot: "Slot", lcp: int, context) -> int:
        """Take `slot`, whose KV cache holds the first `lcp` prompt tokens (the rest is dropped
        from `context`'s sequence); returns the prefix kept (the prompt's last token is always
        decoded: its logits give the first token). Sampler and text stream are made here."""
        lcp = min(lcp, self.prompt.size - 1)
        context.executor.drop(slot.id, lcp)
        slot.n_cached = lcp
        slot.req = self
        slot.owner = self.cache_owner      # what the slot caches from now on is this owner's
        self.slot = slot
        self.n_past = self.n_cached = lcp
        self.t_admit = time.perf_counter()
        self.sampler = Sampler(self.sampling, context.n_vocab, context.eog)
        self.sampler.accept(self.prompt)
        self.text = TextStream(context.piece, self.sampling.stop)
        return lcp


class Slot:
    """One sequence of the context and the tokens its KV cache holds.

    Notes
    -----
    Memory: a copy of the slot's cached tokens (4 bytes per cell). Thread-safety: the decode
    thread's.
    """

    def __init__(self, sid: int, n_ctx: int):
        self.id = sid
        self.cached = np.empty(n_ctx, dtype=np.int32)  # tokens whose KV the sequence holds
        self.n_cached = 0
        self.req: Optional[RunningRequest] = None
        self.last_used = 0
        self.owner = None     # the cache_owner of the request that left the cache


def completion(r: RunningRequest, reason: str) -> Completion:
    """What the request's client gets back when it ends for `reason`."""
    now = time.perf_counter()
    text = r.text.text if r.text is not None else ""
    stop_string = r.text.stop_string if r.text is not None else None
    engine = r.loop.engine if r.loop is not None else NO_DRAFT
    t_first = r.t_first or now
    return Completion(
        tokens=list(r.tokens), text=text, finish_reason=reason, prompt_n=int(r.prompt.size),
        prompt_cached_n=r.n_cached, predicted_n=len(r.tokens),
        prompt_ms=(t_first - r.t_admit) * 1e3 if r.t_admit else 0.0,
        predicted_ms=(now - t_first) * 1e3 if r.t_first else 0.0,
        counts=r.counts.copy(), stop_string=stop_string,
        queued_ms=((r.t_admit or now) - r.t_submit) * 1e3,
        accepted_prediction_tokens=engine.accepted_prediction_tokens,
        rejected_prediction_tokens=engine.rejected_prediction_tokens)

"""The batched scheduler's proposers: the configured chain, a request's engine on it, their
counters, and what a finished request teaches them.

One `SpecEngine` of the configured chain serves every slot; a request asking for a subset of
the chain (``speculation.types``) gets an engine over the chain's own proposer objects (so the
slots, the ngram-mod pool and the ngram-suffix store stay shared), cached per subset; a request
with a prediction puts it in front (`PredictedEngine`); a request without speculation gets
`NO_DRAFT`.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, Optional, Tuple

from ngramspec.config import SpecConfig
from ngramspec.cost import CostModel
from ngramspec.draft_engine import NO_DRAFT, DraftEngine
from ngramspec.engine import SpecEngine
from ngramspec.loop import SlotLoop
from ngramspec.policy import FIXED, POLICIES, AutoPolicy, DraftPolicy
from ngramspec.prediction import PredictedEngine, PredictionDrafter

from .calibration import context_calibration
from .decoder import check_engine_models
from ngramspec.request_params import SpeculationParams
from ngramspec.validation import check_choice

__all__ = ["ChainEngines", "PROPOSER_COUNTS", "checked_spec", "joint_policy"]

log = logging.getLogger("ngramspec.scheduler")

#: `SpecEngine.stats`' counts that `Scheduler.stats` sums per proposer type.
PROPOSER_COUNTS = ("gen_tokens", "acc_tokens", "gen_drafts", "acc_drafts")


class ChainEngines:
    """The scheduler's proposer chain and the engines of its requests.

    Parameters
    ----------
    llm : llama_cpp.Llama
        The target: drafts must be ids of its vocabulary (`check_engine_models`).
    n_slots : int
    spec : SpecConfig
        The chain (`SpecConfig.types`: none is no speculation, the engine is `NO_DRAFT`; a
        ``model_draft`` ends it with ``draft-simple`` on that model) and its `SpecEngine`
        keywords, cache files loaded (`SpecConfig.with_files_loaded`).

    Attributes
    ----------
    engine : DraftEngine
        The whole chain's engine (`NO_DRAFT` without proposers).
    types : tuple of str
        The chain's proposer types.

    Notes
    -----
    Memory: the chain's proposers (`SpecEngine`); a small engine object per subset asked for.

    Thread-safety: `for_request` and `learn` run on the decode thread; `stats` may be called
    from any thread (the subset cache is guarded by a lock).
    """

    def __init__(self, llm, n_slots: int, spec: SpecConfig):
        types = spec.types
        self.engine: DraftEngine = NO_DRAFT
        if types:
            self.engine = SpecEngine(list(types), n_slots=n_slots, **spec.params)
            # drafts must be ids of this model: a draft model of another vocabulary, an n-gram
            # cache file of another tokenizer are refused, and drafts stay inside the vocabulary
            check_engine_models(llm, self.engine)
        self.types = tuple(self.engine.types) if types else ()
        self.n_slots = n_slots
        self._subsets: Dict[tuple, SpecEngine] = {}
        self._lock = threading.Lock()
        # draft-simple keeps a p_min per slot: each request sets its own at its start
        self._draft_proposer = next((p for p in self.engine.proposers
                                     if p.name == "draft-simple"), None)

    def _subset(self, types: Optional[tuple]) -> DraftEngine:
        """The engine of a proposer subset (None: the whole chain)."""
        if types is None or tuple(types) == self.types or not self.engine.speculates:
            return self.engine
        with self._lock:        # `stats` reads the cache from other threads
            return self.engine.subset(types, self._subsets)

    def for_request(self, spec: SpeculationParams, prediction: Optional[PredictionDrafter],
                    slot: int) -> DraftEngine:
        """The engine of a request starting on `slot`: its subset of the chain, its prediction in
        front, or `NO_DRAFT` when its speculation is off."""
        if not spec.enabled:
            return NO_DRAFT
        engine = self._subset(spec.types)
        if prediction is not None:
            engine = PredictedEngine(prediction, engine)
        if self._draft_proposer is not None:
            # the request's own p_min, held by its slot (None: the proposer's)
            self._draft_proposer.set_p_min(slot, spec.p_min)
        return engine

    def loop_for(self, r, first_token: int, n_ctx_slot: int, policy: str,
                 auto_policy: Optional[AutoPolicy]) -> Tuple[SlotLoop, DraftPolicy]:
        """The `SlotLoop` of request `r` (`ngramspec.llama.running.RunningRequest`) whose prompt
        is in its slot and whose first output token is `first_token`, on its engine
        (`for_request`), and the policy the planner drafts it through: the joint `auto_policy`
        when its policy (else the scheduler's `policy`) is "auto" and it speculates, else
        llama.cpp's `FIXED`."""
        engine = self.for_request(r.spec, r.prediction, r.slot.id)
        auto = engine.speculates and (r.spec.policy or policy) == "auto"
        loop = SlotLoop(engine, r.slot.id, r.prompt, first_token, n_ctx=n_ctx_slot,
                        n_predict=r.sampling.max_tokens, capacity=n_ctx_slot)
        return loop, auto_policy if auto else FIXED

    def learn(self, slot: int) -> None:
        """What the finished request on `slot` taught (ngram-suffix's store) reaches every slot
        now, not when this slot's next request begins: a server with many slots learns as one.
        Called after the client has its answer (a store insertion may rebuild the store); a
        failure only loses the lesson (the slot is idle all the same), never the request."""
        try:
            self.engine.end(slot)
        except MemoryError:
            log.warning("out of memory storing slot %d's finished request in the proposers' "
                        "store: not learned from", slot)

    def stats(self) -> Dict[str, dict]:
        """Per proposer type, the sums of `PROPOSER_COUNTS` over every engine of the chain's
        proposers."""
        with self._lock:
            engines = [self.engine, *self._subsets.values()]
        per: Dict[str, dict] = {t: dict.fromkeys(PROPOSER_COUNTS, 0) for t in self.types}
        for eng in engines:
            for st in eng.stats():
                d = per[st["type"]]
                for key in PROPOSER_COUNTS:
                    d[key] += st[key]
        return per


def checked_spec(spec: Optional[SpecConfig]) -> Tuple[SpecConfig, Optional[CostModel]]:
    """The scheduler's configuration checked, its cache files and cost model loaded, before
    any model (a bad value or file fails fast): ``(spec, cost model or None)``; None is
    ngram-mod with llama.cpp's parameters.

    Raises
    ------
    TypeError
        Not a `SpecConfig`.
    ValueError, OSError
        A policy out of `POLICIES` (`OutOfRange` naming ``policy``), an unknown spec type, a
        corrupt or missing cache file, an unknown cost model.
    """
    if spec is None:
        spec = SpecConfig.from_keywords()
    if not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be a SpecConfig, got {type(spec).__name__}")
    check_choice("policy", spec.policy, POLICIES)
    spec.types      # noqa: B018  (the chain's names checked)
    spec = spec.with_files_loaded()
    return spec, spec.cost_model


def joint_policy(cost_model: Optional[CostModel], llm, ctx, n_threads: int, n_batch: int, *,
                 measure_now: bool) -> Tuple[Optional[CostModel], Optional[AutoPolicy]]:
    """The cost model of the scheduler's context and the one joint `AutoPolicy` of its "auto"
    requests: `cost_model` when given, else the context's calibration
    (`ngramspec.llama.calibration.context_calibration`: measured on the idle context with
    `measure_now`, else only a cached one); ``(None, None)`` without any."""
    if cost_model is None:
        cost_model = context_calibration(llm, ctx, n_threads, n_batch, measure_now=measure_now)
    return cost_model, (AutoPolicy(cost_model, joint=True) if cost_model is not None else None)

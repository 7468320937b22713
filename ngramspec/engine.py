"""`SpecEngine`: llama-server's proposer chain, built from ``--spec-type`` and its parameters.

The compiled `ngramspec._engine.Engine` drives a chain of proposers; this layer builds the chain
from the registry (`ngramspec.registry`: names, parameters, ranges), so the kernels import
nothing from the Python layer.
"""
from __future__ import annotations

from ngramspec._engine import Engine
from ngramspec._mod import ModPool
from ngramspec._proposer import check_int
from ngramspec.draft_engine import LearnsAtEnd
from ngramspec.registry import build_proposers
from ngramspec.stats import statistics_line

__all__ = ["SpecEngine"]


class SpecEngine(Engine):
    """A chain of proposers driven as llama-server drives them.

    A `ngramspec.draft_engine.DraftEngine`. Methods ``begin(slot, prompt)``, ``draft(slot, context, sampled, n_max=None)`` and
    ``accept(slot, n_accepted)`` follow llama-server: begin once per request with the full
    prompt; draft with the tokens in the KV cache and the last sampled token; accept after every
    non-empty draft (also with 0). Token arrays may be any 1-D integer array-like; ids must be
    in 0 .. 2**31-1. `ngramspec.loop.SlotLoop` drives them for one request.

    Parameters
    ----------
    spec_type : str or list of str
        llama-server's ``--spec-type`` comma list, e.g. ``"ngram-mod,ngram-map-k4v"``. The
        proposers run in llama.cpp's fixed priority order, whatever the list's order; the first
        non-empty draft wins.
    n_slots : int, >= 1
        Server slots. Per-slot state is separate; the ngram-mod pool is shared by all slots.
    pool : ModPool, optional
        The ngram-mod table to use (shared with other engines given the same pool).
    proposers : sequence of Proposer, optional
        Already built proposers instead of `spec_type` (see `from_proposers`).
    **params
        Flat keywords named after the server flags: ``ngram_simple_size_n``,
        ``ngram_map_k4v_min_hits``, ``ngram_mod_n_match``, ... (`ngramspec.registry`); a value
        out of range raises ValueError naming the keyword and the allowed range.

    Raises
    ------
    TypeError
        Neither or both of `spec_type` and `proposers`, an unknown keyword, a value of the
        wrong kind, `pool` not a ``ModPool``.
    ValueError
        An unknown or unsupported spec type, a value out of range (the message names the
        keyword and the allowed range).
    MemoryError
        An `n_slots` whose per-slot state would need more than the machine's memory
        (`ngramspec.registry.check_slot_memory`), or an allocation refused.

    Notes
    -----
    Memory: see each proposer; the engine adds ``n_slots * max_draft`` int32 of output buffers.

    Thread-safety: calls for different slots may come from different threads at once (one
    thread per slot at a time); statistics are updated with the GIL held.
    """

    __slots__ = ()
    # `ngramspec.draft_engine.DraftEngine`'s optional parts this engine has not
    speculates = True
    accepted_prediction_tokens = rejected_prediction_tokens = 0

    def __init__(self, spec_type=None, n_slots=1, pool=None, *, proposers=None, **params):
        if proposers is None:
            if spec_type is None:
                raise TypeError("SpecEngine needs spec_type (or proposers=)")
            # the engine's own checks, before any proposer is built with these values
            n_slots = check_int("n_slots", n_slots, 1)
            if pool is not None and not isinstance(pool, ModPool):
                raise TypeError(f"pool must be a ModPool, got {type(pool).__name__}")
            proposers = build_proposers(spec_type, n_slots, pool, params)
        elif params or spec_type is not None:
            raise TypeError("pass either spec_type with parameters, or proposers=")
        super().__init__(proposers, n_slots, pool)

    def end(self, slot) -> None:
        """Request `slot` is over: proposers that learn from finished requests (ngram-suffix's
        global store) learn from it now rather than at the slot's next `begin`; the others
        have nothing to do (llama.cpp's proposers learn at `begin`, as llama-server calls
        them). Same thread rule as `begin`."""
        for p in self.proposers:
            if isinstance(p, LearnsAtEnd):
                p.end(slot)

    @classmethod
    def from_proposers(cls, proposers, n_slots: int = 1) -> "SpecEngine":
        """An engine over already-built proposers.

        Parameters
        ----------
        proposers : sequence of Proposer
            Their priority is the given order (the first non-empty draft wins).
        n_slots : int
            Slots; every proposer must have at least as many.

        Returns
        -------
        SpecEngine
        """
        return cls(None, n_slots, proposers=proposers)

    def subset(self, types, cache: dict) -> "SpecEngine":
        """The engine of this chain's proposers named in `types` (None, or every type: this
        engine itself): the same proposer objects, so a request drafting with a subset shares
        the slots' state and the stores with the whole chain. Built once per subset into
        `cache`, the caller's dict keyed by the subset (the caller guards it where several
        threads read it)."""
        if types is None or tuple(types) == tuple(self.types):
            return self
        key = tuple(t for t in self.types if t in types)
        eng = cache.get(key)
        if eng is None:
            props = [p for p in self.proposers if p.name in key]
            eng = cache[key] = SpecEngine.from_proposers(props, n_slots=self.n_slots)
        return eng

    def stats_lines(self) -> list[str]:
        """llama.cpp's ``statistics <type>: ...`` lines, one per proposer."""
        return [statistics_line(s) for s in self.stats()]

"""Offline verification: replay recorded token traces through an engine.

Each request runs through `ngramspec.loop`'s slot loop with the recorded output as the target
(greedy verification): a draft is accepted up to its first token that differs from the
recording. Results come out in the golden files' format.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ngramspec import store_log
from ngramspec._mod import ModPool
from ngramspec.engine import SpecEngine
from ngramspec.loop import Timers, run_recorded  # noqa: F401 (Timers re-exported)
from ngramspec.registry import TYPES, parse_types

COUNTERS = ("calls_b", "calls_g", "calls_a", "gen_drafts", "acc_drafts", "gen_tokens",
            "acc_tokens")


def replay_request(engine: SpecEngine, slot: int, prompt: np.ndarray, output: np.ndarray,
                   record_drafts: bool, timers: Timers, n_ctx: int = 0, policy=None) -> dict:
    """Run one request through `engine` on `slot` (`ngramspec.loop.run_recorded`).

    Parameters
    ----------
    engine : SpecEngine
    slot : int
    prompt, output : 1-D int arrays
        The request's prompt and recorded output.
    record_drafts : bool
        Include every draft in the record.
    timers : Timers
        The engine calls' times are added to it.
    n_ctx : int
        > 0 bounds every draft by llama-server's ``n_ctx - L - 2`` (no draft call when that is
        <= 0); 0 means unbounded, as in the golden files.
    policy : DraftPolicy, optional
        The draft-length policy `run_recorded` drives the loop through; None: llama.cpp's (the
        golden files).

    Returns
    -------
    dict
        The request's golden-format record.
    """
    loop = run_recorded(engine, slot, prompt, output, n_ctx=n_ctx, record_drafts=record_drafts,
                        policy=policy)
    timers.add(loop.timers)
    return loop.record()


@dataclass
class ReplayResult:
    """What `replay` returns.

    Attributes
    ----------
    summary : dict
        Totals, llama.cpp's counters per proposer (``llama_stats``), µs per call, the policy's
        summary.
    requests : list of dict
        One golden-format record per request.

    Notes
    -----
    Memory: the records (with every draft when recorded).

    Thread-safety: plain data; share read-only.
    """
    summary: dict
    requests: list = field(default_factory=list)


TIMERS = ("t_begin_us", "t_draft_us", "t_accept_us")


def _sum_stats(total: list | None, stats: list) -> list:
    """Add one engine's `stats()` into `total` (fresh state sums engines per type)."""
    if total is None:
        return [dict(s, acc_per_pos=list(s["acc_per_pos"])) for s in stats]
    for t, s in zip(total, stats):
        for k in COUNTERS + TIMERS:
            t[k] += s[k]
        pos = t["acc_per_pos"]
        pos.extend([0] * (len(s["acc_per_pos"]) - len(pos)))
        for i, c in enumerate(s["acc_per_pos"]):
            pos[i] += c
    return total


def _run_once(requests, spec_type, params, state, n_slots, record_drafts, n_ctx, progress,
              policy_factory=None, store=None):
    timers = Timers()
    policy = policy_factory() if policy_factory is not None else None
    records, total = [], None
    pool = ModPool() if any(TYPES[t].uses_pool for t in parse_types(spec_type)) else None
    engine = None
    for t, req in enumerate(requests):
        slot = t % n_slots
        if engine is None or state == "fresh":
            if engine is not None:
                total = _sum_stats(total, engine.stats())
                if pool is not None:
                    pool.reset()       # a fresh context has an empty pool
            engine = SpecEngine(spec_type, n_slots=n_slots, pool=pool, **params)
            if store is not None:
                replica = store_log.attach(engine, store)
        rec = replay_request(engine, slot, req.prompt, req.output, record_drafts, timers, n_ctx,
                             policy)
        engine.end(slot)              # as a server does when the request finishes
        records.append({"trace": t, **rec, "id": req.id})
        if progress is not None:
            progress(t + 1, len(requests))
    if engine is not None:
        total = _sum_stats(total, engine.stats())
    if store is not None and engine is not None:
        for slot in range(n_slots):      # the requests end: publish the slots' last ones
            engine.begin(slot, np.empty(0, dtype=np.int32))
        replica.stop()
        total = [dict(s, store_log=replica.stats()) if s["type"] == "ngram-suffix" else s
                 for s in total]
    return records, total or [], timers, policy


def _json_params(params: dict) -> dict:
    """The params as JSON can hold them: paths as strings, loaded objects (an NgramCache, a
    llama_cpp model) by their repr, so a summary always serialises."""
    plain = (str, int, float, bool, type(None))
    return {k: v if isinstance(v, plain) else os.fspath(v) if isinstance(v, os.PathLike)
            else repr(v) for k, v in params.items()}


def replay(requests, spec_type: str, params: dict | None = None, *, state: str = "shared",
           n_slots: int = 1, record_drafts: bool = False, repeat: int = 1, n_ctx: int = 0,
           progress=None, policy_factory=None, store: str | None = None) -> ReplayResult:
    """Replay recorded requests through a chain and return the golden-format result.

    Parameters
    ----------
    requests : sequence of ngramspec.traces.Request
    spec_type : str
        ``--spec-type`` list.
    params : dict, optional
        Engine keywords (`ngramspec.registry`).
    state : {"shared", "fresh"}
        "shared" keeps one engine for all requests (a running server; request t on slot
        t % n_slots); "fresh" builds a new one per request (the pool emptied).
    n_slots : int
    record_drafts : bool
        Keep every draft in the request records.
    repeat : int
        Run that many times and report the fastest timings (drafts are deterministic; differing
        counters raise RuntimeError).
    n_ctx : int
        > 0 bounds drafts by llama-server's ``n_ctx - L - 2``.
    progress : callable, optional
        ``progress(done, total)`` after each request of the first run.
    policy_factory : callable, optional
        Makes the draft-length policy of each run (one policy serves all requests of a run, as
        one would a server's slots); None is llama.cpp's (`FixedPolicy`).
    store : str, optional
        A store log (`ngramspec.store_log`: ``dir:PATH``, ``redis://...``) that ngram-suffix's
        global store shares with other replicas (other replays, servers) while it runs;
        needs state "shared" and repeat 1 (drafts then depend on what the others publish).

    Returns
    -------
    ReplayResult
        ``summary`` (totals, llama.cpp's counters per proposer, µs per call) and ``requests``.

    Raises
    ------
    ValueError
        `state`, `n_slots` or `repeat` out of range, or an engine parameter (as `SpecEngine`).
    RuntimeError
        Runs of one `repeat` gave different counters.

    Notes
    -----
    Memory: the engine's, plus the records (with every draft when record_drafts).

    Thread-safety: builds its own engines; safe to run in several threads at once.
    """
    params = dict(params or {})
    if state not in ("shared", "fresh"):
        raise ValueError(f"state = {state!r}: allowed 'shared' or 'fresh'")
    if n_slots < 1:
        raise ValueError(f"n_slots = {n_slots} is out of range: allowed >= 1")
    if repeat < 1:
        raise ValueError(f"repeat = {repeat} is out of range: allowed >= 1")
    if store is not None and (state != "shared" or repeat != 1):
        raise ValueError("--store shares one engine's store while it runs: it needs --state "
                         "shared and --repeat 1")
    best = None
    for r in range(repeat):
        records, stats, timers, policy = _run_once(
            requests, spec_type, params, state, n_slots, record_drafts, n_ctx,
            progress if r == 0 else None, policy_factory, store)
        if best is None:
            best = (records, stats, timers, policy)
        else:
            if [[s[k] for k in COUNTERS] for s in stats] != \
                    [[s[k] for k in COUNTERS] for s in best[1]]:
                raise RuntimeError("replay is not deterministic: counters differ between repeats")
            bt = best[2]
            for name in ("begin_ns", "draft_ns", "accept_ns"):
                setattr(bt, name, min(getattr(bt, name), getattr(timers, name)))
    records, stats, timers, policy = best
    keys = ("n_output", "n_steps", "n_draft_calls", "n_drafts", "n_draft_tokens",
            "n_acc_drafts", "n_acc_tokens")
    totals = {k: sum(r[k] for r in records) for k in keys}
    summary = {
        "summary": True, "types": spec_type, "state": state, "slots": n_slots, "repeat": repeat,
        "n_ctx": n_ctx, "params": _json_params(params), "n_traces": len(records), **totals,
        "n_accept_calls": totals["n_drafts"],
        "acc_rate": round(totals["n_acc_tokens"] / totals["n_draft_tokens"], 4)
        if totals["n_draft_tokens"] else 0.0,
        "tokens_per_step": round(totals["n_output"] / totals["n_steps"], 4)
        if totals["n_steps"] else 0.0,
        "llama_stats": stats,
        **timers.per_call_us(),
    }
    if policy is not None and hasattr(policy, "summary"):
        summary["policy"] = policy.summary()
    return ReplayResult(summary, records)

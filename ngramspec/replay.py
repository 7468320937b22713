"""Offline verification: replay recorded token traces through an engine.

The loop is llama-server's slot loop under greedy verification, as ``../shared/golden/README.md``
gives it: the target's tokens are the recorded output, so a draft is accepted up to its first
token that differs from the recording. Results come out in the golden files' format.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ngramspec._core import ModPool, SpecEngine
from ngramspec.spec_types import REGISTRY, parse_types

COUNTERS = ("calls_b", "calls_g", "calls_a", "gen_drafts", "acc_drafts", "gen_tokens",
            "acc_tokens")


@dataclass
class Timers:
    """Nanoseconds spent in, and number of, the engine's begin/draft/accept calls."""
    begin_ns: int = 0
    draft_ns: int = 0
    accept_ns: int = 0
    n_begin: int = 0
    n_draft: int = 0
    n_accept: int = 0

    def per_call_us(self) -> dict:
        def us(ns, n):
            return round(ns / n / 1000, 4) if n else 0.0
        return {"us_per_gen_call": us(self.draft_ns, self.n_draft),
                "us_per_acc_call": us(self.accept_ns, self.n_accept),
                "us_per_begin_call": us(self.begin_ns, self.n_begin)}


def common_prefix(draft: np.ndarray, target: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    k = min(len(draft), len(target))
    diff = np.flatnonzero(draft[:k] != target[:k])
    return int(diff[0]) if len(diff) else k


def replay_request(engine: SpecEngine, slot: int, prompt: np.ndarray, output: np.ndarray,
                   record_drafts: bool, timers: Timers, n_ctx: int = 0) -> dict:
    """Run one request through `engine` on `slot`; returns its golden-format record.

    n_ctx > 0 bounds every draft by llama-server's ``n_ctx - L - 2`` (no draft call when that
    is <= 0); 0 means unbounded, as in the golden files.
    """
    n_out = len(output)
    buf = np.empty(len(prompt) + n_out + 1, dtype=np.int32)
    buf[:len(prompt)] = prompt
    L = len(prompt)
    steps, drafts = [], []
    clock = time.perf_counter_ns
    t0 = clock()
    engine.begin(slot, prompt)
    timers.begin_ns += clock() - t0
    timers.n_begin += 1
    draft_fn, accept_fn = engine.draft, engine.accept
    n_draft_calls = n_drafts = n_draft_tokens = n_acc_drafts = n_acc_tokens = 0
    produced = 1
    sampled = int(output[0]) if n_out else 0
    while produced < n_out:
        bound = None
        if n_ctx > 0:
            bound = n_ctx - L - 2
        n_acc = 0
        if bound is None or bound > 0:
            context = buf[:L]                # the driver's view, made outside the timed call
            t0 = clock()
            draft = draft_fn(slot, context, sampled, bound)
            timers.draft_ns += clock() - t0
            timers.n_draft += 1
            n_draft_calls += 1
            called = 1
        else:
            draft = buf[:0]
            called = 0
        n_d = len(draft)
        if n_d:
            n_acc = common_prefix(draft, output[produced:produced + n_d])
            t0 = clock()
            accept_fn(slot, n_acc)
            timers.accept_ns += clock() - t0
            timers.n_accept += 1
            n_drafts += 1
            n_draft_tokens += n_d
            n_acc_tokens += n_acc
            n_acc_drafts += n_acc > 0
        steps.append([n_d, n_acc, called])
        if record_drafts:
            drafts.append(draft.tolist())
        buf[L] = sampled
        buf[L + 1:L + 1 + n_acc] = output[produced:produced + n_acc]
        L += 1 + n_acc
        produced += n_acc
        if produced >= n_out:
            break
        sampled = int(output[produced])
        produced += 1
    n_steps = len(steps)
    record = {
        "slot": slot, "n_prompt": len(prompt), "n_output": n_out, "n_steps": n_steps,
        "n_draft_calls": n_draft_calls, "n_drafts": n_drafts, "n_draft_tokens": n_draft_tokens,
        "n_acc_drafts": n_acc_drafts, "n_acc_tokens": n_acc_tokens,
        "acc_rate": round(n_acc_tokens / n_draft_tokens, 4) if n_draft_tokens else 0.0,
        # the first output token comes from the prompt pass, not from a verification step
        "tokens_per_step": round((n_out - 1) / n_steps, 4) if n_steps else 0.0,
        "steps": steps,
    }
    if record_drafts:
        record["drafts"] = drafts
    return record


@dataclass
class ReplayResult:
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


def _run_once(requests, spec_type, params, state, n_slots, record_drafts, n_ctx, progress):
    timers = Timers()
    records, total, engines = [], None, []
    pool = ModPool() if any(REGISTRY[t].uses_pool for t in parse_types(spec_type)) else None
    engine = None
    for t, req in enumerate(requests):
        slot = t % n_slots
        if engine is None or state == "fresh":
            if engine is not None:
                total = _sum_stats(total, engine.stats())
                if pool is not None:
                    pool.reset()       # a fresh context has an empty pool
            engine = SpecEngine(spec_type, n_slots=n_slots, pool=pool, **params)
        rec = replay_request(engine, slot, req.prompt, req.output, record_drafts, timers, n_ctx)
        records.append({"trace": t, **rec, "id": req.id})
        if progress is not None:
            progress(t + 1, len(requests))
    if engine is not None:
        total = _sum_stats(total, engine.stats())
    return records, total or [], timers, engine


def _json_params(params: dict) -> dict:
    """The params as JSON can hold them: paths as strings, loaded objects (an NgramCache, a
    llama_cpp model) by their repr, so a summary always serialises."""
    plain = (str, int, float, bool, type(None))
    return {k: v if isinstance(v, plain) else os.fspath(v) if isinstance(v, os.PathLike)
            else repr(v) for k, v in params.items()}


def replay(requests, spec_type: str, params: dict | None = None, *, state: str = "shared",
           n_slots: int = 1, record_drafts: bool = False, repeat: int = 1, n_ctx: int = 0,
           progress=None) -> ReplayResult:
    """Replay `requests` (``traces.Request``) and return the golden-format result.

    state "shared" keeps one engine for all requests (a running server; request t on slot
    t % n_slots); "fresh" builds a new one per request. With repeat > 1 the replay runs that many
    times and the fastest timings are reported (drafts are deterministic).
    """
    params = dict(params or {})
    if state not in ("shared", "fresh"):
        raise ValueError(f"state = {state!r}: allowed 'shared' or 'fresh'")
    if n_slots < 1:
        raise ValueError(f"n_slots = {n_slots} is out of range: allowed >= 1")
    if repeat < 1:
        raise ValueError(f"repeat = {repeat} is out of range: allowed >= 1")
    best = None
    for r in range(repeat):
        records, stats, timers, engine = _run_once(
            requests, spec_type, params, state, n_slots, record_drafts, n_ctx,
            progress if r == 0 else None)
        if best is None:
            best = (records, stats, timers, engine)
        else:
            if [[s[k] for k in COUNTERS] for s in stats] != \
                    [[s[k] for k in COUNTERS] for s in best[1]]:
                raise RuntimeError("replay is not deterministic: counters differ between repeats")
            bt = best[2]
            for name in ("begin_ns", "draft_ns", "accept_ns"):
                setattr(bt, name, min(getattr(bt, name), getattr(timers, name)))
    records, stats, timers, engine = best
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
    return ReplayResult(summary, records)


class ProgressBar:
    """A one-line progress bar on stderr (only drawn when stderr is a terminal)."""

    def __init__(self, label: str, stream=None, min_total: int = 20):
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.min_total = min_total

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_total:
            return
        width = 30
        fill = width * done // total
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()

"""llama.cpp's ``statistics <type>: ...`` lines (``common/speculative.cpp``) and llama-server's
``draft acceptance`` line, from `SpecEngine.stats()` dicts; and the one name of every statistic.

One name per statistic
----------------------
Every layer reports a count under its one name here; a new report reuses it. Finish reasons
have their own one vocabulary, `ngramspec.stop_rules`.

Driver counts: what a driver verified, per request or summed over requests (`SlotLoop` and its
golden-format record, replay's records and totals, `GenerationResult`, the scheduler's
`Completion`, ``Scheduler.stats()``, run-batch's summary).
The names are the golden files' (``shared/golden/README.md``)::

    n_draft_calls      draft calls made
    n_drafts           non-empty drafts verified
    n_draft_tokens     draft tokens verified
    n_acc_drafts       verified drafts with at least one token accepted
    n_acc_tokens       draft tokens accepted

Proposer counts: one proposer's, cumulative (`SpecEngine.stats()`, the golden files'
``llama_stats``, the per-proposer totals of ``Scheduler.stats()``). The names are llama.cpp's
(``common_speculative_print_stats``)::

    calls_b, calls_g, calls_a            begin, draft and accept calls
    gen_drafts, acc_drafts               drafts made, drafts with a token accepted
    gen_tokens, acc_tokens               draft tokens made, accepted
    acc_per_pos                          acceptances per draft position
    t_begin_us, t_draft_us, t_accept_us  microseconds in begin, draft, accept

A request's token counts and times (`Completion`) keep llama-server's ``timings`` names
(``prompt_n``, ``prompt_cached_n``, ``predicted_n``, ``prompt_ms``, ``predicted_ms``), the fields
the server returns them in.

Wire names stay the wire's: a server response's ``timings.draft_n`` / ``draft_n_accepted``
(llama-server's JSON); ``/metrics``' ``llamacpp:n_drafted_total`` /
``llamacpp:n_drafted_accepted_total`` (llama-server's) and
``vllm:spec_decode_num_draft_tokens_total`` / ``vllm:spec_decode_num_accepted_tokens_total``
(vLLM's Prometheus names).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Mapping

__all__ = ["DraftCounts", "acceptance_line", "statistics_line"]


@dataclass(slots=True)
class DraftCounts:
    """The driver counts of one request or of many (the one type every report embeds).

    Attributes
    ----------
    n_draft_calls, n_drafts, n_draft_tokens, n_acc_drafts, n_acc_tokens : int
        As named above: draft calls made, non-empty drafts verified, draft tokens verified,
        drafts with an accepted token, draft tokens accepted.

    Notes
    -----
    Memory: five integers.

    Thread-safety: not thread-safe; its owner updates it (a loop, the decode thread) and
    readers of another thread take a copy (`copy`) under the owner's lock.
    """
    n_draft_calls: int = 0
    n_drafts: int = 0
    n_draft_tokens: int = 0
    n_acc_drafts: int = 0
    n_acc_tokens: int = 0

    def verified(self, n_draft: int, n_accepted: int) -> None:
        """Count one verified draft of `n_draft` tokens, `n_accepted` of them accepted (an
        empty draft counts nothing)."""
        if n_draft:
            self.n_drafts += 1
            self.n_draft_tokens += n_draft
            self.n_acc_tokens += n_accepted
            self.n_acc_drafts += n_accepted > 0

    def add(self, other: "DraftCounts") -> "DraftCounts":
        """Add `other`'s counts into this one; returns self."""
        self.n_draft_calls += other.n_draft_calls
        self.n_drafts += other.n_drafts
        self.n_draft_tokens += other.n_draft_tokens
        self.n_acc_drafts += other.n_acc_drafts
        self.n_acc_tokens += other.n_acc_tokens
        return self

    @classmethod
    def of(cls, stats: Mapping) -> "DraftCounts":
        """The counts a report holds under their names (``Scheduler.stats()``: the token
        counts); a count it does not hold is 0."""
        return cls(**{f.name: stats[f.name] for f in fields(cls) if f.name in stats})

    def minus(self, earlier: "DraftCounts") -> "DraftCounts":
        """The counts made since `earlier` (a snapshot of the same counter), as a new object."""
        return DraftCounts(*(getattr(self, f.name) - getattr(earlier, f.name)
                             for f in fields(self)))

    def copy(self) -> "DraftCounts":
        return DraftCounts(self.n_draft_calls, self.n_drafts, self.n_draft_tokens,
                           self.n_acc_drafts, self.n_acc_tokens)

    @property
    def acc_rate(self) -> float:
        """Accepted per verified draft token, rounded to 4 places as the records print it."""
        return round(self.n_acc_tokens / self.n_draft_tokens, 4) if self.n_draft_tokens else 0.0

    def as_dict(self) -> dict:
        """The five counts under their names."""
        return asdict(self)


def statistics_line(s: dict) -> str:
    """``statistics <type>: #calls(b,g,a) = ...`` exactly as llama.cpp prints it.

    The line ``common_speculative_print_stats`` logs once per implementation (at TRACE level);
    the optional ``#mean acc len`` / ``#acc rate/pos`` part appears once there were accept
    calls.

    Parameters
    ----------
    s : dict
        One entry of ``SpecEngine.stats()``: ``type``, the counters ``calls_b``, ``calls_g``,
        ``calls_a``, ``gen_drafts``, ``acc_drafts``, ``gen_tokens``, ``acc_tokens``,
        ``acc_per_pos`` and the times ``t_begin_us``, ``t_draft_us``, ``t_accept_us``.

    Returns
    -------
    str
    """
    line = (f"statistics {s['type']:>16}: #calls(b,g,a) = {s['calls_b']:4d} {s['calls_g']:6d} "
            f"{s['calls_a']:6d}, #gen drafts = {s['gen_drafts']:6d}, #acc drafts = "
            f"{s['acc_drafts']:5d}, #gen tokens = {s['gen_tokens']:6d}, #acc tokens = "
            f"{s['acc_tokens']:5d}")
    if s["calls_a"] > 0:
        rates = ", ".join(f"{c / s['calls_a']:.3f}" for c in s["acc_per_pos"])
        line += (f", #mean acc len = {1 + s['acc_tokens'] / s['calls_a']:.2f}"
                 f", #acc rate/pos = ({rates})")
    line += (f", dur(b,g,a) = {s['t_begin_us'] / 1000:.3f}, {s['t_draft_us'] / 1000:.3f}, "
             f"{s['t_accept_us'] / 1000:.3f} ms")
    return line


def acceptance_line(accepted: int, generated: int, n_drafts: int) -> str:
    """llama-server's per-request ``draft acceptance`` line.

    ``draft acceptance = R (A accepted / G generated), mean len = M``.

    Parameters
    ----------
    accepted, generated : int
        Draft tokens accepted and drafted in the request.
    n_drafts : int
        Drafts verified; ``mean len`` is 1 + accepted per draft, the mean number of tokens a
        verified draft contributed (as ``#mean acc len`` of `statistics_line`).

    Returns
    -------
    str
    """
    rate = accepted / generated if generated else 0.0
    mean_len = 1 + accepted / n_drafts if n_drafts else 0.0
    return (f"draft acceptance = {rate:.5f} ({accepted:5d} accepted / {generated:5d} generated), "
            f"mean len = {mean_len:5.2f}")


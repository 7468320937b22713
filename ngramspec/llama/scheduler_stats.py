"""The batched scheduler's counters for monitoring (``/metrics``): one object, its own lock."""
from __future__ import annotations

import threading

from ngramspec.stats import DraftCounts

__all__ = ["SchedulerStats"]


class SchedulerStats:
    """Requests, tokens, decodes and the drivers' draft counts of one scheduler.

    Notes
    -----
    Memory: a few integers. Thread-safety: the decode thread updates and any thread reads
    (`snapshot`), under the object's lock.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._n = {"requests_submitted": 0, "requests_finished": 0, "requests_cancelled": 0,
                   "tokens_predicted": 0, "tokens_prompt": 0, "tokens_prompt_cached": 0,
                   "decode_calls": 0, "decode_tokens": 0}
        self.counts = DraftCounts()      # every request's, summed
        self.t_decode_s = self.t_steps_cpu_s = 0.0

    def add(self, **counts) -> None:
        """Add to the named counters (``requests_submitted=1``, ...)."""
        with self._lock:
            for key, n in counts.items():
                self._n[key] += n

    def decoded(self, n_tokens: int, seconds: float) -> None:
        """One ``llama_decode`` of `n_tokens` that took `seconds`."""
        with self._lock:
            self._n["decode_calls"] += 1
            self._n["decode_tokens"] += n_tokens
            self.t_decode_s += seconds

    def verified(self, n_draft: int, n_accepted: int) -> None:
        """A slot's draft of `n_draft` tokens verified, `n_accepted` accepted."""
        with self._lock:
            self.counts.verified(n_draft, n_accepted)

    def stepped(self, cpu_s: float) -> None:
        """The decode thread's CPU time of one step."""
        with self._lock:
            self.t_steps_cpu_s += cpu_s

    def prompt_seconds(self, n: int, cost_model, default: float) -> float:
        """Estimated seconds to decode `n` prompt tokens: the cost model's t(n) when there is
        one, else the timed decodes' mean per token (`default` per token before any)."""
        if cost_model is not None:
            return cost_model.seconds(n)
        with self._lock:
            done = self._n["decode_tokens"]
            return n * (self.t_decode_s / done if done else default)

    def snapshot(self) -> dict:
        """The counters under `Scheduler.stats`' names, in its order.

        ``requests_submitted``, ``requests_finished``, ``requests_cancelled``,
        ``tokens_predicted``, ``tokens_prompt``, ``tokens_prompt_cached``, ``decode_calls``,
        ``decode_tokens``, ``n_draft_tokens`` and ``n_acc_tokens`` (draft tokens the steps
        verified and accepted: the drivers' names, see `ngramspec.stats`), ``t_decode_s`` (wall
        time in ``llama_decode``), ``t_steps_cpu_s`` (CPU time of the decode thread's steps:
        with one decode thread llama.cpp computes on it, so this is the work done, whatever the
        machine's load).
        """
        with self._lock:
            return dict(self._n, n_draft_tokens=self.counts.n_draft_tokens,
                        n_acc_tokens=self.counts.n_acc_tokens, t_decode_s=self.t_decode_s,
                        t_steps_cpu_s=self.t_steps_cpu_s)

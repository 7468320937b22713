"""`Replica`: one engine's ngram-suffix store, kept in step with a store log.

Each round (`sync`, run by a background thread every `interval` seconds once `start` ran):
the sequences the proposer's `begin` inserted since the last round (its finished requests:
output and prompt tail) are encoded and appended to the log; then the entries other replicas
appended are read from the reader's last position and inserted into the proposer's store
(`SuffixProposer.insert_global`, which takes the store's lock with the GIL released; a draft
that finds the lock taken drafts from its local index, so a draft never waits for the log).

Faults: a log that cannot be reached leaves the proposer drafting from its own store; the
first failure logs one warning, rounds are retried with exponential back-off (`interval` up
to `max_backoff`), sequences to publish wait in a bounded backlog (`max_backlog`; the oldest
dropped and counted past it), and reading resumes from the last position (stream id), so the
replica catches up. An entry that is corrupt or foreign (another format version or model) is
skipped and counted. The log is trimmed to about the store's budget.

The calibration travels the same way (issue 35): each round also publishes, as a calibration
entry, the per-cell outcomes the proposer's slots learned since the last round
(`SuffixProposer.take_calibration`, at most the table's 1800 cells), and folds the other
replicas' into its table (`SuffixProposer.fold_calibration`), so N replicas' calibration
learns from the whole fleet's traffic as one server's does. Deltas that could not be published
add up while the log is unreachable (one entry's worth at most) and go out when it is back.
"""
from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import uuid
import weakref
from collections import deque

import numpy as np

from ngramspec._suffix import SuffixProposer
from ngramspec.store_log.backends import LogUnavailable, StoreLog
from ngramspec.store_log.entry import (CAL_CELLS, BadEntry, CalibrationEntry, decode, encode,
                                       encode_calibration)
from ngramspec.validation import WrongType, check_int, check_real

__all__ = ["Replica", "replicas"]

log = logging.getLogger("ngramspec.store_log")

_LIVE: "weakref.WeakSet[Replica]" = weakref.WeakSet()

#: Bytes of an entry besides its tokens (header, names, CRC): for the log's byte bound.
_ENTRY_OVERHEAD = 64
#: Bytes of the largest calibration entry (1800 cells of 10 bytes, header, names, CRC).
_CAL_ENTRY_BYTES = 1800 * 10 + 64
#: The most outcomes a calibration entry counts per cell (`fold_calibration`'s bound).
_DELTA_MAX = (1 << 31) - 1
#: The mean entry length assumed before one was published (tokens).
_FIRST_GUESS = 256


def replicas() -> list:
    """The replicas alive in this process (for the server's /metrics)."""
    return list(_LIVE)


class Replica:
    """Publishes a `SuffixProposer`'s finished requests to a store log and ingests the
    others'.

    Parameters
    ----------
    proposer : SuffixProposer
        Its global store is the one shared (``global_tokens`` >= 2).
    log : StoreLog
        `ngramspec.store_log.open_log`'s result (in-process, directory or Redis); its
        ``name`` is what the warnings and ``stats`` call it.
    model : str
        Identity of the model's vocabulary (e.g. the model's name and vocabulary size): an
        entry of another identity is refused, its token ids would mean other text.
    n_vocab : int, optional
        Token ids at or above it make an entry corrupt.
    origin : str, optional
        This replica's name in its entries (a random one by default): its own entries are
        not inserted twice.
    interval : float, 0.001 .. 60
        Seconds between rounds of the background thread.
    batch : int, 1 .. 65536
        Entries read per call to the log.
    max_backlog : int, 1 .. 2**20
        Sequences kept for publishing while the log is unreachable.
    max_backoff : float, interval .. 600
        Longest wait between retries.
    share_calibration : bool
        Publish and fold in calibration deltas too (default True): False shares the store
        only (each replica then calibrates from its own traffic).

    Notes
    -----
    Memory: the backlog (up to `max_backlog` sequences), one read batch, and the calibration
    deltas not published yet (2 x 1800 int64).

    Thread-safety: `sync` runs in the background thread once `start` ran, or in the caller's
    (tests, benchmarks) when it did not; a lock makes concurrent `sync` calls run one after
    another. `stats` may be read from any thread.
    """

    def __init__(self, proposer, log_backend, *, model: str = "", n_vocab=None, origin=None,
                 interval: float = 0.05, batch: int = 256, max_backlog: int = 4096,
                 max_backoff: float = 5.0, share_calibration: bool = True):
        if not isinstance(proposer, SuffixProposer):
            raise TypeError(f"proposer must be a SuffixProposer, got {type(proposer).__name__}")
        if not isinstance(log_backend, StoreLog):
            raise WrongType("log", log_backend, "a store log (append, read, close and a name: "
                                                "ngramspec.store_log.backends.StoreLog)")
        self.proposer = proposer
        self.log = log_backend
        self.model = str(model)
        self.n_vocab = None if n_vocab is None else check_int("n_vocab", n_vocab, 1)
        self.origin = origin or uuid.uuid4().hex
        self.interval = check_real("interval", interval, 0.001, 60.0)
        self.batch = check_int("batch", batch, 1, 1 << 16)
        self.max_backlog = check_int("max_backlog", max_backlog, 1, 1 << 20)
        self.max_backoff = check_real("max_backoff", max_backoff, self.interval, 600.0)
        if not isinstance(share_calibration, bool):
            raise WrongType("share_calibration", share_calibration, "a bool")
        self.share_calibration = share_calibration
        if share_calibration:
            proposer.take_calibration()     # what it learned before joining is its own
        # calibration deltas taken but not published yet (per cell; `_calibration_delta`)
        self._cal_tried = np.zeros(CAL_CELLS, dtype=np.int64)
        self._cal_accepted = np.zeros(CAL_CELLS, dtype=np.int64)
        self._cal_steps = self._cal_tokens = 0
        self.budget = proposer.global_stats()["budget"]
        proposer.publish_finished(self.max_backlog)
        self._backlog: deque = deque()
        self._dropped_here = 0
        self._position = None
        self._round = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._down = False
        self._mean_tokens = float(_FIRST_GUESS)
        self.counts = dict(published=0, ingested=0, own=0, skipped_corrupt=0,
                           skipped_foreign=0, dropped=0, gaps=0, errors=0,
                           calibration_published=0, calibration_ingested=0)
        self.lag_seconds = 0.0
        self.last_error = ""
        _LIVE.add(self)

    # -- one round ------------------------------------------------------------------------

    def sync(self) -> bool:
        """One round: publish what finished, ingest what the log holds past our position.
        False when the log could not be reached (counted in ``errors``; retried next round)."""
        with self._round:
            try:
                self._publish()
                while self._ingest() == self.batch:
                    pass
            except LogUnavailable as exc:
                self.counts["errors"] += 1
                self.last_error = str(exc)
                if not self._down:
                    log.warning("store log %s unreachable (drafting from this replica's own "
                                "store; retrying with back-off): %s", self.log.name, exc)
                self._down = True
                return False
            if self._down:
                log.warning("store log %s reachable again: caught up", self.log.name)
                self._down = False
            return True

    def _publish(self) -> None:
        sequences, dropped_by_proposer = self.proposer.take_finished()
        now = time.time()
        for seq in sequences:
            self._backlog.append(encode(self.model, self.origin, now, seq))
            self._mean_tokens += (len(seq) - self._mean_tokens) / 16
        extra = len(self._backlog) - self.max_backlog
        for _ in range(max(0, extra)):
            self._backlog.popleft()
        self._dropped_here += max(0, extra)
        self.counts["dropped"] = dropped_by_proposer + self._dropped_here
        blobs = list(self._backlog)
        calibration = self._calibration_delta(now)
        if calibration is not None:
            blobs.append(calibration)
        if not blobs:
            return
        # the log holds about the store's budget: as many entries of the mean length, and a
        # calibration entry (<= _CAL_ENTRY_BYTES) beside each, at most one per round
        max_entries = max(16, math.ceil(self.budget / max(1.0, self._mean_tokens)))
        max_bytes = max(1 << 16, 4 * self.budget + _ENTRY_OVERHEAD * max_entries)
        if self.share_calibration:
            max_entries *= 2
            max_bytes += _CAL_ENTRY_BYTES * max_entries // 2
        self.log.append(blobs, max_entries, max_bytes)
        self._backlog.clear()
        self.counts["published"] += len(blobs) - (calibration is not None)
        if calibration is not None:
            self._cal_tried[:] = 0
            self._cal_accepted[:] = 0
            self._cal_steps = self._cal_tokens = 0
            self.counts["calibration_published"] += 1

    def _calibration_delta(self, now: float):
        """The calibration entry of what the proposer learned since the last one published,
        or None. Deltas taken while the log is unreachable add up here (one entry's worth,
        however long the outage), so none is lost and the backlog holds sequences only."""
        if not self.share_calibration:
            return None
        cells, tried, accepted, steps, tokens = self.proposer.take_calibration()
        self._cal_steps += steps
        self._cal_tokens += tokens
        self._cal_tried[cells] = np.minimum(self._cal_tried[cells] + tried, _DELTA_MAX)
        self._cal_accepted[cells] = np.minimum(self._cal_accepted[cells] + accepted,
                                               self._cal_tried[cells])
        cells = np.flatnonzero(self._cal_tried)
        if not len(cells) and not self._cal_steps:
            return None
        return encode_calibration(self.model, self.origin, now, cells, self._cal_tried[cells],
                                  self._cal_accepted[cells], self._cal_steps, self._cal_tokens)

    def _ingest(self) -> int:
        blobs, position, gap = self.log.read(self._position, self.batch)
        self._position = position
        self.counts["gaps"] += bool(gap)
        for blob in blobs:
            try:
                entry = decode(blob, self.model, self.n_vocab)
            except BadEntry as exc:
                self.counts["skipped_foreign" if exc.foreign else "skipped_corrupt"] += 1
                continue
            if isinstance(entry, CalibrationEntry):
                if self.share_calibration and entry.origin != self.origin:
                    self.proposer.fold_calibration(entry.cells, entry.tried, entry.accepted,
                                                   entry.steps, entry.tokens)
                    self.counts["calibration_ingested"] += 1
                continue
            if entry.origin == self.origin:
                self.counts["own"] += 1
                continue
            self.proposer.insert_global(entry.tokens)
            self.counts["ingested"] += 1
            self.lag_seconds = max(0.0, time.time() - entry.time)
        return len(blobs)

    # -- the background thread ------------------------------------------------------------

    def start(self) -> "Replica":
        """Run `sync` in a daemon thread every `interval` seconds (back-off after failures)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ngramspec-store-log",
                                            daemon=True)
            self._thread.start()
            # a server or batch that exits publishes what finished since the last round
            atexit.register(self.stop)
        return self

    def _run(self) -> None:
        delay = self.interval
        while not self._stop.wait(delay):
            try:
                ok = self.sync()
            except Exception:       # noqa: BLE001 - a bug must not kill replication silently
                log.exception("store log %s: round failed", self.log.name)
                ok = False
            delay = self.interval if ok else min(self.max_backoff, delay * 2)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (after its current round), publish what is left once, close.
        Once: a second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            atexit.unregister(self.stop)
        try:
            self.sync()
        finally:
            self.log.close()
            _LIVE.discard(self)

    def stats(self) -> dict:
        """Counters (``published``, ``ingested``, ``own``, ``skipped_corrupt``,
        ``skipped_foreign``, ``dropped``, ``gaps``, ``errors``; ``calibration_published`` and
        ``calibration_ingested`` count calibration entries, the others sequences), ``lag_seconds`` (publication
        to ingestion of the last entry ingested), ``connected`` and the log's name."""
        return dict(self.counts, skipped=self.counts["skipped_corrupt"]
                    + self.counts["skipped_foreign"], lag_seconds=self.lag_seconds,
                    connected=not self._down, log=self.log.name)

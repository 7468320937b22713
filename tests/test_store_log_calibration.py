"""ngram-suffix's calibration shared across replicas (issue 35): the kernel's per-cell deltas
out (`take_calibration`) and in (`fold_calibration`, along the forgetting rule), the store
log's calibration entry, and replicas that learn each other's calibration. (Redis Streams:
tests/test_store_log_redis.py reuses `calibrations_meet`.)"""
import threading

import numpy as np
import pytest

from ngramspec._suffix import SuffixProposer
from ngramspec.store_log import DirectoryLog, MemoryLog, Replica
from ngramspec.store_log.entry import (CAL_FORMAT_VERSION, BadEntry, CalibrationEntry, decode,
                                       encode_calibration)
from ngramspec.validation import OutOfRange, Refused, WrongType
from test_store_log import DOC, _engine, _Flaky, _finish, _request

N_CAL = 1800          # fine cells 0 .. 1679, then the coarse ones
WINDOW = 1024         # a cell's counts are halved when its tried count reaches it


def _serve(engine, k, slot=0):
    """Request k of a family that quotes DOC (so drafts happen and are scored)."""
    _request(engine, slot, DOC[7 * k:7 * k + 8], DOC[40 * k:40 * k + 300])
    _finish(engine, slot)


def _sequential(outcomes, t=0, a=0):
    """The kernel's forgetting rule, one outcome at a time (tried, accepted)."""
    for hit in outcomes:
        t, a = t + 1, a + bool(hit)
        if t >= WINDOW:
            t, a = t >> 1, a >> 1
    return t, a


def _empty(deltas):
    cells, tried, accepted, steps, tokens = deltas
    return len(cells) == len(tried) == len(accepted) == steps == tokens == 0


def _cell0(prop):
    acc, tried = prop.calibration()
    return int(tried.reshape(-1)[0]), int(acc.reshape(-1)[0])


# -- the kernel ----------------------------------------------------------------------------------

def test_the_deltas_out_are_what_the_slots_folded_and_restart_from_zero():
    eng = _engine(n_slots=2)
    for k in range(4):
        _serve(eng, k, slot=k % 2)
    prop = eng.proposers[0]
    cells, tried, accepted, steps, tokens = prop.take_calibration()
    # the tokens-per-step average's steps: one per draft call scored, at least a token each
    assert steps > 10 and steps <= tokens <= steps * 257
    assert cells.dtype == np.int32 and tried.dtype == accepted.dtype == np.uint32
    assert np.all(np.diff(cells) > 0) and cells.max() < N_CAL and np.all(accepted <= tried)
    fine = cells < 1680
    # every outcome folded, once in its fine cell and once in its coarse cell
    outcomes = prop.calibration_stats()["outcomes"]
    assert outcomes > 100
    assert tried[fine].sum() == tried[~fine].sum() == outcomes
    # no cell reached the forgetting window here, so the table is the deltas
    acc_t, tried_t = prop.calibration()
    assert tried_t.max() < WINDOW
    dense_t = np.zeros(1680, np.uint32)
    dense_a = np.zeros(1680, np.uint32)
    dense_t[cells[fine]] = tried[fine]
    dense_a[cells[fine]] = accepted[fine]
    np.testing.assert_array_equal(tried_t.reshape(-1), dense_t)
    np.testing.assert_array_equal(acc_t.reshape(-1), dense_a)
    assert _empty(prop.take_calibration())
    _serve(eng, 5)
    later = prop.calibration_stats()["outcomes"] - outcomes
    cells, tried, _, steps2, _ = prop.take_calibration()
    assert later > 0 and tried[cells < 1680].sum() == later      # only what came since
    assert 0 < steps2 < steps


def test_folding_another_replicas_deltas_gives_its_table_and_is_not_echoed():
    a = _engine()
    for k in range(3):
        _serve(a, k)
    deltas = a.proposers[0].take_calibration()
    b = SuffixProposer()
    b.fold_calibration(*deltas)
    for mine, theirs in zip(b.calibration(), a.proposers[0].calibration()):
        np.testing.assert_array_equal(mine, theirs)
    stats, theirs = b.calibration_stats(), a.proposers[0].calibration_stats()
    assert stats["merged"] == theirs["outcomes"] and stats["outcomes"] == 0
    # the tokens-per-step average: the same steps, as a block of their mean
    assert theirs["tokens_per_step"] > 1.2
    assert stats["tokens_per_step"] == pytest.approx(theirs["tokens_per_step"], rel=0.05)
    assert _empty(b.take_calibration())                       # a replica never echoes


def test_the_rate_merge_moves_towards_the_steps_mean_by_their_weight():
    prop = SuffixProposer()
    assert prop.calibration_stats()["tokens_per_step"] == 1.0
    prop.fold_calibration([], [], [], steps=710, tokens=710 * 5)   # 1 - (1 - 2**-10)**710 = 1/2
    assert prop.calibration_stats()["tokens_per_step"] == pytest.approx(3.0, abs=0.01)
    prop.fold_calibration([], [], [], steps=1 << 40, tokens=3 << 40)   # the past is gone
    assert prop.calibration_stats()["tokens_per_step"] == pytest.approx(3.0, abs=1e-4)
    prop.fold_calibration([], [], [], steps=0, tokens=0)
    assert prop.calibration_stats()["tokens_per_step"] == pytest.approx(3.0, abs=1e-4)


@pytest.mark.parametrize("start", [(0, 0), (700, 350), (1000, 999)])
@pytest.mark.parametrize("n, hit", [(1, True), (24, False), (324, True), (1500, True),
                                    (3000, False), (100_000, True)])
def test_a_merge_follows_the_forgetting_rule_exactly_when_the_outcomes_agree(start, n, hit):
    """All hits or all misses: the merged cell is what the outcomes one by one would give."""
    prop = SuffixProposer()
    t0, a0 = start
    if t0:
        prop.fold_calibration([0], [t0], [a0])
        assert _cell0(prop) == (t0, a0)
    prop.fold_calibration([0], [n], [n if hit else 0])
    (t, a), (want_t, want_a) = _cell0(prop), _sequential([hit] * n, t0, a0)
    assert t == want_t
    # past 32 windows the merge restarts from the delta's hit rate: the old counts' rounding
    # trace (at most one hit) is gone
    assert a == want_a if n < 32 * WINDOW // 2 else abs(a - want_a) <= 1


def test_a_mixed_merge_spreads_the_hits_evenly_and_keeps_the_horizon():
    prop = SuffixProposer()
    prop.fold_calibration([0], [1500], [500])
    t, a = _cell0(prop)
    want_t, want_a = _sequential([k % 3 == 0 for k in range(1500)])
    assert t == want_t                       # the tried count's path is exact: same horizon
    assert abs(a - want_a) <= 2
    # a delta of many horizons: the older outcomes are forgotten, in O(1)
    prop.fold_calibration([0], [2**31 - 1], [2**30])
    t, a = _cell0(prop)
    assert WINDOW // 2 <= t < WINDOW and abs(a / t - 0.5) < 0.01
    # repeats fold in turn; an empty delta changes nothing
    before = prop.calibration()
    prop.fold_calibration([], [], [])
    np.testing.assert_array_equal(prop.calibration()[1], before[1])


@pytest.mark.parametrize("args, error, field", [
    (([1800], [1], [0]), OutOfRange, "cells[0]"),
    (([5, -1], [1, 1], [0, 0]), OutOfRange, "cells[1]"),
    (([0], [-3], [0]), OutOfRange, "tried[0]"),
    (([0], [2**31], [0]), OutOfRange, "tried[0]"),
    (([0, 1], [4, 4], [1, 5]), OutOfRange, "accepted[1]"),
    (([0, 1], [4], [1, 1]), Refused, "cells"),
    (([0.5], [1], [0]), WrongType, "cells"),
    (([[0]], [1], [0]), WrongType, "cells"),
    (([0], [True], [0]), WrongType, "tried"),
    ((list(range(1800)) + [0], [1] * 1801, [0] * 1801), OutOfRange, "len(cells)"),
    (([0], [1], [0], -1, 0), OutOfRange, "steps"),
    (([0], [1], [0], 2, 8195), OutOfRange, "tokens"),
    (([0], [1], [0], 0, 1), OutOfRange, "tokens"),
    (([0], [1], [0], 1.5, 1), WrongType, "steps"),
])
def test_bad_deltas_name_the_argument_and_fold_nothing(args, error, field):
    prop = SuffixProposer()
    prop.fold_calibration([3], [10], [4])
    before = prop.calibration()
    with pytest.raises(error) as info:
        prop.fold_calibration(*args)
    assert info.value.field == field
    for now, then in zip(prop.calibration(), before):
        np.testing.assert_array_equal(now, then)


def test_folds_run_beside_drafts_in_other_threads():
    """Another thread folds deltas while slots draft: drafts go on (they only try the lock),
    every delta lands, and the slots' own outcomes still go out."""
    eng = _engine(n_slots=2)
    prop = eng.proposers[0]
    stop = threading.Event()
    folds = [0]

    def folder():
        while not stop.is_set():
            prop.fold_calibration(np.arange(0, 1680, 7), np.full(240, 3), np.full(240, 1))
            folds[0] += 1

    th = threading.Thread(target=folder)
    th.start()
    try:
        for k in range(6):
            _serve(eng, k, slot=k % 2)
    finally:
        stop.set()
        th.join()
    assert folds[0] > 0
    stats = prop.calibration_stats()
    assert stats["merged"] == folds[0] * 240 * 3
    cells, tried, *_ = prop.take_calibration()
    assert tried[cells < 1680].sum() == stats["outcomes"] > 0


# -- the entry -----------------------------------------------------------------------------------

def test_a_calibration_entry_round_trips_and_a_bad_one_is_refused():
    cells = np.array([0, 17, 1799], np.int32)
    tried = np.array([5, 2**31 - 1, 1], np.uint32)
    acc = np.array([5, 12, 0], np.uint32)
    blob = encode_calibration("m", "r1", 12.5, cells, tried, acc, 1 << 33, 5 << 33)
    e = decode(blob, "m")
    assert isinstance(e, CalibrationEntry) and (e.origin, e.time) == ("r1", 12.5)
    assert (e.steps, e.tokens) == (1 << 33, 5 << 33)
    for got, want in zip((e.cells, e.tried, e.accepted), (cells, tried, acc)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(BadEntry) as info:
        decode(blob, "other")
    assert info.value.foreign
    bumped = bytearray(blob)
    bumped[4] = CAL_FORMAT_VERSION + 1          # a newer format: foreign, not corrupt
    with pytest.raises(BadEntry) as info:
        decode(bytes(bumped), "m")
    assert info.value.foreign and "NGSC format version" in str(info.value)
    for broken in (blob[:-1], blob[:-4] + b"\0\0\0\0", blob[:30]):
        with pytest.raises(BadEntry) as info:
            decode(broken, "m")
        assert not info.value.foreign
    # well framed (CRC right) but out of range: corrupt
    for bad in (encode_calibration("m", "x", 0.0, [1800], [1], [0]),
                encode_calibration("m", "x", 0.0, [3], [1], [2]),
                encode_calibration("m", "x", 0.0, [3], [1], [1], 2, 9000)):
        with pytest.raises(BadEntry, match="out of range"):
            decode(bad, "m")
    with pytest.raises(ValueError, match="1800 cells"):
        encode_calibration("m", "x", 0.0, np.arange(1801), np.ones(1801), np.zeros(1801))


@pytest.mark.parametrize("kind", ["memory", "dir"])
def test_a_calibration_entry_round_trips_through_the_log(kind, tmp_path):
    log = MemoryLog() if kind == "memory" else DirectoryLog(tmp_path)
    blob = encode_calibration("m", "r1", 1.0, [4, 9], [7, 3], [6, 0])
    log.append([blob], 10, 1 << 20)
    blobs, _, _ = log.read(None, 10)
    assert [bytes(b) for b in blobs] == [blob]
    e = decode(blobs[0], "m")
    assert e.cells.tolist() == [4, 9] and e.tried.tolist() == [7, 3]


# -- replicas ------------------------------------------------------------------------------------

def calibrations_meet(log_a, log_b):
    """Replica A serves requests; B, fresh, syncs and holds A's calibration. Then B serves,
    and A folds in B's outcomes, not its own again. Returns the replicas."""
    a, b = _engine(), _engine()
    ra = Replica(a.proposers[0], log_a, model="m")
    rb = Replica(b.proposers[0], log_b, model="m")
    for k in range(3):
        _serve(a, k)
    assert ra.sync() and rb.sync()
    assert ra.stats()["calibration_published"] == 1 and rb.stats()["calibration_ingested"] == 1
    pa, pb = a.proposers[0], b.proposers[0]
    for mine, theirs in zip(pb.calibration(), pa.calibration()):
        np.testing.assert_array_equal(mine, theirs)
    own_a = pa.calibration_stats()["outcomes"]
    for k in range(3, 5):
        _serve(b, k)
    assert rb.sync() and ra.sync()
    assert pa.calibration_stats()["merged"] == pb.calibration_stats()["outcomes"] > 0
    assert pb.calibration_stats()["merged"] == own_a
    assert ra.stats()["calibration_ingested"] == 1       # its own entry is not folded back
    assert pb.calibration_stats()["tokens_per_step"] != 1.0    # the rate travelled too
    return ra, rb


def test_replicas_learn_each_others_calibration_in_process():
    log = MemoryLog()
    calibrations_meet(log, log)


def test_replicas_learn_each_others_calibration_through_a_directory(tmp_path):
    calibrations_meet(DirectoryLog(tmp_path), DirectoryLog(tmp_path))


def test_a_bad_calibration_entry_is_skipped_and_counted_and_sharing_can_be_off():
    log = MemoryLog()
    good = encode_calibration("m", "x", 0.0, [0], [9], [9])
    bumped = bytearray(good)
    bumped[4] = CAL_FORMAT_VERSION + 1
    log.append([good[:-1], encode_calibration("other", "x", 0.0, [2], [9], [9]),
                bytes(bumped), good], 100)
    b = _engine()
    rb = Replica(b.proposers[0], log, model="m")
    assert rb.sync()
    s = rb.stats()
    assert (s["skipped_corrupt"], s["skipped_foreign"]) == (1, 2)
    assert s["calibration_ingested"] == 1 and _cell0(b.proposers[0]) == (9, 9)
    # a replica that shares the store only neither folds nor publishes calibration
    c = _engine()
    rc = Replica(c.proposers[0], log, model="m", share_calibration=False)
    _serve(c, 0)
    assert rc.sync()
    assert rc.stats()["calibration_ingested"] == rc.stats()["calibration_published"] == 0
    assert c.proposers[0].calibration_stats()["merged"] == 0 and rc.stats()["published"] == 1
    with pytest.raises(WrongType, match="share_calibration"):
        Replica(c.proposers[0], log, model="m", share_calibration="yes")


def test_deltas_add_up_while_the_log_is_unreachable_and_go_out_once():
    log = _Flaky()
    a, b = _engine(), _engine()
    ra = Replica(a.proposers[0], log, model="m")
    rb = Replica(b.proposers[0], log, model="m")
    log.up = False
    for k in range(3):
        _serve(a, k)
        assert not ra.sync()
    log.up = True
    assert ra.sync() and rb.sync()
    assert ra.stats()["calibration_published"] == 1         # one entry for the whole outage
    for mine, theirs in zip(b.proposers[0].calibration(), a.proposers[0].calibration()):
        np.testing.assert_array_equal(mine, theirs)

"""The store log on Redis Streams against a real ``redis-server`` (`redistools`): two engines
in two processes learn from each other, the server killed and restarted mid-run, a malformed
entry, a slow consumer, the stream's bound."""
import time

import numpy as np
import pytest

from redistools import RedisServer, require_redis
from test_store_log import DOC, _engine, _finish, _request, two_processes_learn
from test_store_log_calibration import calibrations_meet

from ngramspec.store_log import Replica, attach, open_log
from ngramspec.store_log.entry import decode, encode, encode_calibration

redis = require_redis()


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path)
    yield srv
    srv.stop()


def _wait(cond, timeout=30.0):
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_two_engines_in_two_processes_learn_from_each_other(server):
    two_processes_learn(server.url + "?stream=two-procs")


def test_a_calibration_entry_round_trips_and_replicas_learn_each_others_calibration(server):
    log = open_log(server.url + "?stream=cal-entry")
    blob = encode_calibration("m", "r1", 1.0, [4, 9], [7, 3], [6, 0])
    log.append([blob], 10)
    blobs, _, _ = log.read(None, 10)
    assert [bytes(b) for b in blobs] == [blob]
    e = decode(blobs[0], "m")
    assert e.cells.tolist() == [4, 9] and e.accepted.tolist() == [6, 0]
    url = server.url + "?stream=cal-replicas"
    calibrations_meet(open_log(url), open_log(url))


def test_a_killed_server_leaves_replicas_serving_then_they_catch_up(server, caplog):
    url = server.url + "?stream=restart"
    a, b = _engine(), _engine()
    ra = attach(a, url, model="m", interval=0.01, max_backoff=0.1)
    rb = attach(b, url, model="m", interval=0.01, max_backoff=0.1)
    try:
        _request(a, 0, DOC[:2], DOC[:200])
        _finish(a)
        assert _wait(lambda: rb.stats()["ingested"] == 1)
        server.stop()
        # both keep drafting from their own stores while the log is gone
        assert _request(b, 0, DOC[:2], DOC[:200]) > 150
        _request(a, 0, DOC[:2], DOC[200:400])
        _finish(a)
        assert _wait(lambda: not ra.stats()["connected"] and not rb.stats()["connected"])
        time.sleep(0.3)                          # several failed rounds
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 2
        server.start()                           # empty: no persistence
        assert _wait(lambda: rb.stats()["ingested"] == 2), (ra.stats(), rb.stats())
        assert ra.stats()["connected"] and ra.stats()["published"] == 2
        assert ra.stats()["errors"] >= 1
        np.testing.assert_array_equal(b.proposers[0].global_text()[-201:-1], DOC[200:400])
    finally:
        ra.stop()
        rb.stop()


def test_a_malformed_entry_is_skipped_and_counted(server):
    url = server.url + "?stream=malformed"
    client = redis.Redis.from_url(server.url)
    client.xadd("malformed", {b"e": b"not an entry"})
    client.xadd("malformed", {b"other-field": b"x"})
    client.xadd("malformed", {b"e": encode("another-model", "x", 0.0, DOC[:20])})
    client.xadd("malformed", {b"e": encode("m", "x", 0.0, DOC[:20])})
    b = _engine()
    rb = Replica(b.proposers[0], open_log(url), model="m")
    assert rb.sync()
    s = rb.stats()
    assert (s["skipped_corrupt"], s["skipped_foreign"], s["ingested"]) == (2, 1, 1)
    np.testing.assert_array_equal(b.proposers[0].global_text(), np.append(DOC[:20], -1))
    # a key of another type where the stream should be: an error, retried, not a crash
    client.delete("malformed")
    client.set("malformed", "a string")
    assert not rb.sync() and rb.stats()["errors"] == 1
    client.close()


def test_a_slow_consumer_reads_bounded_batches_and_sees_the_trim(server):
    url = server.url + "?stream=slow"
    log = open_log(url)
    b = _engine()
    rb = Replica(b.proposers[0], open_log(url), model="m", batch=8)
    log.append([encode("m", "x", 0.0, DOC[k:k + 8]) for k in range(5)], 10_000)
    assert rb.sync() and rb.stats()["ingested"] == 5
    blobs, pos, gap = open_log(url).read(None, 3)
    assert len(blobs) == 3 and not gap                 # a read never returns more than asked
    # the log moves on by far more than it keeps while the consumer is away
    for _ in range(10):
        log.append([encode("m", "x", 0.0, DOC[k:k + 8]) for k in range(100)], 50)
    client = redis.Redis.from_url(server.url)
    assert client.xlen("slow") <= 50 + 200               # MAXLEN ~: trimmed by whole nodes
    assert rb.sync()
    assert rb.stats()["gaps"] == 1 and rb.stats()["ingested"] == 5 + client.xlen("slow")
    client.close()


def test_the_stream_is_trimmed_to_the_store_budget(server):
    url = server.url + "?stream=budget"
    a = _engine()
    p = a.proposers[0]
    ra = Replica(p, open_log(url), model="m")
    ra.budget = 2000                                     # a small store: ~2000 / 100 entries
    for k in range(400):
        _request(a, 0, DOC[:2], DOC[k:k + 100])
        _finish(a)
        if k % 50 == 49:
            assert ra.sync()
    client = redis.Redis.from_url(server.url)
    assert ra.stats()["published"] == 400
    assert client.xlen("budget") <= 2000 // 90 + 200
    client.close()

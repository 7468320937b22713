"""The store log (`ngramspec.store_log`) without a server: the kernel's two calls, the entry
format, the in-process and directory backends, replicas learning from each other, faults.
(Redis Streams: tests/test_store_log_redis.py.)"""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import ROOT
from ngramspec._suffix import SuffixProposer
from ngramspec.engine import SpecEngine
from ngramspec.store_log import (DirectoryLog, MemoryLog, Replica, attach, attach_from_env,
                                 check_spec, open_log)
from ngramspec.store_log.backends import LogUnavailable
from ngramspec.store_log.entry import BadEntry, CalibrationEntry, Entry, decode, encode
from ngramspec.validation import ParamError

RNG = np.random.default_rng(7)
# a "document" both replicas' requests quote: what one learns, the other can draft
DOC = RNG.integers(3, 5000, 600).astype(np.int32)


def _request(engine, slot, prompt, output):
    """Run one request through the engine with greedy verification; tokens accepted."""
    engine.begin(slot, prompt)
    ctx = list(prompt)
    accepted = 0
    i = 0
    while i < len(output):
        sampled = int(output[i])
        draft = engine.draft(slot, np.asarray(ctx, dtype=np.int32), sampled)
        ctx.append(sampled)
        i += 1
        if len(draft):
            n = 0
            while n < len(draft) and i + n < len(output) and draft[n] == output[i + n]:
                n += 1
            engine.accept(slot, n)
            accepted += n
            ctx.extend(output[i:i + n])
            i += n
    return accepted


def _child_env():
    """The environment of a child process that imports this tree's ngramspec."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _engine(n_slots=1):
    return SpecEngine("ngram-suffix", n_slots=n_slots)


def _finish(engine, slot=0):
    """End the slot's request (begin() of an empty prompt inserts it into the store)."""
    engine.begin(slot, np.empty(0, dtype=np.int32))


# -- the kernel's calls ---------------------------------------------------------------------------

def test_take_finished_hands_out_what_begin_inserted():
    p = SuffixProposer(global_prompt=4)
    p.publish_finished(8)
    e = SpecEngine.from_proposers([p])
    prompt = np.arange(10, 30, dtype=np.int32)
    _request(e, 0, prompt, DOC[:50])
    assert p.take_finished() == ([], 0)            # still running: nothing finished
    _finish(e)
    seqs, dropped = p.take_finished()
    assert dropped == 0 and len(seqs) == 1
    # exactly the global store's sequence: prompt tail + output
    np.testing.assert_array_equal(seqs[0], np.concatenate([prompt[-4:], DOC[:50]]))
    text = p.global_text()
    np.testing.assert_array_equal(text[:-1], seqs[0])
    assert p.take_finished() == ([], 0)


def test_publish_finished_is_bounded_and_counts_drops():
    p = SuffixProposer()
    p.publish_finished(2)
    e = SpecEngine.from_proposers([p])
    for k in range(5):
        _request(e, 0, DOC[:5], DOC[10 * k:10 * k + 10])
        _finish(e)
    seqs, dropped = p.take_finished()
    assert len(seqs) == 2 and dropped == 3
    np.testing.assert_array_equal(seqs[-1][-10:], DOC[40:50])
    with pytest.raises(ParamError, match="max_pending"):
        p.publish_finished(-1)


def test_insert_global_feeds_drafts_and_is_not_republished():
    p = SuffixProposer()
    p.publish_finished(8)
    assert p.insert_global(DOC[:300]) is True
    assert p.take_finished() == ([], 0)
    np.testing.assert_array_equal(p.global_text(), np.append(DOC[:300], -1))
    e = SpecEngine.from_proposers([p])
    # a request that quotes the document drafts it from the store at once
    assert _request(e, 0, np.array([1, 2], np.int32), DOC[:200]) > 150
    for bad, field in ((np.array([1, -1], np.int32), "tokens"), ([[1, 2]], "tokens")):
        with pytest.raises((ValueError, TypeError), match=field):
            p.insert_global(bad)
    assert SuffixProposer(global_tokens=0).insert_global(DOC[:10]) is False


def test_insert_global_runs_beside_drafts_in_other_threads():
    """Inserting from the log thread while slots draft: no crash, drafts keep coming."""
    p = SuffixProposer(n_slots=2, global_tokens=4096)
    e = SpecEngine.from_proposers([p], n_slots=2)
    errors = []

    def log_thread():
        try:
            for k in range(200):          # ~50 times the store's budget: evictions too
                p.insert_global(DOC[k % 500:k % 500 + 100])
        except Exception as exc:    # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=log_thread)
    t.start()
    n = 0
    while t.is_alive() or n < 3:
        _request(e, n % 2, DOC[:20], DOC[100:300])
        n += 1
    t.join()
    assert not errors
    assert p.global_stats()["evictions"] > 0


# -- entries --------------------------------------------------------------------------------------

def test_entry_round_trip_and_refusals():
    blob = encode("smol|49152", "a", 12.5, DOC[:20])
    e = decode(blob, "smol|49152", 49152)
    assert (e.origin, e.time) == ("a", 12.5)
    np.testing.assert_array_equal(e.tokens, DOC[:20])
    with pytest.raises(BadEntry) as info:
        decode(blob, "other|32000")
    assert info.value.foreign
    bumped = bytearray(blob)
    bumped[4] = 9                       # the format version
    with pytest.raises(BadEntry) as info:
        decode(bytes(bumped), "smol|49152")
    assert info.value.foreign
    for broken in (blob[:-1], blob[:10], b"", b"garbage" * 9, blob[:-5] + b"xxxxx", 42):
        with pytest.raises(BadEntry) as info:
            decode(broken, "smol|49152")
        assert not info.value.foreign
    with pytest.raises(BadEntry, match="token id"):
        decode(encode("m", "a", 0.0, np.array([5, 70000], np.int32)), "m", 49152)


# -- the setting ---------------------------------------------------------------------------------

def test_the_setting_names_the_flag_and_the_forms(tmp_path):
    for bad in ("", "redis:", "http://x", "dir:", "foo"):
        with pytest.raises(ParamError, match="--store") as info:
            check_spec(bad)
        assert "dir:PATH" in str(info.value)
    assert isinstance(open_log(f"dir:{tmp_path}"), DirectoryLog)
    assert open_log("memory:x") is open_log("memory:x")
    assert attach_from_env(_engine(), environ={}) is None
    with pytest.raises(ParamError, match="NGRAMSPEC_STORE"):
        attach_from_env(SpecEngine("ngram-mod"), environ={"NGRAMSPEC_STORE": "memory:y"})
    p = _engine().proposers[0]
    for bad, field in (({"interval": 0}, "interval"), ({"batch": 0}, "batch"),
                       ({"max_backlog": 0}, "max_backlog"), ({"n_vocab": 0}, "n_vocab"),
                       ({"max_backoff": 1e6}, "max_backoff")):
        with pytest.raises(ParamError, match=field):
            Replica(p, MemoryLog(), **bad)
    with pytest.raises(TypeError, match="SuffixProposer"):
        Replica(SpecEngine("ngram-mod").proposers[0], MemoryLog())
    # a backend declares its name (the warnings' and the metrics'): one without it is refused
    with pytest.raises(TypeError, match=r"^log must be a store log \(append, read, close and a "
                                        r"name"):
        Replica(p, object())
    assert open_log("memory:x").name == "memory:x"
    assert open_log(f"dir:{tmp_path}").name == str(tmp_path)


# -- replicas ------------------------------------------------------------------------------------

def _learns_from_the_other(log_a, log_b):
    """Replica A serves a request quoting DOC; B, which never saw DOC, drafts it after one
    sync. The baseline (no log) shows B could not have drafted it alone."""
    alone = _engine()
    base = _request(alone, 0, np.array([1, 2], np.int32), DOC[:400])
    a, b = _engine(), _engine()
    ra = Replica(a.proposers[0], log_a, model="m")
    rb = Replica(b.proposers[0], log_b, model="m")
    _request(a, 0, np.array([1, 2], np.int32), DOC[:400])
    _finish(a)
    assert ra.sync() and rb.sync()
    assert ra.stats()["published"] == 1 and rb.stats()["ingested"] == 1
    got = _request(b, 0, np.array([1, 2], np.int32), DOC[:400])
    assert got > base + 200, (got, base)
    _finish(b)
    assert rb.sync() and ra.sync()
    assert ra.stats()["ingested"] == 1 and ra.stats()["own"] == 1
    return ra, rb


def test_replicas_learn_through_the_in_process_log():
    log = MemoryLog()
    _learns_from_the_other(log, log)


def test_replicas_learn_through_a_directory(tmp_path):
    _learns_from_the_other(DirectoryLog(tmp_path), DirectoryLog(tmp_path))


def test_a_foreign_or_corrupt_entry_is_skipped_and_counted(tmp_path):
    for log in (MemoryLog(), DirectoryLog(tmp_path)):
        b = _engine()
        rb = Replica(b.proposers[0], log, model="m", n_vocab=10000)
        log.append([b"junk", encode("other", "x", 0.0, DOC[:50]),
                    encode("m", "x", 0.0, np.array([1, 99999], np.int32)),
                    encode("m", "x", 0.0, DOC[:50])], 100)
        assert rb.sync()
        s = rb.stats()
        assert (s["skipped_corrupt"], s["skipped_foreign"], s["ingested"]) == (2, 1, 1)
        np.testing.assert_array_equal(b.proposers[0].global_text(), np.append(DOC[:50], -1))


def test_a_directory_log_skips_a_garbage_frame(tmp_path):
    log = DirectoryLog(tmp_path)
    log.append([encode("m", "x", 0.0, DOC[:5])], 0)
    with open(tmp_path / "000000000001.seg", "ab") as f:
        f.write(b"\xff\xff\xff\xff not a frame")
    b = _engine()
    rb = Replica(b.proposers[0], log, model="m")
    assert rb.sync()
    assert (rb.stats()["ingested"], rb.stats()["skipped_corrupt"]) == (1, 1)
    log.append([encode("m", "x", 0.0, DOC[5:10])], 0, 4096 * 8)   # into a fresh segment
    assert rb.sync() and rb.stats()["ingested"] == 2


_APPENDER = """
import sys, numpy as np
from ngramspec.store_log import DirectoryLog
from ngramspec.store_log.entry import encode
log, me = DirectoryLog(sys.argv[1]), sys.argv[2]
for k in range(150):
    log.append([encode("m", me, 0.0, np.arange(k, k + 1 + k % 50, dtype=np.int32))], 0, 1 << 16)
"""


def test_processes_appending_at_once_leave_whole_entries(tmp_path):
    """Three processes append to one directory log at once (under its flock), a reader follows:
    every entry arrives whole, in each writer's order, and segments rotate and are trimmed."""
    env = _child_env()
    procs = [subprocess.Popen([sys.executable, "-c", _APPENDER, str(tmp_path), f"w{i}"],
                              env=env) for i in range(3)]
    log, seen, pos = DirectoryLog(tmp_path), [], None
    while True:
        done = all(p.poll() is not None for p in procs)
        blobs, pos, _ = log.read(pos, 64)
        seen += [decode(b, "m") for b in blobs]     # a torn entry would raise BadEntry
        if done and not blobs:
            break
    assert all(p.returncode == 0 for p in procs)
    for w in ("w0", "w1", "w2"):
        firsts = [int(e.tokens[0]) for e in seen if e.origin == w]
        assert firsts == sorted(firsts) and len(firsts) > 0
    assert len(list(tmp_path.glob("*.seg"))) <= 8


class _Flaky(MemoryLog):
    """An in-process log that can be switched off (a network partition)."""
    up = True

    def append(self, blobs, max_entries, max_bytes=0):
        if not self.up:
            raise LogUnavailable("down")
        return super().append(blobs, max_entries, max_bytes)

    def read(self, after, count):
        if not self.up:
            raise LogUnavailable("down")
        return super().read(after, count)


def test_an_unreachable_log_warns_once_keeps_a_bounded_backlog_and_catches_up(caplog):
    log = _Flaky()
    a, b = _engine(), _engine()
    ra = Replica(a.proposers[0], log, model="m", max_backlog=3)
    rb = Replica(b.proposers[0], log, model="m")
    log.up = False
    for k in range(5):
        _request(a, 0, DOC[:4], DOC[50 * k:50 * k + 50])   # drafts go on from its own store
        _finish(a)
        assert not ra.sync() and not rb.sync()
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 2                      # one per replica, not one per round
    assert ra.stats()["connected"] is False and ra.stats()["errors"] == 5
    log.up = True
    assert ra.sync() and rb.sync()
    s = ra.stats()
    assert s["published"] == 3 and s["dropped"] == 2 and s["connected"]
    assert rb.stats()["ingested"] == 3
    np.testing.assert_array_equal(b.proposers[0].global_text()[-51:-1], DOC[200:250])


def test_a_slow_consumer_reads_in_bounded_batches_and_sees_the_gap():
    log = MemoryLog()
    b = _engine()
    rb = Replica(b.proposers[0], log, model="m", batch=4)
    log.append([encode("m", "x", 0.0, DOC[k:k + 8]) for k in range(10)], 100)
    assert rb.sync() and rb.stats()["ingested"] == 10
    # the log moved on by more than it keeps while the consumer was away
    log.append([encode("m", "x", 0.0, DOC[k:k + 8]) for k in range(30)], 12)
    assert len(log._entries) == 12
    assert rb.sync()
    assert rb.stats()["ingested"] == 22 and rb.stats()["gaps"] == 1


def test_the_background_thread_publishes_and_ingests():
    log = MemoryLog()
    a, b = _engine(), _engine()
    ra = attach(a, "memory:thread-test", model="m", interval=0.01)
    rb = attach(b, "memory:thread-test", model="m", interval=0.01)
    try:
        _request(a, 0, DOC[:4], DOC[:300])
        _finish(a)
        for _ in range(500):
            if rb.stats()["ingested"]:
                break
            threading.Event().wait(0.01)
        assert rb.stats()["ingested"] == 1 and rb.stats()["lag_seconds"] < 5
    finally:
        ra.stop()
        rb.stop()
    del log


_TWO_PROCESSES = """
import sys, time, numpy as np
sys.path.insert(0, sys.argv[3])
from test_store_log import DOC, _engine, _finish, _request
from ngramspec.store_log import attach
me, spec = int(sys.argv[1]), sys.argv[2]
e = _engine()
r = attach(e, spec, model="m", interval=0.01)
_request(e, 0, np.array([1], np.int32), DOC[:300] if me == 0 else DOC[300:])
_finish(e)
deadline = time.time() + 60
while (r.stats()["ingested"] < 1 or r.stats()["calibration_ingested"] < 1) \
        and time.time() < deadline:
    time.sleep(0.02)
merged = e.proposers[0].calibration_stats()["merged"]
print(_request(e, 0, np.array([1], np.int32), DOC[300:] if me == 0 else DOC[:300]),
      r.stats()["ingested"], r.stats()["published"], merged)
r.stop()
"""


def two_processes_learn(spec: str) -> None:
    """Two processes, each one engine on the log `spec`, serve one half of DOC each, then the
    other half: each drafts far more of the half it never served than an engine alone, and
    its calibration has folded in the other's outcomes."""
    env = _child_env()
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESSES, str(i), spec,
                               str(ROOT / "tests")], stdout=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    alone = [_request(_engine(), 0, np.array([1], np.int32), half)
             for half in (DOC[300:], DOC[:300])]
    for (got, ingested, published, merged), base in zip(outs, alone):
        assert (int(ingested), int(published)) == (1, 1) and int(merged) > 0
        assert int(got) > base + 150, (got, base)


def test_two_processes_share_a_directory_log(tmp_path):
    two_processes_learn(f"dir:{tmp_path}")


# -- the one setting: NGRAMSPEC_STORE for the plug-ins, --store for the commands ----------------

def test_the_plug_ins_attach_from_NGRAMSPEC_STORE_one_replica_per_process(monkeypatch):
    from ngramspec.integrations.requests import engine_from_env
    from ngramspec.store_log import replicas

    monkeypatch.setenv("NGRAMSPEC_STORE", "memory:plug-in")
    before = set(replicas())
    first, _ = engine_from_env(2, "--spec-type ngram-suffix")
    mine = set(replicas()) - before
    assert len(mine) == 1 and next(iter(mine)).proposer is first.proposers[0]
    second, _ = engine_from_env(2, "--spec-type ngram-suffix")     # e.g. SGLang's flush
    mine = set(replicas()) - before
    assert len(mine) == 1 and next(iter(mine)).proposer is second.proposers[0]
    monkeypatch.setenv("NGRAMSPEC_STORE", "redis:/nowhere")
    with pytest.raises(ParamError, match="NGRAMSPEC_STORE"):
        engine_from_env(2, "--spec-type ngram-suffix")
    monkeypatch.delenv("NGRAMSPEC_STORE")
    engine_from_env(2, "--spec-type ngram-suffix")
    assert set(replicas()) - before == set()


def test_replay_store_flag_publishes_to_a_directory(tmp_path, shared_dir):
    """``ngramspec replay --store dir:PATH``: the replayed requests land in the log, where
    another replica ingests them; a bad value names the flag."""
    from ngramspec.replay import replay
    from ngramspec.traces import read_requests

    reqs = read_requests(str(shared_dir / "traces" / "code-edit.jsonl.gz"), 6)
    res = replay(reqs[:3], "ngram-suffix", store=f"dir:{tmp_path}")
    assert res.summary["llama_stats"][0]["store_log"]["published"] == 3
    blobs, _, _ = DirectoryLog(tmp_path).read(None, 100)
    # every request, the slot's last one too, and what the calibration learned from them
    assert [bytes(b[:4]) for b in blobs].count(b"NGSL") == 3
    assert [bytes(b[:4]) for b in blobs].count(b"NGSC") >= 1
    b = _engine()
    rb = Replica(b.proposers[0], DirectoryLog(tmp_path))
    assert rb.sync() and rb.stats()["ingested"] == 3
    assert rb.stats()["calibration_ingested"] >= 1
    assert b.proposers[0].calibration_stats()["merged"] > 0
    text = b.proposers[0].global_text()
    assert (text == -1).sum() == 3 and len(text) > sum(len(r.output) for r in reqs[:3])
    with pytest.raises(ValueError, match="--store"):
        replay(reqs, "ngram-suffix", store=f"dir:{tmp_path}", repeat=2)
    out = subprocess.run([sys.executable, "-m", "ngramspec", "replay", "--spec-type",
                          "ngram-suffix", "--store", "nowhere", str(shared_dir / "traces" /
                                                                   "chat.jsonl.gz")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--store" in out.stderr and "dir:PATH" in out.stderr


def test_the_server_metrics_show_each_replica():
    pytest.importorskip("prometheus_client")
    from ngramspec.server.metrics import _store_log_families
    from ngramspec.store_log import replicas

    log = MemoryLog()
    a = _engine()
    ra = Replica(a.proposers[0], log, model="m")
    _request(a, 0, DOC[:2], DOC[:50])
    _finish(a)
    assert ra.sync()
    fams = {f.name: f for f in _store_log_families()}
    sample = [s for s in fams["ngramspec:store_log_published"].samples
              if s.labels == {"log": "MemoryLog"}]
    assert sample and sample[0].value >= 1
    assert "ngramspec:store_log_lag_seconds" in fams
    ra.stop()
    assert ra not in replicas()                 # a stopped replica leaves the metrics


def test_run_batch_store_publishes_the_finished_requests(tmp_path, capsys):
    """``run-batch --store dir:PATH`` on the embedded model: the requests a slot finished are in
    the log, as entries of the model's identity (its file name) with its vocabulary's ids."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    import json

    from clitools import cli
    from ngramspec.llama.model import default_model_path

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": f"Count: {i}, {i + 1},", "temperature": 0, "max_tokens": 6}}) + "\n"
        for i in range(4)))
    res = cli(capsys, "run-batch", "-i", inp, "-o", out, "-t", "1", "-c", "1024", "-np", "1",
              "--no-progress", "--spec-type", "ngram-suffix", "--store", f"dir:{tmp_path}/log")
    assert res.returncode == 0, res.stderr
    from ngramspec.store_log import replicas
    for r in replicas():
        if getattr(r.log, "path", None) == f"{tmp_path}/log":
            r.stop()                       # what the process's exit does
    blobs, _, _ = DirectoryLog(tmp_path / "log").read(None, 100)
    model = os.path.basename(default_model_path())
    entries = [decode(b, model, 49152) for b in blobs]
    requests = [e for e in entries if isinstance(e, Entry)]
    assert len(requests) >= 3 and all(len(e.tokens) > 6 for e in requests)
    # the rest: what its calibration learned, of the same identity
    assert all(isinstance(e, CalibrationEntry) for e in entries if not isinstance(e, Entry))
    res = cli(capsys, "run-batch", "-i", inp, "-o", out, "--spec-type", "ngram-mod",
              "--store", f"dir:{tmp_path}/log")
    assert res.returncode != 0 and "--store" in res.stderr and "ngram-suffix" in res.stderr


def test_an_insertion_out_of_memory_raises_and_leaves_the_store_usable():
    """Every allocation an insertion from the log makes, failed in turn: MemoryError, and the
    proposer keeps drafting and takes the next sequence."""
    from ngramspec._proposer import _fail_allocation

    long_seq = np.tile(DOC, 10)                  # 6000 tokens: the store grows a few times
    p = SuffixProposer(global_tokens=8192)
    _fail_allocation(0)
    p.insert_global(long_seq)
    n_alloc = _fail_allocation(None)
    assert n_alloc > 0
    for k in range(1, n_alloc + 1):
        p = SuffixProposer(global_tokens=8192)
        _fail_allocation(k)
        try:
            with pytest.raises(MemoryError, match="global store"):
                p.insert_global(long_seq)
        finally:
            _fail_allocation(None)
        assert p.insert_global(DOC[:300])
        e = SpecEngine.from_proposers([p])
        assert _request(e, 0, np.array([1, 2], np.int32), DOC[:300]) > 150

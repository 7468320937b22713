"""The batched scheduler's request queue (ngramspec.llama.request_queue) on its own: bounded
under concurrent submitters, cancellation before admission, stop. No model needed."""
import threading

import numpy as np
import pytest

from ngramspec.request_params import SamplingParams, SpeculationParams
from ngramspec.request import QueueFull
from ngramspec.llama.request_queue import RequestQueue
from ngramspec.llama.running import RunningRequest


def _request(rid):
    return RunningRequest(rid, np.array([1, 2], dtype=np.int32), SamplingParams(),
                          SpeculationParams(), None, None, lambda _: None)


def test_concurrent_submitters_fill_the_queue_exactly():
    q = RequestQueue(5)
    got, full = [], []
    start = threading.Barrier(16)

    def submit():
        start.wait()
        try:
            got.append(q.put(_request, lambda: 2))      # two free slots: 7 may wait
        except QueueFull as exc:
            full.append(str(exc))
    threads = [threading.Thread(target=submit) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 7 and len(full) == 9
    assert full[0] == "the request queue is full (5 waiting)"
    assert sorted(r.id for r in got) == list(range(1, 8))
    assert [r.id for r in q.waiting] == list(range(1, 8))     # ids in queue order


def test_cancel_stop_drain_close():
    q = RequestQueue(4)
    a, b = q.put(_request, lambda: 0), q.put(_request, lambda: 0)
    q.cancel(a.id)
    q.cancel(999)                                        # unknown: ignored
    with q.cond:
        assert q.take_cancelled() == [a] and list(q.waiting) == [b]
        assert q.next_turn(0)                            # b waits: work to do
    q.stop(cancel_also=[])
    assert b.cancel_requested
    with pytest.raises(RuntimeError, match="stopped"):
        q.put(_request, lambda: 0)
    assert q.drain() == [b] and not q.waiting
    with q.cond:
        assert not q.next_turn(0)                        # stopping with nothing left
    assert q.close() and not q.close()

"""Admission and slots: a slot's cached prefix is reused, a request waits for the busy slot that
holds its prompt, the queue is bounded and takes submissions from many threads."""
import threading

import numpy as np
import pytest

from greedy import assert_same_greedy, assert_same_greedy_prefix
from scheduler_common import N_CTX_SLOT, llm, prompts, sched  # noqa: F401
from ngramspec.llama import QueueFull, SamplingParams, Scheduler, generate_plain
from ngramspec.llama import tokenize_prompt
from ngramspec.config import SpecConfig


def test_prompt_cache_decodes_only_the_new_turn(llm, sched, prompts):
    p, _ = prompts[1]
    first = sched.submit(p, SamplingParams(max_tokens=16)).result(timeout=120)
    follow = np.concatenate([p, first.tokens, tokenize_prompt(llm, " And subtract?")])
    res = sched.submit(follow, SamplingParams(max_tokens=16)).result(timeout=120)
    # Everything but the last output token (never decoded) came from the slot's cache.
    assert res.prompt_cached_n >= len(p) + len(first.tokens) - 1
    assert_same_greedy(llm, follow, res.tokens,
                        generate_plain(llm, follow, n_predict=16).output_tokens)


def test_request_waits_for_the_busy_slot_that_holds_its_prompt(llm, prompts):
    code, _ = prompts[0]
    other, _ = prompts[3]
    with Scheduler(llm, SpecConfig("none"), n_slots=2, n_ctx=2 * N_CTX_SLOT, n_threads=1) as s:
        for p in (code, other):           # slot 0 holds the code prompt, slot 1 the other one
            s.submit(p, SamplingParams(max_tokens=1)).result(timeout=300)
        running = s.submit(code, SamplingParams(max_tokens=6))
        again = s.submit(code, SamplingParams(max_tokens=4))
        first, second = running.result(timeout=300), again.result(timeout=300)
    # The second request of the code prompt did not decode it again in the free slot: it waited
    # (a few steps, far less than decoding the prompt) for the slot that holds it.
    assert first.prompt_cached_n == second.prompt_cached_n == len(code) - 1
    assert_same_greedy_prefix(llm, code, second.tokens, first.tokens)


def test_bounded_queue_and_submission_from_many_threads(llm):
    s = Scheduler(llm, SpecConfig("ngram-mod"), n_slots=2, n_ctx=512, n_threads=1, queue_size=6)
    try:
        p = s.tokenize("Hello")
        errors, handles = [], []
        lock = threading.Lock()

        def client():
            try:
                h = s.submit(p, SamplingParams(max_tokens=4))
                with lock:
                    handles.append(h)
            except QueueFull as exc:
                with lock:
                    errors.append(exc)

        threads = [threading.Thread(target=client) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # not started: the two free slots' requests and queue_size more wait (the queue
        # counts only what no free slot takes), the other eight were refused
        assert len(handles) == 2 + 6 and len(errors) == 8
        s.start()
        outs = [h.result(timeout=120).tokens for h in handles]
        assert all(o == outs[0] for o in outs)
    finally:
        s.stop(timeout=60)
    with pytest.raises(RuntimeError, match="stopped"):
        s.submit(p)

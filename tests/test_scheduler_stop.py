"""How requests end and what they give back: streamed chunks, stop strings, cancel, a full slot
context, refused parameters."""
import threading

import pytest

from greedy import assert_same_greedy_prefix
from scheduler_common import N_CTX_SLOT, llm, prompts, sched  # noqa: F401
from ngramspec.llama import SamplingParams, Scheduler, SpeculationParams
from ngramspec.config import SpecConfig
from ngramspec.validation import OutOfRange


def test_streaming_chunks_add_up_to_the_completion(sched, prompts):
    p, _ = prompts[2]
    seen = []
    h = sched.submit(p, SamplingParams(max_tokens=40), on_token=lambda t, s: seen.append((t, s)))
    chunks = list(h)
    res = h.result(timeout=120)
    assert [c.tokens for c in chunks] == [t for t, _ in seen]
    assert sum((c.tokens for c in chunks), []) == res.tokens
    assert "".join(c.text for c in chunks) == res.text == sched.detokenize(res.tokens)


def test_stop_string_cuts_the_text(sched, prompts):
    p, _ = prompts[2]
    full = sched.submit(p, SamplingParams(max_tokens=56)).result(timeout=120)
    assert "\n" in full.text
    stop = sched.submit(p, SamplingParams(max_tokens=56, stop=("\n",))).result(timeout=120)
    assert stop.finish_reason == "stop" and stop.stop_string == "\n" and "\n" not in stop.text
    assert_same_greedy_prefix(sched.llm, p, stop.tokens, full.tokens)
    if stop.tokens == full.tokens[:len(stop.tokens)]:   # no float-noise tie on the way
        assert stop.text == full.text[:full.text.index("\n")]


def test_cancel_frees_the_slot(sched, prompts):
    p, _ = prompts[1]
    got = threading.Event()
    h = sched.submit(p, SamplingParams(max_tokens=-1, ignore_eos=True),
                     on_token=lambda t, s: got.set())
    assert got.wait(120)
    h.cancel()
    res = h.result(timeout=30)
    assert res.finish_reason == "cancelled" and res.predicted_n < N_CTX_SLOT - len(p)
    h.cancel()                       # a finished request, an unknown id: nothing happens
    sched.cancel(10**9)
    assert h.result(timeout=1) is res
    # a queued request cancelled before admission never runs
    hs = [sched.submit(p, SamplingParams(max_tokens=8)) for _ in range(8)]
    hs[-1].cancel()
    assert hs[-1].result(timeout=120).finish_reason == "cancelled"
    assert all(h.result(timeout=300).finish_reason == "length" for h in hs[:-1])
    assert sched.stats()["slots_busy"] == 0


def test_full_context_stops_cleanly(llm):
    with Scheduler(llm, SpecConfig("ngram-simple"), n_slots=2, n_ctx=256, n_threads=1) as s:
        p = s.tokenize("Count from one to one thousand: one, two, three,")
        res = s.submit(p, SamplingParams(max_tokens=-1, ignore_eos=True)).result(timeout=300)
        assert res.finish_reason == "context"
        assert len(p) + res.predicted_n == s.n_ctx_slot + 1 == 129
        with pytest.raises(ValueError, match="prompt_tokens.*does not fit"):
            s.submit(list(range(1, 129)))


def test_bad_parameters_are_refused(llm, sched):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(TypeError, match="top_k"):
        SamplingParams(top_k=2.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: float("nan")})
    with pytest.raises(ValueError, match="speculation.n_min"):
        SpeculationParams(n_min=5, n_max=2)
    with pytest.raises(ValueError, match="speculation.policy"):
        SpeculationParams(policy="greedy")
    with pytest.raises(ValueError, match="speculation.types.*ngram-map-k"):
        sched.submit([1, 2, 3], speculation=SpeculationParams(types=("ngram-map-k",)))
    with pytest.raises(ValueError, match="speculation.p_min"):
        sched.submit([1, 2, 3], speculation=SpeculationParams(p_min=0.5))
    with pytest.raises(ValueError, match="prompt_tokens"):
        sched.submit([])
    with pytest.raises(ValueError, match="prompt_tokens.*0 .. 49151"):
        sched.submit([1, 10**6])
    with pytest.raises(ValueError, match="logit_bias token id"):
        sched.submit([1, 2], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="n_slots"):
        Scheduler(llm, n_slots=0)
    # the configuration is checked before the context: its unknown type, its policy
    with pytest.raises(ValueError, match="spec type"):
        Scheduler(llm, SpecConfig("ngram-bogus"), n_slots=1, n_ctx=64)
    with pytest.raises(OutOfRange, match=r"^policy = 'best' is out of range: allowed auto"):
        Scheduler(llm, SpecConfig("ngram-mod", policy="best"), n_slots=1, n_ctx=64)
    with pytest.raises(TypeError, match="spec must be a SpecConfig, got str"):
        Scheduler(llm, "ngram-mod", n_slots=1, n_ctx=64)

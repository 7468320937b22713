"""Speculation per request and the policy: proposer subsets, n_max, the draft model with each
request's own p_min, the joint cost-aware policy; the counters of `Scheduler.stats`."""
import time

from greedy import assert_same_greedy
from scheduler_common import N_CTX_SLOT, llm, prompts, sched  # noqa: F401
from ngramspec.llama import SamplingParams, Scheduler, SpeculationParams, generate_plain
from ngramspec.llama.model import default_model_path
from ngramspec.config import SpecConfig

import pytest


def test_speculation_per_request(sched, prompts):
    p, n = prompts[4]
    st0 = sched.stats()
    before = st0["proposers"]
    off = sched.submit(p, SamplingParams(max_tokens=n),
                       SpeculationParams(enabled=False)).result(timeout=120)
    assert off.n_draft_tokens == 0
    only_mod = sched.submit(p, SamplingParams(max_tokens=n),
                            SpeculationParams(types=("ngram-mod",))).result(timeout=120)
    after = sched.stats()["proposers"]
    assert after["ngram-simple"]["gen_tokens"] == before["ngram-simple"]["gen_tokens"]
    assert after["ngram-mod"]["gen_tokens"] - before["ngram-mod"]["gen_tokens"] \
        == only_mod.n_draft_tokens > 0
    short = sched.submit(p, SamplingParams(max_tokens=n),
                         SpeculationParams(n_max=2)).result(timeout=120)
    assert 0 < short.n_draft_tokens <= 2 * short.predicted_n
    for other in (only_mod, short):  # greedy: speculation changes no token (up to float noise)
        assert_same_greedy(sched.llm, p, other.tokens, off.tokens)
    # the steps' counts (what was verified) are the requests' own, under the drivers' names
    st = sched.stats()
    assert st["n_draft_tokens"] - st0["n_draft_tokens"] == only_mod.n_draft_tokens + short.n_draft_tokens
    assert st["n_acc_tokens"] - st0["n_acc_tokens"] \
        == only_mod.n_acc_tokens + short.n_acc_tokens > 0


def test_draft_model_alongside(llm, prompts):
    """A draft model (the same GGUF: its greedy drafts are the target's) ends the chain; greedy
    output is unchanged and the draft model's tokens are accepted."""
    spec = SpecConfig.from_keywords("ngram-mod", model_draft=default_model_path(),
                                    spec_draft_n_max=4)
    with Scheduler(llm, spec, n_slots=2, n_ctx=2 * N_CTX_SLOT, n_threads=1) as s:
        assert s.spec_types == ("ngram-mod", "draft-simple")
        ps = [prompts[1], prompts[3]]
        hs = [s.submit(p, SamplingParams(max_tokens=n)) for p, n in ps]
        res = [h.result(timeout=300) for h in hs]
        for (p, n), r in zip(ps, res):
            assert_same_greedy(llm, p, r.tokens, generate_plain(llm, p, n_predict=n).output_tokens)
        st = s.stats()["proposers"]["draft-simple"]
        assert st["acc_tokens"] > 0.5 * st["gen_tokens"] > 0
        # two requests at once, each with its own p_min (held by its slot, not patched into the
        # shared proposer): 1 stops every draft-model draft before its first token, 0 never
        before = s.stats()["proposers"]["draft-simple"]["gen_tokens"]
        only_dm = ("draft-simple",)
        strict, free = (s.submit(ps[0][0], SamplingParams(max_tokens=8),
                                 SpeculationParams(types=only_dm, p_min=p_min))
                        for p_min in (1.0, 0.0))
        strict, free = strict.result(timeout=120), free.result(timeout=120)
        assert strict.n_draft_tokens == 0 and free.n_acc_tokens > 0
        assert s.stats()["proposers"]["draft-simple"]["gen_tokens"] - before == free.n_draft_tokens
        with pytest.raises(ValueError, match="speculation.p_min"):
            s.submit(ps[0][0], speculation=SpeculationParams(p_min=2.0))


def test_auto_policy_keeps_greedy_output(llm, prompts):
    """policy "auto": drafts cut to the joint cost-aware lengths; the output is unchanged."""
    spec = SpecConfig.from_keywords("ngram-simple,ngram-mod", policy="auto",
                                    ngram_simple_size_n=3, ngram_simple_size_m=8,
                                    ngram_mod_n_match=8, ngram_mod_n_min=2, ngram_mod_n_max=16)
    with Scheduler(llm, spec, n_slots=2, n_ctx=2 * N_CTX_SLOT, n_threads=1) as s:
        assert s.cost_model is not None  # measured (or found cached) at start
        ps = [prompts[4], prompts[3]]
        hs = [s.submit(p, SamplingParams(max_tokens=n)) for p, n in ps]
        for (p, n), h in zip(ps, hs):
            assert_same_greedy(llm, p, h.result(timeout=300).tokens,
                                generate_plain(llm, p, n_predict=n).output_tokens)
        st = s.stats()
        # the proposers' drafts (whole) against what the steps verified (cut)
        drafted = sum(v["gen_tokens"] for v in st["proposers"].values())
        assert st["n_draft_tokens"] <= drafted
        # every step's drafts went through the one policy's joint choice, and the executor
        # verified them through it (its observe moment learned from each)
        summary = s.auto_policy.summary()
        assert summary["drafts"] > 0 and summary["verified"] > 0


def test_a_finished_request_teaches_every_slot_at_once(llm, prompts):
    """ngram-suffix's store gets a request's output when the request ends (`SpecEngine.end`), not
    when its slot's next request begins: with several slots, the next request may never land on
    the same slot."""
    p, n = prompts[0]
    with Scheduler(llm, SpecConfig("ngram-suffix"), n_slots=2, n_ctx=2 * N_CTX_SLOT,
                   n_threads=1) as s:
        suffix = s.engine.proposers[0]
        assert suffix.global_stats()["tokens"] == 0
        done = s.submit(p, SamplingParams(max_tokens=n)).result(timeout=120)
        # stored by the decode thread right after it answered (before it admits anything else)
        deadline = time.monotonic() + 30
        while suffix.global_stats()["tokens"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stored = suffix.global_text().tolist()
        # the output is in the store (up to its last step's tokens, which no draft call saw),
        # although neither slot began another request
        k = len(done.tokens) // 2
        assert k >= 2 and suffix.global_stats()["tokens"] >= k
        assert any(stored[i:i + k] == done.tokens[:k] for i in range(len(stored) - k + 1))

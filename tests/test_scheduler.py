"""The batched scheduler on the real embedded model (SmolLM2-135M-Instruct Q4_1): no mocks.

Greedy requests decoded together must each give their plain greedy output (where they do not, the
first difference must be a float-noise tie: ``tests/greedy.py``). Sampled requests: speculative
sampling must draw the same distribution as plain sampling (chi-square homogeneity test over
fixed seeds: deterministic, no flakiness). Small contexts and outputs keep the module near two
minutes on a loaded 2-core box.
"""
import collections
import pathlib
import threading
import time

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
scipy_stats = pytest.importorskip("scipy.stats")

import ngramspec  # noqa: E402
from ngramspec.llama import (divergence_report, generate_plain, load_model,  # noqa: E402
                            tokenize_prompt)
from ngramspec.llama import (QueueFull, SamplingParams, Scheduler,  # noqa: E402
                             SpeculationParams)
from ngramspec.llama.model import default_model_path  # noqa: E402
from greedy import assert_same_greedy, assert_same_greedy_prefix  # noqa: E402

EXAMPLE = pathlib.Path(ngramspec.__file__).parent / "examples" / "code_edit_prompt.txt"
N_CTX_SLOT = 1024
COPY_TEXT = " ".join(["The quick brown fox jumps over the lazy dog."] * 6) + " The quick brown"


@pytest.fixture(scope="module")
def llm():
    return load_model(default_model_path(), n_ctx=N_CTX_SLOT, n_threads=1)


@pytest.fixture(scope="module")
def sched(llm):
    s = Scheduler(llm, n_slots=4, n_ctx=4 * N_CTX_SLOT, n_threads=1, queue_size=512,
                  spec_type="ngram-simple,ngram-mod",
                  spec_params=dict(ngram_simple_size_n=3, ngram_simple_size_m=8,
                                   ngram_mod_n_match=8, ngram_mod_n_min=2, ngram_mod_n_max=16))
    s.start()
    yield s
    s.stop(cancel=True, timeout=60)


@pytest.fixture(scope="module")
def prompts(llm):
    code = EXAMPLE.read_text(encoding="utf-8")
    texts = [(code, True, 32),
             ("Write a Python function that adds two numbers.", True, 32),
             ("List the planets of the solar system, one per line.", True, 48),
             ("def fib(n):\n    if n < 2:\n        return n\n", False, 16),
             ("Repeat after me: " + COPY_TEXT, True, 32)]
    return [(tokenize_prompt(llm, t, chat=chat), n) for t, chat, n in texts]


@pytest.mark.slow
def test_concurrent_greedy_requests_give_plain_greedy_output(llm, sched, prompts):
    plain = [generate_plain(llm, p, n_predict=n).output_tokens for p, n in prompts]
    handles = [None] * len(prompts)

    def client(i):
        time.sleep(0.15 * i)  # arrivals while earlier requests are running
        p, n = prompts[i]
        handles[i] = sched.submit(p, SamplingParams(max_tokens=n))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [h.result(timeout=300) for h in handles]
    for (p, n), res, want in zip(prompts, results, plain):
        assert res.finish_reason in ("length", "stop")
        assert res.predicted_n == len(res.tokens) <= n
        assert_same_greedy(llm, p, res.tokens, want)
    # 5 requests on 4 slots: one waited; drafts were verified in the batched decodes
    assert sum(r.draft_n_accepted for r in results) > 0
    st = sched.stats()
    assert st["decode_calls"] > 0 and st["decode_tokens"] >= st["decode_calls"]


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


def test_prompt_cache_decodes_only_the_new_turn(llm, sched, prompts):
    p, _ = prompts[1]
    first = sched.submit(p, SamplingParams(max_tokens=16)).result(timeout=120)
    follow = np.concatenate([p, first.tokens, tokenize_prompt(llm, " And subtract?")])
    res = sched.submit(follow, SamplingParams(max_tokens=16)).result(timeout=120)
    # Everything but the last output token (never decoded) came from the slot's cache.
    assert res.prompt_cached_n >= len(p) + len(first.tokens) - 1
    assert_same_greedy(llm, follow, res.tokens,
                        generate_plain(llm, follow, n_predict=16).output_tokens)


def test_plain_scheduler_gives_plain_greedy_output_on_a_long_prompt(llm):
    """Speculation off, a 523-token prompt: the scheduler decodes it in its own batches (one
    unified KV cache of several sequences), plain decoding in one pass. The first tokens agree
    or differ only at a tie within the float noise of those paths (issue 25: the report once
    rated a prompt-pass difference as noise-free)."""
    p = llm.tokenize(EXAMPLE.read_text(encoding="utf-8")[:2500].encode(), add_bos=True)
    want = generate_plain(llm, p, n_predict=8).output_tokens
    with Scheduler(llm, n_slots=2, n_ctx=2 * N_CTX_SLOT, n_threads=1, spec_type="none") as s:
        got = s.submit(p, SamplingParams(max_tokens=8)).result(timeout=300).tokens
    assert_same_greedy(llm, p, got, want)
    # A difference at the very first token is measured along the paths that decode the prompt
    # otherwise (in chunks, beside another sequence): the noise is not assumed to be zero.
    other = (want[0] + 1) % llm.n_vocab()
    rep = divergence_report(llm, p, [other], want[:1])
    assert set(rep.path_noise) == {"chunked", "multi_seq"}
    assert rep.noise == max(rep.path_noise.values()) and np.isfinite(rep.noise)


def test_request_waits_for_the_busy_slot_that_holds_its_prompt(llm, prompts):
    code, _ = prompts[0]
    other, _ = prompts[3]
    with Scheduler(llm, n_slots=2, n_ctx=2 * N_CTX_SLOT, n_threads=1, spec_type="none") as s:
        for p in (code, other):           # slot 0 holds the code prompt, slot 1 the other one
            s.submit(p, SamplingParams(max_tokens=1)).result(timeout=300)
        running = s.submit(code, SamplingParams(max_tokens=6))
        again = s.submit(code, SamplingParams(max_tokens=4))
        first, second = running.result(timeout=300), again.result(timeout=300)
    # The second request of the code prompt did not decode it again in the free slot: it waited
    # (a few steps, far less than decoding the prompt) for the slot that holds it.
    assert first.prompt_cached_n == second.prompt_cached_n == len(code) - 1
    assert_same_greedy_prefix(llm, code, second.tokens, first.tokens)


def test_speculation_per_request(sched, prompts):
    p, n = prompts[4]
    before = sched.stats()["proposers"]
    off = sched.submit(p, SamplingParams(max_tokens=n),
                       SpeculationParams(enabled=False)).result(timeout=120)
    assert off.draft_n == 0
    only_mod = sched.submit(p, SamplingParams(max_tokens=n),
                            SpeculationParams(types=("ngram-mod",))).result(timeout=120)
    after = sched.stats()["proposers"]
    assert after["ngram-simple"]["drafted"] == before["ngram-simple"]["drafted"]
    assert after["ngram-mod"]["drafted"] - before["ngram-mod"]["drafted"] == only_mod.draft_n > 0
    short = sched.submit(p, SamplingParams(max_tokens=n),
                         SpeculationParams(n_max=2)).result(timeout=120)
    assert 0 < short.draft_n <= 2 * short.predicted_n
    for other in (only_mod, short):  # greedy: speculation changes no token (up to float noise)
        assert_same_greedy(sched.llm, p, other.tokens, off.tokens)


def test_cancel_frees_the_slot(sched, prompts):
    p, _ = prompts[1]
    got = threading.Event()
    h = sched.submit(p, SamplingParams(max_tokens=-1, ignore_eos=True),
                     on_token=lambda t, s: got.set())
    assert got.wait(120)
    h.cancel()
    res = h.result(timeout=30)
    assert res.finish_reason == "cancelled" and res.predicted_n < N_CTX_SLOT - len(p)
    # a queued request cancelled before admission never runs
    hs = [sched.submit(p, SamplingParams(max_tokens=8)) for _ in range(8)]
    hs[-1].cancel()
    assert hs[-1].result(timeout=120).finish_reason == "cancelled"
    assert all(h.result(timeout=300).finish_reason == "length" for h in hs[:-1])
    assert sched.stats()["slots_busy"] == 0


def test_full_context_stops_cleanly(llm):
    with Scheduler(llm, n_slots=2, n_ctx=256, n_threads=1, spec_type="ngram-simple") as s:
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
    with pytest.raises(ValueError, match="spec type"):
        Scheduler(llm, n_slots=1, n_ctx=64, spec_type="ngram-bogus")


def test_bounded_queue_and_submission_from_many_threads(llm):
    s = Scheduler(llm, n_slots=2, n_ctx=512, n_threads=1, queue_size=6, spec_type="ngram-mod")
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


def _copy_category(tokens, copy):
    """Where a sample leaves the copy continuation, and with which token."""
    for i, (t, c) in enumerate(zip(tokens, copy)):
        if t != c:
            return (i, t)
    return ("copy",)


def _chi2_p(a, b):
    """Chi-square homogeneity p-value of two samples of categories: rare (position, token)
    categories pooled by position, rare positions into one."""
    both = collections.Counter(a) + collections.Counter(b)
    by_pos = collections.Counter()
    for key, v in both.items():
        by_pos[key[:1]] += v

    def pooled(key):
        if both[key] >= 10:
            return key
        return key[:1] if by_pos[key[:1]] >= 10 else "other"

    ca = collections.Counter(pooled(x) for x in a)
    cb = collections.Counter(pooled(x) for x in b)
    keys = sorted(set(ca) | set(cb), key=str)
    return scipy_stats.chi2_contingency(np.array([[ca[k] for k in keys],
                                                  [cb[k] for k in keys]]))[1]


@pytest.mark.slow
def test_speculative_sampling_has_the_plain_distribution(llm):
    """Many short sampled continuations of a text the proposers can copy: speculative (drafts
    accepted while the sample equals them) and plain sampling, disjoint fixed seeds."""
    with Scheduler(llm, n_slots=8, n_ctx=8 * 128, n_threads=1, queue_size=512,
                   spec_type="ngram-simple",
                   spec_params=dict(ngram_simple_size_n=3, ngram_simple_size_m=8)) as sched:
        _check_sampling_distribution(sched)


def _check_sampling_distribution(sched):
    p = sched.tokenize(COPY_TEXT, special=False)
    n, k = 160, 5
    copy = sched.submit(p, SamplingParams(max_tokens=k)).result(timeout=120).tokens

    def run(seeds, temperature, enabled):
        # the whole distribution (no top-k/p, min-p cut-offs): samples leave the copy at
        # every position
        hs = [sched.submit(p, SamplingParams(temperature=temperature, seed=s, max_tokens=k,
                                             top_k=0, top_p=1.0, min_p=0.0),
                           SpeculationParams(enabled=enabled)) for s in seeds]
        rs = [h.result(timeout=600) for h in hs]
        return [_copy_category(r.tokens, copy) for r in rs], sum(r.draft_n_accepted for r in rs)

    spec, accepted = run(range(n), 1.0, True)
    plain, none = run(range(n, 2 * n), 1.0, False)
    assert none == 0 and accepted > n  # the speculative runs did accept drafts
    # not degenerate: samples leave the copy at the drafted positions too
    assert 0.2 < collections.Counter(spec)[("copy",)] / n < 0.9
    assert sum(1 for c in spec if c[0] in (2, 3, 4)) >= 5
    p_same = _chi2_p(spec, plain)
    assert p_same > 1e-3, (p_same, collections.Counter(spec), collections.Counter(plain))
    # the test can tell distributions apart: plain at another temperature differs
    colder, _ = run(range(2 * n, 2 * n + 64), 0.8, False)
    p_other = _chi2_p(colder, plain)
    assert p_other < 1e-3, p_other


def test_draft_model_alongside(llm, prompts):
    """A draft model (the same GGUF: its greedy drafts are the target's) ends the chain; greedy
    output is unchanged and the draft model's tokens are accepted."""
    with Scheduler(llm, n_slots=2, n_ctx=2 * N_CTX_SLOT, n_threads=1, spec_type="ngram-mod",
                   draft_model=default_model_path(),
                   spec_params=dict(spec_draft_n_max=4)) as s:
        assert s.spec_types == ("ngram-mod", "draft-simple")
        ps = [prompts[1], prompts[3]]
        hs = [s.submit(p, SamplingParams(max_tokens=n)) for p, n in ps]
        res = [h.result(timeout=300) for h in hs]
        for (p, n), r in zip(ps, res):
            assert_same_greedy(llm, p, r.tokens, generate_plain(llm, p, n_predict=n).output_tokens)
        st = s.stats()["proposers"]["draft-simple"]
        assert st["accepted"] > 0.5 * st["drafted"] > 0
        # a per-request p_min of 1 stops every draft-model draft before its first token
        before = s.stats()["proposers"]["draft-simple"]["drafted"]
        r = s.submit(ps[0][0], SamplingParams(max_tokens=8),
                     SpeculationParams(types=("draft-simple",), p_min=1.0)).result(timeout=120)
        assert r.draft_n == 0 and s.stats()["proposers"]["draft-simple"]["drafted"] == before
        with pytest.raises(ValueError, match="speculation.p_min"):
            s.submit(ps[0][0], speculation=SpeculationParams(p_min=2.0))


def test_auto_policy_keeps_greedy_output(llm, prompts):
    """policy "auto": drafts cut to the joint cost-aware lengths; the output is unchanged."""
    with Scheduler(llm, n_slots=2, n_ctx=2 * N_CTX_SLOT, n_threads=1, policy="auto",
                   spec_type="ngram-simple,ngram-mod",
                   spec_params=dict(ngram_simple_size_n=3, ngram_simple_size_m=8,
                                    ngram_mod_n_match=8, ngram_mod_n_min=2,
                                    ngram_mod_n_max=16)) as s:
        assert s._cost.calibrated  # measured at start
        ps = [prompts[4], prompts[3]]
        hs = [s.submit(p, SamplingParams(max_tokens=n)) for p, n in ps]
        for (p, n), h in zip(ps, hs):
            assert_same_greedy(llm, p, h.result(timeout=300).tokens,
                                generate_plain(llm, p, n_predict=n).output_tokens)
        st = s.stats()
        # the proposers' drafts (whole) against what the steps verified (cut)
        drafted = sum(v["drafted"] for v in st["proposers"].values())
        assert st["draft_tokens"] <= drafted and s._accept_prior.tried[0] > 0


def test_logit_bias_and_ignore_eos(sched, prompts):
    p, _ = prompts[3]
    plain = sched.submit(p, SamplingParams(max_tokens=8)).result(timeout=120).tokens
    banned = plain[1]
    res = sched.submit(p, SamplingParams(max_tokens=8, logit_bias={banned: float("-inf")})
                       ).result(timeout=120)
    assert_same_greedy(sched.llm, p, res.tokens[:1], plain[:1])
    assert banned not in res.tokens
    eos = sched.tokenize("<|im_end|>", add_bos=False)[0]
    res = sched.submit(p, SamplingParams(max_tokens=8, ignore_eos=True,
                                         logit_bias={eos: 100.0})).result(timeout=120)
    assert res.finish_reason == "length" and eos not in res.tokens  # banned despite the bias
    res = sched.submit(p, SamplingParams(max_tokens=8, logit_bias={eos: 100.0})).result(timeout=120)
    assert res.tokens == [eos] and res.finish_reason == "stop" and res.text == ""

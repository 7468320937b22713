"""Acceptance estimates and draft-length policies (fixed, auto) on the verification loop."""
import numpy as np
import pytest

from ngramspec import SpecEngine
from ngramspec.acceptance import AcceptanceEstimator, DraftOutcomes, expected_accepted
from ngramspec.cost import PROFILES, CostModel
from ngramspec.draft_engine import EngineDefaults
from ngramspec.loop import run_recorded
from ngramspec.policy import AutoPolicy, FixedPolicy, make_policy


def linear_cost():
    # c(k) = k: a batch costs as much as its tokens one by one (worst CPU case)
    return CostModel([1, 64], [0], [[1.0, 64.0]], name="linear", source="test")


def flat_cost():
    # c(k) = 1: a batch of 64 costs no more than one token (an idealized GPU)
    return CostModel([1, 64], [0], [[1.0, 1.0]], name="flat", source="test")


class ScriptedEngine(EngineDefaults):
    """Drafts the recorded continuation, n tokens, the first `wrong_at(rng)` of them right."""

    def __init__(self, prompt_len, output, n, wrong_at, seed=0):
        self.prompt_len, self.output, self.n = prompt_len, np.asarray(output), n
        self.wrong_at, self.rng = wrong_at, np.random.default_rng(seed)
        self.accepted = []

    def begin(self, slot, prompt):
        pass

    def draft(self, slot, context, sampled, n_max):
        start = len(context) - self.prompt_len + 1
        d = self.output[start:start + self.n].astype(np.int32).copy()
        n = len(d) if n_max is None else min(len(d), n_max)
        d = d[:n]
        w = self.wrong_at(self.rng)
        if w < n:
            d[w] += 1           # a token the recording does not have
        return d

    def accept(self, slot, n):
        self.accepted.append(n)


def run(policy, wrong_at, n=16, n_out=600, seed=0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 1000, 50).astype(np.int32)
    output = rng.integers(0, 1000, n_out).astype(np.int32)
    eng = ScriptedEngine(len(prompt), output, n, wrong_at, seed)
    loop = run_recorded(eng, 0, prompt, output, policy=policy)
    assert loop.n_output == n_out
    # what was verified is a prefix of the recording: the output is unchanged
    assert np.array_equal(loop.context[len(prompt):], output[:len(loop.context) - len(prompt)])
    return loop


def geometric(p):
    return lambda rng: int(rng.geometric(1 - p)) - 1   # P(first wrong at i) = p^i (1 - p)


# -- the estimator -------------------------------------------------------------------------

def test_estimator_is_censoring_aware():
    # accepted lengths geometric (q = 0.7 at every position), drafts of random length: a
    # fully accepted draft says only "accepted >= n"
    rng = np.random.default_rng(1)
    est = AcceptanceEstimator(64, decay=1.0)
    naive_acc = naive_tokens = 0
    for _ in range(4000):
        n = int(rng.integers(1, 9))
        a = min(int(rng.geometric(0.3)) - 1, n)
        est.observe(n, a)
        naive_acc += a
        naive_tokens += n
    q = est.conditional(8)
    assert np.allclose(q[:6], 0.7, atol=0.04)
    assert naive_acc / naive_tokens < 0.45          # what a per-token rate would say


def test_estimator_full_drafts_do_not_lower_the_next_position():
    est = AcceptanceEstimator(16, decay=1.0)
    for _ in range(50):
        est.observe(4, 4)
    q = est.conditional(6)
    assert (q[:4] > 0.95).all()
    assert q[4] == q[3] and q[5] == q[3]             # unseen: the last seen position's estimate
    est2 = AcceptanceEstimator(16, decay=1.0)
    for _ in range(50):
        est2.observe(4, 1)
    q2 = est2.conditional(4)
    assert q2[0] > 0.95 and q2[1] < 0.05 and q2[2] == q2[1]


def test_estimator_prior_decay_and_checks():
    est = AcceptanceEstimator(8, prior=0.4)
    assert np.allclose(est.conditional(3), 0.4)
    est.observe(0, 0)                                  # an empty draft teaches nothing
    assert est.n_obs == 0
    for _ in range(100):
        est.observe(2, 0)
    low = est.conditional(1)[0]
    for _ in range(100):
        est.observe(2, 2)
    assert low < 0.1 and est.conditional(1)[0] > 0.9  # decay: recent outcomes dominate
    with pytest.raises(ValueError, match="n_accepted"):
        est.observe(2, 3)
    for kw in ({"prior": 1.0}, {"prior_weight": 0}, {"decay": 0}, {"decay": 1.5}):
        with pytest.raises(ValueError):
            AcceptanceEstimator(8, **kw)
    assert AcceptanceEstimator(4).conditional(6).shape == (6,)


def test_expected_accepted():
    assert np.allclose(expected_accepted(np.array([0.5, 0.5, 1.0])), [0, 0.5, 0.75, 1.0])
    assert np.allclose(expected_accepted(np.array([])), [0])


# -- the policy's choice -------------------------------------------------------------------

def test_best_k():
    e = expected_accepted(np.full(8, 0.9))
    assert AutoPolicy.best_k(e, flat_cost().costs(9)) == 8
    assert AutoPolicy.best_k(e, linear_cost().costs(9)) == 0
    assert AutoPolicy.best_k(np.zeros(3), np.ones(3)) == 0          # ties: the shortest


def test_linear_cost_and_low_acceptance_makes_plain_steps():
    policy = AutoPolicy(linear_cost())
    loop = run(policy, geometric(0.3))
    steps = np.array(loop.steps)
    # c(k) = k: a draft never pays, so nothing is verified (no probe is needed: every draft's
    # outcome is read off the output), yet the estimates follow the drafts
    assert (steps[:, 0] == 0).all()
    assert policy.n_plain == policy.n_drafts_seen == len(steps)
    est = policy._slots[0].estimators[0]
    q1 = est.accepted[0] / est.tried[0]
    assert abs(q1 - 0.3) < 0.15 and est.n_obs == 0      # learned only from unverified drafts


def test_flat_cost_and_high_acceptance_verifies_long_drafts():
    policy = AutoPolicy(flat_cost())
    loop = run(policy, geometric(0.97))
    steps = np.array(loop.steps)
    assert np.median(steps[:, 0]) == 16              # the whole draft, almost every step
    assert policy.n_plain == 0
    fixed = run(FixedPolicy(), geometric(0.97))
    assert len(loop.steps) == len(fixed.steps)       # nothing lost against llama.cpp's policy


def test_truncates_to_the_profitable_prefix():
    # first 3 tokens always right, then always wrong: on the CPU-like curve, verify ~3
    policy = AutoPolicy(PROFILES["cpu-embedded"], decay=0.9)
    loop = run(policy, lambda rng: 3)
    late = np.array(loop.steps[len(loop.steps) // 2:])
    verified = late[late[:, 0] > 0, 0]
    assert len(verified) > 0.8 * len(late)           # it learned that drafts pay ...
    assert np.median(verified) in (3, 4)             # ... their first 3 tokens, not all 16
    # and this beats verifying the whole 16-token draft under that cost model
    cpu = PROFILES["cpu-embedded"]

    def modeled(lp):
        return (lp.n_output - 1) / sum(cpu.cost(d + 1, 1000) for d, _, _ in lp.steps)
    assert modeled(loop) > modeled(run(FixedPolicy(), lambda rng: 3))


def test_plain_slot_sees_when_drafts_turn_good():
    # rejected drafts for 150 steps, then perfect ones: the policy goes back to drafting within
    # a few dozen steps (the faded evidence of the rejections must be outweighed), from the
    # unverified drafts' outcomes alone
    rng_switch = {"n": 0}

    def wrong_at(rng):
        rng_switch["n"] += 1
        return 0 if rng_switch["n"] < 150 else 99

    policy = AutoPolicy(PROFILES["cpu-embedded"])
    loop = run(policy, wrong_at, n=16, n_out=1500)
    steps = np.array(loop.steps)
    assert (steps[:150, 0] == 0).all()               # nothing verified while drafts are wrong
    first = next(i for i, s in enumerate(steps) if i >= 150 and s[0] > 0)
    assert first < 150 + 40
    assert (steps[first:, 0] == steps[first:, 1]).all()   # each verified draft accepted whole
    assert (steps[-20:, 0] == 16).mean() > 0.5


def test_policy_argument_checks():
    with pytest.raises(TypeError, match="CostModel"):
        AutoPolicy("gpu")
    with pytest.raises(ValueError, match="probe_len"):
        AutoPolicy(flat_cost(), probe_len=0)
    with pytest.raises(ValueError, match="probe_max"):
        AutoPolicy(flat_cost(), probe_min=8, probe_max=4)
    with pytest.raises(ValueError, match="decay"):
        AutoPolicy(flat_cost(), decay=2.0)
    assert isinstance(make_policy("fixed"), FixedPolicy)
    assert isinstance(make_policy("auto", flat_cost()), AutoPolicy)
    with pytest.raises(ValueError, match="cost model"):
        make_policy("auto")
    with pytest.raises(ValueError, match="allowed auto, fixed"):
        make_policy("greedy")


# -- the engine's side: who drafted, and ngram-suffix's probabilities ----------------------

def test_last_proposer_and_suffix_probabilities():
    eng = SpecEngine("ngram-suffix,ngram-simple", n_slots=2)
    assert eng.last_proposer(0) == -1
    text = np.tile(np.arange(40, dtype=np.int32), 6)
    eng.begin(1, text[:100])
    d = eng.draft(1, text[:100], int(text[100]))
    assert len(d) > 0
    assert eng.types[eng.last_proposer(1)] == "ngram-suffix"
    probs, tried = eng.proposers[0].draft_probs(1)
    assert len(probs) == len(d) == len(tried)
    assert (tried >= 0).all()
    assert ((probs > 0) & (probs <= 1)).all()
    assert np.prod(probs) >= 0.005 - 1e-9            # drafted only while above min_prob
    eng.accept(1, len(d))
    with pytest.raises(IndexError):
        eng.last_proposer(2)


def test_auto_policy_on_a_real_chain_keeps_the_output():
    rng = np.random.default_rng(3)
    base = rng.integers(0, 500, 300).astype(np.int32)
    prompt = np.concatenate([base, rng.integers(0, 500, 20).astype(np.int32)])
    output = np.concatenate([base[:200], rng.integers(0, 500, 100).astype(np.int32)])
    for cm in (PROFILES["gpu"], PROFILES["cpu-embedded"]):
        policy = AutoPolicy(cm, proposer_time=False)
        eng = SpecEngine("ngram-suffix,ngram-mod,ngram-simple")
        loop = run_recorded(eng, 0, prompt, output, policy=policy)
        assert loop.n_output == len(output)
        assert np.array_equal(loop.context[len(prompt):], output[:loop.n_context - len(prompt)])
        assert policy.n_verified > 0


def test_expensive_proposer_is_not_called_when_no_draft_would_pay():
    # a proposer that costs 2 ms a token (a draft model) against a 1 ms target decode: after
    # its first draft it is called only for probes
    import time

    class Slow(ScriptedEngine):
        calls = 0

        def draft(self, slot, context, sampled, n_max):
            Slow.calls += 1
            d = super().draft(slot, context, sampled, n_max)
            time.sleep(0.002 * len(d))
            return d

    cm = CostModel([1, 64], [0], [[0.001, 0.064]], name="linear-ms", source="test")
    policy = AutoPolicy(cm)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, 20).astype(np.int32)
    output = rng.integers(0, 1000, 120).astype(np.int32)
    eng = Slow(len(prompt), output, 4, geometric(0.5))
    loop = run_recorded(eng, 0, prompt, output, policy=policy)
    assert loop.n_output == len(output)
    assert policy.n_skipped_calls > 0
    assert Slow.calls == loop.n_draft_calls < len(loop.steps) / 2
    # the same proposer, its time not counted (a replay against a profile): called every step
    policy = AutoPolicy(cm, proposer_time=False)
    loop = run_recorded(Slow(len(prompt), output, 4, geometric(0.5)), 0, prompt, output,
                        policy=policy)
    assert policy.n_skipped_calls == 0 and loop.n_draft_calls == len(loop.steps)


def test_cut_drafts_still_teach_the_positions_after_the_cut():
    # n-gram copies accepted whole, on the CPU-like curve where only long drafts pay: the
    # positions a cut draft did not verify are learned from the output all the same, so the
    # verified length ramps up within a few steps (the depth discount keeps it a little behind
    # the evidence) and every verified draft is accepted whole
    cpu = PROFILES["cpu-embedded"]
    policy = AutoPolicy(cpu)
    loop = run(policy, lambda rng: 99, n=32, n_out=1500)
    steps = np.array(loop.steps)
    verified = steps[:-1, 0]
    first = int(np.flatnonzero(verified)[0])
    assert first < 8 and (verified[first + 10:] >= 20).all()
    assert (steps[:, 0] == steps[:, 1]).all()
    # position 32 was never verified, yet it is known: every draft's tail was read off the output
    assert verified.max() < 32
    est = policy._slots[0].estimators[0]
    assert est.tried[31] > 5 and est.accepted[31] == est.tried[31]
    # learning only from verified drafts would have left it unknown: that estimate leans on the
    # previous position, discounted, so it is lower
    blind = AcceptanceEstimator(decay=0.95, depth=0.95)
    for d, a, _ in loop.steps:
        if d:
            blind.observe(d, a)
    assert blind.tried[31] == 0
    assert blind.conditional(32)[31] < est.conditional(32)[31]


def test_depth_discounts_positions_beyond_the_evidence():
    est = AcceptanceEstimator(16, decay=1.0, depth=0.9)
    for _ in range(20):
        est.observe(4, 4)
    q = est.conditional(16)
    assert q[3] > 0.9
    # beyond the 4 observed positions each further one is discounted by 0.9
    assert np.allclose(q[5:] / q[4:-1], 0.9)
    flat = AcceptanceEstimator(16, decay=1.0, depth=1.0)
    for _ in range(20):
        flat.observe(4, 4)
    assert np.allclose(flat.conditional(16)[4:], flat.conditional(16)[3])
    with pytest.raises(ValueError, match="depth"):
        AcceptanceEstimator(4, depth=0.0)


def test_draft_outcomes_resolve_position_by_position():
    est = AcceptanceEstimator(8, decay=1.0)
    out = DraftOutcomes()
    tokens = np.arange(100, dtype=np.int32)
    # a draft predicting positions 50..53 = 50, 51, 52, 99 (wrong at the 4th)
    out.add(50, np.array([50, 51, 52, 99], dtype=np.int32), est)
    out.resolve(tokens[:50])                       # nothing known yet
    assert est.tried.sum() == 0 and len(out.pending) == 1
    out.resolve(tokens[:51], 51)                   # positions 50 (in tokens) and 51 (next)
    assert list(est.tried[:3]) == [1, 1, 0] and list(est.accepted[:3]) == [1, 1, 0]
    out.resolve(tokens[:54])                       # 52 right, 53 wrong: done
    assert list(est.tried[:5]) == [1, 1, 1, 1, 0] and list(est.accepted[:4]) == [1, 1, 1, 0]
    assert out.pending == []
    # a wrong first token is one rejection; a draft whose tokens all match is done at its end
    out.add(60, np.array([7], dtype=np.int32), est)
    out.add(60, np.array([60, 61], dtype=np.int32), est)
    out.resolve(tokens[:62])
    assert out.pending == []
    assert est.tried[0] == 3 and est.accepted[0] == 2 and est.accepted[1] == 2
    # the oldest draft goes when too many are open; clear() forgets them
    small = DraftOutcomes(max_pending=2)
    for i in range(3):
        small.add(10 + i, np.array([1, 2, 3], dtype=np.int32), est)
    assert [p[0] for p in small.pending] == [11, 12]
    small.clear()
    assert small.pending == []
    with pytest.raises(ValueError, match="max_pending"):
        DraftOutcomes(0)


def test_outcomes_count_every_draft_as_replay_would():
    # the estimator's counts equal a direct count over every draft the engine made (verified,
    # cut or dropped): position i tried when the draft's first i - 1 tokens match the output,
    # accepted when the i-th does too
    drafts = []

    class Recording(ScriptedEngine):
        def draft(self, slot, context, sampled, n_max):
            d = super().draft(slot, context, sampled, n_max)
            drafts.append((len(context) + 1, d.copy()))
            return d

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 1000, 50).astype(np.int32)
    output = rng.integers(0, 1000, 300).astype(np.int32)
    policy = AutoPolicy(PROFILES["cpu-embedded"], decay=1.0, depth=1.0)
    eng = Recording(len(prompt), output, 8, geometric(0.8), seed=5)
    loop = run_recorded(eng, 0, prompt, output, policy=policy)
    assert loop.n_output == len(output)
    assert 0 < sum(1 for d, _, _ in loop.steps if d) < len(loop.steps)   # some cut, some not
    tokens = np.concatenate([prompt, output])
    tried, accepted = np.zeros(8), np.zeros(8)
    for start, d in drafts:
        known = tokens[start:start + len(d)]
        m = len(known)
        diff = np.flatnonzero(d[:m] != known)
        a = int(diff[0]) if len(diff) else m
        accepted[:a] += 1
        tried[:a + (a < m)] += 1
    est = policy._slots[0].estimators[0]
    assert np.array_equal(est.tried[:8], tried) and np.array_equal(est.accepted[:8], accepted)
    assert not est.tried[8:].any()

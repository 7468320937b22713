"""The auto policy's batch method: all slots' draft lengths of one batched step chosen jointly
(`AutoPolicy.best_split`, `AutoPolicy.choose`), as the scheduler uses it."""
import itertools

import numpy as np
import pytest

from ngramspec.cost import CostModel
from ngramspec.draft_engine import EngineDefaults
from ngramspec.loop import SlotLoop
from ngramspec.policy import AutoPolicy


def linear_cost(fixed, per_token):
    """t(n) = fixed + per_token * n seconds, measured at n = 1 .. 128."""
    ks = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostModel(ks, [0], [[fixed + per_token * n for n in ks]], name="linear",
                     source="test")


def relative(cost, n_max):
    return cost.costs(n_max)


def brute_force(gains, n_base, e_base, costs):
    best, arg = -1.0, None
    for ks in itertools.product(*[range(len(g) + 1) for g in gains]):
        e = e_base + sum(float(np.sum(g[:k])) for g, k in zip(gains, ks))
        r = e / float(costs[n_base + sum(ks) - 1])
        if r > best + 1e-12:
            best, arg = r, list(ks)
    return best, arg


@pytest.mark.parametrize("seed", range(20))
def test_choice_is_the_best_split(seed):
    rng = np.random.default_rng(seed)
    costs = relative(linear_cost(rng.uniform(0.5, 5), rng.uniform(0.05, 1)), 32)
    gains = [np.cumprod(rng.uniform(0.2, 1.0, size=rng.integers(0, 5))) for _ in range(3)]
    ks = AutoPolicy.best_split(gains, 3, 3.0, costs)
    best, _ = brute_force(gains, 3, 3.0, costs)
    got = (3.0 + sum(float(np.sum(g[:k])) for g, k in zip(gains, ks))) \
        / float(costs[3 + sum(ks) - 1])
    assert got == pytest.approx(best, rel=1e-9)


def test_cheap_tokens_draft_everything_expensive_ones_nothing():
    gains = [np.cumprod(np.full(6, 0.9)), np.cumprod(np.full(4, 0.5))]
    split = AutoPolicy.best_split
    # a decode whose time hardly grows with its size (a GPU): verify every drafted token
    assert split(gains, 2, 2.0, relative(linear_cost(10.0, 0.01), 12)) == [6, 4]
    # a cost proportional to the tokens (no batching gain): no draft pays
    assert split(gains, 2, 2.0, relative(linear_cost(1e-9, 1.0), 12)) == [0, 0]
    # in between: the likely tokens of the first slot before the unlikely ones of the second
    k1, k2 = split(gains, 2, 2.0, relative(linear_cost(1.0, 0.3), 12))
    assert k1 > k2
    assert split([], 1, 0.0, np.ones(1)) == [] and split([np.zeros(0)], 1, 1.0, np.ones(1)) == [0]


class Repeating(EngineDefaults):
    """Drafts `n` copies of the last token; a recording of one repeated token accepts them all."""

    def __init__(self, n):
        self.n = n

    def begin(self, slot, prompt):
        pass

    def draft(self, slot, context, sampled, n_max):
        return np.full(self.n if n_max is None else min(self.n, n_max), sampled, np.int32)

    def accept(self, slot, n):
        pass


def step(policy, loops, n_base):
    drafts = [policy.draft(loop) for loop in loops]
    assert all(len(d) == 8 for d in drafts)     # joint: after_draft keeps the whole draft
    ks = policy.choose(loops, [len(d) for d in drafts], n_base, float(len(loops)))
    for loop, k in zip(loops, ks):
        policy.verify(loop, np.full(k + 1, 7, np.int32), n_verified=k)
    return ks


@pytest.mark.parametrize("cost, long", [(linear_cost(10.0, 0.01), True),
                                        (linear_cost(1e-9, 1.0), False)])
def test_choose_learns_and_cuts_every_slot(cost, long):
    policy = AutoPolicy(cost, joint=True, proposer_time=False)
    engine = Repeating(8)
    loops = [SlotLoop(engine, s, np.arange(10, dtype=np.int32), 7) for s in range(3)]
    for _ in range(30):
        ks = step(policy, loops, len(loops))
    # drafts that are always accepted: on a cheap batch the whole draft of every slot, on a
    # cost that grows like the tokens none (a plain step decodes the one sure token per slot)
    assert ks == ([8, 8, 8] if long else [0, 0, 0])
    s = policy.summary()
    assert s["drafts"] == 90 and (s["plain"] == 0 if long else s["plain"] == 90)


def test_the_schedulers_cost_model_is_loaded_before_the_model():
    """A configuration's cost model (a profile name, a file or a CostModel) replaces the
    context's calibration; an unknown one is refused before the model loads."""
    pytest.importorskip("llama_cpp")
    from ngramspec.config import SpecConfig
    from ngramspec.llama.scheduler import Scheduler
    with pytest.raises(ValueError, match="--cost-model nonsense: neither a file nor a profile"):
        Scheduler(None, SpecConfig(cost_model="nonsense"), n_threads=1)
    with pytest.raises(TypeError, match="cost_model must be a file path, a profile name or a "
                                        "CostModel, got int"):
        SpecConfig.from_keywords(cost_model=3)


@pytest.mark.parametrize("seed", range(4))
def test_one_decision_for_one_slot_and_for_a_batch(seed):
    """`AutoPolicy.choose` is the policy's one decision: a driver of one request reaches it
    through ``after_draft``, the scheduler's planner for the whole step; for one slot both are
    the same choice, step after step, while the estimates learn."""
    rng = np.random.default_rng(seed)
    cost = linear_cost(1.0, 0.08)
    single = AutoPolicy(cost, proposer_time=False)
    joint = AutoPolicy(cost, joint=True, proposer_time=False)
    engine = Repeating(12)
    a = SlotLoop(engine, 0, np.arange(10, dtype=np.int32), 7)
    b = SlotLoop(engine, 1, np.arange(10, dtype=np.int32), 7)
    chosen = []
    for _ in range(60):
        cut = single.draft(a)
        full = joint.draft(b)
        k = joint.choose([b], [len(full)])[0]
        assert k == len(cut)
        chosen.append(k)
        p = rng.uniform(0.3, 1.0)
        target = np.where(rng.random(len(full) + 1) < p, a.sampled, 3).astype(np.int32)
        assert single.verify(a, target) == joint.verify(b, target, n_verified=k)
    assert len(set(chosen)) > 1                  # the choice moved with what was learned
    assert single.summary() == joint.summary()

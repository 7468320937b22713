"""The joint cost-aware draft lengths of the batched scheduler (ngramspec.llama.joint)."""
import itertools

import numpy as np
import pytest

from ngramspec.llama.joint import StepCost, choose_lengths


def linear_cost(fixed, per_token):
    cost = StepCost()
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        cost.observe(n, fixed + per_token * n)
    return cost


def brute_force(gains, n_base, e_base, cost):
    best, arg = -1.0, None
    for ks in itertools.product(*[range(len(g) + 1) for g in gains]):
        e = e_base + sum(float(np.sum(g[:k])) for g, k in zip(gains, ks))
        r = e / float(cost([n_base + sum(ks)])[0])
        if r > best + 1e-12:
            best, arg = r, list(ks)
    return best, arg


@pytest.mark.parametrize("seed", range(20))
def test_choice_is_the_best_split(seed):
    rng = np.random.default_rng(seed)
    cost = linear_cost(rng.uniform(0.5, 5), rng.uniform(0.05, 1))
    gains = [np.cumprod(rng.uniform(0.2, 1.0, size=rng.integers(0, 5))) for _ in range(3)]
    ks = choose_lengths(gains, 3, 3.0, cost)
    best, _ = brute_force(gains, 3, 3.0, cost)
    got = (3.0 + sum(float(np.sum(g[:k])) for g, k in zip(gains, ks))) \
        / float(cost([3 + sum(ks)])[0])
    assert got == pytest.approx(best, rel=1e-9)


def test_cheap_tokens_draft_everything_expensive_ones_nothing():
    gains = [np.cumprod(np.full(6, 0.9)), np.cumprod(np.full(4, 0.5))]
    # a decode whose time hardly grows with its size (a GPU): verify every drafted token
    assert choose_lengths(gains, 2, 2.0, linear_cost(10.0, 0.01)) == [6, 4]
    # a cost proportional to the tokens (no batching gain): no draft pays
    assert choose_lengths(gains, 2, 2.0, linear_cost(0.0, 1.0)) == [0, 0]
    # in between: the likely tokens of the first slot before the unlikely ones of the second
    k1, k2 = choose_lengths(gains, 2, 2.0, linear_cost(1.0, 0.3))
    assert k1 > k2


def test_step_cost_interpolates_and_extrapolates():
    cost = StepCost(alpha=1.0)
    cost.observe(1, 1.0)
    cost.observe(8, 2.0)
    assert cost([1, 8])[0] == pytest.approx(1.0) and cost([8])[0] == pytest.approx(2.0)
    assert 1.0 < cost([4])[0] < 2.0
    assert cost([16])[0] == pytest.approx(4.0)       # proportional past the last bucket
    assert not StepCost().calibrated and cost.calibrated



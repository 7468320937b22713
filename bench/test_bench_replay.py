"""Trace replay benchmarks: every trace family of ../shared/traces, every proposer, and
llama-cpp-python's LlamaPromptLookupDecoding through the same replay loop.

One round replays a small subset of a family (first requests of the file, `SUBSETS`) on one
server slot with shared state, exactly as ``ngramspec replay`` does; the figures the terminal
summary prints (tokens per verification step, acceptance rate, us per draft call) are the
replay driver's. ``bench/replay_report.py`` runs the larger subsets of the README's table.
"""
import pytest

import benchlib
from benchlib import PROMPT_LOOKUP, PROPOSERS
from ngramspec.replay import replay
from ngramspec.traces import read_requests

# First N requests of each family; what repeats (hit4 in ../shared/traces/README.md) decides
# whether a draft must be accepted somewhere in the subset.
SUBSETS = {"code-edit": 6, "agentic": 4, "reasoning": 3, "chat": 8, "model-generated": 10}
REPEATS = {"code-edit", "agentic", "model-generated"}
NAMES = [*PROPOSERS, PROMPT_LOOKUP]


@pytest.fixture(scope="module")
def family_requests():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = read_requests(str(benchlib.TRACES / f"{family}.jsonl.gz"),
                                          SUBSETS[family])
        return cache[family]
    return get


@pytest.mark.parametrize("family", list(SUBSETS))
@pytest.mark.parametrize("name", NAMES)
def test_replay(benchmark, engines, family_requests, rounds, results, name, family):
    benchmark.group = f"replay {family}"
    requests = family_requests(family)
    factory = engines.factory(name)
    s = benchmark.pedantic(benchlib.replay_family, args=(factory, requests),
                           rounds=rounds(3 if name != PROMPT_LOOKUP else 1))
    n_output = sum(len(r.output) for r in requests)
    assert s["n_traces"] == len(requests) and s["n_output"] == n_output
    # each step emits its accepted tokens and (but for a request's last step when it ends on
    # accepted tokens) the next sampled one; the first comes from the prompt pass
    assert n_output - len(requests) <= s["n_steps"] + s["n_acc_tokens"] <= n_output
    assert s["n_steps"] == s["n_draft_calls"] and s["n_acc_tokens"] <= s["n_draft_tokens"]
    if family in REPEATS:
        assert s["n_drafts"] > 0 and s["n_acc_tokens"] > 0, f"{name} drafted nothing on {family}"
    benchmark.extra_info.update({k: s[k] for k in ("n_steps", "n_drafts", "n_acc_tokens",
                                                   "tokens_per_step", "acc_rate",
                                                   "us_per_gen_call")})
    results["replay"].append(dict(s, family=family, name=name))


def test_replay_family_is_the_drivers_replay(family_requests, engines):
    """`benchlib.replay_family` (any engine) counts exactly what ``ngramspec replay`` does."""
    requests = family_requests("code-edit")
    ours = benchlib.replay_family(engines.factory("chain"), requests)
    theirs = replay(requests, PROPOSERS["chain"]).summary
    for key in ("n_output", "n_steps", "n_draft_calls", "n_drafts", "n_draft_tokens",
                "n_acc_drafts", "n_acc_tokens", "tokens_per_step"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-4), key
    assert [{k: v for k, v in s.items() if not k.startswith("t_")} for s in ours["stats"]] == \
        [{k: v for k, v in s.items() if not k.startswith("t_")} for s in theirs["llama_stats"]]

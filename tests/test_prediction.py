"""Predicted Outputs' proposer (`ngramspec.prediction`) in the verification loop, on code-edit
traces: it follows the output through the prediction, finds its place again after insertions
and deletions, counts accepted/rejected tokens as the loop saw them, and never changes what is
emitted (the loop's output is the target's)."""
import gzip
import json

import numpy as np
import pytest

from conftest import ROOT
from ngramspec.engine import SpecEngine
from ngramspec.loop import run_recorded
from ngramspec.prediction import PredictedEngine, PredictionDrafter

TRACES = ROOT.parent / "shared" / "traces" / "code-edit.jsonl.gz"


def _traces(n):
    if not TRACES.exists():
        pytest.skip("no ../shared/traces")
    out = []
    with gzip.open(TRACES, "rt") as f:
        for line in f:
            r = json.loads(line)
            out.append((np.array(r["prompt"], np.int32), np.array(r["output"], np.int32)))
            if len(out) == n:
                break
    return out


def _replay(engine, prompt, output):
    loop = run_recorded(engine, 0, prompt, output)
    return loop, loop.record()


def _emitted(loop, prompt):
    """The loop's output: the verified tokens, and the last sampled one if it is not in them."""
    out = loop.context[len(prompt):].tolist()
    return out + [loop.sampled] if len(out) < loop.n_output else out


def test_a_perfect_prediction_drafts_the_whole_output():
    prompt, output = _traces(1)[0]
    eng = PredictedEngine(PredictionDrafter(output))
    loop, rec = _replay(eng, prompt, output)
    # the steps verify 8, 16, 32, then 64 predicted tokens, all accepted, plus the target's own
    assert eng.rejected_prediction_tokens == 0
    assert [s[0] for s in rec["steps"][:5]] == [8, 16, 32, 64, 64]
    assert rec["n_steps"] == 3 + -(-(len(output) - 1 - 9 - 17 - 33) // 65)
    assert eng.accepted_prediction_tokens == len(output) - 1 - (rec["n_steps"] - 1)
    assert _emitted(loop, prompt) == output.tolist()


def test_it_finds_its_place_after_an_insertion_and_a_deletion():
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 1000, 50).astype(np.int32)
    base = rng.integers(3, 30000, 600).astype(np.int32)
    # the output inserts 20 tokens at 200 and deletes 30 at 400 of what was predicted
    output = np.concatenate([base[:200], rng.integers(30000, 31000, 20), base[200:400],
                             base[430:]]).astype(np.int32)
    eng = PredictedEngine(PredictionDrafter(base, n_max=16))
    _, rec = _replay(eng, prompt, output)
    n_rejected = eng.rejected_prediction_tokens
    # only the drafts that ran into the two edits lose anything
    assert n_rejected <= 2 * 16
    assert eng.accepted_prediction_tokens >= len(output) - 20 - 4 * 16
    assert rec["n_acc_tokens"] == eng.accepted_prediction_tokens


def test_the_chain_drafts_where_the_prediction_has_nothing():
    prompt, output = _traces(2)[1]
    chain = SpecEngine("ngram-mod", ngram_mod_n_min=8, ngram_mod_n_max=32)
    # a prediction unrelated to the output: every draft comes from the chain, as without it
    unrelated = np.arange(40000, 40500, dtype=np.int32)
    eng = PredictedEngine(PredictionDrafter(unrelated), chain)
    _, with_pred = _replay(eng, prompt, output)
    _, alone = _replay(SpecEngine("ngram-mod", ngram_mod_n_min=8, ngram_mod_n_max=32),
                       prompt, output)
    assert eng.accepted_prediction_tokens == eng.rejected_prediction_tokens == 0
    assert with_pred["steps"] == alone["steps"]


def test_a_prediction_of_the_file_before_the_edit_beats_the_chain_on_traces():
    sys_path_bench = ROOT / "bench"
    import sys
    sys.path.insert(0, str(sys_path_bench))
    try:
        from prediction_report import prediction_of
    finally:
        sys.path.remove(str(sys_path_bench))
    better = 0
    traces = _traces(6)
    for prompt, output in traces:
        pred = prediction_of(prompt, output)
        assert len(pred) > 0
        chain = dict(ngram_mod_n_min=8, ngram_mod_n_max=32)
        eng = PredictedEngine(PredictionDrafter(pred), SpecEngine("ngram-mod", **chain))
        loop, rec = _replay(eng, prompt, output)
        assert _emitted(loop, prompt) == output.tolist()   # lossless replay
        _, alone = _replay(SpecEngine("ngram-mod", **chain), prompt, output)
        better += rec["n_steps"] < alone["n_steps"]
    assert better == len(traces)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="prediction"):
        PredictionDrafter([1, -2, 3])
    with pytest.raises(ValueError, match="n_max"):
        PredictionDrafter([1, 2, 3], n_max=0)
    with pytest.raises(ValueError, match="n_match"):
        PredictionDrafter([1, 2, 3], n_match=2)
    with pytest.raises(ValueError, match="n_start"):
        PredictionDrafter([1, 2, 3], n_max=8, n_start=9)
    with pytest.raises(RuntimeError, match="accept"):
        PredictionDrafter([1, 2, 3]).accept(0)


def test_the_proposer_of_a_draft_is_the_chains_or_none():
    """`last_proposer` (the policy's estimator key): -1 for the prediction's draft, the chain's
    index for the chain's."""
    chain = SpecEngine("ngram-mod", ngram_mod_n_min=2, ngram_mod_n_max=8, ngram_mod_n_match=2)
    eng = PredictedEngine(PredictionDrafter(np.arange(100, 140, dtype=np.int32)), chain)
    prompt = np.array([7, 8, 9, 7, 8, 9, 7, 8], dtype=np.int32)
    eng.begin(0, prompt)
    assert len(eng.draft(0, prompt, 100)) > 0 and eng.last_proposer(0) == -1
    eng.accept(0, 0)
    assert len(eng.draft(0, prompt, 9)) > 0 and eng.last_proposer(0) == 0
    eng.accept(0, 1)
    assert eng.proposers == chain.proposers and eng.stats() == chain.stats()

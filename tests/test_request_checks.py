"""A request's checks as pure functions of (vocabulary, slot context, chain)
(ngramspec.llama.request_checks): the batched scheduler and the live driver refuse the same
request in the same words, with the package's validation errors. No model needed."""
import numpy as np
import pytest

from ngramspec.request_params import SamplingParams, SpeculationParams
from ngramspec.llama.request_checks import (Bounds, check_prediction, check_prompt,
                                            check_request, check_sampling, check_spec)
from ngramspec.prediction import PredictionDrafter
from ngramspec.validation import ContextOverflow, OutOfRange, Refused

SLOT = Bounds(100, 16, "a slot's context (16 tokens)")


def test_a_prompt_is_checked_against_the_vocabulary_and_the_context():
    assert check_prompt(SLOT, [1, 2, 99]).tolist() == [1, 2, 99]
    with pytest.raises(Refused, match=r"^prompt_tokens must hold at least one token id$"):
        check_prompt(SLOT, [])
    with pytest.raises(Refused, match=r"^prompt_tokens: token ids must lie in 0 \.\. 99$"):
        check_prompt(SLOT, [1, 100])
    with pytest.raises(ContextOverflow, match=r"^prompt_tokens: the prompt \(16 tokens\) does "
                                              r"not fit a slot's context \(16 tokens\)$") as e:
        check_prompt(SLOT, list(range(16)))
    assert e.value.value == 16
    assert check_prompt(SLOT, list(range(15))).size == 15   # one cell for the first output


def test_the_live_driver_names_its_own_context():
    live = Bounds(100, 8, "the context (n_ctx = 8); raise --ctx-size")
    with pytest.raises(ContextOverflow, match=r"does not fit the context \(n_ctx = 8\); raise "
                                              r"--ctx-size$"):
        check_prompt(live, list(range(8)))


def test_sampling_is_checked_and_minus_one_is_the_slots_context():
    assert check_sampling(SLOT, SamplingParams(repeat_last_n=-1)).repeat_last_n == 16
    assert check_sampling(SLOT, SamplingParams(repeat_last_n=16)).repeat_last_n == 16
    with pytest.raises(OutOfRange, match=r"^repeat_last_n = 17 is out of range: allowed -1"):
        check_sampling(SLOT, SamplingParams(repeat_last_n=17))
    with pytest.raises(OutOfRange, match=r"^logit_bias token id = 100 is out of range"):
        check_sampling(SLOT, SamplingParams(logit_bias={100: 1.0}))
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        check_sampling(SLOT, {"temperature": 0})


def test_speculation_is_checked_against_the_chain():
    assert check_spec(("ngram-mod",), None) == SpeculationParams()
    with pytest.raises(Refused, match=r"^speculation\.types: 'ngram-suffix' is not in the "
                                      r"configured chain \(ngram-mod\)$"):
        check_spec(("ngram-mod",), SpeculationParams(types=("ngram-suffix",)))
    with pytest.raises(Refused, match=r"^speculation\.types: .*\(none\)$"):
        check_spec((), SpeculationParams(types=("ngram-mod",)))
    with pytest.raises(Refused, match=r"^speculation\.p_min needs a draft model"):
        check_spec(("ngram-mod",), SpeculationParams(p_min=0.5))


def test_a_prediction_gets_its_drafter_or_is_refused():
    assert check_prediction(SLOT, []) is None
    assert isinstance(check_prediction(SLOT, [5, 6, 7]), PredictionDrafter)
    with pytest.raises(Refused, match=r"^prediction: token ids must lie in 0 \.\. 99$"):
        check_prediction(SLOT, [100])
    with pytest.raises(Refused, match=r"^prediction: 17 tokens is longer than any output"):
        check_prediction(SLOT, list(range(17)))


def test_a_whole_request():
    slot = Bounds(100, 128, "a slot's context (128 tokens)")
    prompt, sampling, spec, drafter = check_request(slot, ("ngram-mod",), np.arange(4),
                                                    SamplingParams(), None, None, [9, 9])
    assert prompt.dtype == np.int32 and spec.enabled and drafter.tokens.tolist() == [9, 9]
    with pytest.raises(TypeError, match="on_token must be callable"):
        check_request(slot, (), [1], SamplingParams(), None, "not callable", None)

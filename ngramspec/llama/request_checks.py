"""A request's checks against the model and the slot that will hold it: pure functions.

Each takes what it checks against as plain values (`Bounds`: the vocabulary's size, a slot's
context and how the messages name it; the proposer chain's types) and raises the package's one
vocabulary of errors (`ngramspec.validation`), so every live driver refuses the same request in
the same words: the batched scheduler (a slot's share of the KV cache) and the single-request
live driver (``llm``'s own context, `ngramspec.llama.decoder.target_and_prompt`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from ngramspec.prediction import PredictionDrafter
from ngramspec.tokens import token_array
from ngramspec.validation import ContextOverflow, OutOfRange, Refused

from ngramspec.request_params import SamplingParams, SpeculationParams

__all__ = ["Bounds", "check_prompt", "check_prediction", "check_sampling", "check_spec",
           "check_request"]


@dataclass(frozen=True)
class Bounds:
    """What a request is checked against.

    Attributes
    ----------
    n_vocab : int
        The model's vocabulary size: ids lie in ``0 .. n_vocab - 1``.
    n_ctx : int
        The tokens a request (prompt and output) may hold: a slot's context.
    context : str
        How the prompt message names that context (``"a slot's context (n_ctx 4096 / 4 slots
        = 1024 tokens, one kept for the first output token)"``, ``"the context (n_ctx = 8);
        raise --ctx-size"``).
    field : str
        The prompt's name in the messages (``prompt_tokens``, ``prompt``).

    Notes
    -----
    Thread-safety: immutable.
    """

    n_vocab: int
    n_ctx: int
    context: str
    field: str = "prompt_tokens"


def check_prompt(bounds: Bounds, prompt_tokens) -> np.ndarray:
    """The prompt as an int32 array: non-empty, ids in the vocabulary, and one position left
    for the first output token (`ContextOverflow` otherwise)."""
    arr = token_array(prompt_tokens, bounds.field, non_empty=True, n_vocab=bounds.n_vocab)
    if arr.size >= bounds.n_ctx:
        raise ContextOverflow(bounds.field, f"the prompt ({arr.size} tokens) does not fit "
                              f"{bounds.context}", value=arr.size)
    return arr


def check_prediction(bounds: Bounds, prediction) -> Optional[PredictionDrafter]:
    """The prediction's drafter (its n-gram index built on the caller's thread), None for an
    empty prediction."""
    arr = token_array(prediction, "prediction", n_vocab=bounds.n_vocab)
    if arr.size == 0:
        return None
    if arr.size > bounds.n_ctx:
        raise Refused("prediction", f"{arr.size} tokens is longer than any output can be (a "
                                    f"slot's context: {bounds.n_ctx} tokens)")
    return PredictionDrafter(arr)


def check_sampling(bounds: Bounds, sampling: SamplingParams) -> SamplingParams:
    """The sampling parameters against the model and the slot: logit_bias ids in the
    vocabulary, ``repeat_last_n`` at most a slot's context (-1 = the slot's context, as
    llama-server turns -1 into its context size; the penalty sampler keeps a ring of that many
    tokens, so a larger value would only cost memory)."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    for tok in sampling.logit_bias:
        if tok >= bounds.n_vocab:
            raise OutOfRange("logit_bias token id", tok, f"0 .. {bounds.n_vocab - 1}")
    n = sampling.repeat_last_n
    if n > bounds.n_ctx:
        raise OutOfRange("repeat_last_n", n, f"-1 (a slot's context) .. {bounds.n_ctx} (a "
                                             "slot's context)")
    if n == -1:
        sampling = dataclasses.replace(sampling, repeat_last_n=bounds.n_ctx)
    return sampling


def check_spec(chain: Sequence[str], speculation) -> SpeculationParams:
    """The speculation parameters (None: the defaults) against the proposer chain's types."""
    spec = speculation if speculation is not None else SpeculationParams()
    if not isinstance(spec, SpeculationParams):
        raise TypeError(f"speculation must be a SpeculationParams, got {type(spec).__name__}")
    spec.check_chain(chain)
    return spec


def check_request(bounds: Bounds, chain: Sequence[str], prompt_tokens, sampling, speculation,
                  on_token, prediction) -> Tuple[np.ndarray, SamplingParams, SpeculationParams,
                                                 Optional[PredictionDrafter]]:
    """A submitted request checked whole: ``(prompt, sampling, speculation, prediction drafter
    or None)``, in the order the scheduler always checked them."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    spec = check_spec(chain, speculation)
    prompt = check_prompt(bounds, prompt_tokens)
    drafter = check_prediction(bounds, prediction) if prediction is not None else None
    sampling = check_sampling(bounds, sampling)
    if on_token is not None and not callable(on_token):
        raise TypeError("on_token must be callable")
    return prompt, sampling, spec, drafter

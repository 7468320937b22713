"""A request's fields as the scheduler's parameters, and the scheduler's errors as the request's
fields.

The scheduler and its parameter classes name fields their own way (``speculation.n_max``,
``prompt_tokens``); their errors carry that name as data (`ngramspec.validation.ParamError`).
This module is where the server maps it to the field the client sent (``speculative.n_max``,
``prompt`` or ``messages``), by a table: nothing parses a message.

Notes
-----
Thread-safety: stateless; called on the event loop.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

from ngramspec.request_params import SamplingParams, SpeculationParams
from ngramspec.server.errors import FieldError
from ngramspec.validation import ContextOverflow, OutOfRange, ParamError

# Request fields -> SamplingParams fields (same names, by design of both APIs).
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty",
                   "repeat_last_n", "frequency_penalty", "presence_penalty", "ignore_eos")
# The scheduler's field names -> the request's, where they differ; `request_errors` adds the
# prompt's and max_tokens' names of the request at hand.
REQUEST_FIELDS = {"speculation.enabled": "speculative.enabled",
                  "speculation.types": "speculative.type",
                  "speculation.n_max": "speculative.n_max",
                  "speculation.n_min": "speculative.n_min",
                  "speculation.p_min": "speculative.p_min",
                  "speculation.policy": "speculative.policy",
                  "logit_bias token id": "logit_bias"}


@contextlib.contextmanager
def request_errors(prompt_field: str, max_field: str = "max_tokens"):
    """Re-raise the scheduler's parameter errors as a 400 naming the request's field.

    Parameters
    ----------
    prompt_field : str
        The request's name of ``prompt_tokens``: ``prompt`` or ``messages``.
    max_field : str
        The request's name of ``max_tokens`` (``max_completion_tokens`` when the client gave
        that).

    Raises
    ------
    FieldError
        From a `ParamError`: ``param`` the request's field (an index such as
        ``logit_bias[12]`` belongs to its field, and the message keeps it); ``code``
        ``context_length_exceeded`` for a `ContextOverflow`. From any other ValueError or
        TypeError: ``param`` ``body``.
    """
    try:
        yield
    except ParamError as exc:
        root = exc.field.partition("[")[0]
        param = {"prompt_tokens": prompt_field, "max_tokens": max_field}.get(
            root, REQUEST_FIELDS.get(root, root))
        # an index stays with the field it indexes: prompt_tokens[3] -> prompt[3]
        message = exc.message_for(param + exc.field[len(root):])
        code = "context_length_exceeded" if isinstance(exc, ContextOverflow) else None
        raise FieldError(param, message, code=code) from None
    except (ValueError, TypeError) as exc:    # names no field: the body as a whole
        raise FieldError("body", " ".join(str(exc).split())) from None


def request_params(body, state, prompt_field: str
                   ) -> Tuple[SamplingParams, Optional[SpeculationParams]]:
    """The scheduler's parameters of a completion or chat request.

    Parameters
    ----------
    body : schemas.CompletionRequest or schemas.ChatCompletionRequest
    state : ServerState
        Its defaults, ``n_predict``, slot context and vocabulary.
    prompt_field : str
        ``prompt`` or ``messages`` (for errors).

    Returns
    -------
    (SamplingParams, SpeculationParams or None)
        None: the request has no ``speculative`` fields (the scheduler's defaults).

    Raises
    ------
    FieldError
        A value out of range, naming the request's field.
    """
    max_field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) \
        is not None else "max_tokens"
    max_tokens = body.output_limit()
    if max_tokens is None:
        max_tokens = state.n_predict
    # The scheduler takes any count (-1: until the context is full); a count no slot can
    # ever reach is a client error here.
    if max_tokens > state.n_ctx_slot:
        raise FieldError(max_field, str(OutOfRange(
            max_field, max_tokens, f"1 .. {state.n_ctx_slot} (a slot's context), or -1 = until "
                                   "the context is full")))
    values = dict(state.defaults)
    for name in SAMPLING_FIELDS:
        value = getattr(body, name)
        if value is not None:
            values[name] = value
    if body.logit_bias:
        values["logit_bias"] = body.token_bias(state.n_vocab)
    values["stop"] = body.stop_strings()
    values["max_tokens"] = max_tokens
    with request_errors(prompt_field, max_field):
        sampling = SamplingParams(**values)
        spec = body.speculative_options()
        if spec is None:
            return sampling, None
        return sampling, SpeculationParams(
            enabled=spec.enabled if spec.enabled is not None else True, types=spec.types(),
            n_max=spec.n_max, n_min=spec.n_min, p_min=spec.p_min, policy=spec.policy)

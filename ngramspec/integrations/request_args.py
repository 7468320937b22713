"""A request's ngramspec fields inside an engine: its prediction and its ``speculative`` object.

vLLM and SGLang pass each request's free-form arguments to the engine untouched (vLLM's
``SamplingParams.extra_args``, filled from ``vllm_xargs``; SGLang's ``custom_params``). ngramspec
reads two keys there, the same fields ``serve`` takes:

- ``prediction``: OpenAI's Predicted Outputs, as the object ``{"type": "content", "content":
  TEXT or text parts}``, as text, or as token ids. Text is tokenized where the engine has the
  model's tokenizer (its front end: vLLM's API server, SGLang's tokenizer manager), when the
  request is checked (`checked_args`), so the worker receives token ids.
- ``speculative``: ``{"enabled", "type", "n_max", "n_min", "p_min", "policy"}``, checked by
  ``serve``'s own model and parameter class (`ngramspec.server.schemas.SpeculativeOptions`,
  `ngramspec.request_params.SpeculationParams`), errors named by the request's field. Also as
  flat keys (``"speculative.n_max": 8``, llama-server's form), for vLLM's ``vllm_xargs``,
  which holds no objects (and turns a JSON ``true`` / ``false`` into 1 / 0, so the flat
  ``speculative.enabled`` takes 0 and 1 too).

Where errors surface: `checked_args` runs in the engine's front end and raises a `ParamError`
naming the field (the adapters turn it into the engine's 400). The worker calls `control_of`
on each new request (O(1) for a request without these keys): a value that reaches it
unchecked is logged and ignored (the request drafts as configured), never an error in the
engine's step; a ``speculative.type`` outside the configured chain, or ``policy: auto`` on an
engine started with the fixed policy (only the worker knows its chain and policy), is handled
the same way.

Thread-safety: stateless functions.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from ngramspec.request_params import SpeculationParams
from ngramspec.tokens import token_array
from ngramspec.validation import ParamError, Refused, WrongType

__all__ = ["FLAT_KEYS", "PREDICTION", "SPECULATIVE", "RequestControl", "checked_args",
           "control_of", "has_control"]

#: The keys ngramspec reads in a request's engine arguments.
PREDICTION = "prediction"
SPECULATIVE = "speculative"
_FIELDS = ("enabled", "type", "n_max", "n_min", "p_min", "policy")
#: llama-server's flat form of the ``speculative`` fields.
FLAT_KEYS = tuple(f"{SPECULATIVE}.{name}" for name in _FIELDS)

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestControl:
    """What one request asks of the drafter.

    Attributes
    ----------
    spec : SpeculationParams or None
        ``serve``'s per-request control (None: the configured chain and bounds).
    prediction : numpy.ndarray or None
        The predicted output's int32 token ids (None or empty: no prediction).
    """

    spec: Optional[object] = None
    prediction: Optional[np.ndarray] = None


def has_control(args: Optional[Mapping]) -> bool:
    """Whether a request's engine arguments hold any ngramspec key (a few dict lookups)."""
    if not args:
        return False
    return PREDICTION in args or SPECULATIVE in args or any(k in args for k in FLAT_KEYS)


def _options(args: Mapping):
    """The ``speculative`` object with its flat keys merged in, as ``serve``'s model."""
    from ngramspec.server.schemas import SpeculativeOptions
    obj = args.get(SPECULATIVE)
    if obj is not None and not isinstance(obj, Mapping):
        raise WrongType(SPECULATIVE, obj, "an object")
    merged = dict(obj or {})
    for key in FLAT_KEYS:
        if key not in args:
            continue
        name, value = key.partition(".")[2], args[key]
        if name == "enabled" and type(value) is int and value in (0, 1):
            value = bool(value)            # vllm_xargs' integer form of a JSON bool
        if name in merged and merged[name] != value:
            raise Refused(key, f"{value!r} contradicts the speculative object's {name} = "
                               f"{merged[name]!r}", value=value)
        merged[name] = value
    if obj is None and len(merged) == 0:
        return None
    try:
        return SpeculativeOptions.model_validate(merged)
    except ValueError as exc:       # pydantic's ValidationError
        raise _schema_error(exc, SPECULATIVE) from None


def _schema_error(exc, key: str) -> Refused:
    """pydantic's first error on the request's `key` object, named and worded as ``serve``
    names and words it (`ngramspec.server.errors`)."""
    from ngramspec.server.errors import _validation_message
    err = dict(exc.errors(include_url=False)[0])
    err["loc"] = (key,) + tuple(err.get("loc", ()))
    param, message = _validation_message(err)
    return Refused(param or key, message[len(param or ""):].lstrip(": "),
                   value=err.get("input"))


def _speculation(opts):
    """`SpeculationParams` of the options, its errors named as the request's fields."""
    try:
        return SpeculationParams(
            enabled=opts.enabled if opts.enabled is not None else True, types=opts.types(),
            n_max=opts.n_max, n_min=opts.n_min, p_min=opts.p_min, policy=opts.policy)
    except ParamError as exc:
        raise _renamed(exc) from None


def _renamed(exc: ParamError) -> Refused:
    """`SpeculationParams`' error (``speculation.n_max``) naming the request's field
    (``speculative.n_max``), as ``serve`` names it (`ngramspec.server.fields`)."""
    from ngramspec.server.fields import REQUEST_FIELDS
    field = REQUEST_FIELDS.get(exc.field, exc.field)
    return Refused(field, exc.detail, value=exc.value, allowed=exc.allowed, sep="")


def _prediction_tokens(value, tokenize: Optional[Callable], n_vocab: Optional[int]):
    """The prediction as token ids; text is tokenized with `tokenize`."""
    if isinstance(value, Mapping):
        from ngramspec.server.schemas import Prediction
        try:
            value = Prediction.model_validate(dict(value)).text()
        except ValueError as exc:       # pydantic's ValidationError
            raise _schema_error(exc, PREDICTION) from None
    if isinstance(value, str):
        if tokenize is None:
            raise Refused(PREDICTION, "text needs the model's tokenizer, which this process "
                                      "does not have: send token ids", value=value)
        value = tokenize(value)
    return token_array(value, PREDICTION, n_vocab=n_vocab)


def checked_args(args: Optional[Mapping], *, tokenize: Optional[Callable] = None,
                 n_vocab: Optional[int] = None) -> Optional[dict]:
    """The engine front end's check of a request's arguments.

    Parameters
    ----------
    args : mapping or None
        vLLM's ``extra_args`` / SGLang's ``custom_params``.
    tokenize : callable, optional
        ``tokenize(text) -> list of int``: the model's tokenizer, without special tokens.
    n_vocab : int, optional
        The model's vocabulary size (prediction ids must lie below it).

    Returns
    -------
    dict or None
        `args` itself when it holds no ngramspec key (None for None), else a copy whose
        ``prediction`` is a list of token ids.

    Raises
    ------
    ParamError
        A bad value, naming the request's field (``speculative.n_max``, ``prediction``) and
        what is allowed.
    """
    if not has_control(args):
        return args
    opts = _options(args)
    if opts is not None:
        _speculation(opts)
    out = dict(args)
    if PREDICTION in args and args[PREDICTION] is not None:
        out[PREDICTION] = _prediction_tokens(args[PREDICTION], tokenize, n_vocab).tolist()
    return out


def control_of(args: Optional[Mapping], chain: Sequence[str], *, auto: bool = False,
               key=None) -> Optional[RequestControl]:
    """The worker's reading of a new request's arguments (already `checked_args`).

    Parameters
    ----------
    args : mapping or None
    chain : sequence of str
        The configured proposers' types (``SpecEngine.types``).
    auto : bool
        Whether the host's policy is ``auto`` (``$NGRAMSPEC_SPEC``'s ``--spec-policy``): a
        request may ask for ``fixed`` always, for ``auto`` only then (it has the cost model).
    key : optional
        The request's id, named in the log.

    Returns
    -------
    RequestControl or None
        None: no ngramspec key, or a bad one (logged, ignored: the request drafts as
        configured; never an error in the engine's step).
    """
    if not has_control(args):
        return None
    try:
        opts = _options(args)
        spec = _speculation(opts) if opts is not None else None
        if spec is not None:
            try:
                spec.check_chain(chain)
            except ParamError as exc:
                raise _renamed(exc) from None
            if spec.policy == "auto" and not auto:
                raise Refused("speculative.policy", "'auto' needs the engine's $NGRAMSPEC_SPEC "
                                                    "to hold --spec-policy auto", value="auto")
        pred = None
        if args.get(PREDICTION) is not None:
            pred = _prediction_tokens(args[PREDICTION], None, None)
        return RequestControl(spec, pred if pred is not None and pred.size else None)
    except (ParamError, ValueError, TypeError) as exc:
        _log.warning("ngramspec: request %s: %s; its prediction and speculative fields are "
                     "ignored", key, exc)
        return None

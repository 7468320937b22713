"""Per-request parameters of the batched scheduler: sampling and speculation.

Both are frozen dataclasses validated in ``__post_init__``: a bad value raises ``ValueError``
(or ``TypeError`` for a wrong type) naming the field and its allowed range, before the request
reaches the decode thread. Field names follow llama-server's request fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from ngramspec.tokens import TOKEN_MAX

__all__ = ["SamplingParams", "SpeculationParams", "POLICIES"]

#: Draft-length policies a request may ask for.
POLICIES = ("fixed", "auto")
#: Largest per-request draft bound (the proposers' own parameters stop at 1024).
N_MAX_LIMIT = 1024
#: Largest integer llama.cpp's sampler parameters hold (int32_t): a larger value would be cut to
#: 32 bits on its way into C (``top_k = 2**32 + 1`` would act as 1).
INT32_MAX = 2**31 - 1
#: Largest logit bias (OpenAI's bound); ``-inf`` is allowed too and bans the token.
BIAS_LIMIT = 100.0
#: Longest stop string, in characters: the output's tail that could still begin one is held
#: back and compared with every stop string after each token, on the decode thread that all
#: requests share.
STOP_MAX_CHARS = 1024


def _number(name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise ValueError(f"{name} = {value} is out of range: allowed {left}{lo}, {hi}]")
    return value


def _integer(name: str, value, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = value.__index__()
    if value < lo or (hi is not None and value > hi):
        rng = f"{lo} .. {hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} = {value} is out of range: allowed {rng}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (llama.cpp's sampler chain) and when it stops.

    Attributes
    ----------
    temperature : float, 0 .. 100
        0 = greedy (argmax; token-identical to plain greedy decoding).
    top_k : int, 0 .. 2**31-1 (0 = off)
    top_p : float, 0 .. 1 (1 = off)
    min_p : float, 0 .. 1 (0 = off)
    seed : int or None
        0 .. 2**32-2 makes a sampled request reproducible; None = a random seed.
    repeat_penalty : float, > 0 (1 = off)
    repeat_last_n : int, -1 .. 2**31-1
        Tokens the penalties look back on (0 = off). -1 = the whole context: the scheduler
        turns it into its slot context size at submission, as llama-server does, and refuses a
        value larger than that (the penalty sampler allocates a ring of that many tokens).
    frequency_penalty, presence_penalty : float, -2 .. 2 (0 = off)
    logit_bias : dict of int -> float
        Added to the token's logit, -100 .. 100 (OpenAI's range; float32 would turn 1e308 into
        +inf), or ``-inf`` to ban the token. Token ids are checked against the vocabulary at
        submission.
    stop : tuple of str
        Stop strings (1 .. 1024 characters each), matched on the decoded text; the text is cut
        before the stop string.
    max_tokens : int, 1 .. 2**31-1 (-1 = until EOS or a full context)
    ignore_eos : bool
        Keep generating past end-of-generation tokens (they are banned, as llama-server does).

    Notes
    -----
    The chain is llama.cpp's order: logit_bias, penalties, top_k, top_p, min_p, temperature,
    dist (the sampling RNG, seeded). Penalties see the prompt and the output.

    Thread-safety: immutable.
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Optional[int] = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Dict[int, float] = field(default_factory=dict)
    stop: Tuple[str, ...] = ()
    max_tokens: int = 256
    ignore_eos: bool = False

    def __post_init__(self):
        put = object.__setattr__
        put(self, "temperature", _number("temperature", self.temperature, 0.0, 100.0))
        put(self, "top_k", _integer("top_k", self.top_k, 0, INT32_MAX))
        put(self, "top_p", _number("top_p", self.top_p, 0.0, 1.0))
        put(self, "min_p", _number("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None:
            put(self, "seed", _integer("seed", self.seed, 0, 2**32 - 2))
        put(self, "repeat_penalty", _number("repeat_penalty", self.repeat_penalty, 0.0, 100.0,
                                            lo_open=True))
        put(self, "repeat_last_n", _integer("repeat_last_n", self.repeat_last_n, -1,
                                            INT32_MAX))
        put(self, "frequency_penalty", _number("frequency_penalty", self.frequency_penalty,
                                               -2.0, 2.0))
        put(self, "presence_penalty", _number("presence_penalty", self.presence_penalty,
                                              -2.0, 2.0))
        if not isinstance(self.logit_bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got "
                            f"{type(self.logit_bias).__name__}")
        bias = {}
        for tok, b in self.logit_bias.items():
            tok = _integer("logit_bias token id", tok, 0, TOKEN_MAX)
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not (
                    b == -math.inf or -BIAS_LIMIT <= b <= BIAS_LIMIT):
                raise ValueError(f"logit_bias[{tok}] = {b!r} is out of range: allowed "
                                 f"-{BIAS_LIMIT:g} .. {BIAS_LIMIT:g}, or -inf (bans the token)")
            bias[tok] = float(b)
        put(self, "logit_bias", bias)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise TypeError("stop must be a string or a sequence of strings")
        for s in stop:
            if not 1 <= len(s) <= STOP_MAX_CHARS:
                raise ValueError(f"stop strings must have 1 .. {STOP_MAX_CHARS} characters, got "
                                 f"{len(s)}")
        put(self, "stop", tuple(stop))
        mt = _integer("max_tokens", self.max_tokens, -1, INT32_MAX)
        if mt == 0:
            raise ValueError("max_tokens = 0 is out of range: allowed -1 (no limit) or >= 1")
        put(self, "max_tokens", mt)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        """Greedy decoding (temperature 0)."""
        return self.temperature == 0.0

    @property
    def plain_argmax(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax of the raw logits."""
        return (self.greedy and not self.logit_bias and not self.ignore_eos
                and not self.penalized)

    @property
    def penalized(self) -> bool:
        return (self.repeat_last_n != 0 and (self.repeat_penalty != 1.0
                                              or self.frequency_penalty != 0.0
                                              or self.presence_penalty != 0.0))


@dataclass(frozen=True)
class SpeculationParams:
    """Per-request control of speculation (llama-server's compiled-out ``speculative.*`` fields).

    Attributes
    ----------
    enabled : bool
        False: plain decoding for this request (one token per step).
    types : tuple of str or None
        Proposers to use, a subset of the scheduler's configured chain (priority order kept);
        None = the whole chain.
    n_max : int, 0 .. 1024, or None
        Upper bound on this request's drafts (0 = no drafts).
    n_min : int, 0 .. 1024, or None
        Drafts shorter than this are dropped (not verified).
    p_min : float, 0 .. 1, or None
        Minimum draft-token probability of a draft model (``draft-simple``) in the chain.
    policy : "fixed", "auto" or None (the scheduler's default)

    The fields are checked against the scheduler's chain at submission
    (:meth:`ngramspec.llama.Scheduler.submit`).

    Thread-safety: immutable.
    """

    enabled: bool = True
    types: Optional[Tuple[str, ...]] = None
    n_max: Optional[int] = None
    n_min: Optional[int] = None
    p_min: Optional[float] = None
    policy: Optional[str] = None

    def __post_init__(self):
        put = object.__setattr__
        if not isinstance(self.enabled, bool):
            raise TypeError(f"speculation.enabled must be a bool, got "
                            f"{type(self.enabled).__name__}")
        if self.types is not None:
            types = self.types
            if isinstance(types, str):
                types = tuple(s.strip() for s in types.split(",") if s.strip())
            if not isinstance(types, (tuple, list)) or not all(isinstance(t, str) for t in types):
                raise TypeError("speculation.types must be a list of spec type names")
            put(self, "types", tuple(types))
        if self.n_max is not None:
            put(self, "n_max", _integer("speculation.n_max", self.n_max, 0, N_MAX_LIMIT))
        if self.n_min is not None:
            put(self, "n_min", _integer("speculation.n_min", self.n_min, 0, N_MAX_LIMIT))
        if self.n_max is not None and self.n_min is not None and self.n_min > self.n_max:
            raise ValueError(f"speculation.n_min = {self.n_min} is out of range: allowed "
                             f"0 .. n_max = {self.n_max}")
        if self.p_min is not None:
            put(self, "p_min", _number("speculation.p_min", self.p_min, 0.0, 1.0))
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"speculation.policy = {self.policy!r} is not allowed: "
                             f"{', '.join(map(repr, POLICIES))} or None")

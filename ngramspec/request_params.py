"""Per-request parameters of the batched scheduler: sampling and speculation.

Both are frozen dataclasses validated in ``__post_init__``: a bad value raises ``ValueError``
(or ``TypeError`` for a wrong type) naming the field and its allowed range, before the request
reaches the decode thread. Field names follow llama-server's request fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from ngramspec.policy import POLICIES
from ngramspec.tokens import TOKEN_MAX
from ngramspec.validation import (OutOfRange, Refused, WrongType, check_choice, check_int,
                                  check_real)

__all__ = ["SamplingParams", "SpeculationParams", "POLICIES"]

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


def _checked_bias(logit_bias) -> Dict[int, float]:
    """``logit_bias`` with int token ids (0 .. TOKEN_MAX; the vocabulary is checked at
    submission) and float biases in -100 .. 100 or -inf."""
    if not isinstance(logit_bias, dict):
        raise WrongType("logit_bias", logit_bias, "a dict of token id -> bias")
    bias = {}
    for tok, b in logit_bias.items():
        tok = check_int("logit_bias token id", tok, 0, TOKEN_MAX)
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (
                b == -math.inf or -BIAS_LIMIT <= b <= BIAS_LIMIT):
            raise OutOfRange(f"logit_bias[{tok}]", b, f"-{BIAS_LIMIT:g} .. {BIAS_LIMIT:g}, or "
                                                      "-inf (bans the token)")
        bias[tok] = float(b)
    return bias


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
        put(self, "temperature", check_real("temperature", self.temperature, 0.0, 100.0))
        put(self, "top_k", check_int("top_k", self.top_k, 0, INT32_MAX))
        put(self, "top_p", check_real("top_p", self.top_p, 0.0, 1.0))
        put(self, "min_p", check_real("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None:
            put(self, "seed", check_int("seed", self.seed, 0, 2**32 - 2))
        put(self, "repeat_penalty", check_real("repeat_penalty", self.repeat_penalty, 0.0,
                                               100.0, lo_open=True))
        put(self, "repeat_last_n", check_int("repeat_last_n", self.repeat_last_n, -1,
                                             INT32_MAX))
        put(self, "frequency_penalty", check_real("frequency_penalty", self.frequency_penalty,
                                                  -2.0, 2.0))
        put(self, "presence_penalty", check_real("presence_penalty", self.presence_penalty,
                                                 -2.0, 2.0))
        put(self, "logit_bias", _checked_bias(self.logit_bias))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise WrongType("stop", stop, "a string or a sequence of strings")
        for s in stop:
            if not 1 <= len(s) <= STOP_MAX_CHARS:
                raise Refused("stop", f"strings must have 1 .. {STOP_MAX_CHARS} characters, got "
                                      f"{len(s)}", value=s, sep=" ")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as exc:   # JSON's \ud800 escapes can carry one
                raise Refused("stop", f"character {exc.start} is an unpaired surrogate "
                                      f"(U+{ord(s[exc.start]):04X}): not valid Unicode text",
                              value=s) from None
        put(self, "stop", tuple(stop))
        mt = check_int("max_tokens", self.max_tokens, -1, INT32_MAX)
        if mt == 0:
            raise OutOfRange("max_tokens", 0, "-1 (no limit) or >= 1")
        put(self, "max_tokens", mt)
        if not isinstance(self.ignore_eos, bool):
            raise WrongType("ignore_eos", self.ignore_eos, "a bool")

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
            raise WrongType("speculation.enabled", self.enabled, "a bool")
        if self.types is not None:
            types = self.types
            if isinstance(types, str):
                types = tuple(s.strip() for s in types.split(",") if s.strip())
            if not isinstance(types, (tuple, list)) or not all(isinstance(t, str) for t in types):
                raise WrongType("speculation.types", types, "a list of spec type names")
            put(self, "types", tuple(types))
        if self.n_max is not None:
            put(self, "n_max", check_int("speculation.n_max", self.n_max, 0, N_MAX_LIMIT))
        if self.n_min is not None:
            put(self, "n_min", check_int("speculation.n_min", self.n_min, 0, N_MAX_LIMIT))
        if self.n_max is not None and self.n_min is not None and self.n_min > self.n_max:
            raise OutOfRange("speculation.n_min", self.n_min, f"0 .. n_max = {self.n_max}")
        if self.p_min is not None:
            put(self, "p_min", check_real("speculation.p_min", self.p_min, 0.0, 1.0))
        check_choice("speculation.policy", self.policy, POLICIES, none=True)

    def check_chain(self, chain) -> None:
        """Refuse types outside `chain` (the configured spec types; ``Refused`` naming
        ``speculation.types``) and a ``p_min`` without a draft model in it."""
        for t in self.types or ():
            if t not in chain:
                raise Refused("speculation.types", f"{t!r} is not in the configured chain "
                              f"({', '.join(chain) or 'none'})", value=t)
        if self.p_min is not None and "draft-simple" not in chain:
            raise Refused("speculation.p_min", "needs a draft model (draft-simple) in the chain",
                          sep=" ")

"""One range check and one message format for every parameter of the package.

Every check names the field as the user typed it (the flag ``--spec-ngram-mod-n-max``, the
keyword ``n_ctx``, the request field ``speculation.n_max``) and what is allowed:

- out of range: ``<field> = <value> is out of range: allowed <range>``, the range written
  ``lo .. hi``, ``>= lo`` or a list of names (`range_text`);
- wrong type: ``<field> must be <kind>, got <type>``;
- any other refusal: ``<field>: <reason>``.

The errors carry the field as data (`ParamError.field`, with `value` and `allowed`): a layer
that knows other names for the same field (the server's request fields, the command line's
flags) reports the error under its own name with `ParamError.message_for`, without parsing the
message. They subclass ``ValueError`` (``TypeError`` for a wrong type), so ``except ValueError``
callers keep working.

This module imports nothing from ngramspec: the kernels use it too (their compiled fast path
hands every failure to `check_int` / `check_real`).

Notes
-----
Thread-safety: stateless.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

__all__ = ["ContextOverflow", "OutOfRange", "ParamError", "Refused", "WrongType",
           "check_choice", "check_int", "check_real", "range_text"]


def _restore(cls, message, state):
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(state)
    return exc


class ParamError(Exception):
    """Base of the parameter errors: the field, the refused value, what is allowed.

    Not raised itself: `OutOfRange`, `WrongType`, `Refused` and `ContextOverflow` are.

    Attributes
    ----------
    field : str
        The name the error reports (a flag, a keyword, a field path such as
        ``speculation.n_max``).
    detail : str
        The message after the field's name: ``str(exc) == field + detail``.
    value : object
        The refused value (None where there is none to show).
    allowed : str or None
        The allowed range or values as the message writes them.

    Notes
    -----
    Memory: the message and the value.

    Thread-safety: immutable once raised.
    """

    def __init__(self, field: str, detail: str, *, value: Any = None,
                 allowed: Optional[str] = None):
        super().__init__(field + detail)
        self.field, self.detail, self.value, self.allowed = field, detail, value, allowed

    def message_for(self, field: str) -> str:
        """The same message naming `field` instead (a request field, a flag)."""
        return field + self.detail

    def __reduce__(self):
        # the subclasses' constructors take other arguments than the message: pickle the state
        return _restore, (type(self), str(self), dict(self.__dict__))


class OutOfRange(ParamError, ValueError):
    """``<field> = <value> is out of range: allowed <allowed>``.

    Parameters
    ----------
    field : str
    value : object
        Shown with ``str`` (``repr`` for a string, so a name is quoted).
    allowed : str
        The allowed range (`range_text`) or values.
    """

    def __init__(self, field: str, value: Any, allowed: str):
        shown = repr(value) if isinstance(value, str) else value
        super().__init__(field, f" = {shown} is out of range: allowed {allowed}", value=value,
                         allowed=allowed)


class WrongType(ParamError, TypeError):
    """``<field> must be <expected>, got <type name>``.

    Parameters
    ----------
    field : str
    value : object
    expected : str
        ``"an integer"``, ``"a number"``, ``"a bool"``...
    got : str, optional
        What the message says was given; default the value's type name.
    detail : str, optional
        The whole message after the field, where the wrong type is better said otherwise
        (``prompt[3] = True is not a token id: ids must be integers, not bool``).
    """

    def __init__(self, field: str, value: Any, expected: str, *, got: Optional[str] = None,
                 detail: Optional[str] = None):
        if detail is None:
            detail = f" must be {expected}, got {got or type(value).__name__}"
        super().__init__(field, detail, value=value, allowed=expected)


class Refused(ParamError, ValueError):
    """``<field>: <reason>``: a value refused for a reason other than its range.

    Parameters
    ----------
    field : str
    reason : str
    value : object, optional
    allowed : str, optional
    sep : str
        Between the field and the reason (``" "`` where the reason continues a sentence:
        ``stop strings must have 1 .. 1024 characters``).
    """

    def __init__(self, field: str, reason: str, *, value: Any = None,
                 allowed: Optional[str] = None, sep: str = ": "):
        super().__init__(field, sep + reason, value=value, allowed=allowed)


class ContextOverflow(Refused):
    """A prompt (or text) that cannot fit the context it is meant for: OpenAI's
    ``context_length_exceeded``."""


def range_text(lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False) -> str:
    """An inclusive range as the messages and ``--help`` write it.

    ``1 .. 1024``, ``>= 1``, ``<= 8``, ``any``; an end that is excluded adds
    ``(<end> excluded)``: ``0.0 .. 1.0 (0.0 excluded)``, ``> 0.0``.

    Parameters
    ----------
    lo, hi : number or None
        The ends; None: unbounded.
    lo_open, hi_open : bool
        The end itself is not allowed.

    Returns
    -------
    str
    """
    if lo is None and hi is None:
        return "any"
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f"{'<' if hi_open else '<='} {hi}"
    out = [str(end) for end, is_open in ((lo, lo_open), (hi, hi_open)) if is_open]
    return f"{lo} .. {hi}" + (f" ({' and '.join(out)} excluded)" if out else "")


def check_int(field: str, value, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """`value` as an int in ``lo .. hi`` (inclusive; None = unbounded).

    Any integer type is accepted (``__index__``: numpy's too), a bool is not.

    Parameters
    ----------
    field : str
        The name to report.
    value : object
    lo, hi : int, optional

    Returns
    -------
    int

    Raises
    ------
    WrongType
        Not an integer.
    OutOfRange
        Outside ``lo .. hi``.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise WrongType(field, value, "an integer")
    value = value.__index__()
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise OutOfRange(field, value, range_text(lo, hi))
    return value


def check_real(field: str, value, lo: Optional[float] = None, hi: Optional[float] = None, *,
               lo_open: bool = False, hi_open: bool = False) -> float:
    """`value` as a finite float in ``lo .. hi`` (None = unbounded; an end may be excluded).

    Parameters
    ----------
    field : str
        The name to report.
    value : object
        A real number (numpy's too); not a bool.
    lo, hi : float, optional
    lo_open, hi_open : bool
        Exclude that end.

    Returns
    -------
    float

    Raises
    ------
    WrongType
        Not a number.
    OutOfRange
        Outside the range, NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise WrongType(field, value, "a number")
    value = float(value)
    if not math.isfinite(value) or (lo is not None and (value < lo or lo_open and value == lo)) \
            or (hi is not None and (value > hi or hi_open and value == hi)):
        raise OutOfRange(field, value, range_text(lo, hi, lo_open=lo_open, hi_open=hi_open))
    return value


def check_choice(field: str, value, allowed: Sequence[str], *, none: bool = False):
    """`value` if it is one of `allowed` (None too with `none`).

    Parameters
    ----------
    field : str
    value : object
    allowed : sequence of str
    none : bool
        None is allowed too (a default chosen elsewhere).

    Returns
    -------
    object
        `value`.

    Raises
    ------
    OutOfRange
        Not one of them: ``policy = 'fast' is out of range: allowed auto, fixed``.
    """
    if (value is None and none) or (isinstance(value, str) and value in allowed):
        return value
    names = ", ".join(allowed) + (" or None" if none else "")
    raise OutOfRange(field, value, names)

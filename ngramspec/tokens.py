"""Token ids from Python values: the one token validator of the Python layer.

Every Python entry that takes token ids from a user (trace files, ``generate --prompt-tokens``,
the live drivers' prompts) checks them here, with the kernels' own checker
(``ngramspec._proposer``), so the Python layer and the kernels give one message format:
``<name>[<pos>] = <id> is not a token id: ids must be in 0 .. 2147483647`` (`TOKEN_MAX`),
``<name>`` being the flag, field or argument the ids came from. Values are checked as given,
before any conversion (a cast first would wrap ``2**32 + 1`` to 1).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ngramspec._proposer import TOKEN_MAX, _tokens_slow
from ngramspec.validation import Refused

__all__ = ["TOKEN_MAX", "token_array"]


def token_array(value, name: str, *, non_empty: bool = False,
                n_vocab: Optional[int] = None) -> np.ndarray:
    """``value`` as a C-contiguous int32 array of token ids in ``0 .. TOKEN_MAX``.

    Parameters
    ----------
    value : sequence of int or 1-D integer array
    name : str
        What the ids are called in errors: a flag, a field, an argument.
    non_empty : bool
        Refuse an empty sequence.
    n_vocab : int, optional
        A model's vocabulary size: ids must lie below it (the one wording of that check for
        prompts and predictions, in the scheduler and inside the engines).

    Raises
    ------
    TypeError
        Not a 1-D sequence of integers (bools and bytes are not token ids).
    ValueError
        An id outside ``0 .. TOKEN_MAX`` (naming its position) or at or above ``n_vocab``, more
        than ``TOKEN_MAX`` ids, or an empty sequence with ``non_empty``.

    Notes
    -----
    Memory: the returned array is ``value`` itself when it already is an aligned,
    C-contiguous int32 array, else a copy.

    Thread-safety: a pure function.
    """
    arr = _tokens_slow(value, name)
    if non_empty and arr.size == 0:
        raise Refused(name, "must hold at least one token id", sep=" ")
    if n_vocab is not None and arr.size and int(arr.max()) >= n_vocab:
        raise Refused(name, f"token ids must lie in 0 .. {n_vocab - 1}")
    return arr

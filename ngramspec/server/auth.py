"""API keys: ``--api-key`` / ``$NGRAMSPEC_API_KEY`` parsed, a blank key refused.

Notes
-----
Thread-safety: stateless.
"""
from __future__ import annotations

from typing import List, Optional

#: Where a key comes from, for error messages.
KEY_SOURCE = "--api-key (or $NGRAMSPEC_API_KEY)"


def parse_api_keys(value: Optional[str]) -> List[str]:
    """The keys of a comma list (surrounding blanks dropped); None = no key (an open server).

    Parameters
    ----------
    value : str or None

    Returns
    -------
    list of str

    Raises
    ------
    ValueError
        An empty or blank key in the list (``""``, ``" , "``, ``"k1,,k2"``): taken as no key at
        all it would silently turn authentication off.
    """
    if value is None:
        return []
    keys = [k.strip() for k in value.split(",")]
    if not all(keys):
        raise ValueError(f"{KEY_SOURCE}: {value!r} holds an empty or blank key: give non-blank "
                         f"keys (a comma list), or leave it unset for a server without a key")
    return keys

"""API keys: ``--api-key`` / ``$NGRAMSPEC_API_KEY`` parsed (a blank key refused), and checked
by `KeyCheck` before a request's body is read.

Notes
-----
Thread-safety: stateless; `KeyCheck` runs on the event loop.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import List, Optional, Sequence

from ngramspec.server.errors import error_response

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


#: Paths served without a key (llama-server's open endpoints: a probe needs no secret).
OPEN_PATHS = frozenset({"/health", "/v1/models"})


def request_key(headers) -> bytes:
    """The key a request presents: ``Authorization: Bearer KEY``, else ``X-Api-Key: KEY``
    (``b""`` for none).

    Parameters
    ----------
    headers : ASGI headers (a list of ``(name, value)`` byte pairs, names lower case)
    """
    given = {}
    for name, value in headers:
        if name in (b"authorization", b"x-api-key") and name not in given:
            given[name] = value
    scheme, _, token = given.get(b"authorization", b"").partition(b" ")
    if scheme.lower() != b"bearer":
        token = given.get(b"x-api-key", b"")
    return token.strip()


def key_matches(token: bytes, keys: Sequence[bytes]) -> bool:
    """Whether `token` is one of `keys`, compared with every key in constant time (no early
    exit: timing tells nothing about the keys)."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return ok


def cache_owner(token: bytes) -> str:
    """The prompt-cache owner of requests presenting `token` (``--cache-isolation per-key``):
    a digest, so that the key itself is not kept beside the cache."""
    return "key:" + hashlib.sha256(token).hexdigest()[:32]


class KeyCheck:
    """ASGI middleware: with keys, every path but `OPEN_PATHS` needs one of them, checked from
    the headers before any of the body is read, so an unauthenticated request costs nothing
    (its body is never received, parsed or kept) and gets 401 whatever it holds.

    Parameters
    ----------
    app : ASGI application
    keys : sequence of bytes
        Empty: an open server (every request passes).

    Notes
    -----
    Memory: none per request.

    Thread-safety: runs on the event loop; the keys are read-only.
    """

    def __init__(self, app, keys: Sequence[bytes]):
        self.app, self.keys = app, list(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS or \
                key_matches(request_key(scope["headers"]), self.keys):
            await self.app(scope, receive, send)
            return
        # The unread body makes the connection unusable for a next request: close it.
        await error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                             code="invalid_api_key", headers={"Connection": "close"})(
            scope, receive, send)

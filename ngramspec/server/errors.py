"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Every 4xx names the offending field in ``param`` (``"max_tokens"``, ``"messages[0].content"``,
``"speculative.n_max"``) and repeats it at the start of ``message``, so a client that only
prints the message still learns which field was wrong. The ``type`` strings are OpenAI's where
OpenAI has one, llama-server's otherwise (``unavailable_error`` for 503).

Notes
-----
Thread-safety: stateless; the handlers run on the event loop.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ngramspec.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          500: "server_error", 503: "unavailable_error"}

# Union members of a strict pydantic field appear in an error's location as type tags
# ("str", "list[int]", "function-after[...]"); they are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


class APIError(Exception):
    """An error answered with an OpenAI-style body and the given HTTP status.

    Parameters
    ----------
    status : int
        HTTP status.
    message : str
    param : str, optional
        The offending request field (``"messages[0].content"``).
    code : str, optional
    type : str, optional
        Default: OpenAI's (or llama-server's) type for `status`.

    Notes
    -----
    Memory: the message and a few fields.

    Thread-safety: immutable once raised.
    """

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def response(self) -> JSONResponse:
        """The error as a `JSONResponse` with its status."""
        return error_response(self.status, self.message, param=self.param, code=self.code,
                              type=self.type)


class FieldError(APIError):
    """A 400 about one request field; the message starts with the field's name.

    Parameters
    ----------
    param : str
        The field, as `loc_to_param` writes it.
    message : str
        Prefixed with ``"<param>: "`` unless it starts with the field's name.
    code : str, optional
    """

    def __init__(self, param: str, message: str, *, code: Optional[str] = None):
        if not message.startswith(param):
            message = f"{param}: {message}"
        super().__init__(400, message, param=param, code=code)


def error_body(message: str, *, type: str, param: Optional[str] = None,
               code: Any = None) -> dict:
    """The JSON body ``{"error": {"message", "type", "param", "code"}}``.

    Parameters
    ----------
    message : str
    type : str
    param : str, optional
    code : object, optional

    Returns
    -------
    dict
    """
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, *, param: Optional[str] = None,
                   code: Any = None, type: Optional[str] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    """An OpenAI-style error response.

    Parameters
    ----------
    status : int
    message : str
    param : str, optional
    code : object, optional
    type : str, optional
        Default: OpenAI's (or llama-server's) type for `status`.
    headers : dict, optional

    Returns
    -------
    fastapi.responses.JSONResponse
    """
    body = error_body(message, type=type or _TYPES.get(status, "invalid_request_error"),
                      param=param, code=code)
    return JSONResponse(body, status_code=status, headers=headers)


def loc_to_param(loc) -> Optional[str]:
    """A pydantic error location as the request field's name.

    ``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"``.

    Parameters
    ----------
    loc : sequence of str or int

    Returns
    -------
    str or None
        None when the location names no field (the body itself).
    """
    parts = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            if not parts:
                return None
            parts[-1] += f"[{item}]"
            continue
        if item in _TYPE_TAGS or "[" in item or item[:1].isupper():
            continue
        parts.append(item)
    return ".".join(parts) or None


def _validation_message(err: dict) -> tuple:
    """``(param, message)`` of one pydantic error."""
    kind = err.get("type", "")
    if kind == "json_invalid":
        pos = err.get("loc", (None, None))[-1]
        detail = (err.get("ctx") or {}).get("error", "invalid JSON")
        return None, f"malformed JSON body: {detail} (at character {pos})"
    param = loc_to_param(err.get("loc", ()))
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind == "missing" and param is None:
        msg = "the request body must be a JSON object"
    elif kind == "missing":
        msg = "this field is required"
    elif kind == "extra_forbidden":
        msg = "unknown field"
    elif kind == "model_attributes_type" or (kind == "dict_type" and param is None):
        msg = "the request body must be a JSON object"
    elif "input" in err and kind not in ("value_error",):
        shown = repr(err["input"])
        msg = f"{msg} (got {shown[:60] + '...' if len(shown) > 60 else shown})"
    return param, (f"{param}: {msg}" if param else msg)


async def _on_validation_error(request: Request, exc: RequestValidationError):
    errors = list(exc.errors())

    def field(err):
        loc = [x for x in err.get("loc", ()) if x != "body"]
        return loc[0] if loc else None

    # The most specific error (deepest location) of the first field that failed: for a union
    # such as prompt (text or token ids), the member the input came closest to.
    first = field(errors[0]) if errors else None
    same = [e for e in errors if field(e) == first]
    best = max(same, key=lambda e: len(e.get("loc", ()))) if same else {}
    param, message = _validation_message(best)
    return error_response(400, message, param=param)


async def _on_api_error(request: Request, exc: APIError):
    return exc.response()


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _on_unexpected(request: Request, exc: Exception):
    log.exception("unhandled error on %s", request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def install_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with an OpenAI-style body."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)

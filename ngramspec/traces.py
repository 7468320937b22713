"""Reading token-trace files (``.jsonl`` / ``.jsonl.gz``, the ``../shared/traces`` format).

Every problem is a `TraceError` whose message names the file and, where there is one, the line.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ngramspec.files import open_regular
from ngramspec.tokens import token_array

#: Longest line read (bytes): about 35M token ids; a longer one is refused with its file:line
#: instead of being read into memory whole.
MAX_LINE_BYTES = 1 << 28
_BOM = b"\xef\xbb\xbf"


class TraceError(ValueError):
    """A trace file that cannot be read: the message is ``FILE[:LINE]: what is wrong``."""


@dataclass
class Request:
    """One recorded request: the prompt and what the model produced.

    Attributes
    ----------
    id : str
        The line's ``id``, or ``FILE#INDEX``.
    prompt, output : numpy.ndarray
        int32 token ids.
    extra : dict
        The line's other fields.

    Notes
    -----
    Memory: the two token arrays (4 bytes per token) and the extra fields.

    Thread-safety: plain data; share read-only.
    """
    id: str
    prompt: np.ndarray   # int32
    output: np.ndarray   # int32
    extra: dict


def _tokens(value, path, lineno, field):
    if not isinstance(value, list):
        raise TraceError(f"{path}:{lineno}: field {field!r} must be a list of integer token ids")
    try:
        return token_array(value, f"{path}:{lineno}: field {field!r}")
    except (TypeError, ValueError) as exc:
        raise TraceError(str(exc)) from None


@contextlib.contextmanager
def _open(path):
    """The file as bytes: each line is decoded on its own, so an encoding error names its line
    (a text wrapper decodes whole chunks ahead of the line being read). A FIFO, device or
    directory is refused (`open_regular`): reading it would block or never end."""
    with open_regular(path, "traces and logs") as f:
        if path.endswith(".gz"):
            with gzip.GzipFile(fileobj=f, mode="rb") as gz:
                yield gz
        else:
            yield f


def _lines(f, path, max_line_bytes):
    """The file's lines (bytes), each at most ``max_line_bytes`` long; a UTF-8 BOM is dropped."""
    lineno = 0
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > max_line_bytes:
            raise TraceError(f"{path}:{lineno}: line longer than {max_line_bytes} bytes")
        if lineno == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        yield lineno, raw


def iter_json_lines(path: str,
                    max_line_bytes: int | None = None) -> Iterator[tuple[int, dict]]:
    """Each non-empty line of a JSONL file (``.gz`` too) as a JSON object.

    A UTF-8 byte-order mark at the start of the file is accepted.

    Parameters
    ----------
    path : str
    max_line_bytes : int, optional
        Longest line read (default `MAX_LINE_BYTES`); a longer one is an error naming its line.

    Yields
    ------
    tuple of (int, dict)
        The line number (from 1) and the object.

    Raises
    ------
    TraceError
        A missing or unreadable file, corrupt gzip data, a line that is not UTF-8, not JSON or not
        an object, or too long.
    """
    if max_line_bytes is None:
        max_line_bytes = MAX_LINE_BYTES
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such file")
    lineno = 0
    try:
        with _open(path) as f:
            for lineno, raw in _lines(f, path, max_line_bytes):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceError(f"{path}:{lineno}: not UTF-8 text ({exc.reason})") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path}:{lineno}: malformed JSON ({exc.msg} at column "
                                     f"{exc.colno})") from None
                except RecursionError:
                    raise TraceError(f"{path}:{lineno}: JSON nested too deeply") from None
                except ValueError as exc:  # an integer of more than 4300 digits, ...
                    what = " ".join(str(exc).split()[:8])
                    raise TraceError(f"{path}:{lineno}: unreadable JSON ({what})") from None
                if not isinstance(obj, dict):
                    raise TraceError(f"{path}:{lineno}: expected a JSON object per line")
                yield lineno, obj
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise TraceError(f"{path}:{lineno + 1}: corrupt or truncated gzip data ({exc})") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}:{lineno + 1}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None


def read_requests(path: str, limit: int | None = None,
                  max_line_bytes: int | None = None) -> list[Request]:
    """The first `limit` requests of a trace file, in file order.

    Parameters
    ----------
    path : str
        ``.jsonl`` or ``.jsonl.gz`` with ``prompt`` and ``output`` lists of token ids per line.
    limit : int, optional
        All when None.
    max_line_bytes : int, optional
        As `iter_json_lines`.

    Returns
    -------
    list of Request

    Raises
    ------
    TraceError
        As `iter_json_lines`, or a missing field or a token id outside 0 .. ``TOKEN_MAX``.
    """
    requests = []
    for lineno, obj in iter_json_lines(path, max_line_bytes):
        if limit is not None and len(requests) >= limit:
            break
        for field in ("prompt", "output"):
            if field not in obj:
                raise TraceError(f"{path}:{lineno}: missing field {field!r}")
        rid = str(obj.get("id", f"{os.path.basename(path)}#{len(requests)}"))
        extra = {k: v for k, v in obj.items() if k not in ("prompt", "output", "id")}
        requests.append(Request(rid, _tokens(obj["prompt"], path, lineno, "prompt"),
                                _tokens(obj["output"], path, lineno, "output"), extra))
    return requests

"""The store log's entry: one finished request's sequence, as bytes every backend carries.

Layout (little-endian): ``b"NGSL"``, format version (u16), model-identity length (u16),
origin length (u16), publication time (f64, seconds since the epoch), token count (u32); the
model identity and the origin (UTF-8); the tokens (int32); a CRC-32 of all that (u32). The
CRC catches a torn or foreign write; the version and the identity refuse an entry of another
format or another vocabulary, whose token ids would mean other text.

Thread-safety: pure functions.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["FORMAT_VERSION", "BadEntry", "Entry", "decode", "encode"]

FORMAT_VERSION = 1
MAGIC = b"NGSL"
_HEAD = struct.Struct("<4sHHHdI")
_CRC = struct.Struct("<I")
#: Longest identity or origin (bytes): a name, not a payload.
MAX_NAME = 1024


class BadEntry(ValueError):
    """An entry that is not ours to ingest; ``foreign`` tells another format or model (a
    well-formed entry of someone else) from a corrupt one."""

    def __init__(self, reason: str, *, foreign: bool = False):
        super().__init__(reason)
        self.foreign = foreign


@dataclass(frozen=True)
class Entry:
    """A decoded entry. Plain data; share read-only."""
    model: str
    origin: str
    time: float
    tokens: np.ndarray      # int32


def encode(model: str, origin: str, time: float, tokens: np.ndarray) -> bytes:
    """The bytes of one entry (`tokens`: int32 ids, as the proposer hands them out)."""
    m, o = model.encode(), origin.encode()
    if len(m) > MAX_NAME or len(o) > MAX_NAME:
        raise ValueError(f"model identity and origin must be at most {MAX_NAME} bytes")
    body = (_HEAD.pack(MAGIC, FORMAT_VERSION, len(m), len(o), time, len(tokens)) + m + o
            + np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return body + _CRC.pack(zlib.crc32(body))


def decode(blob, model: str, n_vocab: int | None = None) -> Entry:
    """The entry in `blob`, or `BadEntry` when it is corrupt (length, CRC, a token id out of
    0 .. n_vocab - 1) or foreign (another format version or model identity than `model`)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise BadEntry(f"not bytes: {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < _HEAD.size + _CRC.size or blob[:4] != MAGIC:
        raise BadEntry("not a store-log entry (no NGSL header)")
    magic, version, n_m, n_o, time, n_tok = _HEAD.unpack_from(blob)
    if version != FORMAT_VERSION:
        raise BadEntry(f"format version {version}, this replica reads {FORMAT_VERSION}",
                       foreign=True)
    end = _HEAD.size + n_m + n_o + 4 * n_tok
    if len(blob) != end + _CRC.size:
        raise BadEntry(f"{len(blob)} bytes, the header says {end + _CRC.size}")
    if _CRC.unpack_from(blob, end)[0] != zlib.crc32(memoryview(blob)[:end]):
        raise BadEntry("CRC mismatch")
    try:
        who = blob[_HEAD.size:_HEAD.size + n_m].decode()
        origin = blob[_HEAD.size + n_m:_HEAD.size + n_m + n_o].decode()
    except UnicodeDecodeError:
        raise BadEntry("model identity or origin is not UTF-8") from None
    if who != model:
        raise BadEntry(f"model {who!r}, this replica serves {model!r}", foreign=True)
    tokens = np.frombuffer(blob, dtype="<i4", count=n_tok, offset=_HEAD.size + n_m + n_o)
    tokens = tokens.astype(np.int32)
    if n_tok and (tokens.min() < 0 or (n_vocab is not None and tokens.max() >= n_vocab)):
        raise BadEntry(f"a token id out of 0 .. {'' if n_vocab is None else n_vocab - 1}")
    return Entry(who, origin, time, tokens)

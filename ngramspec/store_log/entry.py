"""The store log's entries, as bytes every backend carries. Two kinds:

* a finished request's sequence (`Entry`): ``b"NGSL"``, format version (u16), model-identity
  length (u16), origin length (u16), publication time (f64, seconds since the epoch), token
  count (u32); the model identity and the origin (UTF-8); the tokens (int32);
* ngram-suffix's calibration deltas (`CalibrationEntry`, what a replica's slots learned since
  its last one: `SuffixProposer.take_calibration`): ``b"NGSC"``, its own format version
  (u16), the same names and time, the number of cells (u32, at most the table's 1800); the
  names; the steps behind the tokens-per-step delta and their tokens (u64 each); the cells
  (u16), the outcomes per cell (u32), the hits per cell (u32).

Each ends with a CRC-32 of all before it (u32). The CRC catches a torn or foreign write; the
version and the identity refuse an entry of another format or another vocabulary, whose token
ids (and calibration cells) would mean something else. A kind of its own for the calibration
keeps replicas that predate it working: to them it is an entry without the NGSL header,
skipped and counted.

Thread-safety: pure functions.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["CAL_FORMAT_VERSION", "FORMAT_VERSION", "BadEntry", "CalibrationEntry", "Entry",
           "decode", "encode", "encode_calibration"]

FORMAT_VERSION = 1
MAGIC = b"NGSL"
CAL_FORMAT_VERSION = 1
CAL_MAGIC = b"NGSC"
#: Cells of ngram-suffix's calibration (fine and coarse): the most a calibration entry holds.
CAL_CELLS = 1800
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


@dataclass(frozen=True)
class CalibrationEntry:
    """A decoded calibration entry: per-cell deltas for `SuffixProposer.fold_calibration`.
    Plain data; share read-only."""
    model: str
    origin: str
    time: float
    cells: np.ndarray       # int32, 0 .. CAL_CELLS - 1
    tried: np.ndarray       # uint32
    accepted: np.ndarray    # uint32, <= tried
    steps: int = 0          # the tokens-per-step delta: steps,
    tokens: int = 0         # and their tokens in all


def _frame(magic: bytes, version: int, model: str, origin: str, time: float, count: int,
           payload: bytes) -> bytes:
    m, o = model.encode(), origin.encode()
    if len(m) > MAX_NAME or len(o) > MAX_NAME:
        raise ValueError(f"model identity and origin must be at most {MAX_NAME} bytes")
    body = _HEAD.pack(magic, version, len(m), len(o), time, count) + m + o + payload
    return body + _CRC.pack(zlib.crc32(body))


def encode(model: str, origin: str, time: float, tokens: np.ndarray) -> bytes:
    """The bytes of one entry (`tokens`: int32 ids, as the proposer hands them out)."""
    return _frame(MAGIC, FORMAT_VERSION, model, origin, time, len(tokens),
                  np.ascontiguousarray(tokens, dtype="<i4").tobytes())


def encode_calibration(model: str, origin: str, time: float, cells, tried, accepted,
                       steps: int = 0, tokens: int = 0) -> bytes:
    """The bytes of one calibration entry (`take_calibration`'s five values)."""
    n = len(cells)
    if n > CAL_CELLS or len(tried) != n or len(accepted) != n:
        raise ValueError(f"a calibration entry holds at most {CAL_CELLS} cells, with as many "
                         f"counts")
    payload = (_STEPS.pack(steps, tokens) + np.ascontiguousarray(cells, dtype="<u2").tobytes()
               + np.ascontiguousarray(tried, dtype="<u4").tobytes()
               + np.ascontiguousarray(accepted, dtype="<u4").tobytes())
    return _frame(CAL_MAGIC, CAL_FORMAT_VERSION, model, origin, time, n, payload)


_STEPS = struct.Struct("<QQ")
#: Per kind: its format version, the payload's fixed bytes and its bytes per counted item.
_KINDS = {MAGIC: (FORMAT_VERSION, 0, 4), CAL_MAGIC: (CAL_FORMAT_VERSION, _STEPS.size, 10)}


def decode(blob, model: str, n_vocab: int | None = None):
    """The `Entry` or `CalibrationEntry` in `blob`, or `BadEntry` when it is corrupt (length,
    CRC, a token id out of 0 .. n_vocab - 1, a cell or count out of range) or foreign (another
    format version or model identity than `model`)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise BadEntry(f"not bytes: {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < _HEAD.size + _CRC.size or blob[:4] not in _KINDS:
        raise BadEntry("not a store-log entry (no NGSL or NGSC header)")
    magic, version, n_m, n_o, time, count = _HEAD.unpack_from(blob)
    want, fixed, item = _KINDS[magic]
    if version != want:
        raise BadEntry(f"{magic.decode()} format version {version}, this replica reads "
                       f"{want}", foreign=True)
    end = _HEAD.size + n_m + n_o + fixed + item * count
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
    at = _HEAD.size + n_m + n_o
    if magic == CAL_MAGIC:
        return _calibration(blob, at, count, who, origin, time)
    tokens = np.frombuffer(blob, dtype="<i4", count=count, offset=at).astype(np.int32)
    if count and (tokens.min() < 0 or (n_vocab is not None and tokens.max() >= n_vocab)):
        raise BadEntry(f"a token id out of 0 .. {'' if n_vocab is None else n_vocab - 1}")
    return Entry(who, origin, time, tokens)


def _calibration(blob: bytes, at: int, n: int, who: str, origin: str, time: float):
    if n > CAL_CELLS:
        raise BadEntry(f"{n} calibration cells, at most {CAL_CELLS}")
    steps, tokens = _STEPS.unpack_from(blob, at)
    at += _STEPS.size
    cells = np.frombuffer(blob, dtype="<u2", count=n, offset=at).astype(np.int32)
    tried = np.frombuffer(blob, dtype="<u4", count=n, offset=at + 2 * n).astype(np.uint32)
    acc = np.frombuffer(blob, dtype="<u4", count=n, offset=at + 6 * n).astype(np.uint32)
    if n and (cells.max() >= CAL_CELLS or tried.max() > 0x7FFFFFFF or (acc > tried).any()) \
            or steps > 1 << 40 or tokens > 4097 * steps:
        raise BadEntry("a calibration cell or count out of range")
    return CalibrationEntry(who, origin, time, cells, tried, acc, steps, tokens)

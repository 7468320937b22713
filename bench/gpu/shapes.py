"""Random-weight GGUF models of real shapes (Llama-3.2-1B, Llama-3.1-8B), for verify-cost curves.

What a decode of k tokens costs depends on the tensors' shapes and types, not on their values, so
a model with the shapes of Llama-3.1-8B and random weights gives the c(k, L) curve that users of
the real model get, without carrying 4-16 GB to the GPU machine. The file is streamed: every
tensor's bytes repeat one random block, so an 8 GB model is written at disk speed with a few MiB of
memory. Quantized tensors are written as blocks directly (a random fp16 scale per block and
random quants), no quantizer needed.

The vocabulary is a minimal SentencePiece one of the shape's size (llama.cpp's "llama" tokenizer:
unknown, BOS, EOS, the 256 byte tokens, then fillers): the calibration decodes token ids and
never tokenizes text. The bytes written follow GGUF version 3 (llama.cpp's gguf.h, ggml.h types);
the device kit cross-checks the header with llama.cpp's own gguf-py reader.

Usage: ``python bench/gpu/shapes.py SHAPE TYPE OUT.gguf`` (``--list`` names the shapes).
"""
from __future__ import annotations

import argparse
import struct
import sys
from dataclasses import dataclass
from typing import BinaryIO, Dict, List, Tuple

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32

# gguf.h value types
_UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = 4, 5, 6, 7, 8, 9

#: ggml type id, elements per block, bytes per block (ggml.h / ggml-common.h)
TYPES: Dict[str, Tuple[int, int, int]] = {
    "f32": (0, 1, 4),
    "f16": (1, 1, 2),
    "q4_0": (2, 32, 18),   # fp16 scale + 32 4-bit quants
    "q8_0": (8, 32, 34),   # fp16 scale + 32 int8 quants
}
#: llama.cpp's general.file_type (llama_ftype) of each weight type
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture shape (the fields of its config.json that llama.cpp reads)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied: bool            # output projection shared with the token embedding
    rope_theta: float = 500000.0


#: Published configurations (Meta's config.json of each model).
SHAPES: Dict[str, Shape] = {
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 8192, 128256, tied=True),
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 14336, 128256, tied=False),
    # the CPU dry run's stand-ins: same architecture, seconds to write and decode
    "tiny": Shape(64, 2, 4, 2, 128, 512, tied=True),
    "tiny-untied": Shape(64, 2, 4, 2, 128, 512, tied=False),
}


def tensors(shape: Shape, wtype: str) -> List[Tuple[str, Tuple[int, ...], str]]:
    """``(name, dims, type)`` of every tensor, dims in ggml order (innermost first), as
    llama.cpp's llama architecture names them."""
    e, ff = shape.n_embd, shape.n_ff
    kv = e // shape.n_head * shape.n_head_kv
    out = [("token_embd.weight", (e, shape.n_vocab), wtype)]
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,), "f32"),
                (b + "attn_q.weight", (e, e), wtype), (b + "attn_k.weight", (e, kv), wtype),
                (b + "attn_v.weight", (e, kv), wtype), (b + "attn_output.weight", (e, e), wtype),
                (b + "ffn_norm.weight", (e,), "f32"),
                (b + "ffn_gate.weight", (e, ff), wtype), (b + "ffn_up.weight", (e, ff), wtype),
                (b + "ffn_down.weight", (ff, e), wtype)]
    out.append(("output_norm.weight", (e,), "f32"))
    if not shape.tied:
        out.append(("output.weight", (e, shape.n_vocab), wtype))
    return out


def nbytes(dims: Tuple[int, ...], ttype: str) -> int:
    _, block, size = TYPES[ttype]
    n = int(np.prod(dims))
    if dims[0] % block:
        raise ValueError(f"a {ttype} tensor's rows need a multiple of {block} elements, got "
                         f"{dims[0]}")
    return n // block * size


def vocab(n_vocab: int) -> Tuple[List[bytes], List[int]]:
    """Token texts and llama_token_type values of a minimal SentencePiece vocabulary."""
    if n_vocab < 259 + 1:
        raise ValueError(f"a vocabulary needs >= 260 tokens (specials and bytes), got {n_vocab}")
    toks = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    types = [2, 3, 3] + [6] * 256      # UNKNOWN, CONTROL, CONTROL, BYTE
    toks += [f"\u2581t{i}".encode() for i in range(n_vocab - len(toks))]
    types += [1] * (n_vocab - len(types))  # NORMAL
    return toks, types


def _str(s) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, value) -> bytes:
    head = _str(key) + struct.pack("<I", vtype)
    if vtype == _STRING:
        return head + _str(value)
    if vtype == _ARRAY:
        etype, items = value
        body = struct.pack("<IQ", etype, len(items))
        if etype == _STRING:
            return head + body + b"".join(_str(x) for x in items)
        fmt = {_INT32: "i", _FLOAT32: "f"}[etype]
        return head + body + np.asarray(items, dtype=f"<{fmt}4").tobytes()
    fmt = {_UINT32: "<I", _INT32: "<i", _FLOAT32: "<f", _BOOL: "<?"}[vtype]
    return head + struct.pack(fmt, value)


def metadata(name: str, shape: Shape, wtype: str) -> List[bytes]:
    toks, types = vocab(shape.n_vocab)
    a = "llama."
    return [
        _kv("general.architecture", _STRING, "llama"),
        _kv("general.name", _STRING, f"{name} random weights (ngramspec bench/gpu/shapes.py)"),
        _kv("general.file_type", _UINT32, FILE_TYPE[wtype]),
        _kv("general.alignment", _UINT32, ALIGNMENT),
        _kv(a + "context_length", _UINT32, 131072),
        _kv(a + "embedding_length", _UINT32, shape.n_embd),
        _kv(a + "block_count", _UINT32, shape.n_layer),
        _kv(a + "feed_forward_length", _UINT32, shape.n_ff),
        _kv(a + "attention.head_count", _UINT32, shape.n_head),
        _kv(a + "attention.head_count_kv", _UINT32, shape.n_head_kv),
        _kv(a + "rope.freq_base", _FLOAT32, shape.rope_theta),
        _kv(a + "attention.layer_norm_rms_epsilon", _FLOAT32, 1e-5),
        _kv(a + "vocab_size", _UINT32, shape.n_vocab),
        _kv("tokenizer.ggml.model", _STRING, "llama"),
        _kv("tokenizer.ggml.tokens", _ARRAY, (_STRING, toks)),
        _kv("tokenizer.ggml.scores", _ARRAY, (_FLOAT32, [-float(i) for i in range(len(toks))])),
        _kv("tokenizer.ggml.token_type", _ARRAY, (_INT32, types)),
        _kv("tokenizer.ggml.unknown_token_id", _UINT32, 0),
        _kv("tokenizer.ggml.bos_token_id", _UINT32, 1),
        _kv("tokenizer.ggml.eos_token_id", _UINT32, 2),
    ]


def _block(ttype: str, n_bytes: int, rng: np.random.Generator) -> bytes:
    """``n_bytes`` (a whole number of blocks) of random, finite tensor data of ``ttype``."""
    _, block, size = TYPES[ttype]
    n_blocks = n_bytes // size
    if ttype == "f32":
        return np.ones(n_blocks, dtype="<f4").tobytes()   # norms: weight 1
    if ttype == "f16":
        return (rng.standard_normal(n_blocks) * 0.02).astype("<f2").tobytes()
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    # a block's scale, small and finite (random bytes could be an fp16 NaN or infinity)
    scale = rng.uniform(0.001, 0.004, size=n_blocks).astype("<f2")
    raw[:, :2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw.tobytes()


def _pad(n: int) -> int:
    return -n % ALIGNMENT


def write(path: str, name: str, wtype: str, *, seed: int = 0, chunk: int = 1 << 22) -> int:
    """Write the random-weight model ``name`` (a key of `SHAPES`) with weights of ``wtype``
    (``f16``, ``q8_0``, ``q4_0``) to ``path``; returns the file's size in bytes.

    Memory: one random block of about ``chunk`` bytes per tensor type (4 MiB), whatever the
    model's size."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {name!r}")
    if wtype not in FILE_TYPE or wtype == "f32":
        raise ValueError(f"type must be one of f16, q8_0, q4_0, got {wtype!r}")
    shape = SHAPES[name]
    rng = np.random.default_rng(seed)
    specs = tensors(shape, wtype)
    kvs = metadata(name, shape, wtype)
    infos, offset = [], 0
    for tname, dims, ttype in specs:
        infos.append(_str(tname) + struct.pack("<I", len(dims))
                     + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", TYPES[ttype][0], offset))
        offset += nbytes(dims, ttype)
        offset += _pad(offset)
    blocks = {}
    with open(path, "wb") as f:
        head = GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(specs), len(kvs))
        head += b"".join(kvs) + b"".join(infos)
        f.write(head + b"\0" * _pad(len(head)))
        for tname, dims, ttype in specs:
            n = nbytes(dims, ttype)
            if ttype not in blocks:
                size = TYPES[ttype][2]
                blocks[ttype] = _block(ttype, max(size, chunk // size * size), rng)
            _stream(f, blocks[ttype], n)
            f.write(b"\0" * _pad(n))
        return f.tell()


def _stream(f: BinaryIO, block: bytes, n: int) -> None:
    view = memoryview(block)
    while n:
        step = min(n, len(view))
        f.write(view[:step])
        n -= step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/gpu/shapes.py", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("shape", nargs="?", choices=SHAPES, help="model shape")
    ap.add_argument("type", nargs="?", choices=("f16", "q8_0", "q4_0"), help="weight type")
    ap.add_argument("out", nargs="?", help="GGUF file to write")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, s in SHAPES.items():
            print(f"{name}: {s}")
        return 0
    if not (args.shape and args.type and args.out):
        ap.error("SHAPE TYPE OUT are required")
    size = write(args.out, args.shape, args.type)
    print(f"{args.out}: {args.shape} {args.type}, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``ngramspec cache``: create, merge and inspect (``info``) llama.cpp n-gram cache files.

* ``cache create (--traces FILE | --text FILE --model GGUF) --output FILE`` builds a static
  cache (2-grams) as ``llama-lookup-create`` does, for ``--lookup-cache-static``.
* ``cache merge INPUT... --output FILE`` adds caches together as ``llama-lookup-merge`` does.
* ``cache info FILE`` prints what a cache holds.

Every error is one line on stderr and exit code 2 (`ngramspec.cli.main`).
"""
from __future__ import annotations

import os
import sys

import numpy as np

from ngramspec.cache_file import NGRAM_STATIC, build_static_cache, load_cache, save_cache
from ngramspec.cli.common import (Progress, add_model_flags, add_output_flag,
                                  add_progress_flags, check_model_file, check_writable, int_arg)
from ngramspec.files import open_regular
from ngramspec.llama.model import default_model_path, require_llama_cpp
from ngramspec.llama.tokenizer import tokenize_corpus
from ngramspec.traces import read_requests


def add_parser(subparsers):
    p = subparsers.add_parser(
        "cache", help="create, merge and inspect (info) llama.cpp n-gram cache files",
        description="llama.cpp n-gram cache files (--lookup-cache-static / --lookup-cache-dynamic "
                    "of ngram-cache).")
    sub = p.add_subparsers(dest="cache_command", required=True, metavar="{create,merge,info}")

    c = sub.add_parser(
        "create", help="build a static cache (2-grams), like llama-lookup-create",
        description="Count the 2-grams of a corpus into a static cache file, as llama.cpp's "
                    "llama-lookup-create does. With --traces, each request's prompt + output is "
                    "one sequence (no 2-gram spans two requests); with --text, the whole file is "
                    "tokenized with the GGUF model's tokenizer (needs llama-cpp-python).")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", metavar="FILE", help="trace file (.jsonl / .jsonl.gz)")
    src.add_argument("--text", metavar="FILE", help="UTF-8 text file (with --model)")
    add_model_flags(c, draft=False, help="model whose tokenizer --text uses")
    add_output_flag(c, required=True, help="cache file to write")
    c.add_argument("--skip", type=int_arg(0), default=0, metavar="N",
                   help="--traces: leave out the first N requests (default: %(default)s)")
    c.add_argument("--limit", type=int_arg(0), default=None, metavar="N",
                   help="--traces: use at most N requests (after --skip)")
    add_progress_flags(c)
    c.set_defaults(run=run)

    m = sub.add_parser(
        "merge", help="add cache files together, like llama-lookup-merge",
        description="Load the first cache and add the counts of every other one to it.")
    m.add_argument("inputs", nargs="+", metavar="INPUT", help="cache files")
    add_output_flag(m, required=True, help="cache file to write")
    add_progress_flags(m)
    m.set_defaults(run=run)

    i = sub.add_parser(
        "info", help="print what a cache file holds",
        description="Print a cache file's size, its n-grams by size (1..4), entries, total "
                    "count and approximate memory once loaded.")
    i.add_argument("file", metavar="FILE", help="cache file (llama.cpp's format, as "
                                                "--lookup-cache-static/-dynamic read it)")
    i.set_defaults(run=run)
    return p


def run(args) -> int:
    """Run ``ngramspec cache ...``; returns the exit code (errors: `ngramspec.cli.main`)."""
    if args.cache_command == "create":
        return _create(args)
    if args.cache_command == "merge":
        return _merge(args)
    return _info(args)


def _create(args) -> int:
    # Before any counting: a directory or unwritable folder is named as the --output given.
    check_writable("--output", args.output)
    if args.traces is not None:
        if args.model is not None:
            raise ValueError("--model is only used with --text")
        sequences = _trace_sequences(args.traces, args.skip, args.limit)
        label = f"cache create {os.path.basename(args.traces)}"
    else:
        if args.skip or args.limit is not None:
            raise ValueError("--skip/--limit apply to --traces only")
        sequences = _text_sequences(args.text, args.model)
        label = f"cache create {os.path.basename(args.text)}"
    n_tokens = sum(len(s) for s in sequences)
    ends = np.cumsum([len(s) for s in sequences]).tolist()
    with Progress(label, n_tokens, args.progress, unit="token") as progress:
        cache = build_static_cache(sequences, NGRAM_STATIC, lambda i: progress(ends[i - 1]))
    save_cache(cache, args.output)
    sys.stderr.write(f"{args.output}: {len(cache)} 2-grams, {cache.n_entries} entries from "
                     f"{len(sequences)} sequence(s), {n_tokens} tokens\n")
    return 0


def _trace_sequences(path, skip, limit):
    requests = read_requests(path, None if limit is None else skip + limit)[skip:]
    if not requests:
        raise ValueError(f"{path}: no requests to count")
    return [np.concatenate([r.prompt, r.output]) for r in requests]


# Hash the text in slices of this many tokens, so the progress bar moves.
_TEXT_CHUNK = 1 << 20


def _text_sequences(text_path, model_path):
    try:
        require_llama_cpp()
    except ImportError:
        raise ValueError("--text needs llama-cpp-python (pip install 'ngramspec[live]')") from None
    check_model_file("--model", model_path)
    if model_path is None:
        model_path = default_model_path()   # ModelNotFoundError says to pass --model
    with open_regular(text_path, "texts") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{text_path}: not UTF-8 text (byte {exc.start})") from None
    tokens = tokenize_corpus(model_path, data)
    # Slices overlapping by NGRAM_STATIC tokens give exactly the 2-grams of the whole text, in
    # the same insertion order as one pass (positions ascending).
    return [tokens[max(i - NGRAM_STATIC, 0):i + _TEXT_CHUNK]
            for i in range(0, max(len(tokens), 1), _TEXT_CHUNK)]


def _merge(args) -> int:
    check_writable("--output", args.output)
    with Progress("cache merge", len(args.inputs), args.progress, unit="file") as progress:
        cache = load_cache(args.inputs[0])
        progress(1)
        for i, path in enumerate(args.inputs[1:], 2):
            cache.merge(load_cache(path))
            progress(i)
    save_cache(cache, args.output)
    sys.stderr.write(f"{args.output}: {len(cache)} n-grams, {cache.n_entries} entries\n")
    return 0


def _info(args) -> int:
    cache = load_cache(args.file)
    by_size = [0] * 5
    total = 0
    for ngram, part in cache.items():
        by_size[len(ngram)] += 1
        total += sum(c for _, c in part)
    print(f"{args.file}: {os.path.getsize(args.file)} bytes")
    print(f"  n-grams     {len(cache):>12}  (by size 1..4: {', '.join(map(str, by_size[1:]))})")
    print(f"  entries     {cache.n_entries:>12}")
    print(f"  total count {total:>12}")
    print(f"  memory      {cache.memory_bytes():>12}  bytes (approx.)")
    return 0

"""Command-line pieces shared by the subcommands: llama-server's speculative flags."""
from __future__ import annotations

import argparse
import sys

from ngramspec.spec_types import REGISTRY

# Types whose parameters make no sense without a live model.
LIVE_ONLY = {"draft-simple"}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def add_spec_flags(parser: argparse.ArgumentParser, include_live: bool = False) -> None:
    """``--spec-type`` and every parameter flag of the registered spec types."""
    group = parser.add_argument_group("speculative decoding (llama-server flags)")
    group.add_argument("--spec-type", default="ngram-mod",
                       help="comma list of spec types, applied in llama.cpp's priority order "
                            "(default: %(default)s)")
    for spec in REGISTRY.values():
        if spec.name in LIVE_ONLY and not include_live:
            continue
        for p in spec.params:
            if p.kind is object:
                continue
            kind = p.kind if p.kind in (int, float) else str
            rng = ""
            if p.lo is not None:
                rng = f", {p.lo}..{p.hi}" if p.hi is not None else f", >= {p.lo}"
            group.add_argument(p.flag, dest=p.name, type=kind, default=None, metavar="N"
                               if kind is int else ("X" if kind is float else "FILE"),
                               help=f"{spec.name}: {p.help} (default {p.default}{rng})")


# The cache-file flags of ngram-cache (--lookup-cache-static / --lookup-cache-dynamic).
CACHE_FILE_PARAMS = ("lookup_cache_static", "lookup_cache_dynamic")


def load_cache_files(spec_type: str, params: dict) -> tuple:
    """Load the n-gram cache files given on the command line, once, before any model.

    Returns ``(spec_type, params)``: ``ngram-cache`` added to the type list if a cache file is
    given and it is absent, the paths in ``params`` replaced by the loaded `NgramCache` objects
    (every engine built from them shares them, e.g. one per request in ``--state fresh``). A
    dynamic file that does not exist yet is an empty cache (the first run starts it). A static
    file must exist. A corrupt or truncated file raises `CacheFileError` (a ValueError naming
    the file and the byte offset).
    """
    given = [name for name in CACHE_FILE_PARAMS if params.get(name) is not None]
    if not given:
        return spec_type, params
    from ngramspec._cache import NgramCache
    from ngramspec.cache_file import load_cache
    from ngramspec.spec_types import parse_types
    types = parse_types(spec_type)
    if "ngram-cache" not in types:
        spec_type = ",".join(parse_types(types + ["ngram-cache"]))
    params = dict(params)
    for name in given:
        path = params[name]
        try:
            params[name] = load_cache(path)
        except FileNotFoundError:
            if name != "lookup_cache_dynamic":
                raise FileNotFoundError(2, f"--{name.replace('_', '-')}: no such file",
                                        path) from None
            params[name] = NgramCache()
    return spec_type, params


def engine_params(args: argparse.Namespace) -> dict:
    """The engine keywords of the flags given on the command line."""
    params = {}
    for spec in REGISTRY.values():
        for p in spec.params:
            value = getattr(args, p.name, None)
            if value is not None:
                params[p.name] = value
    return params


def add_progress_flags(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (dest ``progress``: None = only on a terminal)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="draw the progress bar even when stderr is not a terminal")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="never draw the progress bar")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse turns the ValueError into a one-line error)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def add_policy_flags(parser: argparse.ArgumentParser, default: str) -> None:
    """``--spec-policy`` (auto | fixed) and ``--cost-model FILE|NAME``."""
    group = parser.add_argument_group("draft-length policy")
    group.add_argument("--spec-policy", choices=("auto", "fixed"), default=default,
                       help="auto: verify only the part of each draft expected to pay under the "
                            "verify-cost curve; fixed: llama.cpp's behaviour, the whole draft "
                            "(default: %(default)s)")
    group.add_argument("--cost-model", metavar="FILE|NAME", default=None,
                       help="verify-cost curve for --spec-policy auto: a JSON file of "
                            "`ngramspec calibrate --json`, or a profile: gpu, cpu-embedded, "
                            "local (this machine's cached calibration of the embedded model)")

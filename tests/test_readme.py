"""The README is tested: every fenced ```python and ```bash block runs, as written, in order.

How the blocks run (the README's "Contributing" section says the same for writers):

* In a sandbox: a temporary folder holding ``repo/`` (links to this checkout's files, so
  ``ngramspec/examples/...`` and ``bench/...`` resolve, while the files an example writes land
  in the sandbox), the current directory being ``repo/``. There is no ``../shared`` beside it
  and ``$NGRAMSPEC_SHARED`` names a missing folder, so every example runs as it would from a
  clone alone (the packaged samples of `ngramspec.examples`, not the full corpora).
  ``$NGRAMSPEC_CACHE_DIR`` is the test session's own, so the first ``--spec-policy auto`` run
  calibrates as it would for a new user.
* A ```bash block runs with ``bash -e -o pipefail``; a ```python block is written to a file and
  run with this interpreter. Each must exit with 0 within `BLOCK_TIMEOUT_S`.
* ``pip`` is a stand-in that installs nothing: it checks that what the command asks for (the
  project's extras, or named distributions) is installed in this environment, so an install
  command that names a missing extra or package fails here too.
* A block that starts ``ngramspec serve`` runs in the background until ``/health`` answers on
  its ``--port``; the server is stopped at the end of its ``##`` section, or when a later
  block of the section starts another one, so the blocks after it are its clients.
* A block preceded by ``<!-- not run in CI: REASON -->`` (the line just before its fence,
  blank lines allowed) is skipped with that reason: pytest lists every such block in its
  summary (``-ra``).
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from conftest import ROOT

README = ROOT / "README.md"
BLOCK_TIMEOUT_S = 600
SERVER_READY_S = 300
RUN_LANGS = ("python", "bash")
NOT_RUN = re.compile(r"^<!--\s*not run in CI:\s*(?P<reason>.*?)\s*-->$")


@dataclasses.dataclass
class Block:
    lang: str
    code: str
    line: int            # 1-based line of the opening fence
    section: str         # the enclosing "## " heading
    skip_reason: str | None

    @property
    def starts_server(self) -> bool:
        return self.lang == "bash" and re.search(r"\bngramspec serve\b", self.code) is not None

    @property
    def label(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        return f"README.md:{self.line} {self.lang}: {first.strip()[:60]}"


def extract_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text`` in a language of `RUN_LANGS`, in order.

    Raises
    ------
    ValueError
        A "not run in CI" marker without a reason or not followed by a code block, or an
        unclosed fence.
    """
    lines = text.splitlines()
    blocks, section, pending, i = [], "", None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        marker = NOT_RUN.match(line.rstrip())   # at the start of a line (not an indented sample)
        if marker:
            if not marker.group("reason"):
                raise ValueError(f"README.md:{i + 1}: 'not run in CI' marker without a reason")
            pending = (i + 1, marker.group("reason"))
        elif line.startswith("```"):
            lang = line[3:].strip()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ValueError(f"README.md:{i + 1}: unclosed code fence")
            if lang in RUN_LANGS:
                blocks.append(Block(lang, "\n".join(lines[i + 1:end]) + "\n", i + 1, section,
                                    pending[1] if pending else None))
            elif pending:
                raise ValueError(f"README.md:{pending[0]}: 'not run in CI' marker before a "
                                 f"```{lang} block, which is never run")
            pending = None
            i = end
        elif line.strip() and pending:
            raise ValueError(f"README.md:{pending[0]}: 'not run in CI' marker not followed by "
                             f"a code block")
        i += 1
    return blocks


BLOCKS = extract_blocks(README.read_text(encoding="utf-8"))

# pip's stand-in (see the module docstring). It reads the project's extras from the installed
# distribution's metadata, as pip would from pyproject.toml.
PIP_STANDIN = r'''
import sys
from importlib import metadata

from packaging.requirements import Requirement

PROJECT = "ngramspec"


def missing(name, extras, seen):
    """Requirements of distribution `name` with `extras` that are not installed."""
    if (name, extras) in seen:
        return []
    seen.add((name, extras))
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return [name]
    known = set(dist.metadata.get_all("Provides-Extra") or [])
    unknown = [e for e in extras if e not in known]
    if unknown:
        return [f"{name}[{e}] (no such extra; {name} has: {', '.join(sorted(known))})"
                for e in unknown]
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e})
                                              for e in extras):
            continue
        out += missing(req.name, tuple(sorted(req.extras)), seen)
    return out


args = sys.argv[1:]
if not args or args[0] != "install":
    sys.exit(f"pip (README test stand-in): only 'pip install' is checked, got {args}")
targets = [a for a in args[1:] if not a.startswith("-")]
if not targets:
    sys.exit("pip (README test stand-in): nothing to install")
gaps = []
for target in targets:
    if target == "." or target.startswith(".["):
        extras = tuple(sorted(filter(None, target[2:-1].split(",")))) if "[" in target else ()
        gaps += missing(PROJECT, extras, set())
    else:
        gaps += missing(Requirement(target).name, (), set())
if gaps:
    sys.exit("pip (README test stand-in): not installed: " + ", ".join(gaps))
'''


class Sandbox:
    """The folder the blocks run in, their environment, and the server a block started."""

    def __init__(self, base):
        self.repo = base / "repo"
        self.repo.mkdir()
        for entry in ROOT.iterdir():
            if entry.name not in (".git", ".venv") and not entry.name.startswith(".venv"):
                (self.repo / entry.name).symlink_to(entry)
        bin_dir = base / "bin"
        bin_dir.mkdir()
        pip = bin_dir / "pip"
        pip.write_text(f"#!{sys.executable}\n{PIP_STANDIN}")
        pip.chmod(0o755)
        self.env = dict(os.environ,
                        PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable),
                                              os.environ.get("PATH", "")]),
                        PYTHONUNBUFFERED="1", NGRAMSPEC_SHARED=str(base / "no-shared"))
        self.server: subprocess.Popen | None = None
        self.server_section = None
        self.server_log = base / "server.log"

    def run(self, block: Block) -> subprocess.CompletedProcess:
        if block.lang == "python":
            script = self.repo / f"readme_block_{block.line}.py"
            script.write_text(block.code)
            argv = [sys.executable, script.name]
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
        return subprocess.run(argv, cwd=self.repo, env=self.env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S)

    def start_server(self, block: Block) -> None:
        port = re.search(r"--port[ =](\d+)", block.code)
        port = int(port.group(1)) if port else 8080
        with socket.socket() as probe:   # /health must be our server's, not another's
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"{block.label}: port {port} is in use by another process; the "
                            f"README's server example needs it")
        log = open(self.server_log, "w")
        self.server = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block.code],
                                       cwd=self.repo, env=self.env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.server_section = block.section
        deadline = time.monotonic() + SERVER_READY_S
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                pytest.fail(f"{block.label}: the server exited with {self.server.returncode}:\n"
                            f"{self.server_log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200 and self.server.poll() is None:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        pytest.fail(f"{block.label}: /health did not answer within {SERVER_READY_S} s")

    def stop_server(self) -> None:
        if self.server is None:
            return
        if self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        self.server = self.server_section = None


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    box = Sandbox(tmp_path_factory.mktemp("readme"))
    yield box
    box.stop_server()


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_readme_block(block, sandbox):
    if sandbox.server is not None and sandbox.server_section != block.section:
        sandbox.stop_server()
    if block.skip_reason:
        pytest.skip(f"{block.label}: not run in CI: {block.skip_reason}")
    if block.starts_server:
        sandbox.stop_server()            # a later server example of a section replaces the first
        sandbox.start_server(block)
        return
    res = sandbox.run(block)
    assert res.returncode == 0, (
        f"{block.label} exited with {res.returncode}\n--- stdout ---\n{res.stdout[-4000:]}\n"
        f"--- stderr ---\n{res.stderr[-4000:]}")


def test_readme_has_runnable_blocks():
    # The harness would pass vacuously if the fences changed language or the parser broke.
    assert sum(b.skip_reason is None for b in BLOCKS) >= 10
    assert any(b.starts_server for b in BLOCKS)


def test_readme_examples_need_no_shared_corpora():
    # A clone has no ../shared: the examples use the samples of ngramspec/examples/ instead.
    # (The sandbox has none either, so a block that slips through fails; this names it first.)
    offenders = [b.label for b in BLOCKS if re.search(r"shared/|NGRAMSPEC_SHARED", b.code)]
    assert offenders == []


def test_markers_parse():
    text = textwrap.dedent("""\
        ## A
        <!-- not run in CI: needs a GPU -->

        ```bash
        nvidia-smi
        ```
        ```python
        print(1)
        ```
        ```text
        output
        ```
        ## B
        ```bash
        ngramspec serve --port 9
        ```
        """)
    blocks = extract_blocks(text)
    assert [(b.lang, b.section, b.skip_reason, b.starts_server) for b in blocks] == [
        ("bash", "A", "needs a GPU", False), ("python", "A", None, False),
        ("bash", "B", None, True)]
    with pytest.raises(ValueError, match="without a reason"):
        extract_blocks("<!-- not run in CI: -->\n```bash\nx\n```\n")
    with pytest.raises(ValueError, match="not followed by a code block"):
        extract_blocks("<!-- not run in CI: slow -->\ntext\n```bash\nx\n```\n")
    with pytest.raises(ValueError, match="never run"):
        extract_blocks("<!-- not run in CI: slow -->\n```text\nx\n```\n")
    with pytest.raises(ValueError, match="unclosed"):
        extract_blocks("```bash\nx\n")

"""llama.cpp's own llama-server, for side-by-side comparisons (bench only, never a dependency).

The binary is built from the llama.cpp that the installed llama-cpp-python vendors, so both
sides run the same ggml kernels on the same model file::

    bash bench/build_llama_server.sh          # -> bench/build/llama-server/bin/llama-server

`find_binary` looks at ``$NGRAMSPEC_LLAMA_SERVER``, then that build folder, then ``PATH``.

`LlamaServer` starts one process on 127.0.0.1 (a free port) with llama-server's own flags —
``--spec-type`` and the ``--spec-ngram-*`` flags are the same names ngramspec's registry uses, so
a configuration is written once (`spec_flags`) — and stops it on exit. `LlamaServer.generation`
measures one greedy generation the way ``bench/e2e_report.py`` measures ngramspec's:

- the prompt is processed first by a 1-token request (``cache_prompt``), so the measured request
  re-evaluates one prompt token and then generates: its cost is generation's, as on our side,
  where the clock starts at the first output token;
- CPU time: user + system time of the server process, all its threads (``/proc/PID/stat``),
  across the request. With ``-t 1`` ggml computes on the slot thread and the HTTP threads sleep, so this
  is the generation's own CPU time, which other jobs on a shared machine do not inflate — the
  counterpart of ``time.thread_time()`` of our decoding thread. With more threads it is the sum
  over the threadpool, so only the wall figure compares across thread counts;
- wall time: llama-server's own ``timings.predicted_ms``.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD_BINARY = ROOT / "bench" / "build" / "llama-server" / "bin" / "llama-server"
_TICK = os.sysconf("SC_CLK_TCK")


def find_binary(explicit: str | None = None) -> pathlib.Path | None:
    """The llama-server binary to use, or None when there is none (the comparison is skipped)."""
    for candidate in (explicit, os.environ.get("NGRAMSPEC_LLAMA_SERVER"), BUILD_BINARY,
                      shutil.which("llama-server")):
        if candidate and pathlib.Path(candidate).is_file():
            return pathlib.Path(candidate)
    return None


def spec_flags(spec_type: str | None, params: dict | None = None) -> list[str]:
    """llama-server's flags for an ngramspec configuration (spec types, engine keywords).

    The keywords are ngramspec.registry's, named after llama-server's flags, so the mapping is
    the registry's own; a keyword llama-server lacks (an ngramspec-only option) raises.
    """
    from ngramspec.registry import all_params

    if not spec_type:
        return []
    flags = ["--spec-type", spec_type]
    known = all_params()
    for name, value in (params or {}).items():
        p = known.get(name)
        if p is None or not p.cli:
            raise ValueError(f"{name}: not a llama-server flag")
        flags += [p.flag, str(value)]
    return flags


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads together (those that
    have ended included: ``/proc/PID/stat`` sums them). Any server: llama-server or
    ``ngramspec serve``."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK      # utime, stime (fields 14, 15)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Generation:
    """One measured greedy generation on llama-server."""
    tokens: list            # the generated token ids
    cpu_s: float            # CPU seconds of the server process across the request
    wall_s: float           # llama-server's timings.predicted_ms / 1000
    draft_n: int            # drafted tokens (timings.draft_n; 0 without speculation)
    draft_n_accepted: int

    @property
    def tokens_per_cpu_s(self) -> float:
        return len(self.tokens) / self.cpu_s if self.cpu_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")


class LlamaServer:
    """A llama-server process for the duration of a ``with`` block.

    Parameters
    ----------
    binary : path
        The llama-server executable (`find_binary`).
    model : path
        GGUF file (the same one ngramspec loads).
    threads, ctx_size, slots : int
        ``-t``, ``-c`` (the whole context; llama-server gives each of ``-np`` slots an equal
        share) and ``-np``.
    flags : list of str
        More flags, e.g. `spec_flags` or ``["--no-repack"]`` on AMX hosts.
    batch_size : int
        ``-b``/``-ub``; ngramspec's live driver decodes prompts in batches of this size too.

    Notes
    -----
    Thread-safety: `complete` and `generation` may be called from several threads at once (one
    httpx client per call); starting and stopping belong to the thread that owns the block.
    """

    def __init__(self, binary, model, *, threads: int = 1, ctx_size: int = 4096,
                 slots: int = 1, flags=(), batch_size: int = 512, log_path=None):
        self.binary = pathlib.Path(binary)
        self.port = _free_port()
        self.argv = [str(self.binary), "-m", str(model), "-t", str(threads), "-tb",
                     str(threads), "-c", str(ctx_size), "-np", str(slots), "-b",
                     str(batch_size), "-ub", str(batch_size), "--host", "127.0.0.1", "--port",
                     str(self.port), "--no-webui", "--metrics", *flags]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): "
                                   f"{' '.join(self.argv)}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise TimeoutError(f"llama-server did not become healthy: {' '.join(self.argv)}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of every thread of the server so far."""
        return proc_cpu_seconds(self.proc.pid)

    def complete(self, prompt, n_predict: int, *, id_slot: int = -1, timeout: float = 600,
                 **fields) -> dict:
        """One greedy ``/completion`` (token ids or text), llama-server's response JSON."""
        body = {"prompt": list(map(int, prompt)) if not isinstance(prompt, str) else prompt,
                "n_predict": int(n_predict), "temperature": 0.0, "top_k": 1,
                "cache_prompt": True, "return_tokens": True, "id_slot": id_slot, **fields}
        r = httpx.post(self.base_url + "/completion", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def generation(self, prompt, n_predict: int) -> Generation:
        """A measured greedy generation after the prompt was processed (module docstring)."""
        self.complete(prompt, 1, id_slot=0)
        cpu0 = self.cpu_seconds()
        out = self.complete(prompt, n_predict, id_slot=0)
        cpu = self.cpu_seconds() - cpu0
        t = out.get("timings", {})
        return Generation(tokens=list(out.get("tokens", [])), cpu_s=cpu,
                          wall_s=float(t.get("predicted_ms", float("nan"))) / 1000.0,
                          draft_n=int(t.get("draft_n", 0)),
                          draft_n_accepted=int(t.get("draft_n_accepted", 0)))

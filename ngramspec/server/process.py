"""``ngramspec serve`` in a child process, for tests, benchmarks and scripts.

Notes
-----
Thread-safety: one `ServerProcess` per server; ``stop`` may be called from any thread once.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Optional


class ServerProcess:
    """``python -m ngramspec serve --port 0 ARGS`` started and waited for (``/health`` is 200).

    Parameters
    ----------
    *args : str
        Further ``serve`` flags.
    timeout : float
        Seconds to wait for the model to load and the server to answer.
    cwd : str, optional
        Working directory (and ``PYTHONPATH`` head) of the child: an uninstalled checkout.

    Attributes
    ----------
    url : str
        ``http://127.0.0.1:PORT`` (the port the server bound).
    proc : subprocess.Popen

    Raises
    ------
    RuntimeError
        The server exited or did not answer in time; the message holds its output.

    Notes
    -----
    Memory: the child holds the model; its output goes to a temporary file (``output()``).

    Thread-safety: one thread drives it; ``stop`` may be called from any thread once.
    """

    def __init__(self, *args: str, timeout: float = 120.0, cwd: Optional[str] = None):
        self._log = tempfile.NamedTemporaryFile("w+", prefix="ngramspec-serve-", suffix=".log")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cwd is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ngramspec", "serve", "--port", "0", *map(str, args)],
            cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.url: Optional[str] = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = self.output()
            if self.url is None and "listening on " in text:
                self.url = text.split("listening on ", 1)[1].split()[0]
            if self.url is not None and self._healthy():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ngramspec serve did not start:\n{self.output()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def output(self) -> str:
        """Everything the server printed so far."""
        with open(self._log.name, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """Stop the server: SIGTERM (graceful shutdown), SIGKILL after `timeout` seconds.

        Parameters
        ----------
        timeout : float

        Returns
        -------
        int or None
            The exit code.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

"""A throwaway ``redis-server`` for the store-log tests: a free loopback port, no persistence
(``--save '' --appendonly no``), stopped (and restartable on the same port) by the test.

Without ``redis-server`` (or the ``redis`` client) the tests skip with the reason, except in CI
(``CI=true``), where they fail: CI installs both (.ci/run)."""
import os
import shutil
import socket
import subprocess
import time

import pytest


def require_redis():
    """The ``redis`` client module; skip (fail under CI=true) when it or the server is missing."""
    missing = []
    if shutil.which("redis-server") is None:
        missing.append("redis-server (apt-get install redis-server)")
    try:
        import redis
    except ImportError:
        redis = None
        missing.append("the redis client (pip install 'ngramspec[store]')")
    if missing:
        reason = "the Redis store-log tests need " + " and ".join(missing)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason, allow_module_level=True)
    return redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; `stop` kills it (SIGKILL: a crash), `start` brings it back on
    the same port, empty."""

    def __init__(self, tmp_path):
        self.port = free_port()
        self.dir = tmp_path
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

"""A full queue answers 503 and SIGTERM stops the server within seconds, answering what runs (a
1-slot server of its own)."""
import signal
import threading
import time

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servertools import Server, wait_for  # noqa: E402


def test_full_queue_is_503_and_sigterm_stops_within_seconds():
    srv = Server("-c", "1024", "-np", "1", "--queue-size", "1", "--spec-type", "none",
                 "--timeout-graceful-shutdown", "1")
    try:
        body = {"prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True}
        done = {}

        def post(name, stream):
            try:
                with httpx.stream("POST", srv.url + "/v1/completions",
                                  json={**body, "stream": stream}, timeout=60) as r:
                    done[name] = (r.status_code, list(r.iter_lines()))
            except httpx.HTTPError as exc:
                done[name] = exc

        running = threading.Thread(target=post, args=("running", True))
        running.start()
        assert wait_for(lambda: httpx.get(srv.url + "/health").json()["slots_processing"] == 1)
        queued = threading.Thread(target=post, args=("queued", False))
        queued.start()
        assert wait_for(lambda: httpx.get(srv.url + "/health").json()["queue_length"] == 1)
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_full"

        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(20)
        elapsed = time.monotonic() - t0
        running.join(10)
        queued.join(10)
        assert rc == 0, srv.output()
        assert elapsed < 15, elapsed
        assert "Application shutdown complete" in srv.output()
        # Both requests got an answer or a closed connection, none hangs.
        assert set(done) == {"running", "queued"}
    finally:
        srv.stop()

"""OpenAI Batch API files on the scheduler (``ngramspec run-batch``), resumable.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` or ``/v1/completions``; each output line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. The bodies
are the server's own: every request goes through the app `create_app` builds (in process, no
socket), so validation, the error bodies, ``usage`` and ``timings`` are exactly what ``serve``
answers. Enough requests are in flight to keep every slot busy.

Resuming: custom_ids already in the output are skipped; each result is one line appended and
flushed, so a crash or Ctrl-C loses only the requests in flight (a line cut by ``kill -9``
mid-write is dropped on the next run) and a rerun completes the file without a duplicate.

A bad line (not JSON, no custom_id, an unknown url or method, a body the server refuses)
becomes that line's error and the batch goes on; duplicate custom_ids are refused before any
request runs. Lines without a usable custom_id are reported with ``custom_id: null`` and
``error.line`` (1-based), which is what a rerun skips them by.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Optional, Set, Tuple, Union

import httpx     # the serve extra's: requests go through the app in process (ASGI)

__all__ = ["BatchSummary", "URLS", "read_done", "run_batch", "scan_input"]

URLS = ("/v1/chat/completions", "/v1/completions")
#: Requests kept in flight per slot: the next one waits in the scheduler's queue, so a slot
#: that finishes is refilled at the next step.
IN_FLIGHT_PER_SLOT = 2


@dataclass
class BatchSummary:
    """What a run did (the summary line's figures).

    Attributes
    ----------
    lines : int
        Input lines.
    skipped : int
        Lines whose result the output already held.
    done, errors : int
        Lines answered by this run, and how many of them are errors.
    failed : int
        Requests the server failed (HTTP 5xx): not written, a rerun tries them again.
    prompt_tokens, completion_tokens : int
        Over this run's successful requests.
    seconds : float
        Wall time of this run's requests.
    n_draft_tokens, n_acc_tokens : int
        Drafted tokens verified and accepted (every proposer, the predictions included).
    accepted_prediction_tokens, rejected_prediction_tokens : int
        Predicted Outputs' counts summed over the requests that gave a prediction.
    """

    lines: int = 0
    skipped: int = 0
    done: int = 0
    errors: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    n_draft_tokens: int = 0
    n_acc_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    proposers: Dict[str, dict] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary ``run-batch`` prints."""
        acc = (f"{self.n_acc_tokens}/{self.n_draft_tokens} draft tokens accepted "
               f"({self.n_acc_tokens / self.n_draft_tokens:.1%})"
               if self.n_draft_tokens else "no drafts")
        pred = ""
        if self.accepted_prediction_tokens or self.rejected_prediction_tokens:
            pred = (f", prediction tokens {self.accepted_prediction_tokens} accepted / "
                    f"{self.rejected_prediction_tokens} rejected")
        failed = f", {self.failed} failed (rerun to retry)" if self.failed else ""
        return (f"{self.lines} lines: {self.done} done ({self.errors} errors), {self.skipped} "
                f"already in the output{failed}; {self.prompt_tokens} prompt + {self.completion_tokens} "
                f"completion tokens in {self.seconds:.1f} s ({self.tokens_per_s:.1f} tokens/s); "
                f"{acc}{pred}")


def _line_error(code: str, message: str, line: int, param: Optional[str] = None) -> dict:
    # OpenAI's BatchError shape (code, message, param, line)
    return {"code": code, "message": message, "param": param, "line": line}


def _parse(text: str, lineno: int) -> Tuple[Optional[str], Union[dict, None], Optional[dict]]:
    """``(custom_id, request, error)`` of one input line; custom_id None when unusable."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return None, None, _line_error("invalid_json", f"line {lineno} is not JSON: {exc}",
                                       lineno)
    if not isinstance(obj, dict):
        return None, None, _line_error("invalid_request", f"line {lineno} is not a JSON object",
                                       lineno)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, None, _line_error("invalid_request", f"line {lineno}: custom_id must be a "
                                       "non-empty string", lineno, "custom_id")
    if obj.get("method", "POST") != "POST":
        return cid, None, _line_error("invalid_request", f"method {obj.get('method')!r} is not "
                                      "allowed: POST", lineno, "method")
    if obj.get("url") not in URLS:
        return cid, None, _line_error("invalid_url", f"url {obj.get('url')!r} is not allowed: "
                                      f"{' or '.join(URLS)}", lineno, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return cid, None, _line_error("invalid_request", "body must be a JSON object", lineno,
                                      "body")
    if body.get("stream"):
        return cid, None, _line_error("invalid_request", "stream is not supported in a batch",
                                      lineno, "body.stream")
    return cid, obj, None


def _lines(path: str) -> Iterator[Tuple[int, str]]:
    with open(path, encoding="utf-8-sig") as fh:
        for lineno, text in enumerate(fh, 1):
            if text.strip():
                yield lineno, text


def scan_input(path: str) -> int:
    """Check the input before any work: returns its number of (non-blank) lines.

    Raises
    ------
    ValueError
        A custom_id appears twice (both line numbers named).
    OSError
        The file cannot be read.
    """
    seen: Dict[str, int] = {}
    n = 0
    for lineno, text in _lines(path):
        n += 1
        cid, _, _ = _parse(text, lineno)
        if cid is None:
            continue
        if cid in seen:
            raise ValueError(f"-i {path}: custom_id {cid!r} appears on lines {seen[cid]} and "
                             f"{lineno}: custom_ids must be unique")
        seen[cid] = lineno
    return n


def read_done(path: str) -> Tuple[Set[str], Set[int]]:
    """The custom_ids (and line numbers of id-less lines) an existing output already holds.

    A last line without its newline (a write cut by a crash) is removed from the file.

    Raises
    ------
    ValueError
        A complete line that is not a result line (``-o`` names some other file).
    """
    ids: Set[str] = set()
    lines: Set[int] = set()
    if not os.path.exists(path):
        return ids, lines
    with open(path, "rb+") as fh:
        data = fh.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            fh.truncate(end)
    for n, raw in enumerate(data[:end].splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            cid = obj["custom_id"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"-o {path}: line {n} is not a batch result line; is it the "
                             "output of another command?") from None
        if cid is None:
            line = (obj.get("error") or {}).get("line")
            if isinstance(line, int):
                lines.add(line)
        else:
            ids.add(cid)
    return ids, lines


class _Writer:
    """Appends whole result lines and flushes each."""

    def __init__(self, path: str):
        self._fh = open(path, "ab")

    def write(self, obj: dict) -> None:
        self._fh.write(json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _result(cid, response=None, error=None) -> dict:
    return {"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": cid,
            "response": response, "error": error}


async def _run(app, scheduler_stats, input_path, writer, done_ids, done_lines, summary,
               in_flight, progress):
    transport = httpx.ASGITransport(app=app)
    sem = asyncio.Semaphore(in_flight)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                 timeout=None) as client, app.router.lifespan_context(app):
        before = scheduler_stats()

        async def one(cid, req):
            try:
                r = await client.post(req["url"], json=req["body"])
                body = r.json()
                error = None
                if r.status_code != 200:
                    err = body.get("error") or {}
                    error = {"code": err.get("code") or err.get("type") or "error",
                             "message": err.get("message", ""), "param": err.get("param"),
                             "line": None}
                else:
                    usage = body.get("usage") or {}
                    summary.prompt_tokens += usage.get("prompt_tokens", 0)
                    summary.completion_tokens += usage.get("completion_tokens", 0)
                    details = usage.get("completion_tokens_details") or {}
                    summary.accepted_prediction_tokens += \
                        details.get("accepted_prediction_tokens", 0)
                    summary.rejected_prediction_tokens += \
                        details.get("rejected_prediction_tokens", 0)
                if r.status_code >= 500:
                    # the server's failure, not the line's (busy, shutting down): not written,
                    # so that a rerun tries the line again
                    summary.failed += 1
                    return
                response = {"status_code": r.status_code, "request_id": uuid.uuid4().hex,
                            "body": body}
                writer.write(_result(cid, response, error))
                summary.done += 1
                summary.errors += error is not None
                progress(summary.done, None)
            finally:
                sem.release()

        tasks = set()
        for lineno, text in _lines(input_path):
            cid, req, error = _parse(text, lineno)
            if _done(cid, lineno, done_ids, done_lines):
                continue
            if error is not None:
                writer.write(_result(cid, None, error))
                summary.done += 1
                summary.errors += 1
                progress(summary.done, None)
                continue
            await sem.acquire()
            task = asyncio.ensure_future(one(cid, req))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        after = scheduler_stats()
    summary.seconds = time.perf_counter() - t0
    summary.n_draft_tokens = after["n_draft_tokens"] - before["n_draft_tokens"]
    summary.n_acc_tokens = after["n_acc_tokens"] - before["n_acc_tokens"]
    summary.proposers = after["proposers"]


def run_batch(app, scheduler, input_path: str, output_path: str, *,
              progress: Optional[Callable[[int, Optional[int]], None]] = None) -> BatchSummary:
    """Answer every request of ``input_path`` not yet in ``output_path``, appending results.

    Parameters
    ----------
    app : fastapi.FastAPI
        The app of `ngramspec.server.create_app` (its lifespan starts and stops the schedulers).
    scheduler : Scheduler
        The app's main scheduler (its slots size the requests in flight; its statistics give
        the summary's draft counts).
    input_path, output_path : str
        The Batch API input file; the output file (created, or completed when it exists).
    progress : callable(done, total), optional
        Called with the count of lines answered so far (``total`` the lines left, first call).

    Returns
    -------
    BatchSummary

    Raises
    ------
    ValueError
        Duplicate custom_ids in the input, an output file that is not a result file.

    Notes
    -----
    Memory: the custom_ids of the input and the output, and the requests in flight
    (``2 * n_slots``); the files are streamed.

    Thread-safety: one call at a time per output file (nothing locks it).
    """
    n_lines = scan_input(input_path)
    done_ids, done_lines = read_done(output_path)
    summary = BatchSummary(lines=n_lines)
    summary.skipped = sum(1 for lineno, text in _lines(input_path)
                          if _done(_parse(text, lineno)[0], lineno, done_ids, done_lines))
    progress = progress or (lambda done, total: None)
    progress(0, n_lines - summary.skipped)
    writer = _Writer(output_path)
    try:
        asyncio.run(_run(app, scheduler.stats, input_path, writer, done_ids, done_lines,
                         summary, IN_FLIGHT_PER_SLOT * scheduler.n_slots, progress))
    finally:
        writer.close()
    return summary


def _done(cid, lineno, done_ids, done_lines) -> bool:
    return cid in done_ids if cid is not None else lineno in done_lines

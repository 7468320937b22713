"""OpenAI Batch API files on the scheduler (``ngramspec run-batch``), resumable.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` or ``/v1/completions``; each output line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. The bodies
are the server's own: every request goes through the app `create_app` builds (in process, no
socket), so validation, the error bodies, ``usage`` and ``timings`` are exactly what ``serve``
answers. Enough requests are in flight to keep every slot busy.

Resuming: custom_ids already in the output are skipped; each result is one line appended in
one write, so a crash or Ctrl-C loses only the requests in flight (a line cut by ``kill -9``
mid-write is dropped on the next run) and a rerun completes the file without a duplicate. The
output is only ever this command's (`ngramspec.server.batch_files.ResultFile`: locked for the
run, checked line by line before anything in it changes); a failed write (a full disk) stops
the run with one error, the requests in flight cancelled.

A bad line (not UTF-8, not JSON or nested too deeply, longer than the body limit, no
custom_id, an unknown url or method, a body the server refuses) becomes that line's error, its
``line`` (1-based) always set, and the batch goes on; duplicate custom_ids are refused before
any request runs. Lines without a usable custom_id are reported with ``custom_id: null``, which
is what a rerun skips them by (their line number).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, Union

import httpx     # the serve extra's: requests go through the app in process (ASGI)

from ngramspec.files import open_regular
from ngramspec.server.batch_files import LineTooLong, ResultFile, request_lines
from ngramspec.server.limits import MAX_BODY_SIZE
from ngramspec.stats import DraftCounts
from ngramspec.validation import check_int

__all__ = ["BatchFiles", "BatchSummary", "URLS", "open_batch", "run_batch", "scan_input"]

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
    counts : DraftCounts
        This run's draft counts (`ngramspec.stats`): the scheduler's (`Backend.stats`) draft
        tokens verified and accepted, every proposer and the predictions included;
        ``n_draft_tokens`` / ``n_acc_tokens`` read them.
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
    counts: DraftCounts = field(default_factory=DraftCounts)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    proposers: Dict[str, dict] = field(default_factory=dict)

    n_draft_tokens = property(lambda self: self.counts.n_draft_tokens)
    n_acc_tokens = property(lambda self: self.counts.n_acc_tokens)

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


def _decode(raw, lineno: int, max_line: int):
    """``(object, error)`` of one input line's bytes (`request_lines`' item)."""
    if isinstance(raw, LineTooLong):
        return None, _line_error("request_too_large", f"line {lineno} ({raw.size} bytes) is "
                                 f"longer than the limit of {max_line} bytes (--max-body-size)",
                                 lineno)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, _line_error("invalid_json", f"line {lineno} is not UTF-8 text (byte "
                                 f"{exc.start + 1} of the line)", lineno)
    try:
        return json.loads(text), None
    except ValueError as exc:
        # the line has no newline: JSON's own position is a column of it
        where = f" (column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else " ".join(str(exc).split()[:12])
        return None, _line_error("invalid_json", f"line {lineno} is not JSON: {msg}{where}",
                                 lineno)
    except RecursionError:
        return None, _line_error("invalid_json", f"line {lineno} is not JSON this reader "
                                 "takes: nested too deeply", lineno)


def _parse(raw, lineno: int,
           max_line: int) -> Tuple[Optional[str], Union[dict, None], Optional[dict]]:
    """``(custom_id, request, error)`` of one input line; custom_id None when unusable."""
    obj, error = _decode(raw, lineno, max_line)
    if error is not None:
        return None, None, error
    if not isinstance(obj, dict):
        return None, None, _line_error("invalid_request", f"line {lineno} is not a JSON object",
                                       lineno)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, None, _line_error("invalid_request", f"line {lineno}: custom_id must be a "
                                       "non-empty string", lineno, "custom_id")
    if obj.get("method", "POST") != "POST":
        return cid, None, _line_error("invalid_request", f"line {lineno}: method "
                                      f"{obj.get('method')!r} is not allowed: POST", lineno,
                                      "method")
    if obj.get("url") not in URLS:
        return cid, None, _line_error("invalid_url", f"line {lineno}: url {obj.get('url')!r} is "
                                      f"not allowed: {' or '.join(URLS)}", lineno, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return cid, None, _line_error("invalid_request", f"line {lineno}: body must be a JSON "
                                      "object", lineno, "body")
    if body.get("stream"):
        return cid, None, _line_error("invalid_request", f"line {lineno}: stream is not "
                                      "supported in a batch", lineno, "body.stream")
    return cid, obj, None


def scan_input(path: str, output: Optional[ResultFile] = None,
               max_line: int = MAX_BODY_SIZE) -> Tuple[int, int]:
    """Check the input before any work, streamed: ``(non-blank lines, lines the output
    already answers)``.

    Raises
    ------
    ValueError
        A custom_id appears twice (both line numbers named).
    OSError
        The file cannot be read (a FIFO or device is refused).
    """
    seen: Dict[str, int] = {}
    n = skipped = 0
    for lineno, raw in request_lines(path, max_line):
        n += 1
        cid, _, _ = _parse(raw, lineno, max_line)
        skipped += output is not None and output.is_done(cid, lineno)
        if cid is None:
            continue
        if cid in seen:
            raise ValueError(f"-i {path}: custom_id {cid!r} appears on lines {seen[cid]} and "
                             f"{lineno}: custom_ids must be unique")
        seen[cid] = lineno
    return n, skipped


def _result(cid, response=None, error=None) -> dict:
    return {"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": cid,
            "response": response, "error": error}


class BatchFiles:
    """A batch ready to run: its input checked, its output (`ResultFile`) locked and read.

    Made by `open_batch`; a context manager that releases the output's lock.

    Attributes
    ----------
    input_path : str
    output : ResultFile
    lines, skipped : int
        The input's non-blank lines, and how many of them the output already answers.
    max_line : int
        Longest input line in bytes (``--max-body-size``); a longer one is that line's error.

    Notes
    -----
    Thread-safety: one run at a time (the output's lock keeps other processes off it).
    """

    def __init__(self, input_path: str, output: ResultFile, lines: int, skipped: int,
                 max_line: int):
        self.input_path, self.output = input_path, output
        self.lines, self.skipped, self.max_line = lines, skipped, max_line

    def close(self) -> None:
        self.output.close()

    def __enter__(self) -> "BatchFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_batch(input_path: str, output_path: str,
               max_line: int = MAX_BODY_SIZE) -> BatchFiles:
    """Check a batch's two files before any model loads; nothing in the output changes.

    Parameters
    ----------
    input_path, output_path : str
        The Batch API input (``-i``), the results (``-o``; created when missing, completed when
        it holds this command's results).
    max_line : int
        The server's body limit (``--max-body-size``) applied to each input line.

    Returns
    -------
    BatchFiles
        With the output locked until it is closed.

    Raises
    ------
    ValueError
        Duplicate custom_ids in the input; an output that is the input, that another run holds,
        or that is not a result file.
    OSError
        A file cannot be read or opened (a FIFO or device is refused).
    """
    check_int("--max-body-size", max_line, 1)
    try:
        open_regular(input_path, "batch requests").close()  # before the output is created
    except OSError as exc:
        raise _named("-i", input_path, exc) from None
    try:
        output = ResultFile(output_path, input_path)
    except OSError as exc:
        raise _named("-o", output_path, exc) from None
    try:
        lines, skipped = scan_input(input_path, output, max_line)
    except BaseException:
        output.close()
        raise
    return BatchFiles(input_path, output, lines, skipped, max_line)


def _named(flag: str, path: str, exc: OSError) -> OSError:
    """``exc`` (the same type and errno) with a message naming the flag and the file."""
    return type(exc)(exc.errno, f"{flag} {path}: {exc.strerror or exc}")


def _record(batch: BatchFiles, summary: BatchSummary, progress, result: dict) -> None:
    """Write one result line and count it (nothing once a write failed)."""
    if batch.output.write(result):
        summary.done += 1
        summary.errors += result["error"] is not None
        progress(summary.done, None)


def _outcome(r, lineno: int, summary: BatchSummary):
    """``(response, error)`` of the app's answer to one line (the usage counted)."""
    body = r.json()
    error = None
    if r.status_code != 200:
        err = body.get("error") or {}
        error = {"code": err.get("code") or err.get("type") or "error",
                 "message": err.get("message", ""), "param": err.get("param"), "line": lineno}
    else:
        usage = body.get("usage") or {}
        summary.prompt_tokens += usage.get("prompt_tokens", 0)
        summary.completion_tokens += usage.get("completion_tokens", 0)
        details = usage.get("completion_tokens_details") or {}
        summary.accepted_prediction_tokens += details.get("accepted_prediction_tokens", 0)
        summary.rejected_prediction_tokens += details.get("rejected_prediction_tokens", 0)
    return {"status_code": r.status_code, "request_id": uuid.uuid4().hex, "body": body}, error


async def _run(app, scheduler_stats, batch: BatchFiles, summary, in_flight, progress):
    transport = httpx.ASGITransport(app=app)
    sem = asyncio.Semaphore(in_flight)
    output = batch.output
    t0 = time.perf_counter()
    async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                 timeout=None) as client, app.router.lifespan_context(app):
        before = scheduler_stats()

        async def one(cid, req, lineno):
            try:
                r = await client.post(req["url"], json=req["body"])
                if r.status_code >= 500:
                    # the server's failure, not the line's (busy, shutting down): not written,
                    # so that a rerun tries the line again
                    summary.failed += 1
                    return
                response, error = _outcome(r, lineno, summary)
                _record(batch, summary, progress, _result(cid, response, error))
            finally:
                sem.release()

        tasks = set()
        for lineno, raw in request_lines(batch.input_path, batch.max_line):
            cid, req, error = _parse(raw, lineno, batch.max_line)
            if output.is_done(cid, lineno):
                continue
            if error is None:
                await sem.acquire()
            if output.error is not None:
                break           # the disk is full: nothing more can be written
            if error is not None:
                _record(batch, summary, progress, _result(cid, None, error))
                continue
            task = asyncio.ensure_future(one(cid, req, lineno))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if output.error is not None:
            for task in tasks:      # their results could not be written either
                task.cancel()
        # every task's exception retrieved here (none is left for the loop to print)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        after = scheduler_stats()
    failures = [x for x in outcomes if isinstance(x, BaseException)
                and not isinstance(x, asyncio.CancelledError)]
    if failures:
        raise failures[0]
    summary.seconds = time.perf_counter() - t0
    summary.counts = DraftCounts.of(after).minus(DraftCounts.of(before))
    summary.proposers = after["proposers"]


def run_batch(app, scheduler, batch: BatchFiles, *,
              progress: Optional[Callable[[int, Optional[int]], None]] = None) -> BatchSummary:
    """Answer every request of the batch's input not yet in its output, appending results.

    Parameters
    ----------
    app : fastapi.FastAPI
        The app of `ngramspec.server.create_app` (its lifespan starts and stops the schedulers).
    scheduler : ngramspec.backend.Backend
        The app's main scheduler (its slots size the requests in flight; its statistics give
        the summary's draft counts).
    batch : BatchFiles
        The checked input and the locked output (`open_batch`).
    progress : callable(done, total), optional
        Called with the count of lines answered so far (``total`` the lines left, first call).

    Returns
    -------
    BatchSummary

    Raises
    ------
    OSError
        A result could not be written (a full disk): one error naming ``-o``, after the
        requests in flight were cancelled; the lines written stay, a rerun completes the file.

    Notes
    -----
    Memory: the custom_ids of the input and the output, and the requests in flight
    (``2 * n_slots``); the files are streamed, one line at a time.

    Thread-safety: one call at a time per batch; `open_batch`'s lock keeps other runs off the
    output.
    """
    summary = BatchSummary(lines=batch.lines, skipped=batch.skipped)
    progress = progress or (lambda done, total: None)
    progress(0, batch.lines - batch.skipped)
    batch.output.start()
    asyncio.run(_run(app, scheduler.stats, batch, summary, IN_FLIGHT_PER_SLOT * scheduler.n_slots,
                     progress))
    error = batch.output.error
    if error is not None:
        raise OSError(error.errno, f"-o {batch.output.path}: cannot write a result: "
                                   f"{error.strerror or error}; {summary.done} results of this "
                                   "run were written, rerun to complete the file")
    return summary

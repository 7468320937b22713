"""Request logs as `traces.Request` lists: token traces, OpenAI-style chat logs, text pairs.

Three JSONL formats (``.gz`` too), one request per line:

* **trace**: ngramspec's token traces (``prompt`` and ``output`` lists of token ids), read by
  `ngramspec.traces.read_requests`, exactly as ``replay`` reads them.
* **chat**: OpenAI-style chat logs, the way servers and proxies record them. The conversation is
  ``messages`` (at the top level or under ``request``); the reply is either a ``response`` /
  ``completion`` (a string, a message, or a chat-completion object with ``choices``), a top-level
  ``choices`` list, or, failing those, the last message when it is the assistant's. Content is a
  string or a list of ``{"type": "text", "text": ...}`` parts; an assistant message's
  ``tool_calls`` are appended to its text as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n
  </tool_call>`` (how ``../shared/traces`` renders them).
* **text**: plain pairs, ``{"prompt": "...", "response": "..."}`` (``completion`` or ``output``
  also name the reply).

Text is tokenized with the target model's tokenizer, loaded vocabulary-only (no weights): the
chat prompt is the model's own chat template with the generation prompt, tokenized with special
tokens parsed (as llama-server tokenizes a templated chat request); a text prompt is tokenized as
llama-server's ``/completion`` does (special tokens parsed, BOS where the model wants it); the
reply is plain text (no BOS, no special tokens), what the model produced. The tokenizer is
the caller's (`ngramspec.llama.tokenizer.Tokenizer` on the command line): this module only
parses. Every problem is a `TraceError` naming the file and the line.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from ngramspec.traces import Request, TraceError, iter_json_lines, read_requests

__all__ = ["FORMATS", "LogTokenizer", "detect_format", "read_log", "read_logs"]

FORMATS = ("auto", "trace", "chat", "text")
_REPLY_KEYS = ("response", "completion", "output")


class LogTokenizer(Protocol):
    """What the readers need of a tokenizer (`ngramspec.llama.tokenizer.Tokenizer` has it)."""

    def chat_prompt(self, messages: Sequence[dict]) -> np.ndarray:
        """The prompt of a chat request (ValueError when the template rejects it)."""

    def text_prompt(self, text: str) -> np.ndarray:
        """A raw completion prompt."""

    def reply(self, text: str) -> np.ndarray:
        """What the model produced."""


def detect_format(path: str) -> str:
    """The format of a log file, from its first JSON object.

    Parameters
    ----------
    path : str

    Returns
    -------
    {"trace", "chat", "text"}

    Raises
    ------
    TraceError
        An empty file, a malformed line, or an object of no known format.
    """
    for lineno, obj in iter_json_lines(path):
        return _format_of(obj, path, lineno)
    raise TraceError(f"{path}: no requests (the file is empty)")


def _format_of(obj: dict, path: str, lineno: int) -> str:
    if "messages" in obj or isinstance(obj.get("request"), dict):
        return "chat"
    prompt = obj.get("prompt")
    if isinstance(prompt, list):
        return "trace"
    if isinstance(prompt, str):
        return "text"
    raise TraceError(f"{path}:{lineno}: cannot tell the log format: expected 'prompt' and "
                     f"'output' token-id lists (trace), 'messages' (chat log), or 'prompt' and "
                     f"'response' strings (text pair)")


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError(f"{where}: content part {i} is not text (only text parts can "
                                 f"be tokenized)")
        return "".join(parts)
    raise ValueError(f"{where}: 'content' must be a string or a list of text parts, got "
                     f"{type(content).__name__}")


def _tool_calls(calls, where: str) -> str:
    if not isinstance(calls, list):
        raise ValueError(f"{where}: 'tool_calls' must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}: tool call {i} has no function name")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args)
        out.append(f'<tool_call>\n{{"name": {json.dumps(fn["name"])}, "arguments": {args}}}'
                   f"\n</tool_call>")
    return "\n".join(out)


def _message(msg, where: str) -> dict:
    """A message as the chat template takes it: role and text content."""
    if not isinstance(msg, dict):
        raise ValueError(f"{where}: a message must be an object with 'role' and 'content'")
    role = msg.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}: 'role' must be a non-empty string")
    if "content" not in msg and "tool_calls" not in msg:
        raise ValueError(f"{where}: missing field 'content'")
    text = _text(msg.get("content"), where)
    if msg.get("tool_calls"):
        calls = _tool_calls(msg["tool_calls"], where)
        text = f"{text}\n{calls}" if text else calls
    return {"role": role, "content": text}


def _reply_message(reply, where: str):
    """The assistant message of a logged response (string, message or chat completion)."""
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    if isinstance(reply, dict) and "choices" in reply:
        reply = reply["choices"]
    if isinstance(reply, list):
        if not reply or not isinstance(reply[0], dict):
            raise ValueError(f"{where}: 'choices' must be a non-empty list of choices")
        reply = reply[0].get("message", reply[0].get("text"))
        if isinstance(reply, str):
            return {"role": "assistant", "content": reply}
    if not isinstance(reply, dict):
        raise ValueError(f"{where}: expected a string, a message or a chat completion "
                         f"with 'choices'")
    return reply


def parse_chat_record(obj: dict) -> tuple[list[dict], str]:
    """The prompt messages and the reply text of one chat-log object.

    Parameters
    ----------
    obj : dict
        One line of a chat log (see the module docstring).

    Returns
    -------
    tuple of (list of dict, str)
        The prompt messages (``role`` and text ``content``) and the assistant's reply.

    Raises
    ------
    ValueError
        What is wrong with the object (no messages, no reply, a malformed message).
    """
    req = obj["request"] if isinstance(obj.get("request"), dict) else obj
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("field 'messages' must be a non-empty list of messages")
    reply = None
    for key in ("response", "completion", "choices"):
        source = obj if key in obj else (req if key in req else None)
        if source is not None and source[key] is not None:
            reply = _message(_reply_message(source[key], f"field {key!r}"), f"field {key!r}")
            break
    if reply is None:
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            raise ValueError("no assistant reply: give 'response' (or 'choices') or end "
                             "'messages' with the assistant's message")
        messages = messages[:-1]
        reply = _message(last, f"message {len(messages)}")
        if not messages:
            raise ValueError("'messages' holds only the assistant's reply, no prompt")
    prompt = [_message(m, f"message {i}") for i, m in enumerate(messages)]
    return prompt, reply["content"]


def _text_pair(obj: dict) -> tuple[str, str]:
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError("field 'prompt' must be a string")
    for key in _REPLY_KEYS:
        if key in obj:
            if not isinstance(obj[key], str):
                raise ValueError(f"field {key!r} must be a string")
            return prompt, obj[key]
    raise ValueError("missing field 'response' (or 'completion' / 'output')")


def read_log(path: str, fmt: str = "auto", limit: Optional[int] = None,
             tokenizer: Optional[Callable[[], LogTokenizer]] = None) -> list[Request]:
    """The first `limit` requests (all when None) of one log file.

    Parameters
    ----------
    path : str
        ``.jsonl`` or ``.jsonl.gz``.
    fmt : {'auto', 'trace', 'chat', 'text'}
        'auto' decides from the first line.
    limit : int, optional
    tokenizer : callable, optional
        Returns the tokenizer for chat logs and text pairs; called only when one is needed
        (e.g. ``lambda: ngramspec.llama.tokenizer.Tokenizer(model_path)``). Without one, a
        chat or text log is refused with a ValueError.

    Returns
    -------
    list of Request

    Raises
    ------
    TraceError
        ``FILE:LINE: what is wrong`` for a malformed line; ``FILE: ...`` for the file.
    ValueError
        An unknown `fmt`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: allowed {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "trace":
        return read_requests(path, limit)
    tok = None
    requests = []
    for lineno, obj in iter_json_lines(path):
        if limit is not None and len(requests) >= limit:
            break
        try:
            if fmt == "chat":
                messages, reply = parse_chat_record(obj)
            else:
                prompt_text, reply = _text_pair(obj)
        except ValueError as exc:
            raise TraceError(f"{path}:{lineno}: {exc}") from None
        if tok is None:
            if tokenizer is None:
                raise ValueError(f"{path}: a {fmt} log is tokenized with the target model's "
                                 f"tokenizer, and none was given")
            tok = tokenizer()
        try:
            prompt = tok.chat_prompt(messages) if fmt == "chat" else tok.text_prompt(prompt_text)
        except ValueError as exc:
            raise TraceError(f"{path}:{lineno}: {exc}") from None
        output = tok.reply(reply)
        if len(output) == 0:
            raise TraceError(f"{path}:{lineno}: the reply is empty")
        rid = str(obj.get("id", f"{os.path.basename(path)}#{len(requests)}"))
        requests.append(Request(rid, prompt, output, {"format": fmt}))
    return requests


def read_logs(paths: Sequence[str], fmt: str = "auto", limit: Optional[int] = None,
              tokenizer: Optional[Callable[[], LogTokenizer]] = None
              ) -> tuple[list[Request], Optional[LogTokenizer]]:
    """Every file's first `limit` requests, in order.

    Parameters
    ----------
    paths : sequence of str
    fmt : {"auto", "trace", "chat", "text"}
        As `read_log`, for every file.
    limit : int, optional
        Per file.
    tokenizer : callable, optional
        As `read_log`; called once for all files, at the first line that needs it.

    Returns
    -------
    tuple of (list of Request, LogTokenizer or None)
        The requests and the tokenizer if one was made.

    Raises
    ------
    TraceError, ValueError
        As `read_log`.
    """
    loaded: list[LogTokenizer] = []

    def once() -> LogTokenizer:
        if not loaded:
            loaded.append(tokenizer())
        return loaded[0]

    requests: list[Request] = []
    for path in paths:
        requests.extend(read_log(path, fmt, limit, once if tokenizer is not None else None))
    return requests, (loaded[0] if loaded else None)

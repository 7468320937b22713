"""A reasoning model's thoughts apart from its answer: llama-server's ``--reasoning-format``.

``none`` leaves the text as generated. ``deepseek`` parses a ``<think>...</think>`` block at the
start of a chat output (after leading whitespace) into ``message.reasoning_content`` (streamed
as ``delta.reasoning_content``), the rest into ``content``, as llama.cpp's chat parser does
(``try_parse_reasoning``): the reasoning is stripped of surrounding whitespace (an empty one is
no reasoning), whitespace after ``</think>`` is dropped, and a block still open when the output
ends stays reasoning. Text that does not start with ``<think>`` is content, tags included.

`ReasoningSplitter` works on the text as it streams: a chunk boundary may fall inside a tag,
so a possible tag prefix and the reasoning's trailing whitespace are held back until the next
chunk decides them; the concatenated stream equals the split of the whole text.
"""
from __future__ import annotations

from typing import Optional, Tuple

__all__ = ["REASONING_FORMATS", "ReasoningSplitter", "split_reasoning"]

#: ``--reasoning-format`` values (llama-server's names).
REASONING_FORMATS = ("none", "deepseek")
START, END = "<think>", "</think>"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Splits one chat output's text into (reasoning, content) pieces as it streams.

    Notes
    -----
    Memory: at most the text not yet released (whitespace and a partial tag).

    Thread-safety: not thread-safe; one per response.
    """

    __slots__ = ("_state", "_buf")

    def __init__(self):
        self._state = "lead"     # lead -> open -> reasoning -> after -> content, or lead -> content
        self._buf = ""

    def push(self, text: str) -> Tuple[str, str]:
        """Feed the next piece of output; returns the (reasoning, content) it releases."""
        reasoning = content = ""
        buf = self._buf + text
        self._buf = ""
        if self._state == "lead":
            stripped = buf.lstrip()
            if not stripped or (len(stripped) < len(START) and START.startswith(stripped)):
                self._buf = buf
                return "", ""
            if not stripped.startswith(START):
                self._state = "content"
                return "", buf
            self._state, buf = "open", stripped[len(START):]
        if self._state == "open":       # the reasoning's leading whitespace is dropped
            buf = buf.lstrip()
            if not buf:
                return "", ""
            self._state = "reasoning"
        if self._state == "reasoning":
            i = buf.find(END)
            if i < 0:
                keep = _held_prefix(buf, END)
                body = buf[:len(buf) - keep]
                released = body.rstrip()
                self._buf = body[len(released):] + buf[len(buf) - keep:]
                return released, ""
            reasoning = buf[:i].rstrip()
            self._state, buf = "after", buf[i + len(END):]
        if self._state == "after":
            buf = buf.lstrip()
            if not buf:
                return reasoning, ""
            self._state = "content"
        content = buf
        return reasoning, content

    def finish(self) -> Tuple[str, str]:
        """The end of the output: what is still held (an unclosed block stays reasoning)."""
        buf, self._buf = self._buf, ""
        if self._state == "lead":
            self._state = "content"
            return "", buf
        if self._state in ("open", "reasoning"):
            # a partial "</thi" at the very end is reasoning text; whitespace is stripped
            return buf.rstrip(), ""
        return "", buf


def split_reasoning(text: str) -> Tuple[Optional[str], str]:
    """The whole output's (reasoning_content, content); reasoning None when there is none."""
    splitter = ReasoningSplitter()
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.finish()
    reasoning = r1 + r2
    return (reasoning or None), c1 + c2

"""Incremental text of a request's output: UTF-8 held back until complete, stop strings cut.

Tokens are turned into bytes one at a time (``llama_token_to_piece``) and decoded with an
incremental UTF-8 decoder, so a character split over two tokens is released only when complete.
Stop strings are matched on the decoded text; the text is cut before the first one, and text that
may be the beginning of a stop string is held back until the next token decides (as llama-server
streams).
"""
from __future__ import annotations

import codecs
import ctypes
from typing import Callable, Optional, Sequence, Tuple

__all__ = ["TextStream", "text_stream", "token_piece_fn"]


def token_piece_fn(vocab) -> Callable[[int], bytes]:
    """``token -> bytes`` of a llama vocabulary; control tokens (EOS) render as nothing."""
    import llama_cpp as lc
    buf = ctypes.create_string_buffer(256)

    def piece(token: int) -> bytes:
        n = lc.llama_token_to_piece(vocab, int(token), buf, len(buf), 0, False)
        if n < 0:  # longer than the buffer: ask again with the size llama.cpp reported
            big = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(vocab, int(token), big, len(big), 0, False)
            return big.raw[:n]
        return buf.raw[:n]
    return piece


def text_stream(llm, stop: Sequence[str] = ()) -> "TextStream":
    """A `TextStream` over the vocabulary of a loaded ``llama_cpp.Llama``."""
    import llama_cpp as lc
    return TextStream(token_piece_fn(lc.llama_model_get_vocab(llm.model)), stop)


class TextStream:
    """The decoded output of one request, released in chunks.

    Parameters
    ----------
    piece : callable, token -> bytes
    stop : sequence of str
        Stop strings (may be empty).

    Notes
    -----
    Memory: the output text. Thread-safety: not thread-safe (the decode thread's).
    """

    def __init__(self, piece: Callable[[int], bytes], stop: Sequence[str] = ()):
        self._piece = piece
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = tuple(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""          # decoded so far (cut at a stop string once found)
        self.sent = 0           # characters of `text` already released
        self.stopped = False
        self.stop_string: Optional[str] = None

    def push(self, tokens: Sequence[int]) -> Tuple[int, str]:
        """Add emitted tokens; returns ``(n_kept, chunk)``.

        ``n_kept`` is how many of ``tokens`` belong to the output: all of them, or up to and
        including the token that completed a stop string (then :attr:`stopped` is True).
        ``chunk`` is the newly released text.
        """
        n_kept = 0
        for t in tokens:
            if self.stopped:
                break
            n_kept += 1
            before = len(self.text)
            self.text += self._dec.decode(self._piece(t))
            hit = self._first_stop(self.text, before)
            if hit is not None:
                i, self.stop_string = hit
                self.text = self.text[:i]
                self.stopped = True
        return n_kept, self._release(final=self.stopped)

    def stop_cut(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` `push` would keep (all, or up to the token that completes a
        stop string), the stream left unchanged: the scheduler bounds a step's verification
        by it, so that tokens after a stop string are neither emitted nor counted as
        accepted."""
        if not self._max_stop or self.stopped:
            return len(tokens)
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        dec.setstate(self._dec.getstate())
        text = self.text
        for n, t in enumerate(tokens):
            before = len(text)
            text += dec.decode(self._piece(t))
            if self._first_stop(text, before) is not None:
                return n + 1
        return len(tokens)

    def _first_stop(self, text: str, before: int) -> Optional[Tuple[int, str]]:
        """``(index, stop string)`` of the first stop string in ``text`` that ends after its
        first ``before`` characters (None: none)."""
        if not self._max_stop or len(text) <= before:
            return None
        start = max(0, before - self._max_stop + 1)
        hits = [(i, s) for i, s in ((text.find(s, start), s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def finish(self) -> str:
        """The rest of the text (held-back stop prefix, incomplete bytes as U+FFFD)."""
        if not self.stopped:
            self.text += self._dec.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and self._max_stop:
            # Hold back a tail that could still become a stop string.
            for k in range(min(self._max_stop - 1, end - self.sent), 0, -1):
                tail = self.text[end - k:]
                if any(s.startswith(tail) for s in self.stop):
                    end -= k
                    break
        chunk = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return chunk


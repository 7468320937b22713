"""Text <-> tokens with a model's own tokenizer: prompts as llama.cpp's tools tokenize them, the
GGUF's chat template, and `Tokenizer`, a vocabulary-only model for reading text logs.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .model import default_model_path, require_llama_cpp
from .repack import load_llama

__all__ = ["Tokenizer", "detokenize", "max_token_bytes", "render_chat", "render_chat_parts",
           "tokenize_chat", "tokenize_corpus", "tokenize_output", "tokenize_parts",
           "tokenize_prompt"]


@contextlib.contextmanager
def _quiet_vocab_load():
    """stderr (the file descriptor) muted while a vocabulary-only model loads: llama.cpp's
    context then logs ``n_ctx_seq (512) > n_ctx_train (0)`` at error level, since no
    hyper-parameters are read, which llama-cpp-python prints whatever ``verbose`` says. A load
    that fails still raises, with llama-cpp-python's message."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def tokenize_prompt(llm, text: str, *, chat: bool = False) -> np.ndarray:
    """Tokenize a text prompt as llama.cpp's tools do.

    Special-token text (``<|im_start|>``) is parsed as the special token, and BOS is added only
    when the model asks for it. With ``chat=True`` the text becomes one user message rendered with
    the GGUF's own chat template (``tokenizer.chat_template``), generation prompt included.

    Returns
    -------
    numpy.ndarray of int32
    """
    if chat:
        return tokenize_chat(llm, [{"role": "user", "content": text}])
    toks = llm.tokenize(text.encode("utf-8"), add_bos=llm._model.add_bos_token(), special=True)
    return np.asarray(toks, dtype=np.int32)


def tokenize_output(llm, text: str) -> np.ndarray:
    """Tokenize ``text`` as the model would output it: no BOS, special-token text stays text
    (a predicted output, ``prediction``, is compared with generated tokens).

    Returns
    -------
    numpy.ndarray of int32
    """
    return np.asarray(llm.tokenize(text.encode("utf-8"), add_bos=False, special=False),
                      dtype=np.int32)


def render_chat(llm, messages: Sequence[Dict[str, Any]]) -> str:
    """``messages`` rendered with the GGUF's own chat template, generation prompt included.

    Parameters
    ----------
    llm : llama_cpp.Llama
    messages : sequence of dict
        OpenAI-style messages (``{"role": ..., "content": str}``).

    Raises
    ------
    ValueError
        The model has no chat template (``tokenizer.chat_template``).
    jinja2.TemplateError
        The template rejects the messages (e.g. roles that do not alternate).
    """
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise ValueError("the model has no chat template (tokenizer.chat_template)")
    eos, bos = llm.token_eos(), llm.token_bos()
    fmt = Jinja2ChatFormatter(
        template=template,
        eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
        bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
        add_generation_prompt=True)
    return fmt(messages=list(messages)).prompt


def render_chat_parts(llm, messages: Sequence[Dict[str, Any]], *,
                      special_in_content: bool = True) -> List[Tuple[str, bool]]:
    """:func:`render_chat` as ``(text, parse_special)`` parts, in order.

    With ``special_in_content=True`` (llama-server's behaviour) the whole rendering is one part
    whose special-token text is parsed, so a message containing ``<|im_end|>\n<|im_start|>system``
    forges a system turn. With False, each message's content is a part of its own tokenized as
    plain text (its ``<|im_start|>`` stays the characters), and only the template's own markup
    is parsed: the messages are rendered with a random marker in place of each content, which
    is then put back. A template that inspects the content's text (rather than writing it)
    sees the marker instead.

    Returns
    -------
    list of (str, bool)

    Notes
    -----
    Memory: the rendering and one copy of the contents.

    Thread-safety: as `render_chat` (the template is rendered on the calling thread; the
    ``llm`` is only read).
    """
    if special_in_content:
        return [(render_chat(llm, messages), True)]
    nonce = secrets.token_hex(8)
    marked, contents = [], {}
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, str) and content:
            marker = f"\x00{nonce}:{i}\x00"
            contents[marker] = content
            msg = {**msg, "content": marker}
        marked.append(msg)
    parts: List[Tuple[str, bool]] = []
    for k, piece in enumerate(re.split(f"(\x00{nonce}:[0-9]+\x00)", render_chat(llm, marked))):
        if k % 2:
            parts.append((contents[piece], False))
        elif piece:
            parts.append((piece, True))
    return parts


def tokenize_parts(llm, parts: Sequence[Tuple[str, bool]]) -> np.ndarray:
    """Tokens of ``(text, parse_special)`` parts (:func:`render_chat_parts`), concatenated; no
    BOS is added (a chat template writes it where the model wants one).

    Returns
    -------
    numpy.ndarray of int32
    """
    toks: List[int] = []
    for text, special in parts:
        toks += llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
    return np.asarray(toks, dtype=np.int32)


def tokenize_chat(llm, messages: Sequence[Dict[str, Any]], *,
                  special_in_content: bool = True) -> np.ndarray:
    """Tokens of ``messages`` rendered with the chat template (:func:`render_chat_parts`).

    Returns
    -------
    numpy.ndarray of int32
    """
    return tokenize_parts(llm, render_chat_parts(llm, messages,
                                                 special_in_content=special_in_content))


def max_token_bytes(llm) -> Optional[int]:
    """The most bytes of text one token stands for when text is tokenized with special tokens
    parsed: the longest piece of the vocabulary, control tokens' text included.

    A text of ``n`` UTF-8 bytes therefore has at least ``ceil(n / max_token_bytes)`` tokens:
    a prompt too long for a context can be refused before it is tokenized.

    Returns
    -------
    int or None
        None where no such bound holds: a tokenizer other than SPM or BPE (WPM and UGM
        normalize the text, folding runs of whitespace), or a token that strips the whitespace
        beside it (llama.cpp's ``lstrip`` / ``rstrip`` attributes): one token then stands for
        any amount of text.

    Notes
    -----
    Memory: none kept. Takes one ``llama_token_to_piece`` call per token (a fraction of a
    second for 50k tokens).
    """
    lc = require_llama_cpp()
    vocab = llm._model.vocab
    strip = lc.LLAMA_TOKEN_ATTR_LSTRIP | lc.LLAMA_TOKEN_ATTR_RSTRIP
    if lc.llama_vocab_type(vocab) not in (lc.LLAMA_VOCAB_TYPE_SPM, lc.LLAMA_VOCAB_TYPE_BPE):
        return None
    buf = ctypes.create_string_buffer(256)
    longest = 1
    for t in range(int(lc.llama_vocab_n_tokens(vocab))):
        if lc.llama_vocab_get_attr(vocab, t) & strip:
            return None
        n = lc.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
        longest = max(longest, abs(n))   # -n: the size the piece needs
    return longest


def tokenize_corpus(model_path: str, data: bytes) -> np.ndarray:
    """Tokens of a UTF-8 corpus as llama-lookup-create tokenizes it (special tokens added and
    parsed), with the vocabulary of ``model_path`` loaded alone (no weights).

    Raises
    ------
    FileNotFoundError
        No such model file.
    ValueError
        The file is not a model llama.cpp can load.
    """
    if not os.path.exists(model_path):
        raise FileNotFoundError(2, "No such file or directory", model_path)
    try:
        with _quiet_vocab_load():
            llm = load_llama(model_path, vocab_only=True, verbose=False)
    except Exception as exc:   # llama_cpp raises ValueError/RuntimeError for unreadable files
        raise ValueError(f"{model_path}: cannot load the tokenizer ({exc})") from None
    return np.asarray(llm.tokenize(data, add_bos=True, special=True), dtype=np.int32)


def detokenize(llm, tokens: Sequence[int]) -> str:
    """Text of ``tokens``; control tokens such as EOS render as nothing."""
    if len(tokens) == 0:
        return ""
    return llm.detokenize([int(t) for t in tokens], special=False).decode("utf-8", errors="replace")


class Tokenizer:
    """The target model's tokenizer (``llama_cpp.Llama(model_path, vocab_only=True)``).

    Parameters
    ----------
    model_path : str, optional
        GGUF file; default the embedded SmolLM2-135M (`default_model_path`).

    Notes
    -----
    Memory: the vocabulary and the GGUF metadata only (a few MiB), no weights.

    Thread-safety: one thread at a time (llama.cpp's tokenizer is not documented as
    reentrant); make one per thread or process.
    """

    def __init__(self, model_path: Optional[str] = None):
        try:
            llama_cpp = require_llama_cpp()
        except ImportError:
            raise ValueError("chat logs and text pairs are tokenized with llama-cpp-python: "
                             "pip install 'ngramspec[live]'") from None
        if model_path is None:
            model_path = default_model_path()      # ModelNotFoundError names --model
        if not os.path.isfile(model_path):
            raise FileNotFoundError(2, "--model: no such file", model_path)
        try:
            with _quiet_vocab_load():
                self.llm = llama_cpp.Llama(model_path=model_path, vocab_only=True,
                                           verbose=False)
        except Exception as exc:    # llama_cpp raises ValueError/RuntimeError for bad files
            raise ValueError(f"--model {model_path}: cannot load the tokenizer ({exc})") from None
        self.model_path = model_path

    def _ids(self, text: str, add_bos: bool, special: bool) -> np.ndarray:
        toks = self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)
        return np.asarray(toks, dtype=np.int32)

    def text(self, ids: Sequence[int], special: bool = False) -> str:
        """The text of token ids; `special` renders control tokens (``<|im_start|>``) too.

        Each piece gets a buffer as long as it needs: llama-cpp-python's own ``detokenize``
        drops pieces longer than 32 bytes (such as a newline and 36 spaces, one token here).
        """
        llama_cpp = require_llama_cpp()
        vocab = self.llm._model.vocab
        buf = ctypes.create_string_buffer(64)
        out = bytearray()
        for t in ids:
            n = llama_cpp.llama_token_to_piece(vocab, int(t), buf, len(buf), 0, special)
            if n < 0:            # -n is the size the piece needs
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(vocab, int(t), buf, len(buf), 0, special)
            out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")

    def chat_prompt(self, messages: Sequence[dict]) -> np.ndarray:
        """The prompt of a chat request: the chat template, generation prompt included.
        ValueError when the model has no template or the template rejects the messages."""
        import jinja2   # llama-cpp-python's dependency, for its chat templates
        if not self.llm.metadata.get("tokenizer.chat_template"):
            raise ValueError(f"{self.model_path}: the model has no chat template "
                             f"(tokenizer.chat_template)")
        try:
            return tokenize_chat(self.llm, messages)
        except (jinja2.TemplateError, ValueError) as exc:   # raise_exception() raises ValueError
            raise ValueError(f"the chat template rejects the messages ({exc})") from None

    def text_prompt(self, text: str) -> np.ndarray:
        """A raw completion prompt, as llama-server's ``/completion`` tokenizes it."""
        return self._ids(text, bool(self.llm._model.add_bos_token()), True)

    def reply(self, text: str) -> np.ndarray:
        """What the model produced: plain text, no BOS, special-token text kept as text."""
        return self._ids(text, False, False)

"""The batched llama.cpp scheduler as the server's `ngramspec.backend.Backend`.

`LlamaBackend` adds to a `Scheduler` the text side the server needs (its model's tokenizer and
chat template, `ngramspec.llama.tokenizer`) and passes the rest through, so the server never
touches ``llama_cpp`` objects.

Notes
-----
Thread-safety: as the scheduler's (its ``submit``, ``stats`` and llama.cpp's tokenizer are
thread-safe; the chat template renders on the calling thread).
"""
from __future__ import annotations

from typing import Optional

from . import tokenizer

__all__ = ["LlamaBackend"]


class LlamaBackend:
    """A `Scheduler` behind `ngramspec.backend.Backend`.

    Parameters
    ----------
    scheduler : ngramspec.llama.scheduler.Scheduler

    Attributes
    ----------
    scheduler : Scheduler
        The wrapped scheduler (its own methods beyond the protocol: ``tokenize``, ...).
    n_slots, n_ctx_slot, n_vocab, queue_size : int
    spec_types : tuple of str
    policy : str
        The scheduler's.
    """

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.n_slots, self.n_ctx_slot = scheduler.n_slots, scheduler.n_ctx_slot
        self.n_vocab, self.queue_size = scheduler.n_vocab, scheduler.queue_size
        self.spec_types, self.policy = tuple(scheduler.spec_types), scheduler.policy
        self._max_token_bytes = None

    def start(self) -> None:
        self.scheduler.start()

    def stop(self, *, cancel: bool = False, timeout: Optional[float] = None) -> None:
        self.scheduler.stop(cancel=cancel, timeout=timeout)

    def submit(self, prompt_tokens, sampling, speculation=None, *, prediction=None,
               cache_owner=None, cache_prompt: bool = True):
        return self.scheduler.submit(prompt_tokens, sampling=sampling, speculation=speculation,
                                     prediction=prediction, cache_owner=cache_owner,
                                     cache_prompt=cache_prompt)

    def stats(self) -> dict:
        return self.scheduler.stats()

    def tokenize_prompt(self, text: str):
        return tokenizer.tokenize_prompt(self.scheduler.llm, text)

    def tokenize_output(self, text: str):
        return tokenizer.tokenize_output(self.scheduler.llm, text)

    def render_chat_parts(self, messages, special_in_content: bool):
        from jinja2 import TemplateError   # llama-cpp-python's dependency (the live extra)

        try:
            return tokenizer.render_chat_parts(self.scheduler.llm, messages,
                                               special_in_content=special_in_content)
        except TemplateError as exc:
            raise ValueError(f"the chat template rejects them: {exc}") from None

    def tokenize_parts(self, parts):
        return tokenizer.tokenize_parts(self.scheduler.llm, parts)

    def max_token_bytes(self) -> Optional[int]:
        # one pass over the vocabulary (a fraction of a second), once per backend
        if self._max_token_bytes is None:
            self._max_token_bytes = (tokenizer.max_token_bytes(self.scheduler.llm),)
        return self._max_token_bytes[0]

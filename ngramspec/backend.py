"""What the server needs of a model backend: the seam between `ngramspec.server` and the
backend that decodes (today `ngramspec.llama.backend.LlamaBackend`, the batched llama.cpp
scheduler).

The server speaks only the backend-neutral request types (`ngramspec.request_params`,
`ngramspec.request`) and the `Backend` protocol below, so another backend (another runtime,
a remote one) implements this protocol and serves the same API without touching the server.
The members are what the server's code calls, and nothing more:

- sizes, read once when the app is built: ``n_slots``, ``n_ctx_slot``, ``n_vocab``,
  ``queue_size``; its speculation (``/v1/models``): ``spec_types``, ``policy``;
- its life: ``start()``, ``stop(cancel=..., timeout=...)`` (the app's lifespan and drain);
- requests: ``submit(...)`` returns a `ngramspec.request.RequestHandle`; ``stats()`` the
  counters ``/metrics`` and run-batch read (`ngramspec.llama.scheduler.Scheduler.stats`' keys);
- text: ``tokenize_prompt``, ``tokenize_output``, ``render_chat_parts`` / ``tokenize_parts``
  (the chat template, with the text bound checked between the two), ``max_token_bytes``.

Notes
-----
Thread-safety: an implementation's ``submit``, ``stats`` and text methods are called from the
server's thread pool concurrently; ``start`` and ``stop`` from the event loop's pool, once each.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from ngramspec.request import RequestHandle
from ngramspec.request_params import SamplingParams, SpeculationParams

__all__ = ["Backend"]


@runtime_checkable
class Backend(Protocol):
    """A model that serves requests: the server's whole view of it (see the module)."""

    n_slots: int
    n_ctx_slot: int
    n_vocab: int
    queue_size: int
    spec_types: Sequence[str]
    policy: str

    def start(self) -> None:
        """Start decoding (once)."""

    def stop(self, *, cancel: bool = False, timeout: Optional[float] = None) -> None:
        """Stop accepting requests; finish (``cancel``: cancel) the submitted ones."""

    def submit(self, prompt_tokens: Sequence[int], sampling: SamplingParams,
               speculation: Optional[SpeculationParams] = None, *, prediction=None,
               cache_owner: Optional[str] = None, cache_prompt: bool = True) -> RequestHandle:
        """Queue a request. Raises `ngramspec.request.QueueFull` when the queue is full,
        RuntimeError once stopped, `ngramspec.validation` errors for a bad parameter."""

    def stats(self) -> Dict[str, Any]:
        """Counters for monitoring (``n_slots``, ``queue_length``, ``proposers``, ...)."""

    def tokenize_prompt(self, text: str) -> Sequence[int]:
        """A text prompt's tokens (special-token text parsed, BOS where the model wants it)."""

    def tokenize_output(self, text: str) -> Sequence[int]:
        """``text`` as the model would output it (a predicted output)."""

    def render_chat_parts(self, messages: Sequence[Dict[str, Any]],
                          special_in_content: bool) -> List[Tuple[str, bool]]:
        """The chat template's rendering as ``(text, parse_special)`` parts. Raises ValueError
        (the message says why) when the template is missing or rejects the messages."""

    def tokenize_parts(self, parts: Sequence[Tuple[str, bool]]) -> Sequence[int]:
        """The tokens of `render_chat_parts`' parts, concatenated."""

    def max_token_bytes(self) -> Optional[int]:
        """The most UTF-8 bytes one token stands for (None: no bound holds)."""

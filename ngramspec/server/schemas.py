"""Request bodies of the OpenAI endpoints, validated with pydantic.

Field names and JSON types are OpenAI's (``max_tokens``, ``stop``, ``logit_bias`` with string
keys, ...) plus llama-server's extensions (``top_k``, ``min_p``, ``repeat_penalty``,
``repeat_last_n``, ``ignore_eos``) and ngramspec's ``speculative`` object, with llama-server's
flat keys ``speculative.n_max`` / ``speculative.n_min`` / ``speculative.p_min`` accepted as well.

Types are strict (a string is not a number, a number not a boolean) so that a client's mistake
becomes a 400 naming the field instead of a silently coerced value. Value ranges that depend on
the model or on the scheduler's configuration (a token id, the context size, a spec type of the
configured chain, ``n_max``) are checked by the scheduler's own parameter classes, not here: one
place for each range.

Notes
-----
Memory: one request's or response's fields; a prompt of token ids is a Python list until the
scheduler converts it.

Thread-safety: the models are plain immutable-by-convention data, built per request.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt,
                      StrictStr, field_validator, model_serializer)

from ngramspec.policy import POLICIES
from ngramspec.server.errors import FieldError

# Strict float: accepts JSON integers, refuses strings and booleans.
Number = StrictFloat
# A token id as a logit_bias key: ASCII decimal, no sign, no leading zero.
_TOKEN_KEY = re.compile(r"0|[1-9][0-9]*", re.ASCII)

def _only_neutral(*fields, neutral: tuple, why: str):
    """A validator refusing anything but the neutral values of fields ngramspec does not
    implement (OpenAI clients send some of them by default): a 400, not a silent ignore."""
    def check(cls, v):
        if v not in neutral:
            raise ValueError(why)
        return v
    return field_validator(*fields)(classmethod(check))


class SpeculativeOptions(BaseModel):
    """The ``speculative`` object of a request: per-request control of speculation.

    ``type`` is a comma list (or a JSON list) of spec types, a subset of the server's
    ``--spec-type`` chain; ``enabled: false`` decodes this request plainly.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: Optional[StrictBool] = None
    type: Optional[Union[StrictStr, List[StrictStr]]] = None
    n_max: Optional[StrictInt] = None
    n_min: Optional[StrictInt] = None
    p_min: Optional[Number] = None
    policy: Optional[Literal[POLICIES]] = None

    def types(self) -> Optional[tuple]:
        """``type`` as a tuple of names (``None``: the configured chain)."""
        if self.type is None:
            return None
        names = self.type.split(",") if isinstance(self.type, str) else self.type
        return tuple(n.strip() for n in names if n.strip())


class GenerationRequest(BaseModel):
    """Fields common to ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    stream: StrictBool = False
    stream_options: Optional[Dict[str, StrictBool]] = None
    logit_bias: Optional[Dict[str, Number]] = None
    frequency_penalty: Optional[Number] = None
    presence_penalty: Optional[Number] = None
    repeat_penalty: Optional[Number] = None
    repeat_last_n: Optional[StrictInt] = None
    ignore_eos: Optional[StrictBool] = None
    # llama-server's: false decodes the whole prompt, reusing no slot's cache (greedy output
    # then does not depend on what the slot held before)
    cache_prompt: StrictBool = True
    n: StrictInt = 1
    # Refused unless neutral: no log-probabilities, no multiple choices.
    logprobs: Optional[Union[StrictBool, StrictInt]] = None
    top_logprobs: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = None

    speculative: Optional[SpeculativeOptions] = None
    prediction: Optional["Prediction"] = None
    flat_n_max: Optional[StrictInt] = Field(None, alias="speculative.n_max")
    flat_n_min: Optional[StrictInt] = Field(None, alias="speculative.n_min")
    flat_p_min: Optional[Number] = Field(None, alias="speculative.p_min")

    _one_choice = _only_neutral("n", neutral=(1,), why="only n = 1 is supported")
    _no_best_of = _only_neutral("best_of", neutral=(None, 1), why="only best_of = 1 is supported")
    _no_logprobs = _only_neutral("logprobs", "top_logprobs", neutral=(None, False, 0),
                                 why="log-probabilities are not supported")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(v)}")
        return v

    @classmethod
    def precheck(cls, obj: dict, bounds) -> None:
        """Bounds checked on the parsed JSON before validation copies it
        (`ngramspec.server.body`); none for the common fields."""

    def token_bias(self, n_vocab: int) -> Dict[int, float]:
        """``logit_bias`` with its keys as token ids.

        A key must be a token id written canonically in ASCII decimal (``"0"``, ``"49151"``):
        not ``"-1"``, ``"+5"``, ``"007"``, ``"²"`` (``str.isdigit`` accepts it, ``int`` does
        not) or thousands of digits. Values are checked by `SamplingParams`.

        Parameters
        ----------
        n_vocab : int
            The model's vocabulary size.

        Raises
        ------
        FieldError
            A key that is not such a token id below `n_vocab`.
        """
        out = {}
        for key, value in (self.logit_bias or {}).items():
            # at most len(str(n_vocab)) digits before int(): a 5000-digit key costs nothing
            if _TOKEN_KEY.fullmatch(key) is None or len(key) > len(str(n_vocab)) \
                    or int(key) >= n_vocab:
                shown = key if len(key) <= 24 else key[:24] + "..."
                raise FieldError("logit_bias", f"key {shown!r} is not a token id: allowed "
                                               f"0 .. {n_vocab - 1}, as a decimal string")
            out[int(key)] = value
        return out

    def speculative_options(self) -> Optional[SpeculativeOptions]:
        """The ``speculative`` object with llama-server's flat keys merged in.

        Raises
        ------
        FieldError
            A flat key contradicts the object's field.
        """
        flat = {"n_max": self.flat_n_max, "n_min": self.flat_n_min, "p_min": self.flat_p_min}
        given = {k: v for k, v in flat.items() if v is not None}
        if not given:
            return self.speculative
        spec = self.speculative or SpeculativeOptions()
        for key, value in given.items():
            inner = getattr(spec, key)
            if inner is not None and inner != value:
                raise FieldError(f"speculative.{key}",
                                 f"{value} contradicts the speculative object's {key} = {inner}")
        return spec.model_copy(update=given)

    def output_limit(self) -> Optional[int]:
        """The request's ``max_tokens`` (None: the server's ``n_predict``)."""
        return self.max_tokens

    def stop_strings(self) -> tuple:
        """``stop`` as a tuple of strings (empty: none)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: a text prompt or a list of token ids."""

    prompt: Union[StrictStr, List[StrictInt], List[StrictStr], List[List[StrictInt]]]
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None

    _no_echo = _only_neutral("echo", neutral=(False,), why="echo is not supported")
    _no_suffix = _only_neutral("suffix", neutral=(None, ""), why="suffix (insertion) is not "
                                                                 "supported")

    @classmethod
    def precheck(cls, obj: dict, bounds) -> None:
        """A prompt of token ids longer than a slot's context is refused by its length."""
        bounds.token_prompt(obj.get("prompt"), "prompt")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"one prompt per request (n = 1), got a batch of {len(v)}")
            v = v[0]
        if len(v) == 0:
            raise ValueError("the prompt is empty")
        return v


class TextPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` part of a message's content."""
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: StrictStr


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": TEXT or text parts}``, the
    expected output (the file an edit rewrites); it drafts, the output does not depend on it."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["content"]
    content: Union[StrictStr, List[TextPart]]

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatMessage(BaseModel):
    """One message of a chat request; its content is a string or text parts."""
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, List[TextPart]]] = None
    name: Optional[StrictStr] = None

    def text(self) -> str:
        """The content as one string (parts joined, ``""`` for none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered with the GGUF's chat template."""

    messages: List[ChatMessage]
    max_completion_tokens: Optional[StrictInt] = None
    tools: Optional[List[Any]] = None

    _no_tools = _only_neutral("tools", neutral=(None, []), why="tools are not supported")

    @classmethod
    def precheck(cls, obj: dict, bounds) -> None:
        """The message count and the summed contents against a slot's context."""
        bounds.messages(obj.get("messages"))

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, v):
        if not v:
            raise ValueError("at least one message is required")
        return v

    def output_limit(self) -> Optional[int]:
        """``max_tokens``, or OpenAI's newer ``max_completion_tokens``."""
        if self.max_completion_tokens is None:
            return self.max_tokens
        if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise FieldError("max_completion_tokens", f"{self.max_completion_tokens} disagrees "
                             f"with max_tokens = {self.max_tokens}")
        return self.max_completion_tokens

    def template_messages(self) -> List[Dict[str, str]]:
        """The messages as the chat template takes them (``role``, text ``content``, ``name``)."""
        return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in self.messages]


# ---------------------------------------------------------------------------------------------
# Responses (OpenAI's shapes; ``timings`` is llama-server's)

class CompletionTokensDetails(BaseModel):
    """OpenAI's ``usage.completion_tokens_details`` (given with a ``prediction``): its drafted
    tokens that the output took, and those it did not (still verified, so still counted)."""
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    """OpenAI's ``usage`` object: prompt, completion and total tokens."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: Optional[CompletionTokensDetails] = None


class Timings(BaseModel):
    """llama-server's ``timings`` object of one request.

    ``prompt_n`` counts the prompt tokens decoded for this request and ``cache_n`` those taken
    from the slot's prompt cache; ``draft_n`` / ``draft_n_accepted`` are the draft tokens
    verified and accepted (0 with speculation off). With ``serve --hide-cache-n`` the prompt's
    fields (``cache_n`` and those that give it away) are left out.
    """

    cache_n: Optional[int] = None
    prompt_n: Optional[int] = None
    prompt_ms: Optional[float] = None
    prompt_per_token_ms: Optional[float] = None
    prompt_per_second: Optional[float] = None
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int
    draft_n_accepted: int

    @model_serializer(mode="wrap")
    def _leave_hidden_out(self, handler):
        # a hidden field is absent, not null (a client reading it as a number gets no 0)
        return {k: v for k, v in handler(self).items() if v is not None}


class _Envelope(BaseModel):
    """Fields every completion response and stream chunk carries."""

    id: str
    created: int
    model: str


class CompletionChoice(BaseModel):
    """One choice of a ``/v1/completions`` response or stream chunk."""
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class CompletionResponse(_Envelope):
    """A ``/v1/completions`` response, and each chunk of its stream (``text_completion`` too,
    as OpenAI streams it)."""

    object: Literal["text_completion"] = "text_completion"
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None
    timings: Optional[Timings] = None


class _OmitsAbsentReasoning(BaseModel):
    """``reasoning_content`` is written only when there is some (``--reasoning-format``): it
    is no field of OpenAI's schema, and llama-server omits it too when it is empty."""

    @model_serializer(mode="wrap")
    def _omit_absent_reasoning(self, handler) -> Dict[str, Any]:
        data = handler(self)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class AssistantMessage(_OmitsAbsentReasoning):
    """The assistant's reply in a chat response."""
    role: Literal["assistant"] = "assistant"
    content: str
    reasoning_content: Optional[str] = None     # --reasoning-format deepseek


class ChatChoice(BaseModel):
    """One choice of a ``/v1/chat/completions`` response."""
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(_Envelope):
    """A ``/v1/chat/completions`` response (not streamed)."""
    object: Literal["chat.completion"] = "chat.completion"
    choices: List[ChatChoice]
    usage: Usage
    timings: Timings


class ChatDelta(_OmitsAbsentReasoning):
    """The new text of a chat stream chunk (the first chunk carries the role); reasoning and
    content never share one (`ngramspec.server.streaming`)."""
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    """One choice of a chat stream chunk."""
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class ChatCompletionChunk(_Envelope):
    """One ``chat.completion.chunk`` of a streamed chat response."""
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None
    timings: Optional[Timings] = None


class ModelCard(BaseModel):
    """One entry of ``/v1/models``."""
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ngramspec"
    meta: Dict[str, Any] = {}


class ModelList(BaseModel):
    """The ``/v1/models`` response."""
    object: Literal["list"] = "list"
    data: List[ModelCard]

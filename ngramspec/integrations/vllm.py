"""ngramspec's proposers inside vLLM (tested with vllm 0.33.0), as a ``custom_class`` proposer.

::

    NGRAMSPEC_SPEC="--spec-type ngram-suffix" vllm serve MODEL --speculative-config \\
        '{"method": "custom_class", "model": "ngramspec.integrations.vllm.NgramspecProposer",
          "num_speculative_tokens": 16}'

vLLM's V1 GPU model runner builds the class as ``NgramspecProposer(vllm_config)`` and calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)`` once per
step, after it has written the sampled tokens into ``token_ids_cpu``. It passes rows, not
requests: no request id, no signal that a request ended, and rows move (the last rows fill the
holes of finished requests). So the proposer follows requests by their tokens: a row whose tokens
continue what a request held (its known tokens, compared at their first and last 32, then the
accepted prefix of its pending draft and one token of the target's) is that request, wherever it
sits; a row that continues none is a new
request; a request no row continues has ended. Requests are drafted for in arrival order, so the
rows they sit in change nothing.

With the ``vllm.general_plugins`` entry point (`register`, installed with ngramspec) on the
tested vLLM version, the runner also hands the proposer each step's request ids and finished
requests, and a request is its id: a new request whose tokens happen to continue an ended one's
is never taken for it. On any other vLLM version the entry point changes nothing and says so.

Cost per step: per row its new tokens and one draft (`RequestLoops.advance`), no compare of a
row's whole context; at a request's first sight ``SpecEngine.begin`` on its prompt (linear in
it, once).

The runner calls the proposer on every tensor-parallel rank of the last pipeline stage and uses
one rank's drafts: the proposer is deterministic, so all ranks agree.
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import numpy as np

from ngramspec.integrations.request_args import (PREDICTION, SPECULATIVE, checked_args,
                                                 control_of)
from ngramspec.integrations.requests import MAX_DRAFT, RequestLoops, engine_from_env
from ngramspec.validation import OutOfRange, ParamError, check_int

__all__ = ["TESTED_VLLM", "NgramspecProposer", "register"]

#: The vLLM version whose runner `register` hooks.
TESTED_VLLM = "0.33.0"

_log = logging.getLogger(__name__)


class NgramspecProposer:
    """vLLM's ``custom_class`` proposer drafting with an ngramspec `SpecEngine`.

    Parameters
    ----------
    vllm_config : vllm.config.VllmConfig
        Only what vLLM's own ``NgramProposer`` reads: ``speculative_config.
        num_speculative_tokens`` (K), ``model_config.max_model_len``, ``scheduler_config.
        max_num_seqs`` (the engine's slots) and ``parallel_config.tensor_parallel_size``.

    Notes
    -----
    Spec types and parameters come from ``$NGRAMSPEC_SPEC`` (llama-server flags, ``serve``'s
    defaults and error messages, plus ``--spec-policy fixed|auto --cost-model NAME``; auto's
    default profile is ``gpu``). A draft is at most ``min(K, max_model_len - n - 1)`` tokens for
    a row of n tokens.

    Memory: the engine's (ngram-mod's pool is 16 MiB) plus a copy of each live request's tokens.

    Thread-safety: not thread-safe; vLLM calls it from its one model-runner thread.
    """

    def __init__(self, vllm_config, *, spec: Optional[str] = None):
        self._setup(vllm_config.speculative_config.num_speculative_tokens,
                    vllm_config.model_config.max_model_len,
                    vllm_config.scheduler_config.max_num_seqs,
                    vllm_config.parallel_config.tensor_parallel_size, spec)

    @classmethod
    def from_limits(cls, num_speculative_tokens: int, max_model_len: int, max_num_seqs: int,
                    tensor_parallel_size: int = 1, spec: Optional[str] = None):
        """The proposer of those four ``vllm_config`` values, without vLLM (replays, tests).

        `spec`: llama-server flags instead of ``$NGRAMSPEC_SPEC``.
        """
        self = cls.__new__(cls)
        self._setup(num_speculative_tokens, max_model_len, max_num_seqs, tensor_parallel_size,
                    spec)
        return self

    def _setup(self, k, max_model_len, max_num_seqs, tp_size, spec) -> None:
        self.k = check_int("num_speculative_tokens", k, 1, MAX_DRAFT)
        self.max_model_len = check_int("max_model_len", max_model_len, 1)
        self.n_slots = check_int("max_num_seqs", max_num_seqs, 1)
        self.tp_size = check_int("tensor_parallel_size", tp_size, 1)
        self.engine, policy = engine_from_env(self.n_slots, spec)
        # SlotLoop's bound n_ctx - L - 2 with L = n - 1 is vLLM's max_model_len - n - 1
        self.requests = RequestLoops(self.engine, self.n_slots, n_ctx=self.max_model_len,
                                     n_max=self.k, policy=policy)
        self._rows: List[Optional[object]] = []
        self._keys = 0
        self._ids: Optional[Sequence[str]] = None
        self._args_of: Optional[Callable] = None
        self.chain = tuple(self.engine.types)

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (vLLM calls this on every proposer)."""

    def set_request_ids(self, req_ids: Sequence[Optional[str]], finished=(),
                        args_of: Optional[Callable] = None) -> None:
        """The next `propose` call's request id of each row, and the requests that ended.

        Called by the runner hook of `register`; without it requests are followed by tokens.
        `args_of(req_id)`: the request's ``SamplingParams.extra_args`` (or None), read once,
        when the request is first seen: its ``prediction`` and ``speculative`` fields
        (`ngramspec.integrations.request_args`).
        """
        for key in finished:
            self.requests.end(key)
        self._ids = list(req_ids)
        self._args_of = args_of

    def propose(self, sampled_token_ids: List[List[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None) -> List[List[int]]:
        """The draft of every row (``[]`` for a row whose sampled list is empty).

        Parameters
        ----------
        sampled_token_ids : list of list of int
            Per row, the tokens sampled this step (already in `token_ids_cpu`); ``[]`` skips
            the row (a partial prefill).
        num_tokens_no_spec : numpy.ndarray
            Per row, its number of tokens (prompt + output).
        token_ids_cpu : numpy.ndarray
            ``(max_num_reqs, max_model_len)`` int32, the rows' tokens.
        slot_mappings
            Unused.

        Returns
        -------
        list of list of int
        """
        rl = self.requests
        n_rows = len(sampled_token_ids)
        if n_rows > self.n_slots:
            # more rows than slots would hand one slot to several requests
            raise OutOfRange("len(sampled_token_ids)", n_rows, f"0 .. {self.n_slots} "
                             "(max_num_seqs, the proposer's slots)")
        rl.step += 1
        ids, self._ids = self._ids, None
        nums = num_tokens_no_spec[:n_rows].tolist()
        by_id = ids is not None and len(ids) >= n_rows
        if by_id:
            rows = self._match_ids(ids, n_rows, nums, token_ids_cpu)
        else:
            rows = self._match_tokens(n_rows, nums, token_ids_cpu)
        drafts: List[List[int]] = [[] for _ in range(n_rows)]
        todo = []
        # new requests begin first (in row order: vLLM gives them rows in arrival order), then
        # every request drafts in arrival order: where rows moved changes nothing
        for i in range(n_rows):
            n = nums[i]
            if not sampled_token_ids[i] or n < 2:
                continue
            req = rows[i]
            if req is None:
                req = rows[i] = self._begin(ids[i] if by_id else None, token_ids_cpu[i], n)
            todo.append((req.seq, i, n))
        todo.sort()
        advance = rl.advance
        for _, i, n in todo:
            req = rows[i]
            drafts[i] = advance(req, token_ids_cpu[i, req.n:n]).tolist()
        self._rows = rows
        return drafts

    # -- following requests ----------------------------------------------------------------

    def _begin(self, key, tokens, n: int):
        control = None
        if key is None:
            key = ("row-request", self._keys)
            self._keys += 1
        elif self._args_of is not None:
            control = control_of(self._args_of(key), self.chain, auto=self.requests.auto,
                                 key=key)
        return self.requests.begin(key, tokens[:n - 1], int(tokens[n - 1]), control)

    def _match_ids(self, ids, n_rows, num_tokens, tokens):
        rl = self.requests
        rows: List[Optional[object]] = [None] * n_rows
        for i in range(n_rows):
            key = ids[i]
            req = rl.get(key) if key is not None else None
            if req is not None and req.holds(tokens[i], num_tokens[i], same_request=True):
                rows[i] = req
            elif req is not None:
                rl.end(key)       # the same id with other tokens (a resumed request): anew
        return rows

    def _match_tokens(self, n_rows, num_tokens, tokens):
        rl = self.requests
        rows: List[Optional[object]] = [None] * n_rows
        claimed = set()
        prev = self._rows
        # the row a request sat in last step first, then any row (rows move when others end)
        for i in range(min(n_rows, len(prev))):
            req = prev[i]
            if req is not None and rl.get(req.key) is req \
                    and req.holds(tokens[i], num_tokens[i]):
                rows[i] = req
                claimed.add(req.key)
        open_reqs = sorted((r for k, r in rl.requests.items() if k not in claimed),
                           key=lambda r: r.seq)
        for i in range(n_rows):
            if rows[i] is not None or not open_reqs:
                continue
            n = num_tokens[i]
            for j, req in enumerate(open_reqs):
                if req.holds(tokens[i], n):
                    rows[i] = req
                    claimed.add(req.key)
                    del open_reqs[j]
                    break
        for req in open_reqs:     # no row continues it: the request has ended
            rl.end(req.key)
        return rows


# -- the optional hooks: request ids and arguments from vLLM's runner, fields at its front end ----

def register() -> None:
    """``vllm.general_plugins`` entry point: hand `NgramspecProposer` request ids and fields.

    On vLLM `TESTED_VLLM`, in every process vLLM loads plug-ins in:

    - the worker: ``GPUModelRunner.propose_draft_token_ids`` is wrapped so that, before a step's
      drafts, an `NgramspecProposer` drafter gets the input batch's request ids, the requests
      that finished and each request's ``SamplingParams.extra_args`` (read at its first sight)
      (`NgramspecProposer.set_request_ids`);
    - the API server: the OpenAI ``prediction`` and ``speculative`` fields of a chat or
      completion request (kept by vLLM's request models as extra fields) are copied into its
      ``extra_args``, and ``SamplingParams.verify`` checks them there with the model's tokenizer
      (a text prediction becomes token ids): a bad value is vLLM's 400 naming the field
      (`ngramspec.integrations.request_args`).

    On any other version it changes nothing and logs why (the proposer then follows requests by
    their tokens, and requests carry no fields to it). vLLM loads general plug-ins in every
    process, whether ngramspec is used or not, so this never raises.
    """
    try:
        import vllm
        version = getattr(vllm, "__version__", "unknown")
    except ImportError:
        return
    if version != TESTED_VLLM:
        _log.warning("ngramspec: vLLM %s is not the tested %s; request ids and fields are not "
                     "handed to NgramspecProposer (it follows requests by their tokens)",
                     version, TESTED_VLLM)
        return
    _hook_front_end()
    try:
        from vllm.v1.worker import gpu_model_runner
    except Exception as exc:  # a platform without the GPU runner: nothing to hook
        _log.info("ngramspec: vLLM's GPU model runner does not import here (%s); not hooked",
                  exc)
        return
    runner = gpu_model_runner.GPUModelRunner
    original = runner.propose_draft_token_ids
    if getattr(original, "_ngramspec_hook", False):
        return

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, NgramspecProposer):
            drafter.set_request_ids(self.input_batch.req_ids,
                                    getattr(scheduler_output, "finished_req_ids", ()),
                                    lambda rid: _extra_args(self, rid))
        return original(self, scheduler_output, *args, **kwargs)

    _install(runner, "propose_draft_token_ids", propose_draft_token_ids, original)


def _extra_args(runner, req_id):
    """The runner's ``extra_args`` of a request (None when it holds none)."""
    state = getattr(runner, "requests", {}).get(req_id)
    params = getattr(state, "sampling_params", None)
    return getattr(params, "extra_args", None)


def _install(cls, name: str, hook, original) -> None:
    hook._ngramspec_hook = True
    hook.__wrapped__ = original
    setattr(cls, name, hook)


def _hook_front_end() -> None:
    """The API server's half of `register`: OpenAI fields into ``extra_args``, checked."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams
    except Exception as exc:
        _log.info("ngramspec: vLLM's OpenAI request models do not import here (%s); the "
                  "prediction and speculative fields go through vllm_xargs only", exc)
        return
    for cls in (ChatCompletionRequest, CompletionRequest):
        original = cls.to_sampling_params
        if not getattr(original, "_ngramspec_hook", False):
            _install(cls, "to_sampling_params", _fields_to_extra_args(original), original)
    verify = SamplingParams.verify
    if getattr(verify, "_ngramspec_hook", False):
        return

    def checked_verify(self, model_config, *args, **kwargs):
        verify(self, model_config, *args, **kwargs)
        tokenizer = args[2] if len(args) > 2 else kwargs.get("tokenizer")
        tokenize = None if tokenizer is None else (
            lambda text: tokenizer.encode(text, add_special_tokens=False))
        try:
            self.extra_args = checked_args(self.extra_args, tokenize=tokenize,
                                           n_vocab=model_config.get_vocab_size())
        except ParamError as exc:
            raise VLLMValidationError(str(exc), parameter=exc.field, value=exc.value) from None

    _install(SamplingParams, "verify", checked_verify, verify)


def _fields_to_extra_args(original):
    """``to_sampling_params`` that copies the request's OpenAI ``prediction`` and
    ``speculative`` fields (extra fields to vLLM's models) into ``extra_args``."""
    def to_sampling_params(self, *args, **kwargs):
        params = original(self, *args, **kwargs)
        extra = self.model_extra or {}
        fields = {k: extra[k] for k in (PREDICTION, SPECULATIVE) if extra.get(k) is not None}
        if fields:
            xargs = params.extra_args or {}
            for key, value in fields.items():
                if key in xargs and xargs[key] != value:
                    from vllm.exceptions import VLLMValidationError
                    raise VLLMValidationError(f"{key}: given both as a field and in vllm_xargs, "
                                              "differently", parameter=key)
            params.extra_args = {**xargs, **fields}
        return params
    return to_sampling_params

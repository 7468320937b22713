"""The batched serving engine: N request slots on one llama context, one ``llama_decode`` per step.

llama-server's slot loop over llama-cpp-python's low-level API, split as vLLM v1's scheduler is:
each step of the decode thread is *plan -> execute -> update*.

1. admission: queued requests go into free slots (:mod:`ngramspec.llama.admission`: the slot
   whose cached tokens share the longest prefix with the prompt, so the next turn of a chat
   decodes only its new tokens; a request whose prompt a busy slot holds waits a little for that
   slot rather than decode the prompt again);
2. plan (:func:`ngramspec.llama.planner.plan_step`, no llama context): the requests that end
   before the decode (cancelled, a full slot context), every generating slot's
   ``[sampled] + draft`` (``SlotLoop.propose``, bounded by llama-server's rules, the request's
   ``n_max`` and the step's token budget; the "auto" requests' drafts cut jointly by the one
   `AutoPolicy`) and the prompt chunks that fill the rest of the ``n_batch`` tokens (a long
   prompt is decoded over several steps while the running requests keep generating);
3. execute (:class:`ngramspec.llama.executor.StepExecutor`): one ``llama_decode``; each
   generating slot samples with its own sampler, accepting the draft while the sample equals it
   (lossless), verifies (``SlotLoop.verify``) and drops its rejected KV cells; a completed prompt
   samples its first token;
4. update: the tokens go through the stop rules (:mod:`ngramspec.stop_rules`, stop strings through
   the request's `TextStream`) to the client (callback / stream); ended requests free their slots.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections import deque
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from . import admission, deterministic
from .decoder import check_engine_models, context_params
from .calibration import context_calibration
from .executor import StepExecutor, StepOutput
from .model import default_threads, load_model
from .params import SamplingParams, SpeculationParams
from .planner import StepPlan, plan_step
from .request import Chunk, Completion, QueueFull, RequestHandle
from .sampling import Sampler
from .text import TextStream, token_piece_fn

from ngramspec.cost import CostModel
from ngramspec.draft_engine import NO_DRAFT
from ngramspec.engine import SpecEngine
from ngramspec.loop import SlotLoop
from ngramspec.policy import POLICIES, AutoPolicy
from ngramspec.prediction import PredictedEngine, PredictionDrafter
from ngramspec.registry import parse_types
from ngramspec.stats import DraftCounts
from ngramspec.stop_rules import CANCELLED, ERROR, LENGTH, STOP, cut_step
from ngramspec.tokens import token_array
from ngramspec.validation import (ContextOverflow, OutOfRange, Refused, check_choice,
                                  check_int)

__all__ = ["Scheduler", "RequestHandle", "Completion", "Chunk", "QueueFull"]

log = logging.getLogger("ngramspec.scheduler")

#: llama.cpp's LLAMA_MAX_SEQ (sequences of one context).
MAX_SLOTS = 256
#: Seconds per prompt token assumed by admission before any step was timed (a small model on a
#: CPU core; the cost model, or the mean of the timed steps, replaces it).
PROMPT_S_PER_TOKEN = 1e-3
#: `SpecEngine.stats`' counts that `Scheduler.stats` sums per proposer type.
PROPOSER_COUNTS = ("gen_tokens", "acc_tokens", "gen_drafts", "acc_drafts")


class _Request:
    """The decode thread's state of one request."""

    def __init__(self, rid, prompt, sampling, spec, on_token, prediction, cancel,
                 cache_owner=None, cache_prompt=True):
        self.prediction: Optional[PredictionDrafter] = prediction   # Predicted Outputs
        self.cache_owner, self.cache_prompt = cache_owner, cache_prompt   # see admission
        self.id = rid
        self.prompt: np.ndarray = prompt
        self.sampling: SamplingParams = sampling
        self.spec: SpeculationParams = spec
        self.on_token = on_token
        self.handle = RequestHandle(rid, cancel)
        self.cancel_requested = False
        self.slot: Optional["_Slot"] = None
        self.n_past = 0                # prompt tokens in the slot's KV cache
        self.n_cached = 0
        self.sampler: Optional[Sampler] = None
        self.loop = None
        self.text: Optional[TextStream] = None
        self.tokens: List[int] = []
        self.callback_error: Optional[BaseException] = None
        self.counts = DraftCounts()
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_first = 0.0


class _Slot:
    def __init__(self, sid: int, n_ctx: int):
        self.id = sid
        self.cached = np.empty(n_ctx, dtype=np.int32)  # tokens whose KV the sequence holds
        self.n_cached = 0
        self.req: Optional[_Request] = None
        self.last_used = 0
        self.owner = None     # the cache_owner of the request that left the cache


class Scheduler:
    """N request slots on one llama context, decoded together; lossless speculative decoding.

    Parameters
    ----------
    llm_or_path : llama_cpp.Llama, str or None
        The target model: a loaded ``Llama`` (its weights are shared, its own context unused),
        a GGUF path, or None for the embedded SmolLM2-135M-Instruct.
    n_slots : int, 1 .. 256
        Requests decoded at once (llama-server's ``-np``); the context's ``n_seq_max``.
    n_ctx : int
        Total KV cache cells, split evenly among the slots as llama-server does: each request
        (prompt + output) may hold ``n_ctx // n_slots`` tokens. The cache is unified (one buffer
        for all sequences, llama-server's ``--kv-unified``), so a step of unequal per-slot token
        counts is one ubatch.
    n_batch : int
        Tokens per ``llama_decode`` (all slots together; drafts are bounded to fit).
    n_threads : int, optional
        Decode threads (default: half the cores, see ``ngramspec.llama.model.default_threads``).
    spec_type : str or sequence of str
        The proposer chain (``SpecEngine``'s ``spec_type``); ``"none"`` = no speculation.
    spec_params : dict, optional
        ``SpecEngine`` keywords (``ngram_mod_n_match``, ...).
    draft_model : str or llama_cpp.Llama, optional
        Ends the chain with ``draft-simple`` on this model.
    queue_size : int, >= 1
        Requests that may wait for a slot (beyond those the free slots take); one more raises
        :class:`QueueFull`.
    policy : "fixed" or "auto"
        Default draft-length policy ("fixed": llama.cpp's behaviour; "auto": the cost-aware
        `ngramspec.policy.AutoPolicy`, choosing all slots' draft lengths of a step jointly).
    cost_model : CostModel, optional
        The verify-cost curve of "auto". Default: this context's calibration, cached per model,
        threads and n_batch (`ngramspec.llama.calibration.context_calibration`), measured at
        `start` when ``policy="auto"``; with ``"fixed"`` a cached one is used when there is
        one, and requests asking for "auto" without any cost model keep their drafts whole.
    deterministic : bool
        Greedy output byte-identical to plain decoding of the same prompt on a model loaded
        with ``load_model(deterministic=True)``, whatever the slot count, the other requests,
        the prompt-cache reuse, the speculation, the draft model or the prediction; a seeded
        sampled request gets the same tokens too (`ngramspec.llama.deterministic`: flash
        attention off, a KV stream per slot, slots' runs in one ``llama_decode`` only padded
        to one length (`StepPlan.split`), each prompt chunk alone, no one-token decode, each
        slot's context rounded up to a multiple of 256 cells). Costs the pads and the
        decodes no longer shared (bench/results/determinism.md). Raises `DeterminismRefused` (naming the
        reason) where it cannot hold: layers on a GPU, repacked weights, kernels that fail
        the run-time probe.

    Notes
    -----
    One decode thread (:meth:`start`) owns the llama context, the batch, the samplers and the
    proposer engine; nothing else touches them while it runs.

    Memory: the model, a KV cache of ``n_ctx`` cells, ``n_batch`` rows of logits, the proposers'
    per-slot state (see ``SpecEngine``), a copy of each slot's cached tokens.

    Thread-safety: :meth:`submit`, :meth:`cancel`, :meth:`stats`, :meth:`stop`, the tokenizer
    helpers and every :class:`RequestHandle` method may be called from any thread; the request
    queue is protected by a lock. ``on_token`` callbacks run on the decode thread: keep them
    short (an exception in one fails that request).
    """

    def __init__(self, llm_or_path=None, *, n_slots: int = 4, n_ctx: int = 4096,
                 n_batch: int = 512, n_threads: Optional[int] = None,
                 spec_type: Union[str, Sequence[str]] = "ngram-mod",
                 spec_params: Optional[dict] = None, draft_model=None, queue_size: int = 64,
                 policy: str = "fixed", cost_model=None, deterministic: bool = False):
        self.n_slots = check_int("n_slots", n_slots, 1, MAX_SLOTS)
        n_ctx = check_int("n_ctx", n_ctx, 8 * self.n_slots)
        self.n_batch = check_int("n_batch", n_batch, 8)
        self.queue_size = check_int("queue_size", queue_size, 1)
        check_choice("policy", policy, POLICIES)
        self.policy = policy
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        self.n_threads = check_int("n_threads", n_threads, 1) if n_threads is not None \
            else default_threads()
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
        self.deterministic = deterministic
        self._open_context(llm_or_path, n_ctx)
        self._engine, self.spec_types = self._build_engine(spec_type, spec_params, draft_model)
        self._engines: Dict[tuple, object] = {}
        # draft-simple keeps a p_min per slot: each request sets its own at its start
        self._draft_proposer = next((p for p in self._engine.proposers
                                     if p.name == "draft-simple"), None)
        self._slots = [_Slot(i, self.n_ctx_slot) for i in range(self.n_slots)]
        self._queue: deque = deque()
        self._active: List[_Request] = []     # admitted, in admission order
        self._live: Dict[int, _Request] = {}  # submitted, not finished (cancel's look-up)
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._closed = False
        #: the verify-cost curve of policy "auto" (set by `start` unless given)
        self.cost_model = cost_model
        #: the one AutoPolicy of all "auto" requests (set by `start`; None without a cost model)
        self.auto_policy: Optional[AutoPolicy] = None
        self._use = 0
        self._stats = {"requests_submitted": 0, "requests_finished": 0,
                       "requests_cancelled": 0, "tokens_predicted": 0, "tokens_prompt": 0,
                       "tokens_prompt_cached": 0, "decode_calls": 0, "decode_tokens": 0,
                       "t_decode_s": 0.0, "t_steps_cpu_s": 0.0}
        self._counts = DraftCounts()   # every request's, summed

    # -- construction helpers ------------------------------------------------------------------

    def _open_context(self, llm_or_path, n_ctx: int) -> None:
        """The target's weights and this scheduler's own context on them (one sequence per slot,
        a unified KV cache; a stream per slot under the deterministic mode), and the step
        executor that decodes on it."""
        import llama_cpp as lc
        self._lc = lc
        if llm_or_path is None or isinstance(llm_or_path, (str, os.PathLike)):
            # A small context of its own: the Llama serves as tokenizer and chat template only.
            self.llm = load_model(None if llm_or_path is None else os.fspath(llm_or_path),
                                  n_ctx=64, n_batch=64, n_threads=self.n_threads,
                                  deterministic=self.deterministic)
        else:
            self.llm = llm_or_path
        model = self.llm.model
        det = self.deterministic
        if det:
            deterministic.require(self.llm, self.n_threads)
            n_ctx = deterministic.slot_context(n_ctx, self.n_slots)
        cp = context_params(n_ctx=n_ctx, n_batch=self.n_batch, n_seq_max=self.n_slots,
                            n_threads=self.n_threads, unified=not det,
                            flash_attn=False if det else None)
        self._ctx = lc.llama_init_from_model(model, cp)
        if not self._ctx:
            raise RuntimeError("llama_init_from_model failed (n_ctx too large for memory?)")
        self.vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        self.n_ctx = int(lc.llama_n_ctx(self._ctx))
        self.n_ctx_slot = self.n_ctx // self.n_slots
        if det:   # the last cell of a stream is kept for the pad of a one-token step
            self.n_ctx_slot -= deterministic.MIN_RUN - 1
        self._eog = [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)]
        self._eog_set = frozenset(self._eog)
        self._piece = token_piece_fn(self.vocab)
        self._executor = StepExecutor(self._ctx, self.n_batch, self._eog_set,
                                      min_run=deterministic.MIN_RUN if det else 1)

    def _build_engine(self, spec_type, spec_params, draft_model):
        types = [t for t in parse_types(spec_type) if t != "none"]
        params = dict(spec_params or {})
        if draft_model is not None:
            if "draft-simple" not in types:
                types.append("draft-simple")
            params["model_draft"] = draft_model
        if not types:
            return NO_DRAFT, ()
        engine = SpecEngine(types, n_slots=self.n_slots, **params)
        # drafts must be ids of this model: a draft model of another vocabulary, an n-gram
        # cache file of another tokenizer are refused, and drafts stay inside the vocabulary
        check_engine_models(self.llm, engine)
        return engine, tuple(engine.types)

    def _engine_for(self, types: Optional[tuple]):
        """The engine of a request's proposer subset: the configured chain's own proposer objects
        (so slots, the ngram-mod pool and the ngram-suffix store stay shared), cached per subset."""
        if types is None or tuple(types) == self.spec_types:
            return self._engine
        key = tuple(t for t in self.spec_types if t in types)
        eng = self._engines.get(key)
        if eng is None:
            props = [p for p in self._engine.proposers if p.name in key]
            eng = SpecEngine.from_proposers(props, n_slots=self.n_slots)
            with self._cond:  # stats() reads the dict from other threads
                self._engines[key] = eng
        return eng

    # -- public API ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the decode thread (once)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler has been stopped")
            if self._thread is not None:
                return
            self._calibrate()
            self._thread = threading.Thread(target=self._run, name="ngramspec-decode",
                                            daemon=True)
            self._thread.start()

    def _calibrate(self) -> None:
        """The cost model and the joint AutoPolicy of "auto" requests: measured on the idle
        context (sequence 0, then emptied) for ``policy="auto"``, else only a cached one."""
        if not self._engine.speculates:
            return
        if self.cost_model is None:
            self.cost_model = context_calibration(self.llm, self._ctx, self.n_threads,
                                                  self.n_batch,
                                                  measure_now=self.policy == "auto")
        if self.cost_model is not None:
            self.auto_policy = AutoPolicy(self.cost_model, joint=True)

    def stop(self, *, cancel: bool = False, timeout: Optional[float] = None) -> None:
        """Stop accepting requests, finish (or with ``cancel=True`` cancel) the ones submitted,
        end the decode thread and free the context.

        Raises TimeoutError when the thread has not ended after ``timeout`` seconds.
        """
        with self._cond:
            self._stopping = True
            if cancel:
                for r in list(self._queue) + self._active:
                    r.cancel_requested = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the decode thread did not stop within {timeout} s")
        else:
            with self._cond:
                for r in list(self._queue):
                    self._finish(r, CANCELLED)
                self._queue.clear()
        self._free()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop(cancel=exc[0] is not None)

    def _free(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if self._ctx:
            self._lc.llama_free(self._ctx)
            self._ctx = None

    def submit(self, prompt_tokens, sampling: SamplingParams = SamplingParams(),
               speculation: Optional[SpeculationParams] = None,
               on_token: Optional[Callable[[List[int], str], None]] = None,
               prediction=None, cache_owner: Optional[str] = None,
               cache_prompt: bool = True) -> RequestHandle:
        """Queue a request.

        Parameters
        ----------
        prompt_tokens : 1-D sequence of int
            The whole prompt (token ids of this model's vocabulary).
        sampling : SamplingParams
        speculation : SpeculationParams, optional
            Default: the whole chain, the scheduler's policy.
        on_token : callable(tokens, text), optional
            Called on the decode thread after every step that emitted tokens.
        prediction : 1-D sequence of int, optional
            The expected output's tokens (OpenAI's Predicted Outputs): the request's first draft
            source (`ngramspec.prediction`), ahead of the chain; unused when speculation is off.
            The output does not depend on it, only the number of steps.
        cache_owner : str, optional
            Whose cached prompts the request may reuse: only those of requests of the same
            owner (None: of every request without an owner, llama-server's shared cache).
        cache_prompt : bool
            llama-server's ``cache_prompt``: False decodes the whole prompt, reusing no cache.

        Returns
        -------
        RequestHandle

        Raises
        ------
        ValueError
            A bad prompt, a prompt that does not fit a slot's context, a proposer type not in the
            configured chain, a logit_bias token outside the vocabulary, a ``repeat_last_n``
            beyond a slot's context.
        QueueFull
            ``queue_size`` requests are already waiting for a slot (requests that free slots
            can take do not count).
        RuntimeError
            The scheduler is stopped.
        """
        prompt, sampling, spec, drafter = self._check_request(prompt_tokens, sampling,
                                                              speculation, on_token, prediction)
        with self._cond:
            if self._stopping or self._closed:
                raise RuntimeError("the scheduler is stopped")
            # Requests a free slot will take at the decode thread's next turn are not waiting:
            # only those beyond the free slots count against the queue.
            free = sum(1 for s in self._slots if s.req is None)
            if len(self._queue) >= self.queue_size + free:
                raise QueueFull(f"the request queue is full ({self.queue_size} waiting)")
            req = _Request(next(self._ids), prompt, sampling, spec, on_token, drafter,
                           self.cancel, cache_owner, bool(cache_prompt))
            self._queue.append(req)
            self._live[req.id] = req
            self._stats["requests_submitted"] += 1
            self._cond.notify_all()
        return req.handle

    def cancel(self, request_id: int) -> None:
        """Ask the decode thread to stop a request (`RequestHandle.cancel`); its slot is free
        within one step. A finished or unknown id is ignored.

        Thread-safety: may be called from any thread.
        """
        with self._cond:
            req = self._live.get(request_id)
            if req is not None:
                req.cancel_requested = True
            self._cond.notify_all()

    def _check_request(self, prompt_tokens, sampling, speculation, on_token, prediction):
        """`submit`'s arguments checked against this model and its slots: ``(prompt array,
        sampling, speculation, prediction drafter or None)``."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        spec = speculation if speculation is not None else SpeculationParams()
        if not isinstance(spec, SpeculationParams):
            raise TypeError(f"speculation must be a SpeculationParams, got "
                            f"{type(spec).__name__}")
        self._check_spec(spec)
        prompt = self._check_prompt(prompt_tokens)
        drafter = self._check_prediction(prediction) if prediction is not None else None
        sampling = self._check_sampling(sampling)
        if on_token is not None and not callable(on_token):
            raise TypeError("on_token must be callable")
        return prompt, sampling, spec, drafter

    def _check_prompt(self, prompt_tokens) -> np.ndarray:
        # The package's one token validator (ngramspec.tokens), then this model's own bounds.
        arr = token_array(prompt_tokens, "prompt_tokens")
        if arr.size == 0:
            raise Refused("prompt_tokens", "must be a non-empty 1-D sequence of integer token ids",
                          sep=" ")
        if arr.max() >= self.n_vocab:
            raise Refused("prompt_tokens", f"token ids must lie in 0 .. {self.n_vocab - 1}")
        if arr.size >= self.n_ctx_slot:
            raise ContextOverflow("prompt_tokens", f"the prompt ({arr.size} tokens) does not fit a "
                                  f"slot's context (n_ctx {self.n_ctx} / {self.n_slots} slots = "
                                  f"{self.n_ctx_slot} tokens, one kept for the first output "
                                  "token)", value=arr.size)
        return arr

    def _check_prediction(self, prediction) -> Optional[PredictionDrafter]:
        # Its index is built here, on the submitting thread, not on the decode thread.
        arr = token_array(prediction, "prediction")
        if arr.size == 0:
            return None
        if arr.max() >= self.n_vocab:
            raise Refused("prediction", f"token ids must lie in 0 .. {self.n_vocab - 1}")
        if arr.size > self.n_ctx_slot:
            raise Refused("prediction", f"{arr.size} tokens is longer than any output can be (a "
                                        f"slot's context: {self.n_ctx_slot} tokens)")
        return PredictionDrafter(arr)

    def _check_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """The request's sampling parameters against this model and slot size: logit_bias ids
        in the vocabulary, ``repeat_last_n`` at most a slot's context (-1 = the slot's context,
        as llama-server turns -1 into its context size; the penalty sampler keeps a ring of
        that many tokens, so a larger value would only cost memory)."""
        for tok in sampling.logit_bias:
            if tok >= self.n_vocab:
                raise OutOfRange("logit_bias token id", tok, f"0 .. {self.n_vocab - 1}")
        n = sampling.repeat_last_n
        if n > self.n_ctx_slot:
            raise OutOfRange("repeat_last_n", n, f"-1 (a slot's context) .. {self.n_ctx_slot} (a "
                                                 "slot's context)")
        if n == -1:
            sampling = dataclasses.replace(sampling, repeat_last_n=self.n_ctx_slot)
        return sampling

    def _check_spec(self, spec: SpeculationParams) -> None:
        if spec.types is not None:
            for t in spec.types:
                if t not in self.spec_types:
                    raise Refused("speculation.types", f"{t!r} is not in the scheduler's chain "
                                  f"({', '.join(self.spec_types) or 'none'})", value=t)
        if spec.p_min is not None and "draft-simple" not in self.spec_types:
            raise Refused("speculation.p_min", "needs a draft model (draft-simple) in the chain",
                          sep=" ")

    def stats(self) -> dict:
        """Counters for monitoring (``/metrics``): slots, queue, tokens, drafts per proposer.

        Keys: ``n_slots``, ``slots_busy``, ``queue_length``, ``requests_submitted``,
        ``requests_finished``, ``requests_cancelled``, ``tokens_predicted``, ``tokens_prompt``,
        ``tokens_prompt_cached``, ``decode_calls``, ``decode_tokens``, ``n_draft_tokens`` and
        ``n_acc_tokens`` (draft tokens the steps verified and accepted: the drivers' names, see
        `ngramspec.stats`), ``t_decode_s`` (wall time in ``llama_decode``), ``t_steps_cpu_s``
        (CPU time of the decode thread's steps: with one decode thread llama.cpp computes on
        it, so this is the work done, whatever the machine's load), and ``proposers``: per
        proposer type the sums of `SpecEngine.stats`' ``gen_tokens``, ``acc_tokens``,
        ``gen_drafts`` and ``acc_drafts`` over every engine of the chain's proposers.
        """
        with self._cond:
            out = dict(self._stats)
            times = {key: out.pop(key) for key in ("t_decode_s", "t_steps_cpu_s")}
            out.update(n_draft_tokens=self._counts.n_draft_tokens,
                       n_acc_tokens=self._counts.n_acc_tokens, **times)
            out["n_slots"] = self.n_slots
            out["slots_busy"] = sum(1 for s in self._slots if s.req is not None)
            out["queue_length"] = len(self._queue)
            engines = [self._engine, *self._engines.values()]
        per: Dict[str, dict] = {t: dict.fromkeys(PROPOSER_COUNTS, 0) for t in self.spec_types}
        for eng in engines:
            for st in eng.stats():
                d = per[st["type"]]
                for key in PROPOSER_COUNTS:
                    d[key] += st[key]
        out["proposers"] = per
        return out

    # tokenizer helpers (thread-safe: llama.cpp's tokenizer is read-only)

    def tokenize(self, text: str, special: bool = True, add_bos: Optional[bool] = None) -> List[int]:
        """Token ids of ``text``; BOS is added when the model asks for it (``add_bos=None``)."""
        if add_bos is None:
            add_bos = bool(self._lc.llama_vocab_get_add_bos(self.vocab))
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (control tokens render as nothing)."""
        return b"".join(self._piece(int(t)) for t in tokens).decode("utf-8", errors="replace")

    # -- the decode thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # never leave a waiting client behind
            log.exception("the scheduler's decode thread failed")
            with self._cond:
                self._stopping = True
                pending = list(self._queue) + list(self._active)
                self._queue.clear()
            for r in pending:
                self._finish(r, ERROR, error=exc)
            raise

    def _serve(self) -> None:
        while True:
            with self._cond:
                while (not self._active and not self._queue and not self._stopping):
                    self._cond.wait()
                if self._stopping and not self._active and not self._queue:
                    return
                self._reap_queue()
                self._admit()
            if self._active:
                c0 = time.thread_time()
                try:
                    self._step()
                except Exception as exc:  # a decode failure fails the running requests only
                    log.exception("scheduler step failed")
                    for r in list(self._active):
                        self._finish(r, ERROR, error=exc)
                        self._executor.drop(r.slot.id, 0)
                        r.slot.n_cached = 0
                with self._cond:
                    self._stats["t_steps_cpu_s"] += time.thread_time() - c0

    def _reap_queue(self) -> None:
        for r in [r for r in self._queue if r.cancel_requested]:
            self._queue.remove(r)
            self._finish(r, CANCELLED)

    def _admit(self) -> None:
        """Admit queued requests into free slots (:func:`ngramspec.llama.admission.plan`: the
        free slot with the longest cached prefix, or a short wait for a busy slot that holds the
        prompt)."""
        if not self._queue:
            return
        free = [s for s in self._slots if s.req is None]
        if not free:
            return
        busy = [s.req for s in self._slots if s.req is not None]
        for req, slot, lcp in admission.plan(self._queue, free, [r.prompt for r in busy],
                                             time.perf_counter(), self._prompt_seconds,
                                             [r.cache_owner for r in busy]):
            self._queue.remove(req)
            self._place(req, slot, lcp)

    def _prompt_seconds(self, n: int) -> float:
        """Estimated seconds to decode ``n`` prompt tokens: the cost model's t(n) when there is
        one, else the timed steps' mean per token."""
        if self.cost_model is not None:
            return self.cost_model.seconds(n)
        st = self._stats
        if not st["decode_tokens"]:
            return n * PROMPT_S_PER_TOKEN
        return n * st["t_decode_s"] / st["decode_tokens"]

    def _place(self, req: _Request, slot: _Slot, lcp: int) -> None:
        # The prompt's last token is always decoded: its logits give the first token.
        lcp = min(lcp, req.prompt.size - 1)
        self._executor.drop(slot.id, lcp)
        slot.n_cached = lcp
        slot.req = req
        slot.owner = req.cache_owner      # what the slot caches from now on is this owner's
        self._use += 1
        slot.last_used = self._use
        req.slot = slot
        req.n_past = req.n_cached = lcp
        req.t_admit = time.perf_counter()
        req.sampler = Sampler(req.sampling, self.n_vocab, self._eog)
        req.sampler.accept(req.prompt)
        req.text = TextStream(self._piece, req.sampling.stop)
        self._active.append(req)
        self._stats["tokens_prompt"] += int(req.prompt.size)
        self._stats["tokens_prompt_cached"] += lcp

    def _step(self) -> None:
        """plan -> execute -> update: one ``llama_decode`` of every running request."""
        plan = plan_step(self._active, self.n_batch, self.n_ctx_slot, self.auto_policy)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step plan:\n%s", plan)
        for r, reason in plan.finishes:
            self._finish(r, reason)
        # the deterministic mode's decodes: runs of one length or one sequence (`StepPlan.split`)
        parts = plan.split(self.n_batch, self.n_ctx_slot, deterministic.MIN_RUN) \
            if self.deterministic else ((plan, 0),)
        for part, pad_to in parts:
            n = part.n_tokens
            if n == 0:
                continue
            out = self._executor.decode(part, pad_to)
            with self._cond:
                self._stats["decode_calls"] += 1
                self._stats["decode_tokens"] += n
                self._stats["t_decode_s"] += out.seconds
            self._update(part, out)

    def _update(self, plan: StepPlan, out: StepOutput) -> None:
        """Apply a decoded plan: verify and emit each generating slot's tokens, advance the
        prompts, start the requests whose prompt is complete."""
        executor = self._executor
        for run, at in zip(plan.verifies, out.verify_at):
            r = run.req
            tokens, n_acc = executor.verify(run, out, at)
            m = len(run.draft)
            r.counts.verified(m, n_acc)
            with self._cond:
                self._counts.verified(m, n_acc)
            self._emit(r, tokens)
        for chunk, at in zip(plan.chunks, out.chunk_at):
            chunk.req.n_past = chunk.stop
            if chunk.last:
                self._start_generating(chunk.req, executor.first_token(chunk, out, at))

    def _start_generating(self, r: _Request, tok: int) -> None:
        """The request's prompt is in its slot and ``tok`` is its first output token: begin its
        loop on its proposers and emit the token."""
        r.t_first = time.perf_counter()
        r.slot.cached[:r.prompt.size] = r.prompt
        r.slot.n_cached = int(r.prompt.size)
        spec = r.spec
        engine = self._engine_for(spec.types) if spec.enabled else NO_DRAFT
        if spec.enabled and r.prediction is not None:
            engine = PredictedEngine(r.prediction, engine)
        if self._draft_proposer is not None:
            # the request's own p_min, held by its slot (None: the proposer's)
            self._draft_proposer.set_p_min(r.slot.id, spec.p_min)
        auto = engine.speculates and (spec.policy or self.policy) == "auto"
        r.loop = SlotLoop(engine, r.slot.id, r.prompt, tok, n_ctx=self.n_ctx_slot,
                          n_predict=r.sampling.max_tokens,
                          policy=self.auto_policy if auto else None, capacity=self.n_ctx_slot)
        self._emit(r, [tok])

    def _emit(self, r: _Request, tokens: List[int]) -> None:
        """Append emitted tokens, apply the stop rules, stream; finish the request if it ends."""
        is_eog = None if r.sampling.ignore_eos else self._eog_set.__contains__
        keep, reason = cut_step(tokens, len(r.tokens), r.sampling.max_tokens, is_eog)
        tokens = [int(t) for t in tokens[:keep]]
        n_kept, chunk = r.text.push(tokens)
        if r.text.stopped:
            tokens, reason = tokens[:n_kept], STOP
        r.tokens.extend(tokens)
        if reason is None and r.loop is not None and r.loop.done:
            reason = LENGTH  # the loop's output limit (sample_run stopped at it)
        if reason is not None:
            chunk += r.text.finish()
        if tokens or chunk:
            self._deliver(r, tokens, chunk)
        if reason is not None and not r.handle.done:
            self._finish(r, reason)

    def _deliver(self, r: _Request, tokens: List[int], text: str) -> None:
        r.handle.deliver(Chunk(tokens, text))
        if r.on_token is not None:
            try:
                r.on_token(tokens, text)
            except Exception as exc:
                log.exception("on_token callback of request %d failed", r.id)
                r.callback_error = exc
                r.cancel_requested = True

    def _finish(self, r: _Request, reason: str, error: Optional[BaseException] = None) -> None:
        if r.handle.done:
            return
        if r in self._active:
            self._active.remove(r)
        if r.slot is not None:
            r.slot.req = None
        if r.sampler is not None:
            r.sampler.close()
        comp = self._completion(r, reason)
        with self._cond:
            self._live.pop(r.id, None)
            self._stats["requests_finished"] += 1
            self._stats["tokens_predicted"] += len(r.tokens)
            if reason == CANCELLED:
                self._stats["requests_cancelled"] += 1
        r.handle.complete(comp, error or r.callback_error)
        if r.slot is not None and r.loop is not None:
            self._learn(r.slot.id)

    def _learn(self, slot: int) -> None:
        """What the finished request on `slot` taught (ngram-suffix's store) reaches every slot
        now, not when this slot's next request begins: a server with many slots learns as one.
        After the client has its answer (a store insertion may rebuild the store); a failure
        only loses the lesson (the slot is idle all the same), never the request."""
        try:
            self._engine.end(slot)
        except MemoryError:
            log.warning("out of memory storing slot %d's finished request in the proposers' "
                        "store: not learned from", slot)

    @staticmethod
    def _completion(r: _Request, reason: str) -> Completion:
        """What the request's client gets back."""
        now = time.perf_counter()
        text = r.text.text if r.text is not None else ""
        stop_string = r.text.stop_string if r.text is not None else None
        engine = r.loop.engine if r.loop is not None else NO_DRAFT
        t_first = r.t_first or now
        return Completion(
            tokens=list(r.tokens), text=text, finish_reason=reason, prompt_n=int(r.prompt.size),
            prompt_cached_n=r.n_cached, predicted_n=len(r.tokens),
            prompt_ms=(t_first - r.t_admit) * 1e3 if r.t_admit else 0.0,
            predicted_ms=(now - t_first) * 1e3 if r.t_first else 0.0,
            counts=r.counts.copy(), stop_string=stop_string,
            queued_ms=((r.t_admit or now) - r.t_submit) * 1e3,
            accepted_prediction_tokens=engine.accepted_prediction_tokens,
            rejected_prediction_tokens=engine.rejected_prediction_tokens)

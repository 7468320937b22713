"""The batched serving engine: N request slots on one llama context, one ``llama_decode`` per step.

llama-server's slot loop over llama-cpp-python's low-level API. Each step of the decode thread:

1. retires cancelled requests (their slot is free for the next step);
2. every generating slot proposes a draft (``SlotLoop.propose``: the proposer chain, bounded by
   llama-server's ``n_ctx - L - 2`` / ``n_remaining - 1`` rules, the request's ``n_max`` and the
   step's token budget) and adds ``[sampled] + draft`` to the batch, logits at every position,
   under its own sequence id (= slot);
3. prompts being processed fill the rest of the batch (``n_batch`` tokens in all): a long prompt
   is decoded in chunks over several steps while the running requests keep generating;
4. one ``llama_decode``;
5. each generating slot samples its target tokens with its own sampler, accepting the draft while
   the sample equals it (:func:`ngramspec.llama.sampling.sample_run`; lossless), verifies
   (``SlotLoop.verify``), drops its rejected KV cells (``llama_memory_seq_rm``) and emits its tokens
   (callback / stream); a slot whose prompt is complete samples its first token;
6. finished requests (EOS, a stop string, ``max_tokens``, a full slot context) are retired, and
   queued requests are admitted into free slots — the slot whose cached tokens share the longest
   prefix with the prompt, so the next turn of a chat decodes only its new tokens; a request
   whose prompt a busy slot holds waits a little for that slot rather than decode the prompt
   again (:mod:`ngramspec.llama.admission`).
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

from . import admission
from .batch import MultiSeqBatch
from .decoder import check_engine_models, context_params
from .calibration import context_calibration
from .model import default_threads, load_model
from .params import SamplingParams, SpeculationParams
from .request import Chunk, Completion, QueueFull, RequestHandle
from .sampling import Sampler, sample_run
from .text import TextStream, token_piece_fn

from ngramspec.cost import CostModel
from ngramspec.engine import SpecEngine
from ngramspec.loop import SlotLoop
from ngramspec.policy import POLICIES, AutoPolicy
from ngramspec.prediction import PredictedEngine, PredictionDrafter
from ngramspec.registry import parse_types
from ngramspec.tokens import token_array
from ngramspec.validation import (ContextOverflow, OutOfRange, Refused, check_choice,
                                  check_int)

__all__ = ["Scheduler", "RequestHandle", "Completion", "Chunk", "QueueFull"]

log = logging.getLogger("ngramspec.scheduler")

#: llama.cpp's LLAMA_MAX_SEQ (sequences of one context).
MAX_SLOTS = 256
#: Prompt tokens a step keeps for admitted prompts when drafts could fill the whole batch.
PREFILL_RESERVE = 64
#: Seconds per prompt token assumed by admission before any step was timed (a small model on a
#: CPU core; the cost model, or the mean of the timed steps, replaces it).
PROMPT_S_PER_TOKEN = 1e-3


class _Request:
    """The decode thread's state of one request."""

    def __init__(self, sched, rid, prompt, sampling, spec, on_token, prediction=None):
        self.sched = sched
        self.prediction: Optional[PredictionDrafter] = prediction   # Predicted Outputs
        self.id = rid
        self.prompt: np.ndarray = prompt
        self.sampling: SamplingParams = sampling
        self.spec: SpeculationParams = spec
        self.on_token = on_token
        self.handle = RequestHandle(self)
        self.cancel_requested = False
        self.slot: Optional["_Slot"] = None
        self.n_past = 0                # prompt tokens in the slot's KV cache
        self.n_cached = 0
        self.sampler: Optional[Sampler] = None
        self.loop = None
        self.text: Optional[TextStream] = None
        self.tokens: List[int] = []
        self.draft = None              # this step's draft
        self.first_idx = 0             # batch index of this step's first token
        self.last_idx = -1             # batch index of the prompt's last token (its final chunk)
        self.callback_error: Optional[BaseException] = None
        self.draft_n = self.draft_acc = 0
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_first = 0.0


class _Slot:
    def __init__(self, sid: int, n_ctx: int):
        self.id = sid
        self.cached = np.empty(n_ctx, dtype=np.int32)  # tokens whose KV the sequence holds
        self.n_cached = 0
        self.req: Optional[_Request] = None
        self.last_used = 0


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

    Notes
    -----
    One decode thread (:meth:`start`) owns the llama context, the batch, the samplers and the
    proposer engine; nothing else touches them while it runs.

    Memory: the model, a KV cache of ``n_ctx`` cells, ``n_batch`` rows of logits, the proposers'
    per-slot state (see ``SpecEngine``), a copy of each slot's cached tokens.

    Thread-safety: :meth:`submit`, :meth:`stats`, :meth:`stop`, the tokenizer helpers and every
    :class:`RequestHandle` method may be called from any thread; the request queue is protected
    by a lock. ``on_token`` callbacks run on the decode thread: keep them short (an exception in
    one fails that request).
    """

    def __init__(self, llm_or_path=None, *, n_slots: int = 4, n_ctx: int = 4096,
                 n_batch: int = 512, n_threads: Optional[int] = None,
                 spec_type: Union[str, Sequence[str]] = "ngram-mod",
                 spec_params: Optional[dict] = None, draft_model=None, queue_size: int = 64,
                 policy: str = "fixed", cost_model=None):
        import llama_cpp as lc
        self._lc = lc
        self.n_slots = check_int("n_slots", n_slots, 1, MAX_SLOTS)
        n_ctx = check_int("n_ctx", n_ctx, 8 * self.n_slots)
        self.n_batch = check_int("n_batch", n_batch, 8)
        self.queue_size = check_int("queue_size", queue_size, 1)
        check_choice("policy", policy, POLICIES)
        self.policy = policy
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        threads = check_int("n_threads", n_threads, 1) if n_threads is not None \
            else default_threads()
        self.n_threads = threads
        if llm_or_path is None or isinstance(llm_or_path, (str, os.PathLike)):
            # A small context of its own: the Llama serves as tokenizer and chat template only.
            self.llm = load_model(None if llm_or_path is None else os.fspath(llm_or_path),
                                  n_ctx=64, n_batch=64, n_threads=threads)
        else:
            self.llm = llm_or_path
        model = self.llm.model
        cp = context_params(n_ctx=n_ctx, n_batch=self.n_batch, n_seq_max=self.n_slots,
                            n_threads=threads, unified=True)
        self._ctx = lc.llama_init_from_model(model, cp)
        if not self._ctx:
            raise RuntimeError("llama_init_from_model failed (n_ctx too large for memory?)")
        self._mem = lc.llama_get_memory(self._ctx)
        self.vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        self.n_ctx = int(lc.llama_n_ctx(self._ctx))
        self.n_ctx_slot = self.n_ctx // self.n_slots
        self._eog = [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)]
        self._eog_set = frozenset(self._eog)
        self._piece = token_piece_fn(self.vocab)
        self._batch = MultiSeqBatch(self.n_batch)

        self._engine, self.spec_types = self._build_engine(spec_type, spec_params, draft_model)
        self._engines: Dict[tuple, object] = {}
        self._draft_proposer = next((p for p in (self._engine.proposers if self._engine else ())
                                     if p.name == "draft-simple"), None)
        self._draft_p_min = getattr(self._draft_proposer, "p_min", 0.0)
        self._slots = [_Slot(i, self.n_ctx_slot) for i in range(self.n_slots)]
        self._queue: deque = deque()
        self._active: List[_Request] = []     # admitted, in admission order
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
                       "draft_tokens": 0, "draft_tokens_accepted": 0, "t_decode_s": 0.0,
                       "t_steps_cpu_s": 0.0}

    # -- construction helpers ------------------------------------------------------------------

    def _build_engine(self, spec_type, spec_params, draft_model):
        types = [t for t in parse_types(spec_type) if t != "none"]
        params = dict(spec_params or {})
        if draft_model is not None:
            if "draft-simple" not in types:
                types.append("draft-simple")
            params["model_draft"] = draft_model
        if not types:
            return None, ()
        engine = SpecEngine(types, n_slots=self.n_slots, **params)
        # drafts must be ids of this model: a draft model of another vocabulary, an n-gram
        # cache file of another tokenizer are refused, and drafts stay inside the vocabulary
        check_engine_models(self.llm, engine)
        return engine, tuple(engine.types)

    def _engine_for(self, types: Optional[tuple]):
        """The engine of a request's proposer subset: the configured chain's own proposer objects
        (so slots, the ngram-mod pool and the ngram-suffix store stay shared), cached per subset."""
        if self._engine is None:
            return None
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
        if self._engine is None:
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
                    self._finish(r, "cancelled")
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
               prediction=None) -> RequestHandle:
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
        with self._cond:
            if self._stopping or self._closed:
                raise RuntimeError("the scheduler is stopped")
            # Requests a free slot will take at the decode thread's next turn are not waiting:
            # only those beyond the free slots count against the queue.
            free = sum(1 for s in self._slots if s.req is None)
            if len(self._queue) >= self.queue_size + free:
                raise QueueFull(f"the request queue is full ({self.queue_size} waiting)")
            req = _Request(self, next(self._ids), prompt, sampling, spec, on_token, drafter)
            self._queue.append(req)
            self._stats["requests_submitted"] += 1
            self._cond.notify_all()
        return req.handle

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
        ``tokens_prompt_cached``, ``decode_calls``, ``decode_tokens``, ``draft_tokens``,
        ``draft_tokens_accepted``, ``t_decode_s`` (wall time in ``llama_decode``),
        ``t_steps_cpu_s`` (CPU time of the decode thread's steps: with one decode thread
        llama.cpp computes on it, so this is the work done, whatever the machine's load), and
        ``proposers``: per proposer type
        ``{"drafted": ..., "accepted": ..., "drafts": ..., "drafts_accepted": ...}``.
        """
        with self._cond:
            out = dict(self._stats)
            out["n_slots"] = self.n_slots
            out["slots_busy"] = sum(1 for s in self._slots if s.req is not None)
            out["queue_length"] = len(self._queue)
            engines = ([self._engine] if self._engine is not None else []) \
                + list(self._engines.values())
        per: Dict[str, dict] = {t: {"drafted": 0, "accepted": 0, "drafts": 0,
                                    "drafts_accepted": 0} for t in self.spec_types}
        for eng in engines:
            for st in eng.stats():
                d = per[st["type"]]
                d["drafted"] += st["gen_tokens"]
                d["accepted"] += st["acc_tokens"]
                d["drafts"] += st["gen_drafts"]
                d["drafts_accepted"] += st["acc_drafts"]
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

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

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
                self._finish(r, "error", error=exc)
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
                        self._finish(r, "error", error=exc)
                        self._lc.llama_memory_seq_rm(self._mem, r.slot.id, 0, -1)
                        r.slot.n_cached = 0
                with self._cond:
                    self._stats["t_steps_cpu_s"] += time.thread_time() - c0

    def _reap_queue(self) -> None:
        for r in [r for r in self._queue if r.cancel_requested]:
            self._queue.remove(r)
            self._finish(r, "cancelled")

    def _admit(self) -> None:
        """Admit queued requests into free slots (:func:`ngramspec.llama.admission.plan`: the
        free slot with the longest cached prefix, or a short wait for a busy slot that holds the
        prompt)."""
        if not self._queue:
            return
        free = [s for s in self._slots if s.req is None]
        if not free:
            return
        running = [s.req.prompt for s in self._slots if s.req is not None]
        for req, slot, lcp in admission.plan(self._queue, free, running, time.perf_counter(),
                                             self._prompt_seconds):
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
        self._lc.llama_memory_seq_rm(self._mem, slot.id, lcp, -1)
        slot.n_cached = lcp
        slot.req = req
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
        batch = self._batch
        batch.clear()
        for r in [r for r in self._active if r.cancel_requested]:
            self._finish(r, "cancelled")
        gen = [r for r in self._active if r.loop is not None]
        pre = [r for r in self._active if r.loop is None]
        for r in list(gen):
            if r.loop.context.size + 1 > self.n_ctx_slot:  # no cell left for `sampled`
                self._finish(r, "context")
                gen.remove(r)
        # Drafts of all generating slots must fit the batch with room kept for prompts.
        reserve = min(PREFILL_RESERVE, self.n_batch // 4) if pre else 0
        cap = max(0, (self.n_batch - reserve) // max(1, len(gen)) - 1)
        dp = self._draft_proposer
        for r in gen:
            n_max = cap if r.spec.n_max is None else min(cap, r.spec.n_max)
            n_min = r.spec.n_min or 0
            if dp is not None and r.spec.p_min is not None:
                # the request's own p_min for this draft call (the decode thread owns dp)
                dp.p_min = r.spec.p_min
                draft = r.loop.propose(n_max, n_min)
                dp.p_min = self._draft_p_min
            else:
                draft = r.loop.propose(n_max, n_min)
            r.draft = draft
        self._cut_auto_drafts(gen, pre)
        for r in gen:
            toks = np.empty(len(r.draft) + 1, dtype=np.int32)
            toks[0] = r.loop.sampled
            toks[1:] = r.draft
            r.first_idx = batch.add(r.slot.id, toks, r.loop.context.size, "all")
        for r in pre:
            r.last_idx = -1
            if batch.free == 0:
                continue
            n = min(batch.free, r.prompt.size - r.n_past)
            last = r.n_past + n == r.prompt.size
            i = batch.add(r.slot.id, r.prompt[r.n_past:r.n_past + n], r.n_past,
                          "last" if last else "none")
            r.n_past += n
            if last:
                r.last_idx = i + n - 1
        if batch.n == 0:
            return
        t0 = time.perf_counter()
        rows = batch.decode(self._ctx)
        dt = time.perf_counter() - t0
        row_of = np.cumsum(batch.logits[:batch.n]) - 1  # batch index -> output row
        with self._cond:
            self._stats["decode_calls"] += 1
            self._stats["decode_tokens"] += batch.n
            self._stats["t_decode_s"] += dt
        for r in gen:
            self._verify(r, rows, int(row_of[r.first_idx]))
        for r in pre:
            if r.last_idx >= 0:
                self._first_token(r, rows[int(row_of[r.last_idx])], r.last_idx)

    def _cut_auto_drafts(self, gen: List[_Request], pre: List[_Request]) -> None:
        """Cut the drafts of ``"auto"`` requests to the lengths the policy chooses for the whole
        step (`AutoPolicy.choose_lengths`)."""
        policy = self.auto_policy
        auto = [r for r in gen if r.loop.policy is policy and len(r.draft)]
        if not auto:
            return
        n_fixed = sum(len(r.draft) for r in gen if r.loop.policy is not policy)
        n_prompt = min(sum(r.prompt.size - r.n_past for r in pre),
                       max(0, self.n_batch - len(gen) - n_fixed))
        ks = policy.choose_lengths([r.loop for r in auto], len(gen) + n_fixed + n_prompt,
                                   float(len(gen)))
        for r, k in zip(auto, ks):
            r.draft = r.draft[:k]

    def _first_token(self, r: _Request, row: np.ndarray, idx: int) -> None:
        tok = r.sampler.sample(self._ctx, idx, row)
        r.t_first = time.perf_counter()
        r.slot.cached[:r.prompt.size] = r.prompt
        r.slot.n_cached = int(r.prompt.size)
        spec = r.spec
        engine = self._engine_for(spec.types) if spec.enabled else None
        if spec.enabled and r.prediction is not None:
            engine = PredictedEngine(r.prediction, engine)
        auto = engine is not None and (spec.policy or self.policy) == "auto"
        r.loop = SlotLoop(engine, r.slot.id, r.prompt, tok, n_ctx=self.n_ctx_slot,
                          n_predict=r.sampling.max_tokens,
                          policy=self.auto_policy if auto else None, capacity=self.n_ctx_slot)
        self._emit(r, [tok])

    def _verify(self, r: _Request, rows: np.ndarray, row0: int) -> None:
        loop, draft = r.loop, r.draft
        m = len(draft)
        remaining = (r.sampling.max_tokens - len(r.tokens)) if r.sampling.max_tokens > 0 \
            else m + 1
        eog = self._eog_set if not r.sampling.ignore_eos else frozenset()
        first_idx = r.first_idx
        target = sample_run(r.sampler, self._ctx, rows[row0:row0 + m + 1], first_idx, draft,
                            max(1, remaining), eog.__contains__)
        L0 = loop.context.size
        # A draft cut by the joint choice: its verified part is what was decoded.
        n_acc = loop.verify(np.asarray(target, dtype=np.int32), n_verified=m)
        r.draft_n += m
        r.draft_acc += n_acc
        L = loop.context.size
        # The sampled token and the accepted draft are in the KV cache; drop the rest.
        if L < L0 + m + 1:
            self._lc.llama_memory_seq_rm(self._mem, r.slot.id, L, -1)
        r.slot.cached[L0:L] = loop.context[L0:L]
        r.slot.n_cached = L
        with self._cond:
            self._stats["draft_tokens"] += m
            self._stats["draft_tokens_accepted"] += n_acc
        self._emit(r, target[:n_acc + 1])

    def _emit(self, r: _Request, tokens: List[int]) -> None:
        """Append emitted tokens, apply the stop rules, stream; finish the request if it ends."""
        reason = None
        keep = len(tokens)
        if not r.sampling.ignore_eos:
            for i, t in enumerate(tokens):
                if t in self._eog_set:
                    keep, reason = i + 1, "stop"
                    break
        mt = r.sampling.max_tokens
        if mt > 0 and len(r.tokens) + keep > mt:
            keep, reason = mt - len(r.tokens), "length"
        elif mt > 0 and len(r.tokens) + keep == mt:
            reason = reason or "length"
        tokens = [int(t) for t in tokens[:keep]]
        n_kept, chunk = r.text.push(tokens)
        if r.text.stopped:
            tokens, reason = tokens[:n_kept], "stop"
        r.tokens.extend(tokens)
        if reason is None and r.loop is not None and r.loop.done:
            reason = "length"
        if reason is not None:
            chunk += r.text.finish()
        if tokens or chunk:
            self._deliver(r, tokens, chunk)
        if reason is not None and not r.handle.done:
            self._finish(r, reason)

    def _deliver(self, r: _Request, tokens: List[int], text: str) -> None:
        r.handle._push(Chunk(tokens, text))
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
        now = time.perf_counter()
        if r in self._active:
            self._active.remove(r)
        if r.slot is not None:
            r.slot.req = None
        if r.sampler is not None:
            r.sampler.close()
        error = error or r.callback_error
        text = r.text.text if r.text is not None else ""
        stop_string = r.text.stop_string if r.text is not None else None
        engine = r.loop.engine if r.loop is not None else None
        t_first = r.t_first or now
        comp = Completion(
            tokens=list(r.tokens), text=text, finish_reason=reason, prompt_n=int(r.prompt.size),
            prompt_cached_n=r.n_cached, predicted_n=len(r.tokens),
            prompt_ms=(t_first - r.t_admit) * 1e3 if r.t_admit else 0.0,
            predicted_ms=(now - t_first) * 1e3 if r.t_first else 0.0,
            draft_n=r.draft_n, draft_n_accepted=r.draft_acc, stop_string=stop_string,
            queued_ms=((r.t_admit or now) - r.t_submit) * 1e3,
            accepted_prediction_tokens=getattr(engine, "accepted_prediction_tokens", 0),
            rejected_prediction_tokens=getattr(engine, "rejected_prediction_tokens", 0))
        with self._cond:
            self._stats["requests_finished"] += 1
            self._stats["tokens_predicted"] += len(r.tokens)
            if reason == "cancelled":
                self._stats["requests_cancelled"] += 1
        r.handle._finish(comp, error)

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

The scheduler only schedules; its pieces live beside it: the llama context, its vocabulary and
token pieces (`slot_context`), the request checks (`request_checks`, pure functions), the
proposer chain and a request's engine and loop on it (`engines`), the queue of submitted
requests (`request_queue`), the slots and a running request's state (`admission.SlotTable`,
`running`), the output through the stop rules (`output`) and the counters (`scheduler_stats`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, List, Optional

from . import admission
from .engines import ChainEngines, checked_spec, joint_policy
from .executor import StepOutput
from .model import default_threads
from .output import emit
from ngramspec.request_params import SamplingParams, SpeculationParams
from .planner import StepPlan, plan_step
from ngramspec.request import Chunk, Completion, QueueFull, RequestHandle
from .request_checks import check_request
from .request_queue import RequestQueue
from .running import RunningRequest, Slot, completion
from .scheduler_stats import SchedulerStats
from .slot_context import SlotContext

from ngramspec.config import SpecConfig
from ngramspec.draft_engine import DraftEngine
from ngramspec.policy import AutoPolicy
from ngramspec.stop_rules import CANCELLED, ERROR
from ngramspec.validation import check_int

__all__ = ["Scheduler", "RequestHandle", "Completion", "Chunk", "QueueFull"]

log = logging.getLogger("ngramspec.scheduler")

#: llama.cpp's LLAMA_MAX_SEQ (sequences of one context).
MAX_SLOTS = 256
#: Seconds per prompt token assumed by admission before any step was timed (a small model on a
#: CPU core; the cost model, or the mean of the timed steps, replaces it).
PROMPT_S_PER_TOKEN = 1e-3


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
    spec : SpecConfig, optional
        The speculation (`ngramspec.config.SpecConfig`, e.g. ``SpecConfig.from_keywords(
        "ngram-mod,ngram-simple")``; default: ngram-mod with llama.cpp's parameters): the
        proposer chain (``"none"`` = no speculation; a ``model_draft``, a path or a loaded
        ``Llama``, ends it with ``draft-simple``), its ``SpecEngine`` keywords (cache files
        loaded before the model), the requests' default policy ("fixed": llama.cpp's; "auto":
        `AutoPolicy` choosing all slots' draft lengths of a step jointly) and its cost model
        (default: this context's calibration, cached per model, threads and n_batch,
        `ngramspec.llama.calibration.context_calibration`, measured at `start` with "auto";
        with "fixed" a cached one when there is one, else "auto" requests keep whole drafts).
    queue_size : int, >= 1
        Requests that may wait for a slot (beyond those the free slots take); one more raises
        :class:`QueueFull`.
    deterministic : bool
        Greedy output byte-identical to plain decoding of the same prompt (a seeded sampled
        request's too) on a model loaded with ``load_model(deterministic=True)``, whatever the
        slots, the other requests, the cache reuse, the speculation or the prediction, at the
        cost of the pads and the decodes no longer shared (`ngramspec.llama.deterministic`,
        bench/results/determinism.md); `DeterminismRefused` (naming the reason) where it
        cannot hold: layers on a GPU, repacked weights, kernels that fail the run-time probe.

    Notes
    -----
    Memory: the model, a KV cache of ``n_ctx`` cells, ``n_batch`` rows of logits, the proposers'
    per-slot state (see ``SpecEngine``), a copy of each slot's cached tokens.

    Thread-safety: one decode thread (:meth:`start`) owns the llama context, the batch, the
    samplers and the proposers. :meth:`submit`, :meth:`cancel`, :meth:`stats`, :meth:`stop`,
    the tokenizer helpers and every :class:`RequestHandle` method may be called from any thread
    (`RequestQueue`'s lock). ``on_token`` callbacks run on the decode thread: keep them short
    (an exception in one fails that request).
    """

    def __init__(self, llm_or_path=None, spec: Optional[SpecConfig] = None, *,
                 n_slots: int = 4, n_ctx: int = 4096, n_batch: int = 512,
                 n_threads: Optional[int] = None, queue_size: int = 64,
                 deterministic: bool = False):
        self.n_slots = check_int("n_slots", n_slots, 1, MAX_SLOTS)
        n_ctx = check_int("n_ctx", n_ctx, 8 * self.n_slots)
        self.n_batch = check_int("n_batch", n_batch, 8)
        self.queue_size = check_int("queue_size", queue_size, 1)
        spec, cost_model = checked_spec(spec)   # its files and cost model: before the model
        self.policy = spec.policy
        self.n_threads = check_int("n_threads", n_threads, 1) if n_threads is not None \
            else default_threads()
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
        self.deterministic = deterministic
        self._context = c = SlotContext(llm_or_path, n_ctx=n_ctx, n_slots=self.n_slots,
                                        n_batch=self.n_batch, n_threads=self.n_threads,
                                        deterministic=deterministic)
        self.llm, self.vocab, self.n_vocab, self.n_ctx = c.llm, c.vocab, c.n_vocab, c.n_ctx
        self.n_ctx_slot = c.n_ctx_slot
        self.tokenize, self.detokenize = c.tokenize, c.detokenize   # thread-safe
        self._chain = ChainEngines(c.llm, self.n_slots, spec)
        self.spec_types = self._chain.types
        self._slots = admission.SlotTable(Slot(i, self.n_ctx_slot) for i in range(self.n_slots))
        self._queue = RequestQueue(self.queue_size)
        self._cond = self._queue.cond     # also guards the slots' bookkeeping
        self._active: List[RunningRequest] = []     # admitted, in admission order
        self._thread: Optional[threading.Thread] = None
        #: the verify-cost curve of policy "auto" (set by `start` unless given)
        self.cost_model = cost_model
        #: the one AutoPolicy of all "auto" requests (set by `start`; None without a cost model)
        self.auto_policy: Optional[AutoPolicy] = None
        self._stats = SchedulerStats()

    @property
    def engine(self) -> DraftEngine:
        """The whole chain's engine, shared by every slot (`NO_DRAFT` without speculation):
        what a store log replicates (`ngramspec.store_log.attach`)."""
        return self._chain.engine

    def start(self) -> None:
        """Start the decode thread (once)."""
        with self._cond:
            if self._queue.closed:
                raise RuntimeError("the scheduler has been stopped")
            if self._thread is not None:
                return
            if self._chain.engine.speculates:   # "auto"'s cost model: measured now for "auto"
                self.cost_model, self.auto_policy = joint_policy(
                    self.cost_model, self.llm, self._context.ctx, self.n_threads, self.n_batch,
                    measure_now=self.policy == "auto")
            self._thread = threading.Thread(target=self._run, name="ngramspec-decode",
                                            daemon=True)
            self._thread.start()

    def stop(self, *, cancel: bool = False, timeout: Optional[float] = None) -> None:
        """Stop accepting requests, finish (or with ``cancel=True`` cancel) the ones submitted,
        end the decode thread and free the context.

        Raises TimeoutError when the thread has not ended after ``timeout`` seconds.
        """
        self._queue.stop(cancel_also=self._active if cancel else None)
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the decode thread did not stop within {timeout} s")
        else:
            for r in self._queue.drain():
                self._finish(r, CANCELLED)
        if self._queue.close():
            self._context.free()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop(cancel=exc[0] is not None)

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
            A request `ngramspec.llama.request_checks.check_request` refuses.
        QueueFull
            ``queue_size`` requests are already waiting for a slot (requests that free slots
            can take do not count).
        RuntimeError
            The scheduler is stopped.
        """
        prompt, sampling, spec, drafter = check_request(
            self._context.bounds, self.spec_types, prompt_tokens, sampling, speculation,
            on_token, prediction)
        def queued(rid: int) -> RunningRequest:   # under the queue's lock, so counted first
            self._stats.add(requests_submitted=1)
            return RunningRequest(rid, prompt, sampling, spec, on_token, drafter, self.cancel,
                                  cache_owner, bool(cache_prompt))
        return self._queue.put(queued, self._slots.n_free).handle

    def cancel(self, request_id: int) -> None:
        """Ask the decode thread to stop a request (`RequestHandle.cancel`); its slot is free
        within one step. A finished or unknown id is ignored.

        Thread-safety: may be called from any thread.
        """
        self._queue.cancel(request_id)

    def stats(self) -> dict:
        """Counters for monitoring (``/metrics``): slots, queue, tokens, drafts per proposer.

        Keys: `SchedulerStats.snapshot`'s; ``n_slots``, ``slots_busy``, ``queue_length``; and
        ``proposers``: per proposer type the sums of `SpecEngine.stats`' ``gen_tokens``,
        ``acc_tokens``, ``gen_drafts`` and ``acc_drafts`` over every engine of the chain's.
        """
        out = self._stats.snapshot()
        with self._cond:
            out["n_slots"] = self.n_slots
            out["slots_busy"] = self._slots.n_busy()
            out["queue_length"] = len(self._queue.waiting)
        out["proposers"] = self._chain.stats()
        return out

    # -- the decode thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # never leave a waiting client behind
            log.exception("the scheduler's decode thread failed")
            for r in self._queue.drain() + list(self._active):
                self._finish(r, ERROR, error=exc)
            raise

    def _serve(self) -> None:
        while True:
            with self._cond:
                if not self._queue.next_turn(len(self._active)):
                    return
                for r in self._queue.take_cancelled():
                    self._finish(r, CANCELLED)
                self._admit()
            if self._active:
                c0 = time.thread_time()
                try:
                    self._step()
                except Exception as exc:  # a decode failure fails the running requests only
                    log.exception("scheduler step failed")
                    for r in list(self._active):
                        self._finish(r, ERROR, error=exc)
                        self._context.executor.drop(r.slot.id, 0)
                        r.slot.n_cached = 0
                self._stats.stepped(time.thread_time() - c0)

    def _admit(self) -> None:
        """Admit queued requests into free slots (`ngramspec.llama.admission`: the free slot
        with the longest cached prefix, or a short wait for a busy slot that holds the prompt;
        the prompt's cost from the cost model, else from the timed steps)."""
        for req, lcp in self._slots.admit(
                self._queue.waiting, time.perf_counter(),
                lambda n: self._stats.prompt_seconds(n, self.cost_model, PROMPT_S_PER_TOKEN),
                self._context):
            self._active.append(req)
            self._stats.add(tokens_prompt=int(req.prompt.size), tokens_prompt_cached=lcp)

    def _step(self) -> None:
        """plan -> execute -> update: one ``llama_decode`` of every running request."""
        plan = plan_step(self._active, self.n_batch, self.n_ctx_slot, self.auto_policy)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step plan:\n%s", plan)
        for r, reason in plan.finishes:
            self._finish(r, reason)
        for part, out in self._context.executor.decode_all(plan, self.n_ctx_slot):
            self._stats.decoded(part.n_tokens, out.seconds)
            self._update(part, out)

    def _update(self, plan: StepPlan, out: StepOutput) -> None:
        """Apply a decoded plan: verify and emit each generating slot's tokens, advance the
        prompts, start the requests whose prompt is complete."""
        executor = self._context.executor
        for run, at in zip(plan.verifies, out.verify_at):
            tokens, n_acc = executor.verify(run, out, at)
            run.req.counts.verified(len(run.draft), n_acc)
            self._stats.verified(len(run.draft), n_acc)
            if (reason := emit(run.req, tokens, self._context.eog_set.__contains__)) is not None:
                self._finish(run.req, reason)
        for chunk, at in zip(plan.chunks, out.chunk_at):
            chunk.req.n_past = chunk.stop
            if chunk.last:
                self._start_generating(chunk.req, executor.first_token(chunk, out, at))

    def _start_generating(self, r: RunningRequest, tok: int) -> None:
        """The request's prompt is in its slot and ``tok`` is its first output token: begin its
        loop on its engine and emit the token."""
        r.t_first = time.perf_counter()
        r.slot.cached[:r.prompt.size] = r.prompt
        r.slot.n_cached = int(r.prompt.size)
        r.loop, r.policy = self._chain.loop_for(r, tok, self.n_ctx_slot, self.policy,
                                                self.auto_policy)
        if (reason := emit(r, [tok], self._context.eog_set.__contains__)) is not None:
            self._finish(r, reason)

    def _finish(self, r: RunningRequest, reason: str,
                error: Optional[BaseException] = None) -> None:
        if r.handle.done:
            return
        if r in self._active:
            self._active.remove(r)
        if r.slot is not None:
            r.slot.req = None
        if r.sampler is not None:
            r.sampler.close()
        comp = completion(r, reason)
        self._queue.finished(r.id)
        self._stats.add(requests_finished=1, tokens_predicted=len(r.tokens),
                        requests_cancelled=int(reason == CANCELLED))
        r.handle.complete(comp, error or r.callback_error)
        if r.slot is not None and r.loop is not None:
            self._chain.learn(r.slot.id)

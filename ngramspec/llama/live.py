"""Live greedy generation on llama-cpp-python: one llama context as the target of the one loop.

The driver decodes through `ngramspec.llama.decoder` (llama.cpp's low-level C API);
``llama_cpp.Llama`` is only used to load the model and to tokenize. Verification is greedy: the
draft is accepted up to the first position where the target's argmax differs, so the output is
the plain greedy output (up to ties within float noise, see `ngramspec.llama.divergence`); only
the speed changes.

Per request: prompt pass, first token = argmax of the prompt's last logits (no speculation on
that step); then `ngramspec.loop.SlotLoop` runs llama-server's slot loop (begin, the
``n_draft_max`` bound, draft, accept), driven through the request's draft-length policy
(`ngramspec.policy.DraftPolicy`: a planner of one request), with `LiveTarget` as its target:
one decode of ``[sampled] + draft`` with logits at every position, the argmax per position as
the target's tokens, rejected positions removed from the KV cache, ``k + 1`` tokens emitted. Plain decoding
(`generate_plain`) is the same loop without an engine: every draft is empty, so each step
decodes one token. Every step's tokens are emitted through `ngramspec.stop_rules` (the stop
rules and finish reasons of every driver).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from ngramspec.cache_file import as_path, merge_into_dynamic
from ngramspec.draft_engine import as_engine
from ngramspec.loop import SlotLoop, draft_budget
from ngramspec.policy import FIXED
from ngramspec.registry import TYPES
from ngramspec.stats import DraftCounts
from ngramspec.stop_rules import CONTEXT, INTERRUPTED, LENGTH, context_full, cut_step

from .decoder import check_engine_models, finish_request, prompt_pass, target_and_prompt
from .tokenizer import detokenize

__all__ = ["GenerationResult", "GenerationInterrupted", "LiveTarget", "generate_speculative",
           "generate_plain"]

# Proposers that run a model of their own (draft-simple): their time is the draft model's.
_MODEL_TYPES = frozenset(name for name, spec in TYPES.items() if spec.live)
_clock = time.perf_counter


@dataclass
class GenerationResult:
    """Outcome of one live generation.

    Attributes
    ----------
    output_tokens : list of int
        Emitted tokens, the EOS/EOG token included when the model stopped by itself.
    text : str
        Detokenized output (control tokens render as nothing).
    n_prompt : int
        Prompt length in tokens.
    finish_reason : str
        One of `ngramspec.stop_rules.FINISH_REASONS`: ``"stop"`` (an end-of-generation token),
        ``"length"`` (``n_predict``), ``"context"`` (KV cache full) or ``"interrupted"``
        (Ctrl-C; the result of `GenerationInterrupted`).
    t_prompt_s : float
        Prompt pass, first token and ``engine.begin`` (the proposers' prompt ingestion, a draft
        model's own prompt pass) included.
    t_gen_s : float
        Everything after the prompt pass (decodes, drafting, accept, bookkeeping).
    t_target_s, t_draft_model_s, t_proposers_s : float
        Split of ``t_gen_s``: target decodes (with argmax), the draft model (``draft-simple``),
        and every other proposer (engine calls minus the draft model).
    n_target_decodes : int
        ``llama_decode`` calls of the generation phase (one per step).
    counts : DraftCounts
        The driver's draft counts (after the ``n_draft_max`` bound; `ngramspec.stats` lists
        every statistic's one name); ``n_draft_tokens`` and ``n_acc_tokens`` read it.
    stats : list of dict
        The engine's per-proposer counters after the run (cumulative, as llama.cpp keeps them).
    stats_lines : list of str
        llama.cpp's ``statistics <type>: ...`` lines.
    steps : list of tuple, optional
        With ``record_steps=True``: ``(L, sampled, draft, k)`` per step.
    prompt_reused : bool
        The prompt's KV cache and first token came from the previous request with the same
        prompt (``t_prompt_s`` is then about 0).
    dynamic_cache_ngrams : int or None
        With ``update_dynamic_cache``: n-grams in the dynamic cache file after the merge.

    Notes
    -----
    Thread-safety: plain data, never modified by ngramspec once returned.
    """

    output_tokens: List[int]
    text: str
    n_prompt: int
    finish_reason: str
    t_prompt_s: float
    t_gen_s: float
    t_target_s: float
    t_draft_model_s: float = 0.0
    t_proposers_s: float = 0.0
    n_target_decodes: int = 0
    counts: DraftCounts = field(default_factory=DraftCounts)
    stats: List[Dict[str, Any]] = field(default_factory=list)
    stats_lines: List[str] = field(default_factory=list)
    steps: Optional[List[tuple]] = None
    prompt_reused: bool = False
    dynamic_cache_ngrams: Optional[int] = None

    n_draft_tokens = property(lambda self: self.counts.n_draft_tokens)
    n_acc_tokens = property(lambda self: self.counts.n_acc_tokens)

    @property
    def n_output(self) -> int:
        return len(self.output_tokens)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second after the prompt pass (llama-server's ``n_decoded / t_gen``)."""
        return self.n_output / self.t_gen_s if self.t_gen_s > 0 else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        """Prompt pass speed; 0.0 when the prompt was reused from the previous request."""
        if self.prompt_reused or self.t_prompt_s <= 0:
            return 0.0
        return self.n_prompt / self.t_prompt_s

    def timings(self) -> Dict[str, float]:
        other = self.t_gen_s - self.t_target_s - self.t_draft_model_s - self.t_proposers_s
        return {"prompt_s": self.t_prompt_s, "gen_s": self.t_gen_s, "target_s": self.t_target_s,
                "draft_model_s": self.t_draft_model_s, "proposers_s": self.t_proposers_s,
                "other_s": max(0.0, other), "tokens_per_s": self.tokens_per_s,
                "prompt_tokens_per_s": self.prompt_tokens_per_s}

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready summary (``generate --json`` field names)."""
        return {"output_tokens": [int(t) for t in self.output_tokens], "text": self.text,
                "n_output": self.n_output, "n_prompt": self.n_prompt,
                "finish_reason": self.finish_reason, "tokens_per_s": self.tokens_per_s,
                "prompt_reused": self.prompt_reused,
                "timings": self.timings(), "n_target_decodes": self.n_target_decodes,
                "n_draft_tokens": self.n_draft_tokens, "n_acc_tokens": self.n_acc_tokens,
                "stats": self.stats}


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a generation, with what was generated until then.

    A KeyboardInterrupt, so code that does not look for it stops as on any Ctrl-C; the command
    line prints the partial output's statistics from `result`.

    Attributes
    ----------
    result : GenerationResult
        The tokens emitted before the interrupt, ``finish_reason == "interrupted"``, the timings
        and proposer statistics so far.

    Notes
    -----
    Memory: the partial result. Thread-safety: raised in the generating thread (Python
    delivers Ctrl-C to the main thread only).
    """

    def __init__(self, result: "GenerationResult"):
        super().__init__("interrupted")
        self.result = result


class LiveTarget:
    """A ``llama_cpp.Llama``'s own context as the target of `ngramspec.loop.SlotLoop`.

    Parameters
    ----------
    llm : llama_cpp.Llama
        Target model (see :func:`ngramspec.llama.model.load_model`). Its context is taken over
        for each request.
    engine : DraftEngine or None
        Proposer chain; ``None`` runs the same loop without drafts (plain decoding).

    Raises
    ------
    ValueError
        The engine could draft ids the model does not have (a draft model of another
        vocabulary, an n-gram cache file of another tokenizer): checked once, here.

    Notes
    -----
    Memory: nothing of its own; the context's decoder is cached per ``llm``.

    Thread-safety: not thread-safe; one request at a time per ``llm`` and per engine slot.
    """

    def __init__(self, llm, engine=None):
        self.engine = engine = as_engine(engine)
        check_engine_models(llm, engine)
        self.llm = llm

    def generate(self, prompt_tokens, *, n_predict: int = -1, slot: int = 0,
                 record_steps: bool = False, update_dynamic_cache=None, policy=None,
                 on_tokens=None) -> GenerationResult:
        """Greedy generation of one request: `generate_speculative`'s parameters, result and
        exceptions (the engine and the model are the target's)."""
        if update_dynamic_cache is not None:
            update_dynamic_cache = as_path("update_dynamic_cache", update_dynamic_cache)
        dec, prompt = target_and_prompt(self.llm, prompt_tokens)
        if n_predict == 0:      # nothing to generate: not even the prompt pass
            res = GenerationResult([], "", int(prompt.size), LENGTH, 0.0, 0.0, 0.0,
                                   stats=self.engine.stats(),
                                   stats_lines=list(self.engine.stats_lines()))
        else:
            req = _Request(self, dec, prompt, n_predict, slot, policy, record_steps)
            res = req.run(on_tokens)
            finish_request(self.llm, dec, prompt.size)
            if res.finish_reason == INTERRUPTED:
                raise GenerationInterrupted(res)
        if update_dynamic_cache is not None:
            # The whole stream, as llama.cpp's lookup example merges its context cache at exit.
            stream = np.concatenate([prompt, np.asarray(res.output_tokens, dtype=np.int32)])
            res.dynamic_cache_ngrams = len(merge_into_dynamic(update_dynamic_cache, stream))
        return res


class _Request:
    """One generation in progress: the prompt pass, then a decode per step until a stop rule
    ends it; the output, the finish reason and the timings as they accrue."""

    def __init__(self, target: LiveTarget, dec, prompt, n_predict, slot, policy, record_steps):
        self.llm, self.engine, self.dec = target.llm, target.engine, dec
        self.n_prompt = int(prompt.size)
        self.n_predict = n_predict
        self.out: List[int] = []
        self.steps: Optional[List[tuple]] = [] if record_steps else None
        self.t_target = 0.0
        self.n_decodes = 0
        t0 = _clock()
        sampled, self.reused = prompt_pass(self.llm, dec, prompt)
        # Part of the prompt phase: every proposer ingests the prompt in begin() (a draft model
        # runs its own prompt pass there).
        self.loop = SlotLoop(self.engine, slot, prompt, sampled, n_ctx=dec.n_ctx,
                             n_predict=n_predict, capacity=dec.n_ctx)
        self.policy = FIXED if policy is None else policy
        self.t_prompt = _clock() - t0
        self.stats0 = self.engine.stats()
        self.finish_reason: Optional[str] = None
        self.emit([sampled])

    def emit(self, tokens: List[int]) -> List[int]:
        """Output the step's tokens the stop rules keep; they set the finish reason."""
        keep, self.finish_reason = cut_step(tokens, len(self.out), self.n_predict,
                                            self.dec.is_eog)
        kept = tokens[:keep]
        self.out.extend(kept)
        return kept

    def step(self) -> List[int]:
        """One decode of ``[sampled] + draft``, the argmax at every position; the tokens kept."""
        loop, dec, policy = self.loop, self.dec, self.policy
        L = loop.n_context
        sampled = loop.sampled
        draft = policy.draft(loop, draft_budget(loop))  # a planner of one request: no cap of its own
        m = len(draft)
        t0 = _clock()
        batch = np.empty(m + 1, dtype=np.int32)
        batch[0] = sampled
        batch[1:] = draft
        target = np.argmax(dec.decode(batch, L, all_logits=True), axis=1)
        self.t_target += _clock() - t0
        self.n_decodes += 1
        k = policy.verify(loop, target)
        if self.steps is not None:
            self.steps.append((L, sampled, draft.tolist(), k))
        if k < m:
            dec.seq_rm(loop.n_context)  # rejected draft positions
        return self.emit(draft[:k].tolist() + [int(target[k])])

    def run(self, on_tokens) -> GenerationResult:
        """Steps until a stop rule, a full context or Ctrl-C ends the request."""
        t1 = _clock()
        try:
            if on_tokens is not None:
                on_tokens(self.out[:])
            while self.finish_reason is None:
                if context_full(self.loop.n_context, self.dec.n_ctx):
                    self.finish_reason = CONTEXT    # no position left for `sampled`
                    break
                kept = self.step()
                if on_tokens is not None:
                    on_tokens(kept)
        except KeyboardInterrupt:
            # Keep what was generated: the caller reports it (the KV cache is released after).
            self.finish_reason = INTERRUPTED
        return self.result(_clock() - t1)

    def result(self, t_gen: float) -> GenerationResult:
        loop, engine = self.loop, self.engine
        stats = engine.stats()
        t_engine = (loop.draft_ns + loop.accept_ns) / 1e9
        t_draft_model = (_draft_time_us(stats) - _draft_time_us(self.stats0)) / 1e6
        return GenerationResult(
            output_tokens=self.out, text=detokenize(self.llm, self.out), n_prompt=self.n_prompt,
            finish_reason=self.finish_reason, t_prompt_s=self.t_prompt, t_gen_s=t_gen,
            t_target_s=self.t_target, t_draft_model_s=t_draft_model,
            t_proposers_s=max(0.0, t_engine - t_draft_model), n_target_decodes=self.n_decodes,
            counts=loop.counts.copy(), stats=stats, stats_lines=list(engine.stats_lines()),
            steps=self.steps,
            prompt_reused=self.reused)


def _draft_time_us(stats) -> int:
    return sum(int(s["t_begin_us"]) + int(s["t_draft_us"]) + int(s["t_accept_us"])
               for s in stats if s.get("type") in _MODEL_TYPES)


def generate_speculative(llm, prompt_tokens, engine, *, n_predict: int = -1, slot: int = 0,
                         record_steps: bool = False, update_dynamic_cache=None,
                         policy=None, on_tokens=None) -> GenerationResult:
    """Greedy generation verified against drafts from ``engine`` (llama-server's loop).

    Parameters
    ----------
    llm : llama_cpp.Llama
        Target model (see :func:`load_model`). Its context is taken over for the request.
    prompt_tokens : sequence of int
        Full prompt; ``engine.begin(slot, prompt)`` receives it once.
    engine : DraftEngine or None
        Proposer chain; ``None`` runs the same loop without drafts (`generate_plain`).
    n_predict : int
        Output token limit; < 0 (-1) = until EOS or a full context
        (`ngramspec.stop_rules`' sentinel). Bounds the drafts as ``n_remaining - 1``
        (llama-server's ``server_slot::get_n_draft_max``).
    slot : int
        Engine slot (llama-server's ``seq_id``) used for this request.
    record_steps : bool
        Keep ``(L, sampled, draft, k)`` for every step in ``result.steps``.
    update_dynamic_cache : str or os.PathLike, optional
        An ngram-cache dynamic cache file (``--lookup-cache-dynamic``): after the generation,
        the 1..4-grams of prompt + output are merged into it (created if absent), so the next
        run drafts from them (`ngramspec.cache_file.merge_into_dynamic`: atomic rewrite under a
        file lock, concurrent writers lose no counts). Not part of the timings.
    policy : DraftPolicy, optional
        `ngramspec.policy.FixedPolicy` (the default: llama.cpp's behaviour) or
        `ngramspec.policy.AutoPolicy` (cost-aware: verifies only the part of each draft that is
        expected to pay). The output is the same greedy output either way.
    on_tokens : callable, optional
        Called with the list of tokens emitted by each step (the first token, then the accepted
        draft and the target's next token), as they are produced: streaming. Its time counts as
        the generation's.

    Returns
    -------
    GenerationResult

    Raises
    ------
    GenerationInterrupted
        On Ctrl-C (KeyboardInterrupt) after the prompt pass, carrying the partial result; the
        dynamic cache file is then left as it was.

    Notes
    -----
    Memory: the output, the loop's context buffer (4 bytes per token of ``n_ctx``) and, with
    ``record_steps``, every step's draft.

    Thread-safety: not thread-safe; one request at a time per ``llm`` and per engine slot.
    """
    return LiveTarget(llm, engine).generate(
        prompt_tokens, n_predict=n_predict, slot=slot, record_steps=record_steps,
        update_dynamic_cache=update_dynamic_cache, policy=policy, on_tokens=on_tokens)


def generate_plain(llm, prompt_tokens, *, n_predict: int = -1) -> GenerationResult:
    """Plain greedy generation, one token per ``llama_decode`` (the reference for comparisons).

    `generate_speculative`'s loop without an engine: the same stop rules (an end-of-generation
    token, ``n_predict``, a full context), result and Ctrl-C handling (`GenerationInterrupted`).

    Notes
    -----
    Memory: the output and the loop's context buffer (4 bytes per token of ``n_ctx``).

    Thread-safety: not thread-safe; one request at a time per ``llm``.
    """
    return LiveTarget(llm).generate(prompt_tokens, n_predict=n_predict)

"""Live greedy speculative decoding on llama-cpp-python, driven as llama-server drives proposers.

The driver decodes through `ngramspec.llama.decoder` (llama.cpp's low-level C API);
``llama_cpp.Llama`` is only used to load the model and to tokenize. Verification is greedy: the
draft is accepted up to the first position where the target's argmax differs, so the output is
the plain greedy output (up to ties within float noise, see
`ngramspec.llama.divergence`); only the
speed changes.

Per request: prompt pass, first token = argmax of the prompt's last logits (no speculation on
that step); then `ngramspec.loop.SlotLoop` runs llama-server's slot loop (begin, the
``n_draft_max`` bound, draft, accept) with this module as its target: one decode of
``[sampled] + draft`` with logits at every position, the argmax per position as the target's
tokens, rejected positions removed from the KV cache, ``k + 1`` tokens emitted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from ngramspec.cache_file import as_path, merge_into_dynamic
from ngramspec.loop import SlotLoop
from ngramspec.registry import TYPES

from .decoder import check_engine_models, finish_request, prompt_pass, target_and_prompt
from .tokenizer import detokenize

__all__ = ["GenerationResult", "generate_speculative", "generate_plain"]

# Proposers that run a model of their own (draft-simple): their time is the draft model's.
_MODEL_TYPES = frozenset(name for name, spec in TYPES.items() if spec.live)


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
    stop_reason : str
        ``"eos"``, ``"n_predict"`` or ``"n_ctx"`` (KV cache full).
    t_prompt_s : float
        Prompt pass, first token and ``engine.begin`` (the proposers' prompt ingestion, a draft
        model's own prompt pass) included.
    t_gen_s : float
        Everything after the prompt pass (decodes, drafting, accept, bookkeeping).
    t_target_s, t_draft_model_s, t_proposers_s : float
        Split of ``t_gen_s``: target decodes (with argmax), the draft model (``draft-simple``),
        and every other proposer (engine calls minus the draft model).
    n_target_decodes : int
        ``llama_decode`` calls of the generation phase (one per iteration).
    n_drafted, n_accepted : int
        Draft tokens verified and accepted by the driver (after the ``n_draft_max`` bound).
    stats : list of dict
        The engine's per-proposer counters after the run (cumulative, as llama.cpp keeps them).
    stats_lines : list of str
        llama.cpp's ``statistics <type>: ...`` lines.
    steps : list of tuple, optional
        With ``record_steps=True``: ``(L, sampled, draft, k)`` per iteration.
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
    stop_reason: str
    t_prompt_s: float
    t_gen_s: float
    t_target_s: float
    t_draft_model_s: float = 0.0
    t_proposers_s: float = 0.0
    n_target_decodes: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    stats: List[Dict[str, Any]] = field(default_factory=list)
    stats_lines: List[str] = field(default_factory=list)
    steps: Optional[List[tuple]] = None
    prompt_reused: bool = False
    dynamic_cache_ngrams: Optional[int] = None

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
                "stop_reason": self.stop_reason, "tokens_per_s": self.tokens_per_s,
                "prompt_reused": self.prompt_reused,
                "timings": self.timings(), "n_target_decodes": self.n_target_decodes,
                "n_drafted": self.n_drafted, "n_accepted": self.n_accepted,
                "stats": self.stats}


def _draft_time_us(stats) -> int:
    return sum(int(s["t_begin_us"]) + int(s["t_draft_us"]) + int(s["t_accept_us"])
               for s in stats if s.get("type") in _MODEL_TYPES)


def generate_speculative(llm, prompt_tokens, engine, *, n_predict: int = -1, slot: int = 0,
                         record_steps: bool = False, update_dynamic_cache=None,
                         policy=None) -> GenerationResult:
    """Greedy generation verified against drafts from ``engine`` (llama-server's loop).

    Parameters
    ----------
    llm : llama_cpp.Llama
        Target model (see :func:`load_model`). Its context is taken over for the request.
    prompt_tokens : sequence of int
        Full prompt; ``engine.begin(slot, prompt)`` receives it once.
    engine : ngramspec.SpecEngine or None
        Proposer chain; ``None`` runs the same loop without drafts.
    n_predict : int
        Output token limit; ``-1`` = until EOS or a full context. Bounds the drafts as
        ``n_remaining - 1`` (llama-server's ``server_slot::get_n_draft_max``).
    slot : int
        Engine slot (llama-server's ``seq_id``) used for this request.
    record_steps : bool
        Keep ``(L, sampled, draft, k)`` for every iteration in ``result.steps``.
    update_dynamic_cache : str or os.PathLike, optional
        An ngram-cache dynamic cache file (``--lookup-cache-dynamic``): after the generation,
        the 1..4-grams of prompt + output are merged into it (created if absent), so the next
        run drafts from them (`ngramspec.cache_file.merge_into_dynamic`: atomic rewrite under a
        file lock, concurrent writers lose no counts). Not part of the timings.
    policy : draft-length policy, optional
        `ngramspec.loop.FixedPolicy` (the default: llama.cpp's behaviour) or
        `ngramspec.policy.AutoPolicy` (cost-aware: verifies only the part of each draft that is
        expected to pay). The output is the same greedy output either way.

    Returns
    -------
    GenerationResult

    Notes
    -----
    Thread-safety: not thread-safe; one request at a time per ``llm`` and per engine slot.
    """
    if update_dynamic_cache is not None:
        update_dynamic_cache = as_path("update_dynamic_cache", update_dynamic_cache)
    if engine is not None:
        check_engine_models(llm, engine)
    dec, prompt = target_and_prompt(llm, prompt_tokens)
    n_ctx = dec.n_ctx
    pc = time.perf_counter

    out: List[int] = []
    steps: Optional[List[tuple]] = [] if record_steps else None
    t_target = 0.0
    n_decodes = 0

    if n_predict == 0:
        res = GenerationResult([], "", int(prompt.size), "n_predict", 0.0, 0.0, 0.0,
                               stats=engine.stats() if engine is not None else [],
                               stats_lines=engine.stats_lines() if engine is not None else [])
        _save_dynamic(res, update_dynamic_cache, prompt)
        return res
    t0 = pc()
    sampled, reused = prompt_pass(llm, dec, prompt)
    # Part of the prompt phase: every proposer ingests the prompt in begin() (a draft model runs
    # its own prompt pass there).
    loop = SlotLoop(engine, slot, prompt, sampled, n_ctx=n_ctx, n_predict=n_predict,
                    policy=policy, capacity=n_ctx)
    t1 = pc()
    stats0 = engine.stats() if engine is not None else []
    out.append(sampled)
    stop = "eos" if dec.is_eog(sampled) else None
    if stop is None and 0 < n_predict <= len(out):
        stop = "n_predict"

    while stop is None:
        L = loop.n_context
        if L >= n_ctx:  # no position left for `sampled`
            stop = "n_ctx"
            break
        sampled = loop.sampled
        draft = loop.propose()
        m = len(draft)

        # The live target: one decode of [sampled] + draft, the argmax at every position.
        tt = pc()
        batch = np.empty(m + 1, dtype=np.int32)
        batch[0] = sampled
        batch[1:] = draft
        target = np.argmax(dec.decode(batch, L, all_logits=True), axis=1)
        t_target += pc() - tt
        n_decodes += 1

        k = loop.verify(target)
        if steps is not None:
            steps.append((L, sampled, [int(t) for t in draft], k))
        if k < m:
            dec.seq_rm(loop.n_context)  # rejected draft positions

        for t in list(draft[:k]) + [int(target[k])]:
            out.append(int(t))
            # Tokens after a stop inside the accepted draft are dropped (llama-server's
            # process_token stops the slot there).
            if dec.is_eog(t):
                stop = "eos"
                break
            if 0 < n_predict <= len(out):
                stop = "n_predict"
                break

    t2 = pc()
    t_engine = (loop.draft_ns + loop.accept_ns) / 1e9
    stats = engine.stats() if engine is not None else []
    t_draft_model = (_draft_time_us(stats) - _draft_time_us(stats0)) / 1e6
    res = GenerationResult(
        output_tokens=out, text=detokenize(llm, out), n_prompt=int(prompt.size), stop_reason=stop,
        t_prompt_s=t1 - t0, t_gen_s=t2 - t1, t_target_s=t_target,
        t_draft_model_s=t_draft_model, t_proposers_s=max(0.0, t_engine - t_draft_model),
        n_target_decodes=n_decodes, n_drafted=loop.n_draft_tokens,
        n_accepted=loop.n_acc_tokens,
        stats=stats, stats_lines=list(engine.stats_lines()) if engine is not None else [],
        steps=steps, prompt_reused=reused)
    finish_request(llm, dec, prompt.size)
    _save_dynamic(res, update_dynamic_cache, prompt)
    return res


def _save_dynamic(res: GenerationResult, path: Optional[str], prompt: np.ndarray) -> None:
    # The whole stream, as llama.cpp's lookup example merges its context cache at exit.
    if path is not None:
        stream = np.concatenate([prompt, np.asarray(res.output_tokens, dtype=np.int32)])
        res.dynamic_cache_ngrams = len(merge_into_dynamic(path, stream))


def generate_plain(llm, prompt_tokens, *, n_predict: int = -1) -> GenerationResult:
    """Plain greedy generation, one token per ``llama_decode`` (the reference for comparisons).

    Same stop rules as :func:`generate_speculative`: EOS, ``n_predict`` or a full context.

    Notes
    -----
    Thread-safety: not thread-safe; one request at a time per ``llm``.
    """
    dec, prompt = target_and_prompt(llm, prompt_tokens)
    n_ctx = dec.n_ctx
    pc = time.perf_counter
    out: List[int] = []
    if n_predict == 0:
        return GenerationResult([], "", int(prompt.size), "n_predict", 0.0, 0.0, 0.0)
    t0 = pc()
    tok, reused = prompt_pass(llm, dec, prompt)
    t1 = pc()
    L = prompt.size
    out.append(tok)
    stop = "eos" if dec.is_eog(tok) else None
    one = np.empty(1, dtype=np.int32)
    n_decodes = 0
    while stop is None:
        if 0 < n_predict <= len(out):
            stop = "n_predict"
            break
        if L >= n_ctx:
            stop = "n_ctx"
            break
        one[0] = tok
        tok = int(np.argmax(dec.decode(one, L, all_logits=False)[0]))
        n_decodes += 1
        L += 1
        out.append(tok)
        if dec.is_eog(tok):
            stop = "eos"
    t2 = pc()
    res = GenerationResult(output_tokens=out, text=detokenize(llm, out),
                           n_prompt=int(prompt.size), stop_reason=stop, t_prompt_s=t1 - t0,
                           t_gen_s=t2 - t1, t_target_s=t2 - t1, n_target_decodes=n_decodes,
                           prompt_reused=reused)
    finish_request(llm, dec, prompt.size)
    return res

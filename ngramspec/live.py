"""Live greedy speculative decoding on llama-cpp-python, driven as llama-server drives proposers.

The driver talks to llama.cpp through llama-cpp-python's low-level C API (``llama_batch_init``,
``llama_decode``, ``llama_get_logits``, ``llama_memory_seq_rm``); ``llama_cpp.Llama`` is only used
to load the model and to tokenize. Verification is greedy: the draft is accepted up to the first
position where the target's argmax differs, so the output is the plain greedy output (up to ties
within float noise, see :func:`divergence_report`); only the speed changes.

Per request: prompt pass, first token = argmax of the prompt's last logits (no speculation on
that step); then `ngramspec.loop.SlotLoop` runs llama-server's slot loop (begin, the
``n_draft_max`` bound, draft, accept) with this module as its target: one decode of
``[sampled] + draft`` with logits at every position, the argmax per position as the target's
tokens, rejected positions removed from the KV cache, ``k + 1`` tokens emitted.
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .loop import SlotLoop

__all__ = [
    "GenerationResult", "DivergenceReport", "load_model", "tokenize_prompt", "tokenize_chat",
    "render_chat", "detokenize",
    "generate_speculative", "generate_plain", "first_divergence", "divergence_report",
]

_DRAFT_TYPE = "draft-simple"


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("live generation needs llama-cpp-python: "
                          "pip install 'ngramspec[live]'") from exc
    return llama_cpp


def default_threads() -> int:
    """Default decode threads: half the cores this process may run on, at least one.

    llama.cpp's worker threads spin while they wait for each other, so a thread count that
    oversubscribes a shared machine slows decoding down by an order of magnitude (measured on a
    busy 2-core box: 70 tokens/s with one thread, 2-5 with two); half the cores is
    llama-cpp-python's own default for single-token decodes.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        n = os.cpu_count() or 1
    return max(1, n // 2)


def load_model(model_path: Optional[str] = None, *, n_ctx: int = 4096, n_batch: int = 512,
               n_threads: Optional[int] = None, verbose: bool = False, repack="auto"):
    """Load a GGUF model for live generation.

    Parameters
    ----------
    model_path : str, optional
        GGUF file; default: the embedded SmolLM2-135M-Instruct
        (:func:`ngramspec.model.default_model_path`).
    n_ctx : int
        Context size (tokens) of the model's KV cache; the generation stops when it is full.
    n_batch : int
        Largest batch one ``llama_decode`` call gets (prompt chunks, verification batches).
    n_threads : int, optional
        Threads for every decode. The same count is used for single-token and batched decodes so
        that a plain/speculative comparison measures speculation, not a thread-count difference
        (llama-cpp-python's default gives single-token decodes half the cores).
    verbose : bool
        Let llama.cpp print its load log.
    repack : {"auto", "on", "off"}
        llama.cpp's weight repacking into extra CPU buffer types (``use_extra_bufts``; ``off`` is
        llama-server's ``--no-repack``). ``auto`` turns it off on CPUs with AMX, whose repacked
        kernel crashes on multi-token batches (:mod:`ngramspec.repack`), and on elsewhere.

    Returns
    -------
    llama_cpp.Llama
        ``llm.model_params.use_extra_bufts`` tells how it was loaded.
    """
    from .repack import load_llama, use_extra_bufts
    _llama_cpp()
    extra = use_extra_bufts(repack)  # a bad value fails before the file checks
    if model_path is None:
        from .model import default_model_path
        model_path = default_model_path()
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"model file not found: {model_path}")
    if n_ctx < 8:
        raise ValueError(f"n_ctx (--ctx-size) must be >= 8, got {n_ctx}")
    threads = n_threads or default_threads()
    llm = load_llama(model_path, repack=extra, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                     n_threads=threads, n_threads_batch=threads, verbose=verbose)
    return llm


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


def tokenize_chat(llm, messages: Sequence[Dict[str, Any]]) -> np.ndarray:
    """Tokens of ``messages`` rendered with the chat template (:func:`render_chat`).

    Returns
    -------
    numpy.ndarray of int32
    """
    # The template writes BOS itself where the model wants one.
    toks = llm.tokenize(render_chat(llm, messages).encode("utf-8"), add_bos=False, special=True)
    return np.asarray(toks, dtype=np.int32)


def detokenize(llm, tokens: Sequence[int]) -> str:
    """Text of ``tokens``; control tokens such as EOS render as nothing."""
    if len(tokens) == 0:
        return ""
    return llm.detokenize([int(t) for t in tokens], special=False).decode("utf-8", errors="replace")


class _Decoder:
    """One ``llama_batch`` over one context, filled through numpy views of its C arrays.

    Not thread-safe: one decoder per thread and context.
    """

    def __init__(self, ctx, model, n_batch: int, seq_id: int = 0):
        lc = _llama_cpp()
        self._lc = lc
        self.ctx = ctx
        self.vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        # Per-sequence capacity: a context with several non-unified sequences splits n_ctx.
        self.n_ctx = int(lc.llama_n_ctx_seq(ctx))
        self.n_batch = int(n_batch)
        self.mem = lc.llama_get_memory(ctx)
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)
        b = self.batch
        # Views over the batch's malloc'ed arrays: one vectorized copy per decode instead of a
        # ctypes assignment per token.
        self.tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self.nsq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        self.out = np.ctypeslib.as_array(ctypes.cast(b.logits, ctypes.POINTER(ctypes.c_int8)),
                                         shape=(self.n_batch,))
        self.nsq[:] = 1
        self._seq = None
        self.set_seq(seq_id)
        # Prompt cache of the target decoder (see _prompt_pass): the prompt whose KV is kept.
        self.cached_prompt: Optional[np.ndarray] = None
        self.cached_first = -1

    def set_seq(self, seq_id: int) -> None:
        if seq_id != self._seq:
            for i in range(self.n_batch):
                self.batch.seq_id[i][0] = seq_id
            self._seq = seq_id

    def close(self) -> None:
        if self.batch is not None:
            self._lc.llama_batch_free(self.batch)
            self.batch = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def clear(self) -> None:
        if self.mem is not None:
            self._lc.llama_memory_clear(self.mem, True)

    def pos_max(self, seq_id: int = 0) -> int:
        """Largest position held for ``seq_id`` (-1 when empty)."""
        return int(self._lc.llama_memory_seq_pos_max(self.mem, seq_id))

    def seq_rm(self, p0: int, seq_id: int = 0) -> None:
        """Drop positions ``p0 ..`` of ``seq_id`` from the KV cache."""
        if not self._lc.llama_memory_seq_rm(self.mem, seq_id, p0, -1):
            raise RuntimeError("this model's KV cache cannot drop a partial sequence "
                               "(recurrent/hybrid models are not supported by the live driver)")

    def decode(self, tokens, pos0: int, all_logits: bool) -> np.ndarray:
        """Decode ``tokens`` at positions ``pos0 ..``; return the logits as a (n_out, n_vocab) view.

        Long inputs are split into ``n_batch`` chunks; with ``all_logits=False`` only the last
        token's row is produced. The view is valid until the next decode on this context.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("empty batch")
        if pos0 + n > self.n_ctx:
            raise ValueError(f"decode past the context: {pos0} + {n} > n_ctx {self.n_ctx}")
        if all_logits and n > self.n_batch:
            raise ValueError(f"batch of {n} tokens with all logits exceeds n_batch {self.n_batch}")
        arr = np.asarray(tokens, dtype=np.int32)
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            self.tok[:m] = arr[start:start + m]
            self.pos[:m] = np.arange(pos0 + start, pos0 + start + m, dtype=np.int32)
            self.out[:m] = 1 if all_logits else 0
            last = start + m == n
            if last:
                self.out[m - 1] = 1
            self.batch.n_tokens = m
            rc = self._lc.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        n_out = n if all_logits else 1
        ptr = self._lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    def is_eog(self, token: int) -> bool:
        return bool(self._lc.llama_vocab_is_eog(self.vocab, int(token)))


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


def _as_prompt(prompt_tokens) -> np.ndarray:
    arr = np.asarray(prompt_tokens)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("the prompt must be a non-empty 1-D sequence of token ids")
    if arr.dtype.kind not in "iuO" or (arr.dtype.kind == "O" and not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in arr)):
        raise ValueError(f"prompt token ids must be integers, got {arr.dtype}")
    # Range checked on the values as given: a cast first would wrap 2**32 + 1 to 1.
    lo, hi = arr.min(), arr.max()
    if lo < 0 or hi > np.iinfo(np.int32).max:
        bad = lo if lo < 0 else hi
        raise ValueError(f"prompt token id {bad} is out of range: allowed 0 .. "
                         f"{np.iinfo(np.int32).max} (and below the vocabulary size)")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _check_prompt(dec: _Decoder, prompt: np.ndarray) -> None:
    if prompt.min() < 0 or prompt.max() >= dec.n_vocab:
        raise ValueError(f"prompt token ids must lie in 0 .. {dec.n_vocab - 1}")
    # One free position is needed to decode the first sampled token.
    if prompt.size >= dec.n_ctx:
        raise ValueError(f"the prompt ({prompt.size} tokens) does not fit the context "
                         f"(n_ctx = {dec.n_ctx}); raise --ctx-size")


def _target_decoder(llm) -> _Decoder:
    # One decoder per Llama, cached on it: the batch is allocated once, not per request.
    dec = getattr(llm, "_ngramspec_decoder", None)
    if dec is None or dec.ctx is not llm.ctx:
        dec = _Decoder(llm.ctx, llm.model, llm.n_batch)
        # llama.cpp pads the context to a multiple of 256 (--ctx-size 8 gets 256 positions):
        # honour the size asked for, so drafts and the stop are bounded by it.
        asked = int(getattr(getattr(llm, "context_params", None), "n_ctx", 0) or 0)
        if 0 < asked < dec.n_ctx:
            dec.n_ctx = asked
        llm._ngramspec_decoder = dec
    return dec


def _reset(llm, dec: _Decoder) -> None:
    # The driver owns the context for the request: drop the KV cache and the high-level Llama's
    # record of it, so a later Llama.generate call does not trust a stale prefix.
    dec.clear()
    dec.cached_prompt = None
    llm.reset()


def _prompt_pass(llm, dec: _Decoder, prompt: np.ndarray):
    """First output token of ``prompt``; returns ``(token, reused)``.

    A request with exactly the previous request's prompt reuses its KV cache and first token (as
    llama-server's prompt cache does), so a ``--compare`` pair or a test suite pays for one
    prompt pass. Only an exact match is reused: the result is then bit-identical to a fresh pass
    (re-decoding a 1-token suffix would take llama.cpp's single-token kernels and could change
    the logits in their last bits).
    """
    cached = dec.cached_prompt
    if (cached is not None and cached.size == prompt.size and np.array_equal(cached, prompt)
            and llm.n_tokens == 0  # nobody has used the Llama's own API since
            and dec.pos_max() == prompt.size - 1):
        return dec.cached_first, True
    _reset(llm, dec)
    tok = int(np.argmax(dec.decode(prompt, 0, all_logits=False)[0]))
    dec.cached_prompt, dec.cached_first = prompt.copy(), tok
    return tok, False


def _finish(llm, dec: _Decoder, n_prompt: int) -> None:
    # Keep the prompt's KV cache for a repeat of the request; drop the generated part.
    if dec.cached_prompt is not None and dec.cached_prompt.size == n_prompt:
        dec.seq_rm(n_prompt)
        llm.reset()
    else:
        _reset(llm, dec)


def _draft_time_us(stats) -> int:
    return sum(int(s["t_begin_us"]) + int(s["t_draft_us"]) + int(s["t_accept_us"])
               for s in stats if s.get("type") == _DRAFT_TYPE)


def check_engine_models(llm, engine) -> None:
    """Refuse an engine whose drafts could hold ids the target ``llm`` does not have.

    Used by every live driver (`generate_speculative`, the batched scheduler) before a request.

    Raises
    ------
    ValueError
        A draft model of another vocabulary, or an n-gram cache file holding a token id
        >= ``llm.n_vocab()`` (naming the file and the token).
    """
    # A draft model must share the target's vocabulary: its tokens are verified as ids. Any
    # proposer with a check_target (DraftModelProposer) is asked, so this generation loop does
    # not import the draft model, which imports this module's decoder.
    for prop in getattr(engine, "proposers", ()) or ():
        check = getattr(prop, "check_target", None)
        if check is not None:
            check(llm)
    # So must ngram-cache's files: a cache of another tokenizer is refused (ValueError naming
    # the file and the token), and no draft holds an id the target lacks.
    set_vocab = getattr(engine, "set_vocab", None)
    if set_vocab is not None:
        set_vocab(llm.n_vocab())


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
        from .cache_file import as_path
        update_dynamic_cache = as_path("update_dynamic_cache", update_dynamic_cache)
    if engine is not None:
        check_engine_models(llm, engine)
    dec = _target_decoder(llm)
    prompt = _as_prompt(prompt_tokens)
    _check_prompt(dec, prompt)
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
    sampled, reused = _prompt_pass(llm, dec, prompt)
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
    _finish(llm, dec, prompt.size)
    _save_dynamic(res, update_dynamic_cache, prompt)
    return res


def _save_dynamic(res: GenerationResult, path: Optional[str], prompt: np.ndarray) -> None:
    # The whole stream, as llama.cpp's lookup example merges its context cache at exit.
    if path is not None:
        from .cache_file import merge_into_dynamic
        stream = np.concatenate([prompt, np.asarray(res.output_tokens, dtype=np.int32)])
        res.dynamic_cache_ngrams = len(merge_into_dynamic(path, stream))


def generate_plain(llm, prompt_tokens, *, n_predict: int = -1) -> GenerationResult:
    """Plain greedy generation, one token per ``llama_decode`` (the reference for comparisons).

    Same stop rules as :func:`generate_speculative`: EOS, ``n_predict`` or a full context.

    Notes
    -----
    Thread-safety: not thread-safe; one request at a time per ``llm``.
    """
    dec = _target_decoder(llm)
    prompt = _as_prompt(prompt_tokens)
    _check_prompt(dec, prompt)
    n_ctx = dec.n_ctx
    pc = time.perf_counter
    out: List[int] = []
    if n_predict == 0:
        return GenerationResult([], "", int(prompt.size), "n_predict", 0.0, 0.0, 0.0)
    t0 = pc()
    tok, reused = _prompt_pass(llm, dec, prompt)
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
    _finish(llm, dec, prompt.size)
    return res


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where ``a`` and ``b`` differ (length included), else ``None``."""
    n = min(len(a), len(b))
    for i in range(n):
        if int(a[i]) != int(b[i]):
            return i
    return None if len(a) == len(b) else n


@dataclass
class DivergenceReport:
    """The target's view at the first position where two greedy outputs of one prompt differ.

    The logits are computed twice for the common context: ``single`` as plain decoding does (the
    prompt in one pass, then one token per decode) and ``batched`` with the output tokens in one
    multi-token decode, as verification does. llama.cpp's CPU kernels take different code paths
    for one-token and multi-token batches, so the two differ in their low bits, and through the
    quantized activations of every layer, by up to about 1 logit on the embedded model
    (``noise``). A speculative output may legitimately leave the plain one only where both
    chosen tokens' logits lie within that noise of the best one (a near tie of the two best
    candidates, or of three or more, when the batched path ranks a third one first).

    Attributes
    ----------
    index : int
        Output position of the divergence.
    token_a, token_b : int
        The tokens the two runs chose there (``-1`` where a run had already stopped).
    logit_a, logit_b : float
        Their single-token-path logits.
    top1, top2 : float
        The two largest single-token-path logits.
    gap : float
        ``|logit_a - logit_b|``.
    noise : float
        ``max |single - batched|`` over the vocabulary at this position.
    rel_gap : float
        ``gap / max(1, |top1|)``.

    Notes
    -----
    Thread-safety: plain data, never modified by ngramspec once returned.
    """

    index: int
    token_a: int
    token_b: int
    logit_a: float
    logit_b: float
    top1: float
    top2: float
    gap: float
    noise: float
    rel_gap: float

    def within_noise(self) -> bool:
        """True when both chosen tokens' logits lie within ``noise`` of the best logit.

        Either run may then have picked its token legitimately: the batched path's logits move
        by up to ``noise`` from the single-token path's, enough to reorder such candidates.
        """
        if self.token_a < 0 or self.token_b < 0:
            return False
        return bool(self.top1 - min(self.logit_a, self.logit_b) <= self.noise)

    def to_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["within_float_noise"] = self.within_noise()
        return d


def divergence_report(llm, prompt_tokens, out_a: Sequence[int],
                      out_b: Sequence[int]) -> Optional[DivergenceReport]:
    """Explain why two greedy outputs of the same prompt differ, or ``None`` when they do not.

    Decodes the common context ``prompt + out[:i]`` (``i`` = first difference) along the plain
    path and along a batched path and compares the logits at ``i``; see :class:`DivergenceReport`.
    """
    i = first_divergence(out_a, out_b)
    if i is None:
        return None
    dec = _target_decoder(llm)
    prompt = _as_prompt(prompt_tokens)
    common = np.asarray([int(t) for t in out_a[:i]], dtype=np.int32)
    _check_prompt(dec, prompt)
    if prompt.size + common.size > dec.n_ctx:
        raise ValueError("the divergence lies beyond the model's context")
    P = prompt.size
    keep_cache = False
    try:
        if common.size == 0:
            # Both runs chose from the prompt pass itself: one computation, no noise.
            _reset(llm, dec)
            single = batched = np.array(dec.decode(prompt, 0, all_logits=False)[0], np.float64)
        else:
            # The prompt's KV (batched, as in every run) is shared by both paths: reuse it.
            _prompt_pass(llm, dec, prompt)
            for j in range(common.size):
                row = dec.decode(common[j:j + 1], P + j, all_logits=False)[0]
            single = np.array(row, dtype=np.float64)
            if common.size >= 2:
                dec.seq_rm(P)
                # n_batch chunks, the last one at least 2 tokens long (a 1-token batch would
                # take the single-token kernels again).
                bounds = list(range(0, common.size, max(2, dec.n_batch))) + [common.size]
                if bounds[-1] - bounds[-2] < 2:
                    bounds[-2] -= 1
                for lo, hi in zip(bounds[:-1], bounds[1:]):
                    row = dec.decode(common[lo:hi], P + lo, all_logits=False)[0]
                keep_cache = True
            else:
                dec.seq_rm(P - 1)  # re-decodes the prompt's last position: the cache is spent
                row = dec.decode(np.array([prompt[-1], common[0]], np.int32), P - 1,
                                 all_logits=False)[0]
            batched = np.array(row, dtype=np.float64)
    finally:
        if keep_cache:
            _finish(llm, dec, P)
        else:
            _reset(llm, dec)
    ta = int(out_a[i]) if i < len(out_a) else -1
    tb = int(out_b[i]) if i < len(out_b) else -1
    la = float(single[ta]) if ta >= 0 else float("nan")
    lb = float(single[tb]) if tb >= 0 else float("nan")
    top = np.sort(single)[-2:]
    top1, top2 = float(top[1]), float(top[0])
    gap = abs(la - lb) if ta >= 0 and tb >= 0 else float("inf")
    noise = float(np.max(np.abs(single - batched)))
    return DivergenceReport(i, ta, tb, la, lb, top1, top2, gap, noise, gap / max(1.0, abs(top1)))

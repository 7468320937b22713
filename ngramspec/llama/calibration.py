"""Calibration of the verify-cost curve on a loaded llama-cpp-python model.

`calibrate` measures c(k, n_past) (a `ngramspec.cost.CostModel`) with a few seconds of decodes;
`calibration_for` caches it on disk per model file, thread count, batch size and llama.cpp
backend (`ngramspec.cost.cached_calibration`), so a model is measured once per machine.
This is the llama layer of the cost model: `ngramspec.cost` itself imports no llama_cpp.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

import numpy as np

from ngramspec.cost import CostModel, cached_calibration, calibration_key, model_identity
from ngramspec.policy import AutoPolicy
from ngramspec.validation import check_int, check_real

from .decoder import Decoder, reset_context, target_decoder
from .model import require_llama_cpp

__all__ = ["DEFAULT_KS", "auto_policy", "backend_description", "calibrate", "calibration_for",
           "context_calibration", "key_for", "measure"]

#: Batch sizes a calibration measures. llama.cpp drafts up to 64 tokens (ngram-mod's n_max);
#: beyond the largest measured k the curve is extended linearly (a decode of k tokens splits
#: into n_batch chunks, so its time keeps growing linearly).
DEFAULT_KS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


def backend_description(llm=None) -> str:
    """llama.cpp's build and backend as the cache key sees them: its system-info line (CPU
    features, compiled backends) plus, for a loaded model, the offloaded layer count."""
    info = require_llama_cpp().llama_print_system_info()
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    if llm is not None:
        text += f" | n_gpu_layers={int(getattr(llm.model_params, 'n_gpu_layers', 0))}"
    return text


def _kv_lengths(n_ctx: int, k_max: int) -> list:
    # Three KV lengths: the attention part of a decode grows with the cache, so c(k) changes
    # with it (the embedded model's CPU curve: c(64) ~50 at 64 cached tokens, ~30 at 2k).
    # Filling the cache is most of a calibration's time (~4 ms a token on one CPU thread for
    # the embedded model), so the longest is 1024; beyond it the model extends linearly.
    room = n_ctx - k_max
    if room < 1:
        raise ValueError(f"the context ({n_ctx} tokens) is too small to calibrate batches of "
                         f"{k_max} tokens")
    return sorted({min(p, room) for p in (32, 256, 1024)})


def calibrate(llm, **kwargs) -> CostModel:
    """Measure c(k, n_past) on a loaded llama-cpp-python model (a few seconds).

    Parameters
    ----------
    llm : llama_cpp.Llama
        The target, loaded with the thread count and batch size it will decode with; its own
        context is measured (`measure`).
    **kwargs
        `measure`'s keywords.

    Returns
    -------
    CostModel
        As `measure`'s.

    Notes
    -----
    Memory: as `measure`.

    Thread-safety: takes over ``llm``'s context (its KV cache is cleared before and after); one
    call at a time per model, and no generation on it meanwhile.
    """
    dec = target_decoder(llm)
    reset_context(llm, dec)
    try:
        return measure(dec, llm.model_path, int(llm.context_params.n_threads),
                       backend_description(llm), **kwargs)
    finally:
        reset_context(llm, dec)


def measure(dec: Decoder, model_path: str, n_threads: int, backend: str, *,
            ks: Sequence[int] = DEFAULT_KS, n_pasts: Optional[Sequence[int]] = None,
            reps: int = 3, budget_s: float = 8.0, seed: int = 0,
            progress: Optional[Callable[[str], None]] = None) -> CostModel:
    """Measure c(k, n_past) with a decoder on an empty sequence of a context (a few seconds).

    The KV cache is filled up to each KV length in turn (one batched pass per increment, so the
    longest length is filled once); there every batch size k is decoded ``reps`` times
    (ascending and descending in turn, so that a drift of the machine's speed spreads over all
    k) with logits at every position and their argmax, as the verification loop does, and each
    decode is removed from the cache again. The fastest decode per (n_past, k) is kept:
    interference from other processes only ever adds time. Every k, k = 1 included, is decoded
    equally often: the fastest of more tries is lower on a noisy machine, so a divisor t(1) taken
    from more tries than the t(k) it divides would make every c(k) too high (and the auto
    policy too shy).

    Parameters
    ----------
    dec : Decoder
        A decoder of the context to measure, its sequence empty; emptied again afterwards.
    model_path, n_threads, backend
        The measurement's facts (``meta``): the model file, decode threads, llama.cpp backend.
    ks : sequence of int
        Batch sizes (1 is always included; sizes above the decoder's n_batch are dropped).
    n_pasts : sequence of int, optional
        KV lengths; default 32, 256 and 1024 (capped by n_ctx).
    reps : int
        Decodes per (n_past, k), at least one.
    budget_s : float
        Soft time limit: once a KV length has used its share, its remaining rounds are skipped
        (each point keeps at least one decode), so a slow or busy machine still finishes soon.
    seed : int
        Seed of the random token ids that fill the cache (their values do not matter for time).
    progress : callable, optional
        Called with a one-line message after each KV length.

    Returns
    -------
    CostModel
        ``name="calibrated"``, meta: model identity, n_threads, n_batch, n_ctx, backend,
        created (UNIX time), calibration_s, reps.

    Notes
    -----
    Memory: a few token arrays; the sequence holds at most ``max(n_pasts) + max(ks)`` tokens
    meanwhile.

    Thread-safety: the caller owns the context for the measurement.
    """
    reps = check_int("reps", reps, 1)
    budget_s = check_real("budget_s", budget_s, 0.0, lo_open=True)
    # a batch needs room beside the KV lengths it is measured at: at most half the context
    ks = sorted({int(k) for k in ks if 1 <= int(k) <= min(dec.n_batch, dec.n_ctx // 2)} | {1})
    n_pasts = _kv_lengths(dec.n_ctx, ks[-1]) if n_pasts is None else sorted(
        {int(p) for p in n_pasts})
    if n_pasts[0] < 0 or n_pasts[-1] + ks[-1] > dec.n_ctx:
        raise ValueError(f"KV lengths {n_pasts} plus a batch of {ks[-1]} exceed n_ctx "
                         f"{dec.n_ctx}")
    rng = np.random.default_rng(seed)
    # Ordinary text-token ids: the first ids of a vocabulary are often control tokens.
    lo = min(1000, dec.n_vocab // 2)
    tokens = rng.integers(lo, dec.n_vocab, size=n_pasts[-1] + ks[-1], dtype=np.int32)
    pc = time.perf_counter
    t_start = pc()
    table = []
    filled = 0
    try:
        for i, p in enumerate(n_pasts):
            if p > filled:
                dec.decode(tokens[filled:p], filled, all_logits=False)
                filled = p
            follow = tokens[p:p + ks[-1]]
            if i == 0:
                # Warm-up: the first decode of the largest size pays for buffer allocation.
                dec.decode(follow, p, all_logits=True)
                dec.seq_rm(p)
            best = _fastest(dec, follow, p, ks, reps, t_start + budget_s * (i + 1) / len(n_pasts))
            table.append([best[k] for k in ks])
            if progress:
                progress(f"KV length {p}: t(1) = {best[1] * 1e3:.2f} ms, "
                         f"c({ks[-1]}) = {best[ks[-1]] / best[1]:.2f}")
    finally:
        dec.seq_rm(0)
    meta = {
        "model": model_identity(model_path),
        "n_threads": int(n_threads),
        "n_batch": int(dec.n_batch),
        "n_ctx": int(dec.n_ctx),
        "backend": backend,
        "created": time.time(),
        "calibration_s": round(pc() - t_start, 3),
        "reps": int(reps),
    }
    source = (f"ngramspec calibrate: {os.path.basename(model_path)}, "
              f"{meta['n_threads']} thread(s), n_batch {meta['n_batch']}, "
              f"fastest of {reps} decodes per point")
    return CostModel(ks, n_pasts, table, name="calibrated", source=source, meta=meta)


def _fastest(dec: Decoder, follow: np.ndarray, p: int, ks: Sequence[int], reps: int,
             deadline: float) -> dict:
    """The fastest of `reps` decodes of ``follow[:k]`` at KV length `p` per k (each one removed
    again; rounds alternate ascending and descending k; rounds after the first stop at
    `deadline`)."""
    pc = time.perf_counter
    best = {k: float("inf") for k in ks}
    for r in range(reps):
        if r and pc() > deadline:
            break
        for k in (ks if r % 2 == 0 else ks[::-1]):
            t0 = pc()
            np.argmax(dec.decode(follow[:k], p, all_logits=True), axis=1)
            best[k] = min(best[k], pc() - t0)
            dec.seq_rm(p)
    return best


def key_for(llm, n_threads: Optional[int] = None, n_batch: Optional[int] = None) -> str:
    """Cache key of a calibration of ``llm``'s model: its model file, threads, n_batch and
    backend; the threads and n_batch of ``llm``'s own context unless given."""
    threads = int(llm.context_params.n_threads) if n_threads is None else int(n_threads)
    batch = int(llm.n_batch) if n_batch is None else int(n_batch)
    return calibration_key(llm.model_path, threads, batch, backend_description(llm))


def _cached(key: str, n_ctx: int, run: Callable[[], CostModel], refresh: bool,
            ks: Sequence[int]) -> CostModel:
    if n_ctx < 2 * max(ks):
        # A context too small for the whole curve (generate -c 8): measured for this run
        # only, so that the cache keeps the full curve for the model.
        return run()
    return cached_calibration(key, run, refresh=refresh)


def calibration_for(llm, *, refresh: bool = False, **kwargs) -> CostModel:
    """The cached calibration of ``llm`` (`key_for`), measured with :func:`calibrate`
    (``kwargs``) at first use or with ``refresh=True``."""
    return _cached(key_for(llm), llm.n_ctx(), lambda: calibrate(llm, **kwargs), refresh,
                   kwargs.get("ks", DEFAULT_KS))


def context_calibration(llm, ctx, n_threads: int, n_batch: int, *, measure_now: bool = True,
                        **kwargs) -> Optional[CostModel]:
    """The calibration of another context of ``llm``'s model (the scheduler's), cached as
    `calibration_for`'s under that context's threads and n_batch.

    Parameters
    ----------
    llm : llama_cpp.Llama
        Gives the model, its file and backend.
    ctx : llama_context pointer
        The context to measure, its sequence 0 empty (and left empty).
    n_threads, n_batch : int
        The context's.
    measure_now : bool
        False: only a cached calibration, None when there is none.
    **kwargs
        `measure`'s keywords.

    Returns
    -------
    CostModel or None

    Notes
    -----
    Memory: as `measure`, plus one batch of n_batch tokens meanwhile.

    Thread-safety: the caller owns ``ctx`` for the measurement.
    """
    key = key_for(llm, n_threads, n_batch)
    if not measure_now:
        return cached_calibration(key)

    def run() -> CostModel:
        dec = Decoder(ctx, llm.model, n_batch)
        try:
            return measure(dec, llm.model_path, n_threads, backend_description(llm), **kwargs)
        finally:
            dec.close()

    n_ctx = int(require_llama_cpp().llama_n_ctx(ctx))
    return _cached(key, n_ctx, run, False, kwargs.get("ks", DEFAULT_KS))


def auto_policy(llm, cost_model: Optional[CostModel] = None, **kwargs):
    """An `ngramspec.policy.AutoPolicy` for a target ``llm``: on `cost_model` when given, else on
    ``llm``'s cached calibration (measured now at first use). For drivers that own a loaded
    model (``generate``, a server); ``kwargs`` go to AutoPolicy."""
    return AutoPolicy(cost_model if cost_model is not None else calibration_for(llm), **kwargs)

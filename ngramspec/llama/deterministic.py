"""Deterministic mode: every logit a sequence sees is computed the way its plain decoding does.

llama.cpp's CPU backend computes one sequence's logits differently depending on how the tokens
reach it (measured by ``python bench determinism``, bench/results/determinism.md):

* **the matrix kernel depends on the batch**: a ``mul_mat`` whose right-hand side has one column
  (a one-token decode) takes ggml's per-row dot products, two or more columns llamafile's
  ``tinyBLAS`` (``llamafile_sgemm`` returns false for ``n < 2``), whose accumulation order
  differs. That hits the attention matrices (F16 KV cache) and the output matrix of every
  verification batch, so a verified token is not computed as plain decoding computes it.
* **flash attention** (llama.cpp's default "auto" turns it on for the CPU) has three kernels: a
  split-KV reduction for one query once the KV cache passes 256 cells, a tiled one for long
  batches, a row-by-row one in between.
* **a unified KV cache** shared by several sequences interleaves their cells: a sequence's
  attention sums its values in SIMD lanes set by cell index, so the same context gives other
  bits beside other requests.
* weight repacking (extra buffer types) has its own gemm and gemv kernels (and crashes on AMX).

Within one kernel every output element is one sequential sum over the contraction dimension
(``tinyBLAS``' tiles only choose which elements a thread computes; padding ``n_kv`` to 256 adds
exact zeros), so the recipe of the mode is:

1. flash attention off, no extra buffer types (``repack="off"``);
2. one KV stream per sequence (``kv_unified = false``); a ``llama_decode`` holds one sequence,
   or several whose runs are padded to one length (llama.cpp splits several streams into
   ubatches with equal tokens per stream: unequal runs could leave a one-token ubatch;
   which runs share a decode: `ngramspec.llama.planner.StepPlan.split`);
3. at least `MIN_RUN` (2) tokens in every decode and at least 2 rows of logits where any are
   asked: a one-token step decodes ``[token, token]`` at ``p, p + 1`` and drops the second
   cell (its row of logits is causal-masked from the first: the first row is exact);
4. a slot's KV stream a multiple of 256 cells (``n_kv`` then stays a multiple of 16), its last
   cell kept for the pad of a one-token step (a request's context is one token shorter).

Plain greedy decoding under the mode (``generate --deterministic``) follows the same rules, so
the scheduler's output is byte-identical to it whatever the slot count, the concurrency, the
prompt chunking, the prompt-cache reuse, the speculation or the prediction. `require` refuses
the mode where it cannot hold: layers offloaded to a GPU, a model loaded with extra buffer
types, or a build whose kernels fail the run-time probe (`probe`).

Thread-safety: the module's functions are safe from any thread; the probe's cache is locked.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

import numpy as np

from ngramspec.validation import Refused

from .batch import MultiSeqBatch
from .context import context_params

__all__ = ["FLAG", "MIN_RUN", "KV_ALIGN", "DeterminismRefused", "refusal", "probe", "require",
           "slot_context"]

#: The flag / keyword the refusals name.
FLAG = "--deterministic"
#: Fewest tokens (and rows of logits) of one decode under the mode (see the module notes).
MIN_RUN = 2
#: A slot's KV cells are a multiple of this (llama.cpp pads n_kv to 256).
KV_ALIGN = 256

_probe_lock = threading.Lock()
_probe_cache: Dict[Tuple[int, int], Optional[str]] = {}


class DeterminismRefused(Refused):
    """The deterministic mode cannot hold here; the message names the reason."""

    def __init__(self, reason: str):
        super().__init__(FLAG, reason)


def slot_context(n_ctx: int, n_slots: int) -> int:
    """The context of ``n_slots`` slots under the mode: each slot's share of ``n_ctx`` rounded
    up to a multiple of `KV_ALIGN` cells (at least one)."""
    per = -(-int(n_ctx) // int(n_slots))
    per = max(KV_ALIGN, -(-per // KV_ALIGN) * KV_ALIGN)
    return per * int(n_slots)


def refusal(llm) -> Optional[str]:
    """Why the mode cannot hold for ``llm`` (a ``llama_cpp.Llama``), or None.

    Checks what the load decided: weights offloaded to a GPU (other kernels, not covered), and
    extra buffer types (repacked weights have batch-dependent gemm/gemv kernels).
    """
    import llama_cpp as lc
    mp = getattr(llm, "model_params", None)
    if mp is not None and bool(getattr(mp, "use_extra_bufts", False)):
        return ("the model was loaded with llama.cpp's extra buffer types (weight repacking), "
                "whose gemm and gemv kernels differ by batch size; load it with repack='off' "
                "(--repack off)")
    if bool(lc.llama_supports_gpu_offload()) and int(getattr(mp, "n_gpu_layers", 0) or 0) != 0:
        return ("layers are offloaded to a GPU (n_gpu_layers / $LLAMA_ARG_N_GPU_LAYERS): the "
                "mode covers llama.cpp's CPU kernels only; set n_gpu_layers to 0")
    return None


def _probe_tokens(n_vocab: int) -> np.ndarray:
    # a fixed, model-independent sequence: 48 distinct ids spread over the vocabulary
    return (np.arange(48, dtype=np.int64) * 7919 + 101).astype(np.int32) % np.int32(n_vocab)


def _probe_paths(llm, n_threads: int) -> Optional[str]:
    """Decode the probe sequence along the mode's paths on a two-slot context of the mode;
    the first path whose logits differ bit-wise from the padded plain path's, or None."""
    import llama_cpp as lc
    n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm.model)))
    S = _probe_tokens(n_vocab)
    P = 33
    cp = context_params(n_ctx=2 * KV_ALIGN, n_batch=128, n_seq_max=2, n_threads=n_threads,
                        unified=False, flash_attn=False)
    ctx = lc.llama_init_from_model(llm.model, cp)
    if not ctx:
        return "llama_init_from_model failed for the probe context"
    try:
        batch = MultiSeqBatch(128, min_run=MIN_RUN)

        mem = lc.llama_get_memory(ctx)
        R = S[::-1].copy()

        def run(seq, chunks, beside=False):
            """Decode S[:P] and the continuation in the given (lo, hi) pieces, one per decode
            (``beside``: the other sequence's R[lo:hi] in the same decodes, both padded to one
            length, as the scheduler decodes its slots' runs); the rows at positions
            P-1 .. len(S)-2."""
            lc.llama_memory_clear(mem, True)
            rows = []
            for lo, hi in chunks:
                batch.clear()
                L = max(hi - lo, MIN_RUN)
                batch.add(seq, S[lo:hi], lo, "all" if hi > P - 1 else "none", L)
                if beside:
                    batch.add(1 - seq, R[lo:hi], lo, "all", L)
                out = batch.decode(ctx)
                rows.extend(np.array(out[max(0, P - 1 - lo):hi - lo]))
            return np.stack(rows)

        n = S.size - 1
        plain = run(0, [(0, P)] + [(q, q + 1) for q in range(P, n)])
        others = {
            "prompt chunks of 1..5 tokens, verification batches of 4": (
                [(0, 1), (1, 6), (6, 13), (13, 20), (20, 21), (21, P)]
                + [(q, min(n, q + 4)) for q in range(P, n, 4)], False),
            "beside another sequence in equal-length runs of 3": (
                [(0, P)] + [(q, min(n, q + 3)) for q in range(P, n, 3)], True),
        }
        for name, (chunks, beside) in others.items():
            got = run(1, chunks, beside)
            if not np.array_equal(got, plain):
                diff = float(np.max(np.abs(got.astype(np.float64) - plain)))
                return (f"this llama.cpp build's kernels compute a sequence's logits differently "
                        f"by batch shape on this CPU (probe: {name} differ from one-token "
                        f"decodes by up to {diff:.3g}); the mode cannot hold")
        return None
    finally:
        lc.llama_free(ctx)


def probe(llm, n_threads: int) -> Optional[str]:
    """The run-time probe of the mode's kernels for ``llm`` at ``n_threads`` threads: a failure
    reason, or None. Cached per model and thread count (a few decodes of 48 tokens)."""
    key = (int(getattr(llm.model, "value", 0) or id(llm.model)), int(n_threads))
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _probe_paths(llm, n_threads)
        return _probe_cache[key]


def require(llm, n_threads: int) -> None:
    """Raise `DeterminismRefused` naming the reason when the mode cannot hold for ``llm``."""
    reason = refusal(llm) or probe(llm, n_threads)
    if reason is not None:
        raise DeterminismRefused(reason)

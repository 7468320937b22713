"""The parameters of the llama contexts ngramspec makes on loaded weights (the scheduler's, the
draft model's, the calibration's, the noise and determinism probes'): one place for them.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["context_params"]


def context_params(*, n_ctx: int, n_batch: int, n_seq_max: int, n_threads: int,
                   unified: bool, flash_attn: Optional[bool] = None):
    """``llama_context_params`` of a context ngramspec makes on a loaded model's weights (the
    scheduler's, the draft model's, a noise-measuring one): ``n_batch`` tokens per decode in one
    ubatch, ``n_threads`` for single and batched decodes alike, no perf counters; ``unified``
    shares the KV cells among the ``n_seq_max`` sequences, else each gets ``n_ctx / n_seq_max``;
    ``flash_attn`` True/False forces llama.cpp's flash attention on/off (None: its "auto")."""
    import llama_cpp as lc   # a context needs a loaded model: llama_cpp is there
    cp = lc.llama_context_default_params()
    if flash_attn is not None:
        cp.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                              else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.n_ctx = int(n_ctx)
    cp.n_batch = cp.n_ubatch = int(n_batch)
    cp.n_seq_max = int(n_seq_max)
    cp.n_threads = cp.n_threads_batch = int(n_threads)
    cp.kv_unified = bool(unified)
    cp.no_perf = True
    return cp

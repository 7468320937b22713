"""Whether llama.cpp may repack model weights into its extra CPU buffer types (``--no-repack``).

llama.cpp loads CPU weights into "extra buffer types" when ``llama_model_params.use_extra_bufts``
is true (its default): repacked layouts for AVX2/NEON kernels, KleidiAI, and Intel AMX tiles. On
CPUs with AMX (``amx_tile``/``amx_int8``/``amx_bf16`` in ``/proc/cpuinfo``: Sapphire Rapids and
later) the AMX matrix multiplication of llama-cpp-python 0.3.x crashes (SIGSEGV in
``ggml_backend_amx_mul_mat``) on every batch of more than one token, so every prompt pass and
every speculative verification dies (ngramspec issue 14; llama.cpp issue 20824). llama.cpp has no
finer switch than ``use_extra_bufts`` (llama-server's ``--no-repack``): ``repack="auto"`` turns it
off on AMX hosts only. Elsewhere it stays on, as before: on this project's AVX2 host the embedded
Q4_1 model has no tensor llama.cpp repacks, but a Q4_0 model does, and its plain decoding ran at
0.85x without (``bench/results/repack.md``).

``llama_cpp.Llama(...)`` takes no keyword for the field: :func:`load_llama` (and the context
manager :func:`extra_buffer_types`) set it on the ``llama_model_params`` that ``Llama.__init__``
builds from ``llama_model_default_params()``.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Callable, FrozenSet, Iterator, Optional, Union

__all__ = ["REPACK_CHOICES", "cpu_flags", "host_has_amx", "use_extra_bufts", "model_params",
           "extra_buffer_types", "load_llama", "warn_if_amx_repack"]

#: Values of ``repack=`` / ``--repack``: auto (off on AMX hosts), on, off.
REPACK_CHOICES = ("auto", "on", "off")

#: Where :func:`cpu_flags` reads the CPU's flags (Linux).
CPUINFO_PATH = "/proc/cpuinfo"

#: A CPU-flags source for tests: a path to a cpuinfo-style file, or a callable returning flags.
FlagsSource = Union[None, str, os.PathLike, Callable[[], "set[str]"]]

_override_lock = threading.RLock()
_warned = False


def cpu_flags(source: FlagsSource = None) -> FrozenSet[str]:
    """The CPU feature flags of the host (the ``flags`` lines of ``/proc/cpuinfo``).

    Parameters
    ----------
    source : str, os.PathLike or callable, optional
        A cpuinfo-style file to read instead of ``/proc/cpuinfo``, or a callable returning the
        flags (tests inject a host with or without AMX this way).

    Returns
    -------
    frozenset of str
        Empty where the file cannot be read (non-Linux hosts): no AMX is assumed there.

    Notes
    -----
    Thread-safety: safe; reads the file on every call (no cache, so tests may swap the source).
    """
    if callable(source):
        return frozenset(source())
    path = CPUINFO_PATH if source is None else os.fspath(source)
    flags = set()
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        return frozenset()
    return frozenset(flags)


def host_has_amx(flags: FlagsSource = None) -> bool:
    """True when the CPU reports any Intel AMX feature (``amx_tile``, ``amx_int8``, ...)."""
    return any(f.startswith("amx") for f in cpu_flags(flags))


def use_extra_bufts(repack: Union[str, bool] = "auto", *, flags: FlagsSource = None) -> bool:
    """The ``use_extra_bufts`` value for a model load.

    Parameters
    ----------
    repack : {"auto", "on", "off"} or bool
        ``"on"``/``True``: llama.cpp's default (repack); ``"off"``/``False``: no extra buffer
        types (llama-server's ``--no-repack``); ``"auto"``: off where the CPU has AMX, else on.
    flags : str, os.PathLike or callable, optional
        CPU-flags source for ``"auto"`` (see :func:`cpu_flags`).

    Raises
    ------
    ValueError
        Naming ``repack`` / ``--repack`` and the allowed values.
    """
    if isinstance(repack, bool):
        return repack
    if repack not in REPACK_CHOICES:
        raise ValueError(f"repack (--repack) must be one of {', '.join(REPACK_CHOICES)}, "
                         f"got {repack!r}")
    if repack == "auto":
        return not host_has_amx(flags)
    return repack == "on"


def model_params(repack: Union[str, bool] = "auto", *, flags: FlagsSource = None):
    """``llama_model_default_params()`` with ``use_extra_bufts`` decided by ``repack``.

    For models ngramspec loads through ``llama_cpp._internals.LlamaModel`` (the draft model,
    vocabulary-only loads).
    """
    import llama_cpp
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = use_extra_bufts(repack, flags=flags)
    return params


@contextlib.contextmanager
def extra_buffer_types(enabled: bool) -> Iterator[None]:
    """Within the block, ``llama_cpp.Llama(...)`` loads models with ``use_extra_bufts=enabled``.

    ``Llama.__init__`` starts from ``llama_cpp.llama_model_default_params()`` and has no keyword
    for the field, so the block replaces that function of ``llama_cpp.llama_cpp`` (the module
    ``Llama`` calls through) with one that sets it, and restores it on exit.

    Notes
    -----
    Thread-safety: blocks of different threads are serialized by a lock; a ``Llama`` created by
    another thread *outside* such a block while one is open gets the same setting (the switch is
    process-wide while the block lasts; ngramspec opens it only around its own loads).
    """
    from llama_cpp import llama_cpp as lc
    with _override_lock:
        original = lc.llama_model_default_params

        def patched():
            params = original()
            params.use_extra_bufts = bool(enabled)
            return params

        lc.llama_model_default_params = patched
        try:
            yield
        finally:
            lc.llama_model_default_params = original


#: llama-server's environment variable for ``-ngl``: layers to offload to a GPU (-1: all). Read
#: by `load_llama` so that every load (generate, calibrate, serve and the processes they start)
#: offloads alike on a GPU build of llama-cpp-python; unset, llama-cpp-python's default (0).
GPU_LAYERS_ENV = "LLAMA_ARG_N_GPU_LAYERS"


def gpu_layers_from_env(environ=None) -> Optional[int]:
    """``n_gpu_layers`` from `GPU_LAYERS_ENV`, or None when it is unset or empty.

    Parameters
    ----------
    environ : Mapping, optional
        Where to read it (default ``os.environ``; tests pass a dict).

    Raises
    ------
    ValueError
        When the value is not an integer >= -1, naming the variable.

    Notes
    -----
    Memory: none kept. Thread-safety: reads the environment only; safe from any thread.
    """
    text = (os.environ if environ is None else environ).get(GPU_LAYERS_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < -1:
        raise ValueError(f"{GPU_LAYERS_ENV} must be an integer >= -1 (-1: every layer on the "
                         f"GPU), got {text!r}")
    return value


def load_llama(model_path: str, *, repack: Union[str, bool] = "auto", flags: FlagsSource = None,
               **llama_kwargs):
    """``llama_cpp.Llama(model_path, **llama_kwargs)`` with ``use_extra_bufts`` from ``repack``.

    The way to build a ``Llama`` (for the plug-in, say) that does not crash on AMX hosts:
    ``load_llama("model.gguf", n_ctx=4096, logits_all=True, draft_model=...)``; a draft model
    with an ``attach(llm)`` method (`ngramspec.integrations.llama_cpp.NgramspecDraftModel`) is
    attached to the new ``Llama``.

    Parameters
    ----------
    model_path : str
        GGUF file.
    repack : {"auto", "on", "off"} or bool
        See :func:`use_extra_bufts`.
    flags : optional
        CPU-flags source for ``"auto"`` (tests).
    **llama_kwargs
        Passed to ``llama_cpp.Llama``; without ``n_gpu_layers``, $LLAMA_ARG_N_GPU_LAYERS gives it
        (:func:`gpu_layers_from_env`).

    Returns
    -------
    llama_cpp.Llama
        Its ``model_params.use_extra_bufts`` holds the value the model was loaded with.

    Notes
    -----
    Thread-safety: safe; concurrent loads are serialized by :func:`extra_buffer_types`' lock.
    """
    import llama_cpp
    enabled = use_extra_bufts(repack, flags=flags)
    if "n_gpu_layers" not in llama_kwargs:
        n_gpu_layers = gpu_layers_from_env()
        if n_gpu_layers is not None:
            llama_kwargs["n_gpu_layers"] = n_gpu_layers
    with extra_buffer_types(enabled):
        llm = llama_cpp.Llama(model_path=model_path, **llama_kwargs)
    if bool(llm.model_params.use_extra_bufts) != enabled:  # a llama-cpp-python that changed
        raise RuntimeError("llama-cpp-python did not take use_extra_bufts from "
                           "llama_model_default_params(); cannot control weight repacking")
    # llama-cpp-python never tells a draft model its Llama: ngramspec's plug-in is told here
    attach = getattr(llama_kwargs.get("draft_model"), "attach", None)
    if attach is not None:
        attach(llm)
    return llm


def warn_if_amx_repack(llm, *, flags: FlagsSource = None, stacklevel: int = 2) -> bool:
    """Warn once per process when ``llm`` was loaded with extra buffer types on an AMX host.

    ``llm=None`` is a ``Llama`` the caller cannot see (a plug-in that was not attached to its
    ``Llama``), taken as built with llama-cpp-python's defaults: extra buffer types on.

    Returns True when the warning applies (whether or not it was already given).

    Notes
    -----
    Thread-safety: safe; two threads racing on the first warning may both give it.
    """
    global _warned
    if llm is not None:
        params = getattr(llm, "model_params", None)
        if params is None or not bool(getattr(params, "use_extra_bufts", False)):
            return False
    if not host_has_amx(flags):
        return False
    if not _warned:
        _warned = True
        which = ("the Llama was loaded with llama.cpp's extra buffer types" if llm is not None
                 else "a Llama not loaded by load_llama has llama.cpp's extra buffer types")
        warnings.warn(
            f"this CPU has AMX and {which} (weight repacking), whose AMX kernel crashes on "
            "multi-token batches; load it with "
            "ngramspec.llama.repack.load_llama(path, ...) or inside "
            "ngramspec.llama.repack.extra_buffer_types(False)", RuntimeWarning,
            stacklevel=stacklevel)
    return True

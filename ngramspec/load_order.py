"""llama.cpp's GPU libraries before libstdc++: the import order a CUDA build needs.

Below every layer (it imports no ngramspec module), so that ``ngramspec/__init__`` can call it
before anything loads numpy; the one module outside `ngramspec.llama` that imports
``llama_cpp`` (inside :func:`load_gpu_llama_first`, tests/test_layers.py checks both).

Seen on the lent H200 (gVisor; CUDA 13.0; llama-cpp-python 0.3.36 built there for sm_90;
bench/gpu/README.md §5): a process that had loaded libstdc++ before llama.cpp's libraries --
through numpy (its C++ core), ngramspec's C++ kernel ``_cache``, or ``ctypes.CDLL("libstdc++.so.6")``
alone -- died with SIGSEGV inside ``llama_model_load`` of every model, with or without layers on
the GPU, while the same load worked when ``import llama_cpp`` came first (``bench/gpu/diag.py``).
The same libstdc++ file is mapped either way; why the order matters there is not known, so the
order is the fix: :func:`load_gpu_llama_first`, called by ``import ngramspec`` before its
kernels and numpy load.

It costs nothing where it does not apply: without llama-cpp-python or with a CPU build, a look at
the package's ``lib`` folder; in a process that already imported numpy (an engine's worker, a
notebook) nothing is done, since it is too late to help there.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

__all__ = ["gpu_build_libraries", "load_gpu_llama_first"]

#: File-name prefixes of llama.cpp's GPU backends in llama-cpp-python's ``lib`` folder.
GPU_BACKENDS = ("libggml-cuda", "libggml-hip", "libggml-musa")


def gpu_build_libraries(package_dir: Optional[str]) -> list:
    """The GPU backend libraries of a llama-cpp-python package folder (its ``lib``), sorted.

    Parameters
    ----------
    package_dir : str or None
        The ``llama_cpp`` package's folder; None (not installed) gives an empty list.
    """
    if not package_dir:
        return []
    try:
        names = os.listdir(os.path.join(package_dir, "lib"))
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(GPU_BACKENDS))


def load_gpu_llama_first() -> bool:
    """Import ``llama_cpp`` now if it is a GPU build and numpy is not loaded yet.

    Returns
    -------
    bool
        Whether it was imported here.

    Notes
    -----
    Any failure of that import (a GPU build on a machine without the driver, a broken install)
    is left to the place that uses llama-cpp-python to report: ``import ngramspec`` must work
    for replay and the engines' plug-ins without it.

    Thread-safety: as any import (Python's import lock).
    """
    if "numpy" in sys.modules or "llama_cpp" in sys.modules:
        return False
    spec = importlib.util.find_spec("llama_cpp")
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not any(gpu_build_libraries(folder) for folder in folders):
        return False
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # reported where llama-cpp-python is used (ngramspec.llama.model)
        return False
    return True

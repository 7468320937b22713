"""Deprecated home of the llama-cpp-python plug-in: use `ngramspec.integrations.llama_cpp`.

The plug-in moved beside the vLLM and SGLang integrations (one home for ngramspec inside
someone else's engine); this path keeps working and warns once per import.
"""
from __future__ import annotations

import warnings

from ngramspec.integrations.llama_cpp import NgramspecDraftModel

__all__ = ["NgramspecDraftModel"]

warnings.warn("ngramspec.llama.plugin moved to ngramspec.integrations.llama_cpp; the old path "
              "will be removed", DeprecationWarning, stacklevel=2)

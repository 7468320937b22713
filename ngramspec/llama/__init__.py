"""ngramspec on llama.cpp (llama-cpp-python): every module that talks to ``llama_cpp``.

* `model`: the embedded GGUF, loading a model; `repack`: llama.cpp's weight repacking (AMX);
* `decoder`: the batch decoder over a llama.cpp context; `tokenizer`: text <-> tokens;
* `live`: greedy speculative generation (the `ngramspec.loop.SlotLoop` on a live context);
* `divergence`: why two greedy outputs differ (llama.cpp's float noise, measured per path);
* `scheduler`: the batched multi-slot engine with sampling (`params`, `sampling`, `joint`, ...);
* `draft_model`: the ``draft-simple`` proposer; `calibration`: the measured verify-cost curve;
* `plugin`: a ``llama_cpp.Llama(draft_model=...)`` plug-in (imports llama_cpp on import).

``llama_cpp`` itself is imported on first use (the ``live`` extra), so importing this package
(and the command line, which names its functions) works without it.
"""
from __future__ import annotations

import importlib as _importlib

# Public names -> their module, imported on first use: `import ngramspec.llama.repack` (the
# command line's flags) then loads that module only, not the scheduler and the drivers.
_EXPORTS = {
    "divergence": ("DivergenceReport", "divergence_report", "first_divergence"),
    "live": ("GenerationResult", "generate_plain", "generate_speculative"),
    "model": ("ModelNotFoundError", "default_model_path", "load_model"),
    "params": ("SamplingParams", "SpeculationParams"),
    "scheduler": ("Chunk", "Completion", "QueueFull", "RequestHandle", "Scheduler"),
    "tokenizer": ("Tokenizer", "detokenize", "render_chat", "tokenize_chat", "tokenize_prompt"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_importlib.import_module(f"{__name__}.{module}"), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))

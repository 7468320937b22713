"""ngramspec on llama.cpp (llama-cpp-python): every module that talks to ``llama_cpp``.

* `model`: the embedded GGUF, loading a model; `repack`: llama.cpp's weight repacking (AMX);
* `decoder`: the batch decoder over a llama.cpp context; `tokenizer`: text <-> tokens;
* `live`: greedy generation, speculative or plain (`ngramspec.loop.SlotLoop` on a live context);
* `divergence`: why two greedy outputs differ (llama.cpp's float noise, measured per path);
* `scheduler`: the batched multi-slot engine with sampling (`sampling`, `batch`, ...), its
  request types in `ngramspec.request_params` and `ngramspec.request`; `backend`: the
  scheduler as the server's `ngramspec.backend.Backend`;
* `draft_model`: the ``draft-simple`` proposer; `calibration`: the measured verify-cost curve;
* `plugin`: a ``llama_cpp.Llama(draft_model=...)`` plug-in (imports llama_cpp on import).

``llama_cpp`` itself is imported on first use (the ``live`` extra), so importing this package
(and the command line, which names its functions) works without it.
"""
from __future__ import annotations

from ngramspec.lazy import lazy_exports

# Public names -> their module, imported on first use: `import ngramspec.llama.repack` (the
# command line's flags) then loads that module only, not the scheduler and the drivers.
__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".divergence": ("DivergenceReport", "divergence_report", "first_divergence"),
    ".live": ("GenerationInterrupted", "GenerationResult", "LiveTarget", "generate_plain",
              "generate_speculative"),
    ".model": ("ModelNotFoundError", "default_model_path", "load_model"),
    ".scheduler": ("Scheduler",),
    # the request types live in the backend-neutral modules (the server imports them there)
    "ngramspec.request_params": ("SamplingParams", "SpeculationParams"),
    "ngramspec.request": ("Chunk", "Completion", "QueueFull", "RequestHandle"),
    ".tokenizer": ("Tokenizer", "detokenize", "render_chat", "tokenize_chat", "tokenize_prompt"),
})

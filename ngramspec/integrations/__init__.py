"""ngramspec inside someone else's engine.

- `ngramspec.integrations.vllm`: ``NgramspecProposer``, vLLM's ``custom_class`` proposer, and a
  ``vllm.general_plugins`` entry point that hands it request ids.
- `ngramspec.integrations.sglang`: ``NgramspecCorpus`` in SGLang's NGRAM worker, registered as
  the speculative algorithm ``NGRAMSPEC`` by a ``sglang.srt.plugins`` entry point.
- `ngramspec.integrations.llama_cpp`: ``NgramspecDraftModel``, a llama-cpp-python draft model.

All of them drive the same pieces: a `ngramspec.engine.SpecEngine` built from the llama-server
flags in ``$NGRAMSPEC_SPEC`` (`ngramspec.integrations.requests.engine_from_env`), one
`ngramspec.loop.SlotLoop` per request and the draft-length policy of `ngramspec.policy`.
Importing this package, or its vllm and sglang modules, needs neither engine: they are imported
on first use.
"""

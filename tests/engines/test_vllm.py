"""The vLLM contract, inside vllm 0.33.0 (.ci/engines runs it in .venv-vllm; the main suite
skips it): the proposer built by vLLM's own ``create_custom_proposer`` from a real
``VllmConfig``, driven with the V1 runner's call sequence (`harness.RunnerSim`), and the
runner hook of the ``vllm.general_plugins`` entry point."""
import importlib.metadata
import json
import logging

import pytest

vllm = pytest.importorskip("vllm")

from conftest import TRACES  # noqa: E402
from harness import (PER_REQUEST, SHARED, RunnerSim, check_drafts_are_spec_engines,  # noqa: E402
                     check_moving_rows_changes_nothing,
                     check_request_ids_match_token_following, sim_requests)

from ngramspec.integrations import vllm as ours  # noqa: E402
from ngramspec.traces import read_requests  # noqa: E402

K = 8
MAX_LEN = 1 << 14
PROPOSER = "ngramspec.integrations.vllm.NgramspecProposer"


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    """A real ModelConfig of a tiny Llama (config.json only: the proposer loads no weights)."""
    from vllm.config import ModelConfig
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 50000, "max_position_embeddings": MAX_LEN,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32"}))
    return ModelConfig(model=str(path), skip_tokenizer_init=True, max_model_len=MAX_LEN,
                       dtype="float32")


def vllm_config(model_config, max_num_seqs, **spec):
    """The VllmConfig of `vllm serve --speculative-config '{spec}'` for the tiny model."""
    from vllm.config import (DeviceConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig,
                             VllmConfig)
    sc = SpeculativeConfig(target_model_config=model_config,
                           target_parallel_config=ParallelConfig(), **spec)
    return VllmConfig(model_config=model_config, speculative_config=sc,
                      scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                       max_model_len=MAX_LEN,
                                                       is_encoder_decoder=False),
                      device_config=DeviceConfig(device="cpu"))


@pytest.fixture(scope="module")
def make(model_config):
    """``make(flags, max_num_seqs)``: the proposer as vLLM builds it, flags in NGRAMSPEC_SPEC."""
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer
    mp = pytest.MonkeyPatch()

    def build(flags, max_num_seqs):
        mp.setenv("NGRAMSPEC_SPEC", flags)
        return create_custom_proposer(vllm_config(model_config, max_num_seqs,
                                                  method="custom_class", model=PROPOSER,
                                                  num_speculative_tokens=K))
    yield build
    mp.undo()


@pytest.fixture(scope="module", params=["code-edit", "agentic"])
def trace(request):
    return [r for r in read_requests(str(TRACES / f"{request.param}.jsonl.gz"), limit=6)
            if len(r.prompt) + len(r.output) < MAX_LEN - 1]


def test_vllm_builds_it_from_its_config(make):
    prop = make("--spec-type ngram-suffix", 5)
    assert isinstance(prop, ours.NgramspecProposer)
    assert (prop.k, prop.max_model_len, prop.n_slots, prop.tp_size) == (K, MAX_LEN, 5, 1)
    assert [s["type"] for s in prop.engine.stats()] == ["ngram-suffix"]


def test_a_bad_flag_stops_vllm_with_serves_message(make):
    with pytest.raises(RuntimeError, match=r"NGRAMSPEC_SPEC: --spec-ngram-mod-n-min = 2000 is "
                                           r"out of range: allowed 0 \.\. 1024"):
        make("--spec-type ngram-mod --spec-ngram-mod-n-min 2000", 2)


def test_drafts_are_spec_engines_for_each_request(make, trace):
    check_drafts_are_spec_engines(make, trace, K, MAX_LEN)


@pytest.mark.parametrize("flags", [PER_REQUEST, SHARED])
def test_moving_rows_changes_nothing(make, trace, flags):
    check_moving_rows_changes_nothing(make, trace, K, MAX_LEN, flags)


def test_request_ids_match_token_following(make, trace):
    check_request_ids_match_token_following(make, trace, MAX_LEN)


def test_vllms_own_ngram_proposer_runs_in_the_same_harness(model_config, trace):
    """The side-by-side bench's vLLM row: its numba NgramProposer, same runner sequence."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    prop = NgramProposer(vllm_config(model_config, 4, method="ngram", num_speculative_tokens=K,
                                     prompt_lookup_min=2, prompt_lookup_max=5))

    class Runner:      # the runner's call: propose(num_spec_tokens_to_schedule, ...)
        def propose(self, sampled, num_tokens, token_ids, slot_mappings=None):
            return prop.propose(K, sampled, num_tokens, token_ids)
    sims = sim_requests(trace)
    RunnerSim(sims, 4, MAX_LEN).run(Runner())
    assert sum(len(d) for r in sims for d in r.drafts) > 0


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "ngramspec.integrations.vllm:register" in {ep.value for ep in eps}


def test_register_hooks_the_runner_on_the_tested_version_only(monkeypatch, caplog):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    original = GPUModelRunner.propose_draft_token_ids
    original = getattr(original, "__wrapped__", original)
    monkeypatch.setattr(GPUModelRunner, "propose_draft_token_ids", original)
    monkeypatch.setattr(vllm, "__version__", "0.0.1")
    with caplog.at_level(logging.WARNING):
        ours.register()
    assert GPUModelRunner.propose_draft_token_ids is original
    assert "vLLM 0.0.1 is not the tested 0.33.0" in caplog.text
    monkeypatch.setattr(vllm, "__version__", ours.TESTED_VLLM)
    ours.register()
    ours.register()                                  # loaded twice: hooked once
    hooked = GPUModelRunner.propose_draft_token_ids
    assert hooked.__wrapped__ is original

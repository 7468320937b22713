"""The vLLM contract, inside vllm 0.33.0 (.ci/engines runs it in .venv-vllm; the main suite
skips it): the proposer built by vLLM's own ``create_custom_proposer`` from a real
``VllmConfig``, driven with the V1 runner's call sequence (`engine_harness.RunnerSim`), and the
runner hook of the ``vllm.general_plugins`` entry point."""
import importlib.metadata
import logging
import re
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

from conftest import TRACES  # noqa: E402
from engine_harness import (PER_REQUEST, SHARED, RunnerSim, SimRequest,  # noqa: E402
                            TimedProposer, VllmNgram, VllmSuffix,
                            check_drafts_are_spec_engines, check_moving_rows_changes_nothing,
                            SUBSET_ARGS, check_prediction_and_control, subset_reference,
                            word_tokenizer,
                            check_request_ids_match_token_following, random_arrivals,
                            reference_drafts, sim_requests, synthetic_trace, tiny_vllm_config)

from ngramspec.integrations import vllm as ours  # noqa: E402
from ngramspec.integrations.requests import engine_from_env  # noqa: E402
from ngramspec.loop import run_recorded  # noqa: E402
from ngramspec.traces import read_requests  # noqa: E402

K = 8
MAX_LEN = 1 << 14
PROPOSER = "ngramspec.integrations.vllm.NgramspecProposer"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-llama")


@pytest.fixture(scope="module")
def make(model_dir):
    """``make(flags, max_num_seqs)``: the proposer as vLLM builds it, flags in NGRAMSPEC_SPEC."""
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer
    mp = pytest.MonkeyPatch()

    def build(flags, max_num_seqs):
        mp.setenv("NGRAMSPEC_SPEC", flags)
        return create_custom_proposer(tiny_vllm_config(model_dir, MAX_LEN, max_num_seqs,
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


def test_vllms_own_ngram_proposer_runs_in_the_same_harness(model_dir, trace):
    """The side-by-side bench's vLLM row: its numba NgramProposer, same runner sequence."""
    prop = VllmNgram(tiny_vllm_config(model_dir, MAX_LEN, 4, method="ngram",
                                      num_speculative_tokens=K, prompt_lookup_min=2,
                                      prompt_lookup_max=5))
    sims = sim_requests(trace)
    RunnerSim(sims, 4, MAX_LEN).run(prop)
    assert sum(s[1] for r in sims for s in r.steps) > 0


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


def test_the_hooked_runner_hands_request_ids(make, monkeypatch):
    """vLLM's own propose_draft_token_ids (its custom_class branch), hooked by register(), on a
    runner holding only what that branch reads: the drafter gets the batch's request ids and
    the finished requests before it drafts."""
    import numpy as np
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    ours.register()
    prop = make(PER_REQUEST, 2)
    seen = []
    real = prop.set_request_ids
    monkeypatch.setattr(prop, "set_request_ids",
                        lambda ids, finished=(), args_of=None: (
                            seen.append((list(ids), set(finished))),
                            real(ids, finished, args_of)))
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.drafter = prop
    runner.speculative_config = SimpleNamespace(method="custom_class")
    tokens = np.zeros((2, MAX_LEN), dtype=np.int32)
    tokens[0, :6] = [1, 2, 3, 1, 2, 3]
    runner.input_batch = SimpleNamespace(req_ids=["r1"], token_ids_cpu=tokens,
                                         num_tokens_no_spec=np.array([6, 0], np.int32))
    out = SchedulerOutput.make_empty()
    out.finished_req_ids = {"r0"}
    drafts = GPUModelRunner.propose_draft_token_ids(runner, out, [[3]], None, None, None, None,
                                                    None, None, None)
    assert seen == [(["r1"], {"r0"})]
    assert list(prop.requests.requests) == ["r1"] and len(drafts) == 1


# -- Predicted Outputs and per-request control through vLLM's request path (issue 37) --------

@pytest.fixture(scope="module")
def model_config(model_dir):
    return tiny_vllm_config(model_dir, MAX_LEN, 4, method="custom_class", model=PROPOSER,
                            num_speculative_tokens=K).model_config


def openai_params(body, model_config, tokenizer=None, chat=True):
    """The ``SamplingParams`` vLLM's API server builds from an OpenAI request body and checks
    (its own request model, ``to_sampling_params``, ``verify``), with the plug-in's hooks."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    ours.register()
    if chat:
        req = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "edit"}], **body})
    else:
        req = CompletionRequest.model_validate({"model": "m", "prompt": "edit", **body})
    params = req.to_sampling_params(64, {})
    params.verify(model_config, None, None, tokenizer)
    return params


def test_openai_fields_reach_extra_args_checked_and_tokenized(model_config):
    """OpenAI's ``prediction`` object and ``serve``'s ``speculative`` object on a chat request
    (extra fields to vLLM's request model), or the same in ``vllm_xargs`` on a completion:
    ``extra_args`` holds them, the text prediction as the tokenizer's ids."""
    tok = word_tokenizer(["def", "f", "(", ")", ":", "return", "1"])
    text = "def f ( ) : return 1"
    params = openai_params({"prediction": {"type": "content", "content": text},
                            "speculative": {"n_max": 4, "type": "ngram-simple"}},
                           model_config, tok)
    assert params.extra_args["prediction"] == tok.encode(text, add_special_tokens=False)
    assert params.extra_args["prediction"] == [1, 2, 3, 4, 5, 6, 7]
    assert params.extra_args["speculative"] == {"n_max": 4, "type": "ngram-simple"}
    xargs = openai_params({"vllm_xargs": {"prediction": text, "speculative.enabled": False,
                                          "speculative.n_max": 4}}, model_config, tok,
                          chat=False).extra_args
    assert xargs["prediction"] == [1, 2, 3, 4, 5, 6, 7]
    assert xargs["speculative.enabled"] == 0         # vllm_xargs turns false into 0
    control = ours.control_of(xargs, ("ngram-simple",))
    assert control.spec.enabled is False and control.spec.n_max == 4
    plain = openai_params({}, model_config, tok)
    assert not plain.extra_args                       # nothing added to a plain request


@pytest.mark.parametrize("body, param, message", [
    ({"speculative": {"n_max": 2000}}, "speculative.n_max",
     "speculative.n_max = 2000 is out of range: allowed 0 .. 1024"),
    ({"speculative": {"n_min": 9, "n_max": 4}}, "speculative.n_min",
     "speculative.n_min = 9 is out of range: allowed 0 .. n_max = 4"),
    ({"speculative": {"enabled": "no"}}, "speculative.enabled", "speculative.enabled: "),
    ({"speculative": {"bogus": 1}}, "speculative.bogus", "unknown field"),
    ({"vllm_xargs": {"speculative.n_max": -1}}, "speculative.n_max",
     "speculative.n_max = -1 is out of range"),
    ({"vllm_xargs": {"speculative.n_max": 4}, "speculative": {"n_max": 8}},
     "speculative.n_max", "contradicts"),
    ({"prediction": {"type": "content", "content": "x"},
      "vllm_xargs": {"prediction": [1]}}, "prediction", "both"),
    ({"vllm_xargs": {"prediction": [1, 60000]}}, "prediction",
     "prediction: token ids must lie in 0 .. 49999"),
    ({"prediction": {"type": "file", "content": "x"}}, "prediction.type", "prediction.type"),
])
def test_bad_fields_are_vllms_400_naming_the_field(model_config, body, param, message):
    """A bad value is refused by the API server (vLLM's validation error: its 400, with the
    field as ``param``), before the request reaches the engine."""
    from vllm.exceptions import VLLMValidationError
    with pytest.raises(VLLMValidationError, match=re.escape(message)) as info:
        openai_params(body, model_config, word_tokenizer(["x"]))
    assert info.value.parameter == param


def test_a_text_prediction_without_a_tokenizer_is_refused(model_config):
    from vllm.exceptions import VLLMValidationError
    with pytest.raises(VLLMValidationError, match="prediction: text needs the model's "
                                                  "tokenizer"):
        openai_params({"prediction": "abc"}, model_config, None)
    assert openai_params({"prediction": [5, 6]}, model_config, None).extra_args[
        "prediction"] == [5, 6]


@pytest.fixture(scope="module")
def edit_trace():
    return read_requests(str(TRACES / "code-edit.jsonl.gz"), limit=3)


def _args_through_openai(model_config):
    def args_of_kind(kind, prediction):
        body = {"predicted": {"prediction": prediction.tolist()},
                "off": {"speculative": {"enabled": False}}, "plain": {}}[kind]
        return openai_params(body, model_config).extra_args or None
    return args_of_kind


def test_a_prediction_drafts_first_and_speculation_off_drafts_nothing(make, model_config,
                                                                      edit_trace):
    """The ``extra_args`` vLLM's request objects build, handed by the hook: the predicted
    request drafts as ``serve`` does (prediction first, found again after an insertion), the
    one with speculation off gets no drafts while its neighbours do."""
    for t in edit_trace:
        check_prediction_and_control(make, t, _args_through_openai(model_config), K, MAX_LEN)


def test_the_hooked_runner_hands_each_requests_extra_args(make, model_config, monkeypatch):
    """vLLM's own propose_draft_token_ids, hooked: the drafter reads a new request's
    ``extra_args`` from the runner's request states (``CachedRequestState.sampling_params``):
    the request with speculation off drafts nothing, its neighbour drafts."""
    import numpy as np
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    ours.register()
    prop = make("--spec-type ngram-suffix", 2)
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.drafter = prop
    runner.speculative_config = SimpleNamespace(method="custom_class")

    def state(rid, body):
        return CachedRequestState(req_id=rid, prompt_token_ids=[1, 2, 3, 1, 2], mm_features=[],
                                  sampling_params=openai_params(body, model_config),
                                  generator=None, block_ids=([],), num_computed_tokens=0,
                                  output_token_ids=[])
    runner.requests = {"on": state("on", {}),
                       "off": state("off", {"speculative": {"enabled": False}})}
    tokens = np.zeros((2, MAX_LEN), dtype=np.int32)
    tokens[:, :20] = [1, 2, 3, 4, 5] * 4
    runner.input_batch = SimpleNamespace(req_ids=["on", "off"], token_ids_cpu=tokens,
                                         num_tokens_no_spec=np.array([20, 20], np.int32))
    drafts = GPUModelRunner.propose_draft_token_ids(runner, SchedulerOutput.make_empty(),
                                                    [[5], [5]], None, None, None, None, None,
                                                    None, None)
    assert drafts[0][:4] == [1, 2, 3, 4] and drafts[1] == []


def test_a_requests_type_subset_and_bounds(make, model_config, edit_trace):
    """``speculative: {type, n_max, n_min}`` through vLLM's request model: the request drafts
    with its subset of the chain alone, at most n_max tokens, none under n_min, while its
    neighbour drafts with the whole chain."""
    t = edit_trace[0]
    sims = [SimRequest("subset", t.prompt, t.output, arrival=0,
                       extra_args=openai_params(SUBSET_ARGS, model_config).extra_args),
            SimRequest("whole", t.prompt, t.output, arrival=0)]
    RunnerSim(sims, 4, MAX_LEN, with_ids=True).run(make(PER_REQUEST, 4))
    assert sims[0].drafts == subset_reference(t, MAX_LEN)
    assert all(len(d) in (0, 2, 3) for d in sims[0].drafts) and any(sims[0].drafts)
    assert max(len(d) for d in sims[1].drafts) > 3


def test_unchecked_bad_fields_never_stop_the_step(make, edit_trace, caplog):
    """Fields that reach the worker unchecked (another front end), name a type outside the
    configured chain or ask for ``auto`` on an engine started ``fixed``: logged, ignored (the
    request drafts as configured), the step goes on."""
    t = edit_trace[0]
    bad = [{"speculative": {"n_max": -3}}, {"speculative": {"type": "ngram-mod"}},
           {"prediction": "text"}, {"speculative": "off"}, {"speculative": {"policy": "auto"}}]
    sims = [SimRequest(f"bad{i}", t.prompt, t.output, arrival=i, extra_args=a)
            for i, a in enumerate(bad)]
    with caplog.at_level(logging.WARNING):
        RunnerSim(sims, 4, MAX_LEN, with_ids=True).run(make(PER_REQUEST, 4))
    ref = run_recorded(engine_from_env(1, PER_REQUEST)[0], 0, t.prompt, t.output, n_ctx=MAX_LEN,
                       record_drafts=True, n_max=K)
    for r in sims:
        assert r.drafts == ref.drafts, r.rid
    assert "speculative.n_max = -3 is out of range" in caplog.text
    assert "speculative.type: 'ngram-mod' is not in the configured chain" in caplog.text
    assert "prediction: text needs the model's tokenizer" in caplog.text
    assert "speculative.policy: 'auto' needs the engine's $NGRAMSPEC_SPEC" in caplog.text


# -- at vLLM's scale: 64 requests in flight, 16k-token prompts, max_num_seqs 256 ---------------

SCALE_LEN = 1 << 15
IN_FLIGHT = 64


@pytest.fixture(scope="module")
def long_trace():
    return synthetic_trace(96, 16384, seed=36)


def _scale_run(proposer, trace):
    """The requests through `RunnerSim` (up to 64 rows, request ids handed as the hook does);
    returns them and the seconds of the steps where no request started and of all steps."""
    import numpy as np
    # a rush that fills the 64 rows, then arrivals that keep them busy
    gaps = [0.01] * IN_FLIGHT + [1.5] * (len(trace) - IN_FLIGHT)
    sims = random_arrivals(trace, np.random.default_rng(36), mean_gap=gaps)
    timed = TimedProposer(proposer)
    sim = RunnerSim(sims, IN_FLIGHT, SCALE_LEN, with_ids=True)
    sim.run(timed)
    assert len(sim.starts) == len(timed.times) and sim.peak == IN_FLIGHT
    steady = [t for t, s in zip(timed.times, sim.starts) if not s]
    assert len(steady) >= 20
    return sims, steady, sum(timed.times)


def test_at_scale_drafts_are_spec_engines_and_cost_less_than_vllms_own(model_dir, long_trace,
                                                                        monkeypatch):
    """96 requests of 16-18k-token prompts arriving at random, up to 64 in flight, finishing
    at random (24-96 output tokens), the proposer built by vLLM for max_num_seqs 256 with the
    shared-state proposers: every draft is SpecEngine's replay of the same requests; a step
    where no request starts costs at most vLLM's own ``suffix`` proposer's (ArcticInference,
    vLLM's defaults) in the same run, and so does the whole run, first sights included (both
    index a new prompt once). vLLM's ``ngram`` indexes nothing, scanning every row at every
    step instead: reported beside, bounded at 3x (a 16k row is a fast scan)."""
    import statistics

    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer
    monkeypatch.setenv("NGRAMSPEC_SPEC", SHARED)
    prop = create_custom_proposer(tiny_vllm_config(model_dir, SCALE_LEN, 256,
                                                   method="custom_class", model=PROPOSER,
                                                   num_speculative_tokens=K))
    sims, steady, total = _scale_run(prop, long_trace)
    assert max(len(r.prompt) for r in sims) >= 16384
    ref = reference_drafts(lambda n: engine_from_env(n, SHARED)[0], sims, SCALE_LEN, K,
                           policy=engine_from_env(1, SHARED)[1])
    for r in sims:
        assert ref[r.rid][:len(r.drafts)] == r.drafts, r.rid
    assert sum(len(d) for r in sims for d in r.drafts) > 0
    ours = statistics.median(steady), total
    pytest.importorskip("arctic_inference")
    theirs = {}
    for name, make in (
            ("ngram", lambda: VllmNgram(tiny_vllm_config(
                model_dir, SCALE_LEN, 256, method="ngram", num_speculative_tokens=K,
                prompt_lookup_min=2, prompt_lookup_max=5))),
            ("suffix", lambda: VllmSuffix(tiny_vllm_config(
                model_dir, SCALE_LEN, 256, method="suffix", num_speculative_tokens=K),
                {t.id: len(t.prompt) for t in long_trace}))):
        _, steady, total = _scale_run(make(), long_trace)
        theirs[name] = statistics.median(steady), total
    print("steady step / whole run: " + ", ".join(
        f"{k} {1e3 * s:.3f} ms / {t:.2f} s" for k, (s, t) in
        dict(ngramspec=ours, **theirs).items()))
    assert ours[0] <= theirs["suffix"][0] and ours[1] <= theirs["suffix"][1], (ours, theirs)
    assert ours[0] <= 3 * theirs["ngram"][0], (ours, theirs)

"""The deterministic mode (issue 38): exact equality, not noise-aware.

Under ``deterministic=True`` every greedy output of the batched scheduler must be byte-identical
(token for token) to plain single-request decoding of the same prompt on a model loaded with
``load_model(deterministic=True)``, whatever the slot count, the concurrency, the prompt
chunking (n_batch), the prompt-cache reuse, speculation and prediction; a seeded sampled request
gets the same tokens too. The real embedded model throughout (SmolLM2-135M Q4_1), small outputs.
"""
import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from scheduler_common import COPY_TEXT, EXAMPLE  # noqa: E402

from ngramspec.llama import Scheduler, generate_plain, generate_speculative  # noqa: E402
from ngramspec.llama import load_model, tokenize_prompt  # noqa: E402
from ngramspec.llama.deterministic import DeterminismRefused, slot_context  # noqa: E402
from ngramspec.request_params import SamplingParams, SpeculationParams  # noqa: E402
from ngramspec.llama.repack import load_llama  # noqa: E402
from ngramspec.llama.model import default_model_path  # noqa: E402
from ngramspec import SpecEngine  # noqa: E402
from ngramspec.config import SpecConfig  # noqa: E402

N_PREDICT = 24
SPEC = SpecConfig.from_keywords("ngram-simple,ngram-mod", ngram_simple_size_n=3,
                                ngram_simple_size_m=8, ngram_mod_n_match=8, ngram_mod_n_min=2,
                                ngram_mod_n_max=16)


@pytest.fixture(scope="module")
def llm():
    return load_model(n_ctx=1024, n_batch=64, n_threads=1, deterministic=True)


@pytest.fixture(scope="module")
def prompts(llm):
    texts = [(EXAMPLE.read_text(encoding="utf-8"), True),
             ("Write a Python function that adds two numbers.", True),
             ("List the planets of the solar system, one per line.", True),
             ("def fib(n):\n    if n < 2:\n        return n\n", False),
             ("Repeat after me: " + COPY_TEXT, True)]
    return [np.asarray(tokenize_prompt(llm, t, chat=chat), np.int32) for t, chat in texts]


@pytest.fixture(scope="module")
def plain(llm, prompts):
    """Each prompt's plain greedy output under the mode (the reference)."""
    return [generate_plain(llm, p, n_predict=N_PREDICT).output_tokens for p in prompts]


def _run(llm, prompts, n_slots, n_batch=64, speculation=None, sampling=None, predictions=None,
         spec=SPEC):
    """Every prompt submitted at once to a deterministic scheduler; the outputs in order."""
    sampling = sampling or SamplingParams(temperature=0.0, max_tokens=N_PREDICT)
    with Scheduler(llm, spec, n_slots=n_slots, n_ctx=n_slots * 1024, n_batch=n_batch,
                   n_threads=1, queue_size=64, deterministic=True) as s:
        handles = [s.submit(p, sampling, speculation,
                            prediction=None if predictions is None else predictions[i])
                   for i, p in enumerate(prompts)]
        outs = [h.result(timeout=600).tokens for h in handles]
        stats = s.stats()
    return outs, stats


@pytest.mark.parametrize("n_slots", [1, 4, 8])
def test_concurrency_gives_plain_output(llm, prompts, plain, n_slots):
    # the prompts twice where several slots run (at 8 slots ten requests run together)
    reps = 1 if n_slots == 1 else 2
    outs, stats = _run(llm, prompts * reps, n_slots)
    assert outs == plain * reps
    assert stats["n_draft_tokens"] > 0          # speculation took part


@pytest.mark.parametrize("n_batch", [8, 13])
def test_prompt_chunking_gives_plain_output(llm, prompts, plain, n_batch):
    # prompts decoded in chunks of a few tokens over many steps, beside generating slots
    outs, _ = _run(llm, prompts, 4, n_batch=n_batch)
    assert outs == plain


def test_speculation_off_and_live_speculation(llm, prompts, plain):
    outs, stats = _run(llm, prompts, 4, speculation=SpeculationParams(enabled=False))
    assert outs == plain and stats["n_draft_tokens"] == 0
    engine = SpecEngine(["ngram-simple", "ngram-mod"], ngram_mod_n_match=8, ngram_mod_n_min=2)
    for p, ref in zip(prompts, plain):
        assert generate_speculative(llm, p, engine, n_predict=N_PREDICT).output_tokens == ref


def test_prediction_gives_plain_output(llm, prompts, plain):
    # the right answer as the prediction (what a pipeline re-applying an edit sends), and a
    # wrong one: the output is the plain one either way
    outs, stats = _run(llm, prompts, 4, predictions=plain)
    assert outs == plain
    assert stats["n_acc_tokens"] >= sum(len(o) for o in plain) // 2
    wrong = [list(reversed(o)) for o in plain]
    assert _run(llm, prompts, 4, predictions=wrong)[0] == plain


def test_prompt_cache_reuse_gives_plain_output(llm, prompts, plain):
    # one slot: every request after the first reuses what the slot holds; a prompt that
    # extends an earlier prompt keeps its prefix, a repeated prompt re-decodes one token
    longer = np.concatenate([prompts[1], prompts[3][1:]])
    ref_longer = generate_plain(llm, longer, n_predict=N_PREDICT).output_tokens
    with Scheduler(llm, SPEC, n_slots=1, n_ctx=1024, n_batch=64, n_threads=1,
                   deterministic=True) as s:
        greedy = SamplingParams(temperature=0.0, max_tokens=N_PREDICT)
        got = []
        for p in [prompts[1], longer, prompts[1], prompts[1]]:
            got.append(s.submit(p, greedy).result(timeout=600).tokens)
        assert s.stats()["tokens_prompt_cached"] > 0
    assert got == [plain[1], ref_longer, plain[1], plain[1]]


def test_seeded_sampling_is_reproducible(llm, prompts):
    sampling = SamplingParams(temperature=0.8, seed=1234, max_tokens=N_PREDICT)
    one, _ = _run(llm, prompts, 1, sampling=sampling)
    four, _ = _run(llm, prompts + prompts, 4, sampling=sampling)
    off, _ = _run(llm, prompts, 4, sampling=sampling,
                  speculation=SpeculationParams(enabled=False))
    assert four == one + one
    assert off == one


def test_slot_context_is_aligned():
    assert slot_context(4096, 4) == 4096
    assert slot_context(4096, 3) == 3 * 1536
    assert slot_context(100, 2) == 512


def test_repacked_weights_are_refused():
    with pytest.raises(DeterminismRefused, match="--deterministic.*repack"):
        load_model(n_ctx=64, deterministic=True, repack="on")
    # a Llama loaded with extra buffer types (its decodes would crash on AMX hosts: the
    # refusal comes before any)
    repacked = load_llama(default_model_path(), repack="on", n_ctx=64, n_batch=64,
                          n_threads=1, verbose=False)
    with pytest.raises(DeterminismRefused, match="--deterministic.*extra buffer types"):
        Scheduler(repacked, n_slots=2, n_ctx=512, n_threads=1, deterministic=True)


def test_cli_generate_deterministic(capsys):
    import json
    from clitools import cli
    bad = cli(capsys, "generate", "--deterministic", "--repack", "on", "-p", "hi", "-n", "2")
    assert bad.returncode != 0 and "--deterministic" in bad.stderr and "repack" in bad.stderr
    # plain and speculative runs of the mode (--compare) agree token for token
    r = cli(capsys, "generate", "--deterministic", "--chat", "-p",
            "Write a Python function that adds two numbers.", "-n", "16", "-t", "1",
            "--compare", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["outputs_match"] is True
    assert out["plain_output_tokens"] == out["output_tokens"] and len(out["output_tokens"]) == 16


def test_run_batch_twice_and_without_speculation(capsys, tmp_path):
    # the criterion: two runs of one batch at 4 slots, and a run with speculation off,
    # give byte-identical text for every request
    import json
    from clitools import cli
    asks = ["Write a Python function that adds two numbers.",
            "List the planets of the solar system, one per line.",
            "Repeat after me: " + COPY_TEXT]
    reqs = [{"custom_id": f"ask{i}-{copy}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": a}], "temperature": 0,
                      "max_tokens": N_PREDICT}}
            for copy in range(2) for i, a in enumerate(asks)]   # 4 in flight, 2 waiting
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))

    def run(name, *flags):
        out = tmp_path / name
        r = cli(capsys, "run-batch", "-i", src, "-o", out, "-np", 4, "-t", 1, "-c", 4096,
                "--deterministic", *flags)
        assert r.returncode == 0, r.stderr
        texts = {}
        for line in out.read_text().splitlines():
            rec = json.loads(line)
            body = rec["response"]["body"]
            choice = body["choices"][0]
            texts[rec["custom_id"]] = (choice.get("message") or {}).get("content") \
                or choice.get("text")
        return texts

    first = run("a.jsonl")
    assert len(first) == len(reqs) and all(first.values())
    assert run("b.jsonl") == first
    assert run("c.jsonl", "--spec-type", "none") == first
    for i in range(len(asks)):      # a request and its copy: the same text
        assert first[f"ask{i}-0"] == first[f"ask{i}-1"]


def test_draft_model_gives_plain_output(llm, prompts, plain):
    # the embedded model as its own draft model (draft-simple ends the chain)
    outs, stats = _run(llm, prompts[:3], 4, spec=SPEC.with_params(model_draft=llm))
    assert outs == plain[:3]
    assert stats["proposers"]["draft-simple"]["gen_drafts"] > 0


def test_split_groups_runs_of_one_length():
    from ngramspec.llama.planner import PromptChunk, StepPlan, Verify

    def v(n, seq, pos0=10):
        return Verify(None, seq, np.zeros(n, np.int32), pos0)

    def shape(plan, **kw):
        return [([len(r.tokens) for r in p.verifies], len(p.chunks), pad)
                for p, pad in plan.split(kw.get("n_batch", 512), kw.get("n_ctx_slot", 1024), 2)]

    chunk = PromptChunk(None, 9, 0, 5, True)
    # one-token steps together (padded to 2); a long draft alone: padding the others to 17
    # would more than double their tokens; each prompt chunk alone
    plan = StepPlan((), (v(1, 0), v(1, 1), v(17, 2), v(1, 3)), (chunk,))
    assert shape(plan) == [([1, 1, 1], 0, 2), ([17], 0, 0), ([], 1, 0)]
    assert shape(StepPlan((), (v(5, 0), v(4, 1), v(6, 2)), ())) == [([5, 4, 6], 0, 6)]
    # no room in the batch, or a pad past a slot's context: each run alone
    assert shape(StepPlan((), (v(1, 0), v(1, 1)), ()), n_batch=3) == [([1], 0, 0), ([1], 0, 0)]
    assert shape(StepPlan((), (v(1, 0, 1023), v(1, 1)), ())) == [([1], 0, 0), ([1], 0, 0)]


def test_full_slot_context_ends_cleanly(llm, prompts):
    # a request that fills its slot's context: its last one-token step's pad still has a cell,
    # the request ends with "context", and plain decoding under the mode stops alike
    small = load_model(n_ctx=256, n_batch=64, n_threads=1, deterministic=True)
    p = prompts[4]
    ref = generate_plain(small, p, n_predict=-1)
    with Scheduler(llm, SPEC, n_slots=2, n_ctx=512, n_batch=64, n_threads=1,
                   deterministic=True) as s:
        c = s.submit(p, SamplingParams(temperature=0.0, max_tokens=-1, ignore_eos=True)
                     ).result(timeout=600)
        assert s.n_ctx_slot == 255          # a stream of 256 cells, one kept for a pad
    assert c.finish_reason == "context"
    assert len(p) + len(c.tokens) == 256    # 255 decoded, the last sampled token emitted
    assert ref.finish_reason == "context" or ref.output_tokens == c.tokens[:len(ref.output_tokens)]

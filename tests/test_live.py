"""Live generation against the real embedded model (SmolLM2-135M-Instruct Q4_1): no mocks.

Speculative greedy decoding must give the plain greedy output. Where it does not, the test does not
skip: it checks that at the first difference both chosen tokens' logits lie closer to the best one
than llama.cpp's float noise between its decode paths (`tests/greedy.py`), and fails otherwise.

Kept small (n_ctx 768, <= 96 output tokens, one thread, one prompt pass per model) so that the
module runs in about a minute on two cores.
"""
import itertools
import json
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

import ngramspec  # noqa: E402
from ngramspec import SpecEngine  # noqa: E402
from ngramspec.cli import main as cli_main  # noqa: E402
from ngramspec.llama.draft_model import (DraftModelProposer, VocabMismatchError,  # noqa: E402
                                   check_vocab_compatible)
from ngramspec.llama import (divergence_report, generate_plain,  # noqa: E402
                            generate_speculative, load_model, tokenize_prompt)
from ngramspec.llama.model import default_model_path  # noqa: E402
from ngramspec.llama.divergence import NOISE_PATHS  # noqa: E402
from greedy import assert_same_greedy  # noqa: E402

N_CTX = 768
N_PREDICT = 96
EXAMPLE = pathlib.Path(ngramspec.__file__).parent / "examples" / "code_edit_prompt.txt"
NGRAM_TYPES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod",
               "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod"]


@pytest.fixture(scope="module")
def model_path():
    return default_model_path()  # a missing model package fails the module, it does not skip


@pytest.fixture(scope="module")
def llm(model_path):
    return load_model(model_path, n_ctx=N_CTX, n_threads=1)


@pytest.fixture(scope="module")
def prompt(llm):
    toks = tokenize_prompt(llm, EXAMPLE.read_text(encoding="utf-8"))
    assert 100 < len(toks) < N_CTX - N_PREDICT - 8
    return toks


@pytest.fixture(scope="module")
def plain(llm, prompt):
    res = generate_plain(llm, prompt, n_predict=N_PREDICT)
    assert res.n_output == N_PREDICT and res.finish_reason == "length"
    return res


def check_steps(res, n_prompt, n_ctx, n_predict):
    """llama-server's n_draft_max bound held at every step, and the emitted tokens add up."""
    for L, sampled, draft, k in res.steps:
        n_decoded = L - n_prompt + 1          # output tokens emitted so far, `sampled` included
        if draft:
            assert len(draft) <= n_ctx - L - 2
            if n_predict > 0:
                assert len(draft) <= n_predict - n_decoded - 1
        assert 0 <= k <= len(draft)
        assert res.output_tokens[n_decoded - 1] == sampled
    assert 1 + sum(k + 1 for *_, k in res.steps) >= res.n_output


@pytest.mark.parametrize("spec_type", NGRAM_TYPES)
def test_ngram_types_match_plain_greedy(llm, prompt, plain, spec_type):
    eng = SpecEngine(spec_type)
    res = generate_speculative(llm, prompt, eng, n_predict=N_PREDICT, record_steps=True)
    assert_same_greedy(llm, prompt, res.output_tokens, plain.output_tokens)
    assert res.n_output == N_PREDICT and res.finish_reason == "length"
    check_steps(res, len(prompt), N_CTX, N_PREDICT)

    # The driver's view and the engine's counters agree (llama.cpp statistics, spec 7).
    stats = eng.stats()
    drafted = [s for s in res.steps if s[2]]
    assert [s["calls_b"] for s in stats] == [1] * len(stats)
    assert sum(s["calls_a"] for s in stats) == len(drafted)
    assert sum(s["gen_drafts"] for s in stats) == len(drafted)
    assert sum(s["gen_tokens"] for s in stats) == res.n_draft_tokens == sum(len(s[2]) for s in drafted)
    assert sum(s["acc_tokens"] for s in stats) == res.n_acc_tokens == sum(s[3] for s in drafted)
    assert len(res.stats_lines) == len(stats)
    assert all(line.startswith("statistics ") for line in res.stats_lines)
    # A code edit copies the file: speculation must have saved target decodes.
    assert res.n_acc_tokens > 0
    assert res.n_target_decodes < N_PREDICT - 1
    t = res.timings()
    assert t["target_s"] > 0 and t["proposers_s"] >= 0 and t["draft_model_s"] == 0
    assert t["target_s"] + t["proposers_s"] <= t["gen_s"] * 1.01 + 1e-3


def test_live_steps_equal_a_replay_of_its_output(llm, prompt):
    """Live and replay are two targets of one loop: replaying the live output through a fresh
    engine (same bounds) makes exactly the live run's drafts and acceptances."""
    from ngramspec.loop import SlotLoop
    spec = "ngram-simple,ngram-mod"
    res = generate_speculative(llm, prompt, SpecEngine(spec), n_predict=N_PREDICT,
                               record_steps=True)
    out = np.asarray(res.output_tokens, dtype=np.int32)
    loop = SlotLoop(SpecEngine(spec), 0, prompt, int(out[0]), n_ctx=N_CTX, n_predict=N_PREDICT)
    replayed = []
    while not loop.done and loop.n_output < len(out):
        L, sampled = loop.n_context, loop.sampled
        draft = loop.propose()
        k = loop.verify(out[loop.n_output:loop.n_output + len(draft) + 1])
        replayed.append((L, sampled, draft.tolist(), k))
    assert replayed == res.steps
    assert (loop.n_draft_tokens, loop.n_acc_tokens) == (res.n_draft_tokens, res.n_acc_tokens)


def test_on_tokens_streams_the_output_step_by_step(llm, prompt):
    """``on_tokens`` gets each step's emitted tokens as they come: the first token, then per
    target decode the accepted draft and the target's token; together exactly the output."""
    chunks = []
    res = generate_speculative(llm, prompt, SpecEngine("ngram-simple,ngram-mod"),
                               n_predict=N_PREDICT, on_tokens=lambda t: chunks.append(list(t)))
    assert [t for c in chunks for t in c] == res.output_tokens
    assert len(chunks) == res.n_target_decodes + 1 and chunks[0] == res.output_tokens[:1]
    assert max(map(len, chunks)) > 1        # accepted drafts arrive as one chunk


def test_context_limit_stops_like_plain(llm, prompt):
    """n_predict = -1: the run ends when the KV cache is full, drafts bounded by n_ctx - L - 2."""
    n_ctx = llm.n_ctx()
    plain = generate_plain(llm, prompt, n_predict=-1)
    res = generate_speculative(llm, prompt, SpecEngine("ngram-simple,ngram-mod"), n_predict=-1,
                               record_steps=True)
    assert_same_greedy(llm, prompt, res.output_tokens, plain.output_tokens)
    check_steps(res, len(prompt), n_ctx, -1)
    if res.output_tokens == plain.output_tokens and plain.finish_reason == "context":
        assert res.finish_reason == "context"
        assert res.n_output == n_ctx - len(prompt) + 1


def test_plain_is_one_token_per_decode(llm, prompt):
    """generate_plain is the loop without an engine, and still the reference: exactly the tokens
    of a hand-written greedy loop of single-token decodes on the same context."""
    from ngramspec.llama.decoder import finish_request, prompt_pass, target_and_prompt
    n = 24
    res = generate_plain(llm, prompt, n_predict=n)
    dec, p = target_and_prompt(llm, prompt)
    tok, _ = prompt_pass(llm, dec, p)
    want = [tok]
    for L in range(p.size, p.size + n - 1):
        tok = int(np.argmax(dec.decode(np.array([tok], np.int32), L, all_logits=False)[0]))
        want.append(tok)
    finish_request(llm, dec, p.size)
    assert res.output_tokens == want
    assert res.n_target_decodes == n - 1 and res.n_draft_tokens == res.n_acc_tokens == 0
    assert res.finish_reason == "length" and res.stats == [] and res.stats_lines == []


def test_draft_model_same_model_accepts_every_token(llm, model_path, prompt, plain):
    """The target as its own draft model: every drafted token is the target's own greedy choice."""
    n = 40
    eng = SpecEngine("draft-simple", model_draft=model_path, spec_draft_n_max=4)
    res = generate_speculative(llm, prompt, eng, n_predict=n, record_steps=True)
    assert_same_greedy(llm, prompt, res.output_tokens, plain.output_tokens[:n])
    check_steps(res, len(prompt), N_CTX, n)
    (st,) = eng.stats()
    assert st["type"] == "draft-simple" and st["gen_drafts"] > 0
    assert res.t_draft_model_s > 0
    out = res.output_tokens
    for L, sampled, draft, k in res.steps:
        assert len(draft) <= 4
        if k < len(draft):
            # A rejection is allowed only where the two kernels' logits tie within float noise.
            idx = L - len(prompt) + 1 + k
            rep = divergence_report(llm, prompt, out[:idx] + [draft[k]], out[:idx + 1])
            assert rep is not None and rep.within_noise(), f"draft token rejected: {rep}"
    if st["acc_tokens"] == st["gen_tokens"]:
        assert res.n_target_decodes < n - 1


def test_draft_model_behind_ngram_proposers(llm, prompt, plain):
    """draft-simple (a loaded Llama here) is last in the chain: n-gram drafts take precedence."""
    n = 64
    eng = SpecEngine("draft-simple,ngram-simple", model_draft=llm, spec_draft_n_max=3)
    assert eng.types == ["ngram-simple", "draft-simple"]
    res = generate_speculative(llm, prompt, eng, n_predict=n, record_steps=True)
    assert_same_greedy(llm, prompt, res.output_tokens, plain.output_tokens[:n])
    ngram, dm = eng.stats()
    assert ngram["gen_drafts"] > 0 and dm["gen_drafts"] > 0
    # The draft model is asked only on iterations where ngram-simple had nothing (spec 7).
    assert dm["calls_g"] == ngram["calls_g"] - ngram["gen_drafts"]
    assert res.t_draft_model_s > 0 and res.t_target_s > 0


def test_draft_model_parameters(model_path, llm, prompt):
    prop = DraftModelProposer(model_path, 1, n_max=5, n_ctx=N_CTX, n_threads=1)
    ctx = prompt[:160]                      # short: each proposer decodes it once
    inp, sampled = np.asarray(ctx[:-1]), int(ctx[-1])
    full = prop.on_draft(0, inp, sampled)
    assert len(full) == 5
    # The cache follows the context: it holds the context plus the drafted tokens but the last.
    assert prop._n[0] == len(ctx) + 4
    again = prop.on_draft(0, inp, sampled)  # nothing new to decode but the last context token
    assert again == full
    strict = DraftModelProposer(llm, 1, n_max=5, p_min=0.9, n_ctx=N_CTX, n_threads=1)
    short = strict.on_draft(0, inp, sampled)
    assert short == full[:len(short)]       # p_min only ever cuts the draft short
    assert DraftModelProposer(llm, 1, n_max=2, n_min=3, n_ctx=N_CTX,
                              n_threads=1).on_draft(0, inp, sampled) == []
    with pytest.raises(ValueError):
        DraftModelProposer(llm, 1, p_min=1.5)
    with pytest.raises(ValueError):
        SpecEngine("draft-simple")          # no model_draft


@pytest.fixture(scope="module")
def other_vocab_gguf(tmp_path_factory, model_path, llm):
    """A copy of the embedded model with one token's text changed (same size, valid GGUF)."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    data = bytearray(pathlib.Path(model_path).read_bytes())
    for tok in range(30000, 30200):
        text = llama_cpp.llama_vocab_get_text(vocab, tok)
        pattern = struct.pack("<Q", len(text)) + text
        at = data.find(pattern)
        if len(text) >= 6 and at >= 0 and data.find(pattern, at + 1) < 0:
            data[at + len(pattern) - 1] = ord("Q") if text[-1:] != b"Q" else ord("Z")
            break
    else:
        pytest.fail("no unique token text found to patch")
    path = tmp_path_factory.mktemp("gguf") / "other-vocab.gguf"
    path.write_bytes(bytes(data))
    return str(path)


def test_vocab_mismatch_is_refused(llm, prompt, other_vocab_gguf):
    eng = SpecEngine("draft-simple", model_draft=other_vocab_gguf)
    with pytest.raises(VocabMismatchError, match="token"):
        generate_speculative(llm, prompt, eng, n_predict=4)
    with pytest.raises(VocabMismatchError):
        check_vocab_compatible(llm, eng.proposers[0].model_ptr)
    check_vocab_compatible(llm, llm)  # same model: fine


def test_cli_refuses_other_vocab(other_vocab_gguf, capsys):
    rc = cli_main(["generate", "--prompt", "hi", "-n", "2", "-c", "256", "-t", "1",
                   "--spec-type", "ngram-simple", "--model-draft", other_vocab_gguf])
    err = capsys.readouterr().err
    assert rc == 2 and "vocabulary" in err and len(err.strip().splitlines()) == 1


def test_plugin_in_create_completion(model_path, prompt):
    from ngramspec.integrations.llama_cpp import NgramspecDraftModel
    from ngramspec.llama.repack import load_llama

    draft = NgramspecDraftModel("ngram-simple,ngram-mod", n_ctx=N_CTX)
    kw = dict(n_ctx=N_CTX, n_threads=1, n_threads_batch=1, verbose=False)
    # logits_all: llama-cpp-python sizes its score buffer from it, not from draft_model.
    # load_llama: llama_cpp.Llama without AMX weight repacking on AMX hosts (issue 14).
    spec_llm = load_llama(model_path, draft_model=draft, logits_all=True, **kw)
    plain_llm = load_llama(model_path, **kw)
    gen = dict(max_tokens=64, temperature=0.0, top_k=1, repeat_penalty=1.0)
    ids = [int(t) for t in prompt]
    spec_text = spec_llm.create_completion(ids, **gen)["choices"][0]["text"]
    plain_text = plain_llm.create_completion(ids, **gen)["choices"][0]["text"]
    if spec_text != plain_text:
        def tokens(model):
            return list(itertools.islice(model.generate(ids, temp=0.0, top_k=1), 64))
        ref = load_model(model_path, n_ctx=N_CTX, n_threads=1)
        assert_same_greedy(ref, prompt, tokens(spec_llm), tokens(plain_llm))
    assert draft.n_requests == 1
    stats = draft.stats()
    assert [s["calls_b"] for s in stats] == [1, 1]
    assert sum(s["gen_drafts"] for s in stats) > 0
    assert sum(s["calls_a"] for s in stats) > 0 and sum(s["acc_tokens"] for s in stats) > 0
    assert all(line.startswith("statistics ") for line in draft.stats_lines())
    # A second request is recognized as one (not an extension of the first): begin again.
    spec_llm.create_completion(ids[:-5], **dict(gen, max_tokens=8))
    assert draft.n_requests == 2
    assert [s["calls_b"] for s in draft.stats()] == [2, 2]


def test_plugin_infers_acceptance_from_calls():
    """The call pattern of Llama.generate, replayed on a periodic stream the drafts predict."""
    from ngramspec.integrations.llama_cpp import NgramspecDraftModel

    period = list(range(100, 117))
    stream = (period * 20)[:300]
    draft_model = NgramspecDraftModel("ngram-simple", ngram_simple_size_n=2,
                                      ngram_simple_size_m=5)
    # The target's "truth" is the stream, with a change at 200 so some drafts are rejected.
    truth = stream[:200] + [7] + stream[201:]
    ids = truth[:41]
    expect_calls_a = expect_acc = 0
    pending = False
    while len(ids) < 280:
        d = [int(t) for t in draft_model(np.array(ids, dtype=np.intc))]
        if pending:
            expect_calls_a += 1
        k = 0
        while k < len(d) and d[k] == truth[len(ids) + k]:
            k += 1
        expect_acc += k
        pending = bool(d)
        ids = truth[:len(ids) + k + 1]
    (st,) = draft_model.stats()
    assert draft_model.n_requests == 1 and st["calls_b"] == 1
    assert st["calls_a"] == expect_calls_a
    assert st["acc_tokens"] == expect_acc - (k if pending else 0)
    assert st["gen_drafts"] > st["acc_drafts"] > 0
    draft_model(np.array(stream[:30], dtype=np.intc))  # not an extension: a new request
    assert draft_model.n_requests == 2


def test_cli_generate_json_compare():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(pathlib.Path(ngramspec.__file__).parent.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "ngramspec", "generate", "--prompt-file", str(EXAMPLE),
           "-n", "48", "-c", str(N_CTX), "-t", "1", "--spec-type", "ngram-simple,ngram-map-k4v",
           "--json", "--compare"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    for key in ("output_tokens", "text", "n_output", "tokens_per_s", "stats",
                "plain_output_tokens", "plain_tokens_per_s", "speedup", "outputs_match"):
        assert key in res
    assert res["n_output"] == len(res["output_tokens"]) == 48
    assert res["text"] and res["tokens_per_s"] > 0 and res["plain_tokens_per_s"] > 0
    assert res["speedup"] == pytest.approx(res["tokens_per_s"] / res["plain_tokens_per_s"])
    assert [s["type"] for s in res["stats"]] == ["ngram-simple", "ngram-map-k4v"]
    assert res["outputs_match"] == (res["output_tokens"] == res["plain_output_tokens"])
    if not res["outputs_match"]:
        assert res["divergence"]["within_float_noise"], res["divergence"]


def test_cli_text_report(capsys, tmp_path, prompt, monkeypatch):
    """The text report; one run checks its flags once and the engine against the model once."""
    from ngramspec import config
    from ngramspec.llama import live
    calls = []

    def counting(name, check):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return check(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(config, "check_values", counting("flags", config.check_values))
    monkeypatch.setattr(live, "check_engine_models", counting("engine", live.check_engine_models))
    toks = tmp_path / "prompt.json"
    toks.write_text(json.dumps([int(t) for t in prompt]))
    rc = cli_main(["generate", "--prompt-tokens", str(toks), "-n", "16", "-c", str(N_CTX),
                   "-t", "1", "--spec-type", "ngram-mod", "--spec-policy", "fixed"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "statistics        ngram-mod:" in out and "tokens/s" in out
    assert "output 16 tokens (finish: length)" in out and "draft tokens accepted" in out
    assert sorted(calls) == ["engine", "flags"]


@pytest.mark.parametrize("argv, needle", [
    (["--prompt-file", "/nonexistent/prompt.txt"],
     "--prompt-file /nonexistent/prompt.txt: no such file"),
    (["--prompt-tokens", __file__], "not JSON"),
    (["--prompt", "x", "--model", "/nonexistent.gguf"], "not found"),
    (["--prompt", "x", "--spec-type", "draft-simple"], "--model-draft"),
    (["--prompt", "x", "--spec-type", "ngram-bogus"], "unknown spec type"),
    (["--prompt", "x", "-n", "-5"], "--n-predict"),
    (["--prompt", "x", "--spec-ngram-mod-n-min", "8", "--spec-ngram-mod-n-max", "4"],
     "--spec-ngram-mod-n-min = 8 is greater than --spec-ngram-mod-n-max = 4"),
    (["--prompt", "x", "--spec-draft-p-min", "1.5"],
     "--spec-draft-p-min = 1.5 is out of range: allowed 0.0 .. 1.0"),
])
def test_cli_errors_are_one_line(capsys, argv, needle):
    try:
        rc = cli_main(["generate", *argv])
    except SystemExit as exc:  # argparse's own checks
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_divergence_report_tells_noise_from_a_wrong_token(llm, prompt, plain):
    """The check the equivalence tests rely on fails for a token that is not a near tie."""
    out = list(plain.output_tokens[:12])
    assert divergence_report(llm, prompt, out, out) is None
    for wrong in (out[10] + 1, out[10] + 2):
        rep = divergence_report(llm, prompt, out[:10] + [wrong], out)
        assert rep.index == 10 and rep.token_b == out[10]
        assert rep.logit_b == rep.top1            # plain greedy took the single-path argmax
        assert 0 < rep.noise < 5                  # the kernels differ, but only a little
        # every decode path a driver takes was measured; the noise is the largest of them
        assert set(rep.path_noise) == set(NOISE_PATHS)
        assert rep.noise == max(rep.path_noise.values())
        if rep.top1 - rep.logit_a > rep.noise:    # further from the best than the noise
            assert not rep.within_noise()
    # The reports keep the prompt cache valid: a repeat of the plain run gives the same tokens.
    again = generate_plain(llm, prompt, n_predict=12)
    assert again.prompt_reused and again.output_tokens == out


def test_generate_defaults_apply_to_generate_only(tmp_path, prompt, monkeypatch, capsys):
    """The generate profile's defaults (bench/results/e2e-fixed.md) change the engines of the
    commands that decode with a model only; replay, SpecEngine and the plug-in keep llama.cpp's
    defaults, and a flag given on the command line wins."""
    import argparse

    import ngramspec.registry as registry
    from ngramspec.cli import generate as generate_cli
    from ngramspec.cli import build_parser
    from ngramspec.config import SPEC_PROFILES, SpecConfig, engine_params
    from ngramspec.integrations.llama_cpp import NgramspecDraftModel

    GENERATE_DEFAULTS = dict(SPEC_PROFILES["generate"].params)

    def generate_params(args):
        return dict(SpecConfig.from_args(args, "generate").params)

    parser = build_parser()
    assert generate_params(parser.parse_args(["generate", "-p", "x"])) == GENERATE_DEFAULTS
    assert engine_params(parser.parse_args(["replay", "t.jsonl"])) == {}
    mod = SpecEngine("ngram-mod").proposers[0]
    assert (mod.n_min, mod.n_max) == (48, 64)                    # llama.cpp's
    plug = NgramspecDraftModel("ngram-mod").engine.proposers[0]
    assert (plug.n_min, plug.n_max) == (48, 64)
    given = generate_params(parser.parse_args(
        ["generate", "-p", "x", "--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "40"]))
    assert (given["ngram_mod_n_min"], given["ngram_mod_n_max"]) == (2, 40)
    # n_max alone below generate's n_min must not silently turn ngram-mod's drafting off
    low = generate_params(parser.parse_args(["generate", "-p", "x", "--spec-ngram-mod-n-max",
                                             "4"]))
    assert low["ngram_mod_n_min"] <= low["ngram_mod_n_max"] == 4
    high = generate_params(parser.parse_args(["generate", "-p", "x", "--spec-ngram-mod-n-min",
                                              "48"]))
    assert high["ngram_mod_n_max"] >= high["ngram_mod_n_min"] == 48
    gen_parser = generate_cli.add_parser(argparse.ArgumentParser().add_subparsers())
    help_text = " ".join(gen_parser.format_help().split())
    for name, value in GENERATE_DEFAULTS.items():
        assert f"--spec-{name.replace('_', '-')} {value}" in gen_parser.description
    # the default and why it differs from llama.cpp's (replay and tune keep llama.cpp's)
    assert "(default: 32, shorter than llama.cpp's 64 for a CPU, where a rejected draft costs " \
           "nearly its length in decodes; 0..1024)" in help_text

    # The CLI really builds its ngram-mod with them.
    seen = []
    real = registry.build_proposers

    def spy(spec_type, n_slots, pool, params):
        props = real(spec_type, n_slots, pool, params)
        seen.extend(props)
        return props
    monkeypatch.setattr(registry, "build_proposers", spy)
    toks = tmp_path / "prompt.json"
    toks.write_text(json.dumps([int(t) for t in prompt]))
    rc = cli_main(["generate", "--prompt-tokens", str(toks), "-n", "4", "-c", str(N_CTX),
                   "-t", "1", "--json"])
    capsys.readouterr()
    assert rc == 0
    (built,) = seen
    assert (built.n_min, built.n_max) == (GENERATE_DEFAULTS["ngram_mod_n_min"],
                                          GENERATE_DEFAULTS["ngram_mod_n_max"])

"""End to end on this CPU with the embedded model (SmolLM2-135M-Instruct Q4_1).

    python bench e2e [--code 4] [--chat 3] [--n-predict 256] [--runs 3] [--threads 1]
                     [--json bench/results/e2e.json] [--md bench/results/e2e.md]
    python bench e2e --render bench/results/e2e.json --md bench/results/e2e.md

Four measurements, all on real prompts of ``../shared/traces`` (token ids of the embedded
model's own tokenizer, used as-is):

1. **Tokens/s** of greedy generation: ngramspec's live driver (``ngramspec generate``'s loop,
   :func:`ngramspec.llama.live.generate_speculative`) with each configuration of `CONFIGS`, plain greedy
   decoding on the same driver, and llama-cpp-python's own loop: ``Llama.create_completion``
   plain and with ``Llama(draft_model=LlamaPromptLookupDecoding())``; and llama.cpp's own
   llama-server (`SERVER_CONFIGS`: plain and every fixed configuration made of llama.cpp's
   types, with the same flags, ``bench/llama_server.py``; skipped with a note when no binary is
   found), one process per configuration, started afresh each round on the same model file,
   threads, context and batch size, fed the same token ids. Every configuration runs
   once per round and prompt, in an order rotated from round to round, so all of them see the
   same machine load; the figures are medians over the rounds, and each ratio is taken within
   a round (configuration / plain on the same prompt) before its median is taken. Every output
   is checked against plain greedy decoding.
2. **What limits the speed-up**: the cost of one target decode of a batch of k tokens (all
   logits, as verification needs them) against one token, at a realistic position, for 1 and 2
   threads; the ceiling ``max_n n / c(n)`` with ``c(n) = t(n) / t(1)`` is what speculation could
   give if every drafted token were accepted.
3. **Acceptance live versus replay**: tokens per verification step of the live runs next to a
   replay of the same prompts against the recorded trace output (what a model that copies its
   file verbatim would give), and the proposers' cost per step next to the target's.
4. **Modeled speed-up**: each ngramspec configuration's live steps (tokens decoded and KV
   length per target decode, ``record_steps``) priced by the run's cost model, ``(n_output -
   1) / sum_i c(n_i, L_i)`` (`modeled_cost`; plain is 1 by construction): what the measured
   ratio would be without the host's noise (±15 % between identical runs on a shared VM) and
   without the proposers' own time. Greedy steps repeat from round to round; the report says
   where they did not.

Generation speed everywhere is ``(n_output - 1) / t`` where ``t`` runs from the first output
token (which comes from the prompt pass, the same in every configuration) to the last, measured
twice: wall clock, and CPU time of the decoding thread (``time.thread_time()``). With one decode
thread llama.cpp computes on the calling thread, so the CPU time is the generation's own on this
shared machine, whatever else runs; it is the report's main figure. For llama-server: wall from
its ``timings.predicted_ms``, CPU time of the whole server process across the request (with one
thread its HTTP threads sleep; `llama_server.LlamaServer.generation`). With 2 threads only the
wall figures compare, and the targets (`targets`) use them.

The configurations are named in ``e2e_configs.py``, the Markdown is written by
``e2e_markdown.py``; this module measures, summarizes and runs the command.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path

ROOT = benchlib.ROOT

import ngramspec  # noqa: E402
from ngramspec import SpecEngine  # noqa: E402
from ngramspec.llama.calibration import calibration_for  # noqa: E402
from ngramspec.cost import oracle_speedup  # noqa: E402
from ngramspec.llama import (detokenize, divergence_report, generate_plain,  # noqa: E402
                             generate_speculative, load_model)
from ngramspec.llama.decoder import prompt_pass as _prompt_pass  # noqa: E402
from ngramspec.llama.decoder import target_decoder as _target_decoder  # noqa: E402
from ngramspec.llama.model import default_model_path  # noqa: E402
from ngramspec.policy import AutoPolicy  # noqa: E402
from ngramspec.replay import replay  # noqa: E402
from ngramspec.traces import Request, read_requests  # noqa: E402

from e2e_configs import (ALL_NAMES, AUTO, BATCH_KS, CONFIGS, LCP_LOOKUP,  # noqa: E402,F401
                         LCP_PLAIN, LS_PLAIN, LS_PREFIX, PLAIN, SERVER_CONFIGS)
from e2e_markdown import render, targets  # noqa: E402,F401  (the report's Markdown)

TRACES = benchlib.TRACES


# ------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------

def pick(requests, n, lo, hi):
    """`n` requests with a prompt of lo..hi tokens, spread evenly over the file (deterministic)."""
    if n <= 0:
        return []
    fit = [r for r in requests if lo <= len(r.prompt) <= hi]
    if len(fit) < n:
        raise ValueError(f"only {len(fit)} prompts of {lo}..{hi} tokens, {n} wanted")
    step = len(fit) / n
    return [fit[int(i * step)] for i in range(n)]


def load_prompts(n_code, n_chat, code_range=(500, 1800), chat_range=(20, 400), n_reasoning=0,
                 n_agentic=0, max_prompt=3500):
    """Code-edit prompts (rewrite a file with a change), chat, reasoning and agentic prompts, as
    trace requests. Reasoning and agentic prompts (4k-8k tokens in the traces) are cut to their
    newest `max_prompt` tokens, so that they fit the context with the output; the recorded
    output stays as it is."""
    code = pick(read_requests(str(TRACES / "code-edit.jsonl.gz")), n_code, *code_range)
    chat = pick(read_requests(str(TRACES / "chat.jsonl.gz")), n_chat, *chat_range)
    out = [("code-edit", r) for r in code] + [("chat", r) for r in chat]
    for family, n in (("reasoning", n_reasoning), ("agentic", n_agentic)):
        for r in pick(read_requests(str(TRACES / f"{family}.jsonl.gz")), n, 1, 1 << 30):
            out.append((family, Request(r.id, r.prompt[-max_prompt:], r.output, r.extra)))
    return out


# ------------------------------------------------------------------------------------------
# One generation per configuration
# ------------------------------------------------------------------------------------------

class Models:
    """The three models of a run: ngramspec's (plain and speculative share it, and its prompt
    cache), llama-cpp-python's plain one, and llama-cpp-python's with the prompt lookup."""

    def __init__(self, n_ctx, threads, model_path=None, cost_model=None):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ngramspec.llama.repack import load_llama
        path = model_path or default_model_path()
        self.ours = load_model(path, n_ctx=n_ctx, n_threads=threads)
        # the auto policy's c(k): this machine's cached calibration (measured at first use)
        self.cost_model = cost_model or calibration_for(self.ours)
        # load_llama: llama_cpp.Llama, without AMX weight repacking on AMX hosts (issue 14)
        kw = dict(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                  n_threads_batch=threads, verbose=False)
        self.lcp_plain = load_llama(**kw)

        class CountingLookup(LlamaPromptLookupDecoding):
            """Counts calls (one per target decode in Llama.generate) and drafted tokens."""
            calls = drafted = 0

            def __call__(self, input_ids, /, **kwargs):
                draft = super().__call__(input_ids, **kwargs)
                self.calls += 1
                self.drafted += len(draft)
                return draft

        self.lookup = CountingLookup()
        # logits_all: llama-cpp-python sizes its score buffer from it, not from draft_model.
        self.lcp_lookup = load_llama(draft_model=self.lookup, logits_all=True, **kw)
        self.servers = {}           # name -> LlamaServer (`start_servers`)


def run_ours(models, name, prompt, n_predict):
    llm = models.ours
    engine = None if name == PLAIN else SpecEngine(CONFIGS[name][0], **CONFIGS[name][1])
    policy = AutoPolicy(models.cost_model) if name in AUTO else None
    c0 = time.thread_time()
    if engine is None:
        res = generate_plain(llm, prompt, n_predict=n_predict)
    else:
        res = generate_speculative(llm, prompt, engine, n_predict=n_predict, policy=policy,
                                   record_steps=True)
    # The whole call (the prompt is cached: see `warm`), begin and detokenizing included.
    cpu = time.thread_time() - c0
    n = res.n_output
    steps = max(1, res.n_target_decodes)
    if engine is None:
        # one token per decode, c(1, L) = 1 at every step: plain is 1.0 by construction
        shapes, cost = None, float(res.n_target_decodes)
    else:
        # steps: (L, sampled, draft, k), the decode of [sampled] + draft over L cached tokens
        shapes = [(len(draft) + 1, int(L)) for L, _, draft, _ in res.steps]
        cost = modeled_cost(models.cost_model, shapes)
    return {"tokens": [int(t) for t in res.output_tokens], "n_output": n,
            "step_shapes": shapes, "modeled_cost": cost,
            "modeled": (n - 1) / cost if cost > 0 and n > 1 else None,
            "tps": (n - 1) / res.t_gen_s if res.t_gen_s > 0 and n > 1 else 0.0,
            "cpu_tps": (n - 1) / cpu if cpu > 0 and n > 1 else 0.0,
            "prompt_reused": res.prompt_reused,
            "n_steps": res.n_target_decodes, "tokens_per_step": (n - 1) / steps,
            "n_draft_tokens": res.n_draft_tokens, "n_acc_tokens": res.n_acc_tokens,
            "target_ms_per_step": res.t_target_s / steps * 1e3,
            "proposer_us_per_step": res.t_proposers_s / steps * 1e6,
            "mean_batch": (res.n_draft_tokens + res.n_target_decodes) / steps}


def modeled_cost(cost_model, shapes):
    """What a generation's target decodes cost under `cost_model`, in single-token decodes:
    ``sum_i c(n_i, L_i)`` (`ngramspec.cost.CostModel.cost_many`) over its steps' shapes
    ``(n_i, L_i)``: n_i tokens decoded over L_i cached ones."""
    if not shapes:
        return 0.0
    n, kv = np.asarray(shapes, dtype=np.int64).reshape(-1, 2).T
    return float(cost_model.cost_many(n, kv).sum())


def run_lcp(models, name, prompt, n_predict):
    """One ``create_completion``; a stopping criterion (never stopping) stamps every sampled
    token, so the time from the first to the last token is measured as for ngramspec. It also
    sees the verified tokens, the last one being the token sampled before: the output tokens
    but the last, for the comparison with plain decoding."""
    from llama_cpp import StoppingCriteriaList
    llm = models.lcp_plain if name == LCP_PLAIN else models.lcp_lookup
    stamps, cpu, seen = [], [], []
    calls0, drafted0 = models.lookup.calls, models.lookup.drafted

    def stamp(input_ids, logits):
        stamps.append(time.perf_counter())
        cpu.append(time.thread_time())
        seen.append(int(input_ids[-1]))
        return False
    out = llm.create_completion([int(t) for t in prompt], max_tokens=n_predict, temperature=0.0,
                                top_k=1, repeat_penalty=1.0,
                                stopping_criteria=StoppingCriteriaList([stamp]))
    # Tokens sampled: the completion's, and the EOS it does not count (finish "stop": no stop
    # strings are given). create_completion calls the criterion once more after its loop.
    choice = out["choices"][0]
    n = out["usage"]["completion_tokens"] + (choice["finish_reason"] == "stop")
    dt = stamps[n - 1] - stamps[0] if n > 1 else 0.0
    dc = cpu[n - 1] - cpu[0] if n > 1 else 0.0
    rec = {"text": choice["text"], "tokens_but_last": seen[1:n], "n_output": n,
           "tps": (n - 1) / dt if dt > 0 else 0.0, "cpu_tps": (n - 1) / dc if dc > 0 else 0.0}
    if name == LCP_LOOKUP:
        # Each call is followed by one decode of [token] + draft (the last one's output may be
        # cut by max_tokens).
        calls = max(1, models.lookup.calls - calls0)
        rec["tokens_per_step"] = (n - 1) / calls
        rec["mean_batch"] = 1 + (models.lookup.drafted - drafted0) / calls
    return rec


def start_servers(stack, binary, names, threads, n_ctx, model_path=None):
    """One llama-server process per llama-server configuration in `names` (each on its own
    free port), stopped when `stack` closes. Same model file, threads, context and batch size
    as ngramspec's model; ``--no-repack`` on AMX hosts (issue 14)."""
    import llama_server

    from ngramspec.llama.repack import host_has_amx
    extra = ["--no-repack"] if host_has_amx() else []
    servers = {}
    for name in names:
        if name in SERVER_CONFIGS:
            types, params = SERVER_CONFIGS[name]
            servers[name] = stack.enter_context(llama_server.LlamaServer(
                binary, model_path or default_model_path(), threads=threads, ctx_size=n_ctx,
                flags=llama_server.spec_flags(types, params) + extra))
    return servers


def run_server(models, name, prompt, n_predict):
    """One measured generation on the configuration's llama-server (`LlamaServer.generation`:
    the prompt is processed by a 1-token request first, on slot 0 with ``cache_prompt``, so
    the measured request re-evaluates one prompt token and generates). Speeds are ``(n - 1) /
    t`` as for ngramspec: wall from llama-server's ``predicted_ms`` (first token to last), CPU
    time of the whole server process across the request (one decode more than that span: the
    1-token prompt pass, which ngramspec's call holds too)."""
    g = models.servers[name].generation(prompt, n_predict)
    n = len(g.tokens)
    rec = {"tokens": [int(t) for t in g.tokens], "n_output": n,
           "tps": (n - 1) / g.wall_s if g.wall_s > 0 and n > 1 else 0.0,
           "cpu_tps": (n - 1) / g.cpu_s if g.cpu_s > 0 and n > 1 else 0.0}
    if SERVER_CONFIGS[name][0] is not None:
        rec |= {"n_draft_tokens": g.n_draft_tokens, "n_acc_tokens": g.n_acc_tokens}
    return rec


def run_one(models, name, prompt, n_predict):
    if name in (LCP_PLAIN, LCP_LOOKUP):
        return run_lcp(models, name, prompt, n_predict)
    if name in SERVER_CONFIGS:
        return run_server(models, name, prompt, n_predict)
    return run_ours(models, name, prompt, n_predict)


def check_against_plain(models, prompt, name, rec, plain):
    """Equal to plain greedy decoding? Where ngramspec's tokens differ, whether the first
    difference is a top-2 tie within the float noise of batched vs one-token kernels."""
    tokens, ref = rec.get("tokens"), plain["tokens"]
    if name in (LCP_PLAIN, LCP_LOOKUP):
        # All tokens but the last, and the text (which has the last one too).
        tokens = rec["tokens_but_last"]
        ref = ref[:len(tokens)]
        if tokens == ref and rec["text"] != plain["text"]:
            return {"match": False, "divergence": None}
    if name in SERVER_CONFIGS and len(ref) - len(tokens) in (0, 1):
        # llama-server's `tokens` may leave out the end-of-generation token that ends it
        ref = ref[:len(tokens)]
    if tokens == ref:
        return {"match": True}
    rep = divergence_report(models.ours, prompt, tokens, ref)
    return {"match": False, "divergence": None if rep is None else rep.to_dict()}


def warm(models, prompt):
    """Prompt passes before the timed runs: ngramspec's driver keeps an identical prompt's KV
    cache, llama-cpp-python re-decodes only its last token."""
    generate_plain(models.ours, prompt, n_predict=1)
    for name in (LCP_PLAIN, LCP_LOOKUP):
        run_lcp(models, name, prompt, 1)


def measure_speed(models, prompts, names, n_predict, runs, log=print, start=None):
    """Every configuration once per round and prompt, in an order rotated from round to round
    and prompt to prompt; returns the raw records per prompt.

    Rounds are the outer loop: `start` (a callable taking an ExitStack) starts the llama-server
    processes afresh for each round, so a server has seen each prompt once when it generates
    for it — llama-server keeps drafting state across requests (ngram-mod's pool is one per
    server), and a second run of the same prompt would draft from its own earlier output.
    Each prompt is warmed (`warm`) before its runs in every round."""
    recs = [{name: [] for name in names} for _ in prompts]
    for r in range(runs):
        with contextlib.ExitStack() as stack:
            if start is not None:
                start(stack)
            for i, (family, req) in enumerate(prompts):
                warm(models, req.prompt)
                shift = (r + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    recs[i][name].append(run_one(models, name, req.prompt, n_predict))
                log(f"  round {r + 1}/{runs}: {req.id} done")
    out = []
    for (family, req), rec in zip(prompts, recs):
        prompt = req.prompt
        plain = rec[PLAIN][0]
        plain["text"] = detokenize(models.ours, plain["tokens"])
        checks = {name: check_against_plain(models, prompt, name, rec[name][0], plain)
                  for name in names if name != PLAIN}
        oracle = oracle_speedup(models.cost_model, len(prompt), plain["n_output"])
        out.append({"family": family, "id": req.id, "n_prompt": len(prompt),
                    "records": rec, "checks": checks, "oracle": oracle["speedup"],
                    "copied_from_trace": copied_prefix(plain["tokens"], req.output),
                    "match4_live": match4(prompt, plain["tokens"]),
                    "match4_recorded": match4(prompt, req.output[:len(plain["tokens"])])})
    return out


def copied_prefix(live, recorded):
    """How many output tokens the model gives before it leaves the recorded trace output."""
    n = min(len(live), len(recorded))
    diff = np.flatnonzero(np.asarray(live[:n]) != np.asarray(recorded[:n]))
    return int(diff[0]) if len(diff) else n


def match4(prompt, output):
    """The traces' README measure: the fraction of output tokens that follow the most recent
    earlier occurrence of their 4 preceding tokens (in prompt + output), i.e. how much of the
    output a 4-gram lookup of the text so far predicts."""
    seq = [int(t) for t in prompt] + [int(t) for t in output]
    last, hits = {}, 0
    for i in range(4, len(seq)):
        key = tuple(seq[i - 4:i])
        if i >= len(prompt) and key in last and seq[last[key]] == seq[i]:
            hits += 1
        last[key] = i
    return hits / len(output) if len(output) else 0.0


# ------------------------------------------------------------------------------------------
# Cost of a batch of k tokens versus one
# ------------------------------------------------------------------------------------------

def batch_costs(llm, context, position, ks=BATCH_KS, threads=(1, 2), reps=5):
    """Milliseconds of one target decode of k tokens at `position` (all logits, plus the
    argmax the driver takes), median over `reps` rounds; ks and thread counts interleaved.

    The KV cache holds ``context[:position]``; every decode is removed again, so each one sees
    the same cache.
    """
    import llama_cpp
    dec = _target_decoder(llm)
    prompt = np.asarray(context[:position], dtype=np.int32)
    _prompt_pass(llm, dec, prompt)
    follow = np.asarray(context[position:position + max(ks)], dtype=np.int32)
    if len(follow) < max(ks):
        raise ValueError("the context is too short for the largest batch")
    times = {t: {k: [] for k in ks} for t in threads}
    cpu = {t: {k: [] for k in ks} for t in threads}
    try:
        for r in range(reps):
            for t in (threads if r % 2 == 0 else threads[::-1]):
                llama_cpp.llama_set_n_threads(llm.ctx, t, t)
                dec.decode(follow[:1], position, all_logits=True)   # warm the thread pool
                dec.seq_rm(position)
                for k in (ks if r % 2 == 0 else ks[::-1]):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    np.argmax(dec.decode(follow[:k], position, all_logits=True), axis=1)
                    times[t][k].append((time.perf_counter() - t0) * 1e3)
                    cpu[t][k].append((time.thread_time() - c0) * 1e3)
                    dec.seq_rm(position)
    finally:
        n = llm.context_params.n_threads
        llama_cpp.llama_set_n_threads(llm.ctx, n, llm.context_params.n_threads_batch)
    med = {t: {k: statistics.median(v) for k, v in times[t].items()} for t in threads}
    out = {"position": int(position), "reps": reps, "ms": med,
           "ceiling": {t: ceiling(med[t]) for t in threads}}
    if 1 in threads:
        # With one thread llama.cpp computes on the calling thread: its CPU time is the decode's
        # own, whatever else runs on the machine.
        out["cpu_ms_1_thread"] = {k: statistics.median(v) for k, v in cpu[1].items()}
        out["ceiling_cpu_1_thread"] = ceiling(out["cpu_ms_1_thread"])
    return out


def ceiling(ms):
    """Best tokens per unit of single-token time if all n - 1 drafted tokens were accepted:
    ``max_n n / c(n)``, ``c(n) = t(n) / t(1)``; returns (speed-up, n)."""
    t1 = ms[1]
    best = max(ms, key=lambda n: n * t1 / ms[n])
    return [best * t1 / ms[best], best]


# ------------------------------------------------------------------------------------------
# Replay of the recorded trace output on the same prompts
# ------------------------------------------------------------------------------------------

def replay_tokens_per_step(req, n_predict, names, cost_model=None):
    """Tokens per verification step when the target's output is the recorded one (cut to
    n_predict tokens), the same as the live runs' ``(n_output - 1) / steps``; the auto
    configurations weigh drafts against `cost_model`."""
    out = {}
    cut = Request(req.id, req.prompt, req.output[:n_predict], {})
    for name in names:
        if name not in CONFIGS:
            continue
        types, params = CONFIGS[name]
        factory = None
        if name in AUTO:
            def factory():
                return AutoPolicy(cost_model, proposer_time=False)
        out[name] = replay([cut], types, params, state="fresh",
                           policy_factory=factory).requests[0]["tokens_per_step"]
    return out


# ------------------------------------------------------------------------------------------
# Summary and report
# ------------------------------------------------------------------------------------------

def geomean(values):
    values = [v for v in values if v > 0]
    return float(np.exp(np.mean(np.log(values)))) if values else 0.0


def modeled_cell(runs, base):
    """The modeled figures of one configuration on one prompt from its rounds' records and
    plain's: ``modeled_vs_plain`` (the median over the rounds of modeled / plain's modeled, plain's
    being 1), ``modeled_rounds_equal`` (every round decoded the same batches at the same KV
    lengths, as greedy decoding should; the auto policy's own proposer timing may change a
    draft's length) and, where they are not, ``modeled_vs_plain_range`` (lowest, highest)."""
    ratios = [r["modeled"] / b["modeled"] for r, b in zip(runs, base)
              if r["modeled"] is not None and b["modeled"] is not None]
    if len(ratios) < len(runs):     # one token only: no step to price
        return {"modeled_vs_plain": None}
    equal = all(r["step_shapes"] == runs[0]["step_shapes"] for r in runs)
    out = {"modeled_vs_plain": statistics.median(ratios), "modeled_rounds_equal": equal}
    if not equal:
        out["modeled_vs_plain_range"] = [min(ratios), max(ratios)]
    return out


def summarize(speed, names):
    """Per prompt: median tokens/s and the median of the per-round ratios; per family: the
    geometric mean of those over the prompts."""
    per_prompt, per_family = [], {}
    for p in speed:
        recs = p["records"]
        base = recs[PLAIN]
        lcp_base = recs.get(LCP_PLAIN)
        row = {k: p[k] for k in ("family", "id", "n_prompt", "copied_from_trace", "match4_live",
                                 "match4_recorded", "oracle") if k in p}
        row["configs"] = {}
        for name in names:
            runs = recs[name]
            cell = {"n_output": runs[0]["n_output"],
                    "match": p["checks"].get(name, {"match": True})["match"]}
            for metric, suffix in (("tps", ""), ("cpu_tps", "_cpu")):
                cell[metric] = statistics.median(r[metric] for r in runs)
                cell["vs_plain" + suffix] = statistics.median(
                    r[metric] / b[metric] for r, b in zip(runs, base))
                if lcp_base is not None:
                    cell["vs_lcp_plain" + suffix] = statistics.median(
                        r[metric] / b[metric] for r, b in zip(runs, lcp_base))
            if "modeled" in runs[0]:
                cell |= modeled_cell(runs, base)
            for k in ("tokens_per_step", "n_draft_tokens", "n_acc_tokens", "mean_batch"):
                if k in runs[0]:
                    cell[k] = runs[0][k]
            for k in ("target_ms_per_step", "proposer_us_per_step"):
                if k in runs[0]:
                    cell[k] = statistics.median(r[k] for r in runs)
            div = p["checks"].get(name, {}).get("divergence")
            if div:
                cell["divergence"] = div
            row["configs"][name] = cell
        if "replay" in p:
            row["replay"] = p["replay"]
        per_prompt.append(row)
    for fam in dict.fromkeys(p["family"] for p in per_prompt):
        rows = [p for p in per_prompt if p["family"] == fam]
        per_family[fam] = {name: {
            key: geomean([r["configs"][name].get(key, 0) for r in rows])
            for key in ("tps", "cpu_tps", "vs_plain", "vs_plain_cpu", "vs_lcp_plain",
                        "vs_lcp_plain_cpu")} for name in names}
        for name in names:
            modeled = [r["configs"][name].get("modeled_vs_plain") for r in rows]
            if None not in modeled:
                per_family[fam][name]["modeled_vs_plain"] = geomean(modeled)
                per_family[fam][name]["min_modeled_vs_plain"] = min(modeled)
            if all("oracle" in r for r in rows):
                # the gain as a share of the oracle's (the most any drafter could gain here)
                oracle = geomean([r["oracle"] for r in rows])
                per_family[fam][name]["oracle"] = oracle
                per_family[fam][name]["share_of_oracle"] = (
                    (per_family[fam][name]["vs_plain_cpu"] - 1) / (oracle - 1)
                    if oracle > 1 else None)
            for key in ("vs_plain_cpu", "vs_plain"):
                per_family[fam][name]["min_" + key] = min(
                    r["configs"][name][key] for r in rows)
            per_family[fam][name]["all_match"] = all(
                r["configs"][name]["match"] or (r["configs"][name].get("divergence") or {})
                .get("within_float_noise", False) for r in rows)
    return per_prompt, per_family


def machine():
    info = {"python": platform.python_version(), "ngramspec": ngramspec.__file__}
    try:
        import llama_cpp
        info["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        pass
    try:
        info["revision"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                          capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        if dirty:
            info["revision"] += " (with uncommitted changes)"
        info["load_average"] = open("/proc/loadavg").read().split()[:3]
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def measure(n_code=4, n_chat=3, n_predict=256, runs=3, threads=1, n_ctx=4096, names=None,
            ks=BATCH_KS, batch_threads=(1, 2), batch_reps=5, batch_position=1468,
            code_range=(500, 1800), chat_range=(20, 400), log=print, n_reasoning=0,
            n_agentic=0, max_prompt=3500, cost_model=None):
    """Everything the report shows, as one JSON-ready dict. `cost_model`: the auto policy's and
    the oracle's c(k) (default: this machine's cached calibration, measured at first use)."""
    names = list(names or ALL_NAMES)
    if PLAIN not in names:
        names.insert(0, PLAIN)
    t_start = time.time()
    prompts = load_prompts(n_code, n_chat, code_range, chat_range, n_reasoning, n_agentic,
                           max_prompt)
    models = Models(n_ctx, threads, cost_model=cost_model)
    log(f"cost model: {models.cost_model.source}")
    log(f"prompts: {[(f, len(r.prompt)) for f, r in prompts]}")
    info = machine()
    binary = None
    if any(n in SERVER_CONFIGS for n in names):
        import llama_server
        binary = llama_server.find_binary()
        if binary is None:
            log("note: no llama-server binary ($NGRAMSPEC_LLAMA_SERVER, "
                "bench/build_llama_server.sh, PATH): its configurations are skipped")
            names = [n for n in names if n not in SERVER_CONFIGS]
        else:
            info["llama_server"] = str(binary)

    def start(stack):
        models.servers = start_servers(stack, binary, names, threads, n_ctx)
    speed = measure_speed(models, prompts, names, n_predict, runs, log, start)
    for p, (family, req) in zip(speed, prompts):
        p["replay"] = replay_tokens_per_step(req, n_predict, names, models.cost_model)
    per_prompt, per_family = summarize(speed, names)
    batch = None
    if ks:
        # A realistic position: a code-edit request's prompt and recorded output, cut there.
        reqs = [r for f, r in prompts if f == "code-edit"] or [r for f, r in prompts]
        req = next((r for r in reqs if len(r.prompt) + len(r.output) >= batch_position
                    + max(ks)), max(reqs, key=lambda r: len(r.prompt) + len(r.output)))
        ctx = np.concatenate([req.prompt, req.output])
        pos = min(batch_position, len(ctx) - max(ks), n_ctx - max(ks) - 1)
        log(f"batch costs at position {pos}")
        batch = batch_costs(models.ours, ctx, pos, ks, batch_threads, batch_reps)
    info["load_average_end"] = open("/proc/loadavg").read().split()[:3]
    info["seconds"] = round(time.time() - t_start, 1)
    return {"machine": info,
            "cost_model": models.cost_model.to_dict(),
            "settings": {"n_code": n_code, "n_chat": n_chat, "n_reasoning": n_reasoning,
                         "n_agentic": n_agentic, "max_prompt": max_prompt,
                         "n_predict": n_predict,
                         "runs": runs, "threads": threads, "n_ctx": n_ctx, "names": names,
                         "configs": {k: {"spec_type": v[0], "params": v[1]}
                                     for k, v in (CONFIGS | SERVER_CONFIGS).items()
                                     if k in names}},
            "per_prompt": per_prompt, "per_family": per_family, "batch": batch,
            "raw": [{k: v for k, v in p.items() if k != "records"} | {
                "tps": {n: [r["tps"] for r in p["records"][n]] for n in names},
                "cpu_tps": {n: [r["cpu_tps"] for r in p["records"][n]] for n in names}}
                for p in speed]}


def _jsonable(obj):
    # thread counts and k are dict keys: JSON makes them strings, the renderer takes either
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return obj


def _restore_batch_keys(res):
    b = res.get("batch")
    if b:
        b["ms"] = {int(t): {int(k): v for k, v in d.items()} for t, d in b["ms"].items()}
        b["ceiling"] = {int(t): v for t, v in b["ceiling"].items()}
        if "cpu_ms_1_thread" in b:
            b["cpu_ms_1_thread"] = {int(k): v for k, v in b["cpu_ms_1_thread"].items()}
    return res


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--code", type=int, default=4, help="code-edit prompts (default 4)")
    ap.add_argument("--chat", type=int, default=3, help="chat prompts (default 3)")
    ap.add_argument("--reasoning", type=int, default=2, help="reasoning prompts (default 2)")
    ap.add_argument("--agentic", type=int, default=2, help="agentic prompts (default 2)")
    ap.add_argument("--max-prompt", type=int, default=3500,
                    help="reasoning/agentic prompts are cut to their newest N tokens")
    ap.add_argument("--cost-model", default=None, metavar="FILE|NAME",
                    help="c(k) of the auto policy and the oracle (default: this machine's "
                         "calibration, cached)")
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3, help="interleaved rounds per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--configs", default=None,
                    help="comma list of configuration names (default: all); plain is always run")
    ap.add_argument("--batch-reps", type=int, default=5)
    ap.add_argument("--no-batch", action="store_true", help="skip the batch-cost measurement")
    ap.add_argument("--json", metavar="FILE", default=benchlib.result_path("e2e.json"),
                    help="write the results here (default: %(default)s)")
    ap.add_argument("--md", metavar="FILE", default=benchlib.result_path("e2e.md"),
                    help="write the Markdown report here (default: %(default)s)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only render an earlier results file")
    ap.add_argument("--notes", default=None, metavar="MD",
                    help="Markdown put after the targets table (the analysis of a run)")
    args = ap.parse_args(argv)
    # SIGTERM as an exception, so the llama-server processes are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.render:
        res = _restore_batch_keys(json.loads(pathlib.Path(args.render).read_text()))
    else:
        names = args.configs.split(",") if args.configs else None
        for n in names or []:
            if n not in ALL_NAMES:
                ap.error(f"unknown configuration {n!r}: allowed {', '.join(ALL_NAMES)}")
        cost_model = None
        if args.cost_model:
            from ngramspec.cost import load_cost_model
            cost_model = load_cost_model(args.cost_model)
        res = measure(args.code, args.chat, args.n_predict, args.runs, args.threads,
                      args.ctx_size, names, () if args.no_batch else BATCH_KS,
                      batch_reps=args.batch_reps,
                      log=lambda msg: print(msg, file=sys.stderr, flush=True),
                      n_reasoning=args.reasoning, n_agentic=args.agentic,
                      max_prompt=args.max_prompt, cost_model=cost_model)
        res["machine"]["command"] = benchlib.command_line("e2e", argv)
        res = _restore_batch_keys(json.loads(json.dumps(_jsonable(res))))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(_jsonable(res), indent=1) + "\n")
    md = render(res, pathlib.Path(args.notes).read_text() if args.notes else None)
    if args.md:
        pathlib.Path(args.md).write_text(md)
    else:
        sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

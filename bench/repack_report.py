"""What llama.cpp's extra buffer types (weight repacking) are worth here, and the plug-in's cost.

    python bench repack [--rounds 3] [--plugin-rounds 3] [--n-predict 256]
                        [--plugin-n-predict 256]
                        [--json bench/results/repack.json] [--md bench/results/repack.md]

Issue 14: on CPUs with AMX, llama.cpp's AMX extra buffer type crashes on multi-token batches, so
``repack="auto"`` loads models with ``use_extra_bufts = False`` there. This measures, on the host
it runs on, what turning the extra buffer types off costs where both work:

1. **Repack on/off**: each model loaded twice (``repack="on"`` / ``"off"``), plain greedy and
   speculative generation (``generate``'s defaults, ngram-mod 8..32) on the README example,
   ``--n-predict`` tokens, one decode thread. Two models: the embedded SmolLM2-135M Q4_1 as
   shipped (whose tensors llama.cpp's AVX2 repacking does not take: the load log says "cannot be
   used with preferred buffer type CPU_REPACK"), and the same model requantized to Q4_0 with
   ``llama_model_quantize`` (its matrices are repacked to ``q4_0_8x8``), so that the cost of
   ``--repack off`` is measured where repacking does something. The configurations run once per
   round in an order rotated from round to round; ratios are taken within a round, then the
   median.
2. **The plug-in**: llama-cpp-python's own loop, ``Llama.create_completion`` plain and with
   ``draft_model=NgramspecDraftModel("ngram-mod,ngram-simple")`` (the README snippet), same
   prompt and token count, next to ngramspec's ``generate_speculative`` on the same model.

Speed is ``(n_output - 1) / t`` from the first output token to the last (as
bench/results/e2e.md), by wall clock and by CPU time of the decoding thread (with one thread
llama.cpp computes on the calling thread, so other processes on a shared machine do not inflate
it); CPU time is the main figure.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import time

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
import ngramspec
from e2e_report import LCP_LOOKUP, LCP_PLAIN, machine, run_lcp
from ngramspec import SpecEngine
from ngramspec.config import SPEC_PROFILES
from ngramspec.llama import generate_plain, generate_speculative, load_model, tokenize_prompt
from ngramspec.llama.model import default_model_path
from ngramspec.llama.repack import host_has_amx, load_llama

GENERATE_DEFAULTS = dict(SPEC_PROFILES["generate"].params)

ROOT = benchlib.ROOT
EXAMPLE = ROOT / "ngramspec" / "examples" / "code_edit_prompt.txt"
N_CTX = 4096
REPACK_CONFIGS = [("on", "plain"), ("on", "spec"), ("off", "plain"), ("off", "spec")]
MODELS = ("Q4_1", "Q4_0")   # as shipped; requantized (repackable on AVX2)


def q4_0_model(folder):
    """The embedded model requantized to Q4_0 (a file in ``folder``)."""
    import llama_cpp
    out = pathlib.Path(folder) / "smollm2-135m-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    from llama_cpp._utils import suppress_stdout_stderr
    with suppress_stdout_stderr(disable=False):  # its log: one line per tensor
        rc = llama_cpp.llama_model_quantize(default_model_path().encode(), str(out).encode(),
                                            params)
    if rc != 0:
        raise RuntimeError("llama_model_quantize failed")
    return str(out)


def _ours(llm, prompt, kind, n_predict):
    engine = SpecEngine("ngram-mod", **GENERATE_DEFAULTS) if kind == "spec" else None
    c0 = time.thread_time()
    if engine is None:
        res = generate_plain(llm, prompt, n_predict=n_predict)
    else:
        res = generate_speculative(llm, prompt, engine, n_predict=n_predict)
    cpu = time.thread_time() - c0  # the prompt pass is cached after the warm-up
    n = res.n_output
    return {"tokens": [int(t) for t in res.output_tokens], "n_output": n,
            "tps": (n - 1) / res.t_gen_s if res.t_gen_s > 0 and n > 1 else 0.0,
            "cpu_tps": (n - 1) / cpu if cpu > 0 and n > 1 else 0.0,
            "prompt_reused": res.prompt_reused}


def measure_repack(prompt_text, rounds, n_predict, folder, log=print):
    paths = {"Q4_1": default_model_path(), "Q4_0": q4_0_model(folder)}
    models = {(q, r): load_model(paths[q], n_ctx=N_CTX, n_threads=1, repack=r)
              for q in MODELS for r in ("on", "off")}
    prompt = tokenize_prompt(models["Q4_1", "on"], prompt_text)
    for llm in models.values():  # warm-up: the prompt pass is cached afterwards
        generate_plain(llm, prompt, n_predict=2)
    configs = [(q, r, k) for q in MODELS for r, k in REPACK_CONFIGS]
    runs = {f"{q} {r}/{k}": [] for q, r, k in configs}
    for i in range(rounds):
        shift = (i * 3) % len(configs)
        for q, r, k in configs[shift:] + configs[:shift]:
            rec = _ours(models[q, r], prompt, k, n_predict)
            runs[f"{q} {r}/{k}"].append(rec)
            log(f"round {i + 1}/{rounds} {q} repack {r} {k}: {rec['cpu_tps']:.1f} "
                f"tokens/CPU-s, {rec['tps']:.1f} tokens/s")
    return prompt, runs


def measure_plugin(prompt, rounds, n_predict, log=print):
    from ngramspec.integrations.llama_cpp import NgramspecDraftModel

    class Counting(NgramspecDraftModel):
        calls = drafted = 0

        def __call__(self, input_ids, /, **kwargs):
            draft = super().__call__(input_ids, **kwargs)
            Counting.calls += 1
            Counting.drafted += len(draft)
            return draft

    path = default_model_path()
    kw = dict(n_ctx=N_CTX, n_batch=512, n_threads=1, n_threads_batch=1, verbose=False)

    class Models:
        lcp_plain = load_llama(path, **kw)
        lookup = Counting("ngram-mod,ngram-simple", n_ctx=N_CTX)
        lcp_lookup = load_llama(path, draft_model=lookup, logits_all=True, **kw)
        ours = load_model(path, n_ctx=N_CTX, n_threads=1)

    generate_plain(Models.ours, prompt, n_predict=2)
    names = [LCP_PLAIN, LCP_LOOKUP, "ngramspec"]
    runs = {n: [] for n in names}
    for i in range(rounds):
        for name in names[i % 3:] + names[:i % 3]:
            if name == "ngramspec":
                rec = _ours(Models.ours, prompt, "spec", n_predict)
            else:
                llm = Models.lcp_plain if name == LCP_PLAIN else Models.lcp_lookup
                if name == LCP_LOOKUP:
                    # a new chain per request, as generate_speculative's runs get: the pool
                    # must not remember the same request from the previous round
                    Models.lcp_lookup.draft_model = Counting("ngram-mod,ngram-simple",
                                                             n_ctx=N_CTX)
                # A fresh request, as a user's call: the prompt pass (all-position logits
                # with the plug-in) is part of the whole call's time.
                llm.reset()
                c0, w0 = time.thread_time(), time.perf_counter()
                rec = run_lcp(Models, name, prompt, n_predict)
                rec["call_cpu_s"] = time.thread_time() - c0
                rec["call_wall_s"] = time.perf_counter() - w0
            runs[name].append(rec)
            log(f"round {i + 1}/{rounds} {name}: {rec['cpu_tps']:.1f} tokens/CPU-s, "
                f"{rec['tps']:.1f} tokens/s")
    return runs


def _median_ratio(a, b, key):
    return statistics.median(x[key] / y[key] for x, y in zip(a, b) if y[key] > 0)


def summarize(repack_runs, plugin_runs):
    return {"repack": summarize_repack(repack_runs), "plugin": summarize_plugin(plugin_runs)}


def summarize_repack(repack_runs):
    s = {"repack": {}}
    for name, recs in repack_runs.items():
        s["repack"][name] = {k: statistics.median(r[k] for r in recs) for k in ("cpu_tps", "tps")}
    for q in MODELS:
        for kind in ("plain", "spec"):
            s["repack"][f"{q} off/on {kind}"] = {
                k: _median_ratio(repack_runs[f"{q} off/{kind}"], repack_runs[f"{q} on/{kind}"], k)
                for k in ("cpu_tps", "tps")}
        on = repack_runs[f"{q} on/plain"][0]["tokens"]
        off = repack_runs[f"{q} off/plain"][0]["tokens"]
        s["repack"][f"{q} same_plain_output"] = on == off
    return s["repack"]


def summarize_plugin(plugin_runs):
    s = {"plugin": {}}
    for name, recs in plugin_runs.items():
        s["plugin"][name] = {k: statistics.median(r[k] for r in recs) for k in ("cpu_tps", "tps")}
    s["plugin"]["plugin/plain"] = {
        k: _median_ratio(plugin_runs[LCP_LOOKUP], plugin_runs[LCP_PLAIN], k)
        for k in ("cpu_tps", "tps")}
    s["plugin"]["ngramspec/plain"] = {
        k: _median_ratio(plugin_runs["ngramspec"], plugin_runs[LCP_PLAIN], k)
        for k in ("cpu_tps", "tps")}
    # whole calls, prompt pass included: speed of the plug-in relative to plain = t_plain / t_plug
    s["plugin"]["call plugin/plain"] = {
        k: _median_ratio(plugin_runs[LCP_PLAIN], plugin_runs[LCP_LOOKUP], k)
        for k in ("call_cpu_s", "call_wall_s")}
    for name in (LCP_PLAIN, LCP_LOOKUP):
        s["plugin"][name].update({k: statistics.median(r[k] for r in plugin_runs[name])
                                  for k in ("call_cpu_s", "call_wall_s")})
    return s["plugin"]


def render(res):
    m, s = res["machine"], res["summary"]
    rp, pl = s["repack"], s["plugin"]
    lines = [
        "# Weight repacking (extra buffer types) and the plug-in's loop",
        "",
        f"`python bench repack --rounds {res['rounds']} --plugin-rounds "
        f"{res['plugin_rounds']} --n-predict {res['n_predict']} --plugin-n-predict "
        f"{res['plugin_n_predict']}` on {m.get('cpu', '?')}, "
        f"AMX: {'yes' if res['amx'] else 'no'}; llama-cpp-python {m.get('llama_cpp_python')}, "
        f"revision {m.get('revision')}; load average at the start "
        f"{' '.join(m.get('load_average', []))} (a shared machine: every configuration runs "
        f"once per round, rotated; figures are medians, ratios taken within a round). "
        f"Embedded SmolLM2-135M-Instruct Q4_1, README example prompt ({res['n_prompt']} tokens), "
        f"{res['n_predict']} output tokens ({res['plugin_n_predict']} in section 2), one decode "
        f"thread. tokens/CPU-s: CPU time of the "
        f"decoding thread (the main figure); tokens/s: wall clock.",
        "",
        "## 1. Repack on / off (issue 14: `repack=\"auto\"` is off on AMX hosts only)",
        "",
        "Q4_1: the embedded model as shipped (llama.cpp repacks none of its tensors on this "
        "CPU: the two loads are the same). Q4_0: the same model requantized, whose matrices "
        "llama.cpp repacks to `q4_0_8x8` (\"CPU_REPACK model buffer size = 56.95 MiB\").",
        "",
        "| model | loaded with | generation | tokens/CPU-s | tokens/s |",
        "|---|---|---|---:|---:|",
    ]
    for q in MODELS:
        for name in ("on/plain", "on/spec", "off/plain", "off/spec"):
            r, k = name.split("/")
            row = rp[f"{q} {name}"]
            lines.append(f"| {q} | use_extra_bufts {'true' if r == 'on' else 'false'} "
                         f"(`--repack {r}`) | "
                         f"{'plain greedy' if k == 'plain' else 'speculative (generate defaults)'}"
                         f" | {row['cpu_tps']:.1f} | {row['tps']:.1f} |")
    lines.append("")
    lines += [
        "The two Q4_1 loads are the same model in the same buffers, so the spread of their rows "
        "is this shared machine's noise. `repack=\"auto\"` keeps `use_extra_bufts` on where "
        "the CPU has no AMX (as llama.cpp's default): such hosts load every model as before.",
        "",
    ]
    for q in MODELS:
        p, sp = rp[f"{q} off/on plain"], rp[f"{q} off/on spec"]
        lines.append(f"{q}, off / on (median of per-round ratios): plain {p['cpu_tps']:.3f} "
                     f"(wall {p['tps']:.3f}), speculative {sp['cpu_tps']:.3f} (wall "
                     f"{sp['tps']:.3f}); plain outputs of the two loads "
                     f"{'identical' if rp[f'{q} same_plain_output'] else 'differ'}.")
        lines.append("")
    lines += [
        "## 2. The plug-in (llama-cpp-python's own loop) against plain llama-cpp-python",
        "",
    ]
    if "plugin_machine" in res:
        pm = res["plugin_machine"]
        lines += [f"Measured in a later run (`--plugin-only --plugin-rounds "
                  f"{res['plugin_rounds']} --plugin-n-predict {res['plugin_n_predict']}`, "
                  f"revision {pm.get('revision')}, load average at its start "
                  f"{' '.join(pm.get('load_average', []))}).", ""]
    lines += [
        "| | tokens/CPU-s | tokens/s |",
        "|---|---:|---:|",
        f"| `Llama.create_completion`, plain | {pl[LCP_PLAIN]['cpu_tps']:.1f} | "
        f"{pl[LCP_PLAIN]['tps']:.1f} |",
        f"| the same with `draft_model=NgramspecDraftModel(\"ngram-mod,ngram-simple\")` | "
        f"{pl[LCP_LOOKUP]['cpu_tps']:.1f} | {pl[LCP_LOOKUP]['tps']:.1f} |",
        f"| `ngramspec.llama.live.generate_speculative` (generate defaults) | "
        f"{pl['ngramspec']['cpu_tps']:.1f} | {pl['ngramspec']['tps']:.1f} |",
        "",
        f"Generation phase (first to last token): plug-in / plain llama-cpp-python "
        f"{pl['plugin/plain']['cpu_tps']:.2f}x (wall {pl['plugin/plain']['tps']:.2f}x); "
        f"generate_speculative / plain llama-cpp-python: {pl['ngramspec/plain']['cpu_tps']:.2f}x "
        f"(wall {pl['ngramspec/plain']['tps']:.2f}x).",
        "",
    ]
    if "call plugin/plain" in pl:
        c = pl["call plugin/plain"]
        lines += [
            f"Whole `create_completion` call of a fresh request ({res['n_prompt']}-token prompt "
            f"pass included, where the plug-in's `logits_all=True` copies every position's "
            f"logits into numpy): plain {pl[LCP_PLAIN]['call_cpu_s']:.2f} CPU-s "
            f"({pl[LCP_PLAIN]['call_wall_s']:.1f} s wall), with the plug-in "
            f"{pl[LCP_LOOKUP]['call_cpu_s']:.2f} CPU-s ({pl[LCP_LOOKUP]['call_wall_s']:.1f} s "
            f"wall): the plug-in runs at {c['call_cpu_s']:.2f}x plain's speed "
            f"(wall {c['call_wall_s']:.2f}x).",
            "",
        ]
    lines += [
    ]
    return "\n".join(lines)


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plugin-rounds", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--plugin-n-predict", type=int, default=256)
    ap.add_argument("--json", metavar="FILE", default=benchlib.result_path("repack.json"),
                    help="write the runs as JSON here (default: %(default)s)")
    ap.add_argument("--md", metavar="FILE", default=benchlib.result_path("repack.md"),
                    help="write the Markdown report here (default: %(default)s)")
    ap.add_argument("--plugin-only", action="store_true",
                    help="measure section 2 again; section 1 is kept from --json")
    args = ap.parse_args(argv)
    info = machine()
    text = EXAMPLE.read_text(encoding="utf-8")
    if args.plugin_only:
        res = json.loads(pathlib.Path(args.json).read_text())
        prompt = tokenize_prompt(load_model(default_model_path(), n_ctx=N_CTX, n_threads=1),
                                 text)
        plugin_runs = measure_plugin(prompt, args.plugin_rounds, args.plugin_n_predict)
        res.update({"plugin_machine": info, "plugin_rounds": args.plugin_rounds,
                    "plugin_n_predict": args.plugin_n_predict})
        res["summary"]["plugin"] = summarize_plugin(plugin_runs)
        res["runs"]["plugin"] = {k: [{kk: vv for kk, vv in r.items()
                                      if kk not in ("tokens", "tokens_but_last", "text")}
                                     for r in v] for k, v in plugin_runs.items()}
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        pathlib.Path(args.md).write_text(render(res))
        print(render(res))
        return
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        prompt, repack_runs = measure_repack(text, args.rounds, args.n_predict, folder)
    plugin_runs = measure_plugin(prompt, args.plugin_rounds, args.plugin_n_predict)
    res = {"machine": info, "amx": host_has_amx(), "rounds": args.rounds,
           "plugin_rounds": args.plugin_rounds, "n_predict": args.n_predict,
           "plugin_n_predict": args.plugin_n_predict,
           "n_prompt": int(len(prompt)), "ngramspec": ngramspec.__version__,
           "summary": summarize(repack_runs, plugin_runs),
           "runs": {"repack": {k: [{kk: vv for kk, vv in r.items() if kk != "tokens"}
                                   for r in v] for k, v in repack_runs.items()},
                    "plugin": {k: [{kk: vv for kk, vv in r.items()
                                    if kk not in ("tokens", "tokens_but_last", "text")}
                                   for r in v] for k, v in plugin_runs.items()}}}
    pathlib.Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    pathlib.Path(args.md).write_text(render(res))
    print(render(res))


if __name__ == "__main__":
    main()

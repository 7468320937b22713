"""The Markdown of ``python bench e2e`` (bench/results/e2e.md) from its results dict
(`e2e_report.measure`, or a results file read back): `render` puts the sections together (targets,
speed-up per family, the oracle, what limits the speed-up, per prompt, batch cost); `targets`
decides issue 16's targets on a run. Reads the results only: measures nothing."""
from __future__ import annotations

import statistics

import numpy as np

from e2e_configs import AUTO, CONFIGS, LS_PLAIN, PLAIN, SERVER_CONFIGS


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def _match(c):
    if c["match"]:
        return "= plain"
    div = c.get("divergence") or {}
    if div.get("within_float_noise"):
        return "tie within noise"
    if div and div["top1"] - min(div["logit_a"], div["logit_b"]) <= div["noise"]:
        # Both chosen tokens within the noise of the best, but with a third candidate between
        # them: divergence_report's top-2 criterion does not cover it; said as it is.
        return "3-way tie within noise"
    return "DIFFERS"


def _prompt_row(name, c, replayed):
    match = _match(c)
    acc = (f"{c['n_acc_tokens']} / {c['n_draft_tokens']}"
           if "n_draft_tokens" in c and name != PLAIN else "—")
    modeled = _fmt(c.get("modeled_vs_plain"), ".3f")
    if "modeled_vs_plain_range" in c:
        modeled += " (rounds {:.3f}–{:.3f})".format(*c["modeled_vs_plain_range"])
    return (f"| {name} | {c['cpu_tps']:.1f} | {c['vs_plain_cpu']:.3f} | {c['tps']:.1f} "
            f"| {c['vs_plain']:.3f} | {modeled} | {match} "
            f"| {_fmt(c.get('tokens_per_step'), '.2f')} | {_fmt(replayed, '.2f')} | {acc} "
            f"| {_fmt(c.get('mean_batch'), '.2f')} | {_fmt(c.get('target_ms_per_step'), '.1f')} "
            f"| {_fmt(c.get('proposer_us_per_step'), '.0f')} |")


def generate_config():
    """The name in CONFIGS of `ngramspec generate`'s default configuration (its policy is
    auto)."""
    from ngramspec.cli.live_flags import GENERATE_DEFAULTS
    return next(name for name, (types, params) in CONFIGS.items()
                if types == "ngram-mod" and params == GENERATE_DEFAULTS and name in AUTO)


def acceptance_summary(res, family="code-edit"):
    """Per ngramspec configuration over a family's prompts: mean tokens per step live and in the
    replay of the recorded output, accepted / drafted tokens, and the median proposer and
    target costs per step."""
    rows = [r for r in res["per_prompt"] if r["family"] == family]
    out = {}
    for name in res["settings"]["names"]:
        cells = [r["configs"][name] for r in rows]
        if not cells or name not in CONFIGS:
            continue
        replayed = [r.get("replay", {}).get(name) for r in rows]
        out[name] = {
            "live": float(np.mean([c["tokens_per_step"] for c in cells])),
            "replay": float(np.mean(replayed)) if None not in replayed else None,
            "n_acc_tokens": sum(c["n_acc_tokens"] for c in cells),
            "n_draft_tokens": sum(c["n_draft_tokens"] for c in cells),
            "proposer_us": statistics.median(c["proposer_us_per_step"] for c in cells),
            "target_ms": statistics.median(c["target_ms_per_step"] for c in cells)}
    return out


def _oracle_section(p, res):
    fams = list(res["per_family"])
    names = res["settings"]["names"]
    if not fams or "oracle" not in res["per_family"][fams[0]][names[0]]:
        return
    cm = res.get("cost_model", {})
    p("## Against the oracle, and the never-slower target")
    p("")
    p("The oracle drafts the true greedy continuation (plain decoding's output) and picks the "
      "best draft length of every step under this machine's c(k, n_past) (`ngramspec.cost."
      f"oracle_speedup`; cost model: {cm.get('source', '?')}): the most any drafter could "
      "gain here. Share = (× plain - 1) / (oracle - 1), CPU time, per family. min: the lowest "
      "per-prompt × plain of the family (target for auto: >= 0.97 on every prompt).")
    p("")
    p("| configuration | " + " | ".join(f"{f}: × plain | {f}: share of oracle | {f}: min"
                                        for f in fams) + " |")
    p("|---|" + "---|---|---|" * len(fams))
    p("| oracle (modeled) | " + " | ".join(
        f"{res['per_family'][f][names[0]]['oracle']:.3f} | 100% | —" for f in fams) + " |")
    for name in names:
        cells = []
        for f in fams:
            c = res["per_family"][f][name]
            share = c.get("share_of_oracle")
            cells += [f"{c['vs_plain_cpu']:.3f}", "—" if share is None else f"{share:.0%}",
                      f"{c['min_vs_plain_cpu']:.3f}"]
        p(f"| {name} | " + " | ".join(cells) + " |")
    p("")
    auto = [n for n in names if n in AUTO]
    if auto:
        worst = {n: min(res["per_family"][f][n]["min_vs_plain_cpu"] for f in fams)
                 for n in auto}
        p("Never slower (auto >= 0.97× plain on every prompt): " + ", ".join(
            f"{n}: {'yes' if w >= 0.97 else 'NO'} (worst {w:.3f})" for n, w in worst.items())
          + ".")
        fixed = [n for n in names if n in CONFIGS and n not in AUTO]
        if fixed:
            best_fixed = {f: max(res["per_family"][f][n]["vs_plain_cpu"] for n in fixed)
                          for f in fams}
            best_auto = {f: max(res["per_family"][f][n]["vs_plain_cpu"] for n in auto)
                         for f in fams}
            p("Best everywhere (an auto configuration >= the best fixed one, per family): "
              + ", ".join(f"{f}: {'yes' if best_auto[f] >= best_fixed[f] else 'NO'} "
                          f"({best_auto[f]:.3f} vs {best_fixed[f]:.3f})" for f in fams) + ".")
        p("")


def main_metric(res):
    """The ratio the targets use: CPU time with one decode thread (the thread's own CPU time
    is the generation's, whatever else runs); wall clock with more (only it compares)."""
    return "vs_plain_cpu" if int(res["settings"]["threads"]) == 1 else "vs_plain"


def targets(res):
    """Issue 16's targets on this run: rows of (target, measured, met: True/False/None).

    Every figure is a ratio to plain (`main_metric`), per family the geometric mean over the
    prompts; "auto" is each of the auto configurations where the target is about auto. `met`
    is decided on those; the measured text adds the modeled figures (``modeled_vs_plain``,
    "—" where absent) beside them."""
    key = main_metric(res)
    fams, names = list(res["per_family"]), res["settings"]["names"]
    fam = res["per_family"]
    auto = [n for n in names if n in AUTO]
    fixed = [n for n in names if n in CONFIGS and n not in AUTO]
    servers = [n for n in names if n in SERVER_CONFIGS and n != LS_PLAIN]
    rows = []
    def mod(f, n, key="modeled_vs_plain"):
        return _fmt(fam[f][n].get(key), ".3f")

    for n in auto:
        worst = min((fam[f][n]["min_" + key], f) for f in fams)
        modeled = [(fam[f][n]["min_modeled_vs_plain"], f) for f in fams
                   if "min_modeled_vs_plain" in fam[f][n]]
        note = ("{:.3f} ({})".format(*min(modeled)) if len(modeled) == len(fams) else "—")
        rows.append((f"never slower: {n} >= 0.97× plain on every prompt",
                     f"worst prompt {worst[0]:.3f} ({worst[1]}); modeled worst prompt {note}",
                     worst[0] >= 0.97))
    if auto and fixed:
        for f in fams:
            ba = max(auto, key=lambda n: fam[f][n][key])
            bf = max(fixed, key=lambda n: fam[f][n][key])
            gen = generate_config() if generate_config() in auto else ba
            rows.append((f"best everywhere, {f}: auto >= the best fixed configuration",
                         f"best auto {ba} {fam[f][ba][key]:.3f} (modeled {mod(f, ba)}), "
                         f"generate's default {gen} {fam[f][gen][key]:.3f} (modeled "
                         f"{mod(f, gen)}); best fixed {bf} {fam[f][bf][key]:.3f} (modeled "
                         f"{mod(f, bf)})", fam[f][ba][key] >= fam[f][bf][key]))
    if auto and servers and "code-edit" in fams:
        f = "code-edit"
        ba = max(auto, key=lambda n: fam[f][n][key])
        bs = max(servers, key=lambda n: fam[f][n][key])
        ratio = fam[f][ba][key] / fam[f][bs][key]
        rows.append(("ahead of llama.cpp, code-edit: auto >= 1.1× llama-server's best fixed",
                     f"{ba} {fam[f][ba][key]:.3f} / {bs} {fam[f][bs][key]:.3f} = "
                     f"{ratio:.3f}×; {ba} modeled {mod(f, ba)}× plain (llama-server: no "
                     "modeled figure)", ratio >= 1.1))
        share = fam[f][ba].get("share_of_oracle")
        if share is not None:
            # the oracle is modeled too: the live steps' modeled gain against it
            oracle, modeled = fam[f][ba].get("oracle"), fam[f][ba].get("modeled_vs_plain")
            note = (f"{(modeled - 1) / (oracle - 1):.0%}" if None not in (oracle, modeled)
                    and oracle > 1 else "—")
            rows.append(("moonshot, code-edit: auto >= 70% of the oracle's gain",
                         f"{ba} {share:.0%}; modeled {note}", share >= 0.7))
    mods = [n for n in names if n in CONFIGS and CONFIGS[n][0] == "ngram-mod"]
    if "ngram-suffix auto" in names and mods:
        for f in fams:
            bm = max(mods, key=lambda n: fam[f][n][key])
            su = fam[f]["ngram-suffix auto"][key]
            rows.append((f"ngram-suffix auto no worse than ngram-mod, {f}",
                         f"{su:.3f} vs {bm} {fam[f][bm][key]:.3f}; modeled "
                         f"{mod(f, 'ngram-suffix auto')} vs {mod(f, bm)}",
                         su >= fam[f][bm][key]))
    return rows


def _targets_section(p, res):
    rows = targets(res)
    if not rows:
        return
    p("## Targets (issue 16)")
    p("")
    p(f"Ratios to plain from {'CPU time' if main_metric(res) == 'vs_plain_cpu' else 'wall clock'}"
      ", per family the geometric mean over its prompts (never slower: the lowest single "
      "prompt); `met` is decided on them. Next to them, modeled: the same ratios of the live "
      "steps priced by the run's cost model (noise-free; — where the results predate it).")
    p("")
    p("| target | measured | met |")
    p("|---|---|---|")
    for target, figure, met in rows:
        p(f"| {target} | {figure} | {'yes' if met else '**no**'} |")
    p("")


def _limits_section(p, res):
    from ngramspec.cli.live_flags import GENERATE_DEFAULTS
    p("## What limits the speed-up")
    p("")
    p("On the code-edit prompts, per configuration: output tokens per target decode live and "
      "when replaying the trace's recorded output on the same prompts (mean over the prompts), "
      "draft tokens accepted / drafted live, and the cost per step of the proposers (µs) and of "
      "the target's decode (ms), medians. The cost of a batch of k tokens is at the end.")
    p("")
    p("| configuration | tok/step live | tok/step replay | accepted / drafted "
      "| proposer µs/step | target ms/step |")
    p("|---|---|---|---|---|---|")
    for name, s in acceptance_summary(res).items():
        p(f"| {name} | {s['live']:.2f} | {_fmt(s['replay'], '.2f')} | {s['n_acc_tokens']} / "
          f"{s['n_draft_tokens']} | {s['proposer_us']:.0f} | {s['target_ms']:.1f} |")
    p("")
    p("`ngramspec generate`'s defaults (`GENERATE_DEFAULTS`, generate only): " + ", ".join(
        f"`{k}={v}`" for k, v in GENERATE_DEFAULTS.items()) + " — the configuration "
      f"`{generate_config()}` above.")
    p("")


def render(res, notes=None):
    """The Markdown of bench/results/e2e.md; `notes` (Markdown) follows the targets table."""
    s, m = res["settings"], res["machine"]
    lines = []
    p = lines.append
    p("# End to end: live speculative generation on this 2-core CPU")
    p("")
    p(f"Generated by `{m.get('command', 'bench/e2e_report.py')}` (see its docstring for the "
      "method). Model: the embedded "
      "SmolLM2-135M-Instruct Q4_1, "
      f"{s['threads']} decode thread(s), n_ctx {s['n_ctx']}, up to {s['n_predict']} output "
      f"tokens, {s['runs']} interleaved rounds per prompt; revision `{m.get('revision', '?')}`, "
      f"llama-cpp-python {m.get('llama_cpp_python', '?')}, CPU {m.get('cpu', '?')}, load average "
      f"{' '.join(m.get('load_average', []))} at the start and "
      f"{' '.join(m.get('load_average_end', []))} at the end ({m.get('seconds', '?')} s).")
    p("")
    p("**The machine is shared** (other jobs ran on the same 2 cores). Every configuration runs "
      "once per round, rotated, so all see the same load; figures are medians over the rounds "
      "and each ratio is the median of per-round ratios on the same prompt; per family, the "
      "geometric mean over its prompts. With one decode thread llama.cpp computes on the "
      "calling thread, so the main figures are **tokens per CPU-second** of that thread "
      "(`time.thread_time()`), which time slices lost to other processes do not inflate; the "
      "wall-clock figures are given next to them. Outputs: `= plain` is token-identical to "
      "plain greedy decoding; `tie within noise` means the first difference is a top-2 "
      "tie closer than the float noise between llama.cpp's batched and one-token kernels "
      "(`ngramspec.llama.live.divergence_report`), as greedy verification of a batch allows; "
      "`3-way tie within noise`: both chosen tokens lie within that noise of the best logit, "
      "with a third candidate between them (outside `divergence_report`'s top-2 criterion).")
    p("")
    if int(s["threads"]) > 1:
        p(f"**{s['threads']} decode threads**: the CPU-time columns count the calling thread "
          "only (ngramspec, llama-cpp-python) or the whole server process (llama-server), so "
          "they do not compare; the wall-clock columns do, and the targets use them. On a "
          "shared 2-core machine they carry the load of the other jobs.")
        p("")
    _targets_section(p, res)
    if notes:
        p(notes.strip())
        p("")
    _family_section(p, res)
    _oracle_section(p, res)
    _limits_section(p, res)
    _prompt_section(p, res)
    _batch_section(p, res.get("batch"))
    return "\n".join(lines) + "\n"


def _family_section(p, res) -> None:
    names = res["settings"]["names"]
    p("## Speed-up over plain greedy decoding, per family")
    p("")
    fams = list(res["per_family"])
    p("× plain (modeled): the live steps priced by the run's cost model (`modeled_cost`), "
      "free of the machine's noise; — where a configuration is not ngramspec's or the results "
      "file predates it.")
    p("")
    p("| configuration | " + " | ".join(
        f"{f}: × plain | {f}: × plain (wall) | {f}: × plain (modeled) "
        f"| {f}: × llama-cpp-python plain" for f in fams) + " | outputs |")
    p("|---|" + "---|---|---|---|" * len(fams) + "---|")
    for name in names:
        cells = []
        for f in fams:
            c = res["per_family"][f][name]
            cells += [f"{c['vs_plain_cpu']:.3f}", f"{c['vs_plain']:.3f}",
                      _fmt(c.get("modeled_vs_plain"), ".3f"), f"{c['vs_lcp_plain_cpu']:.3f}"]
        found = {_match(r["configs"][name]) for r in res["per_prompt"]}
        outputs = ("= plain" if found == {"= plain"} else "DIFFERS" if "DIFFERS" in found else
                   "= plain or a tie within noise" + (" (one 3-way)" if "3-way tie within noise"
                                                      in found else ""))
        p(f"| {name} | " + " | ".join(cells) + f" | {outputs} |")
    p("")


def _prompt_section(p, res) -> None:
    names = res["settings"]["names"]
    p("## Per prompt")
    p("")
    p("Tokens per CPU-second and tokens/s (wall), medians; × plain: the median of the per-round "
      "ratios. modeled × plain: output tokens per single-token decode the live steps cost under "
      "the run's cost model (plain: 1), with the rounds' range where their steps differed. "
      "tok/step: output tokens per target decode, live, and when replaying the trace's "
      "recorded output (a model that copies the file as the recording does). mean batch: tokens "
      "per target decode (1 + draft). Timings of ngramspec's configurations are medians; the "
      "counts are the first round's (every round gives the same tokens).")
    p("")
    for row in res["per_prompt"]:
        p(f"### {row['id']} ({row['family']}, prompt {row['n_prompt']} tokens)")
        p("")
        if row["family"] == "code-edit":
            p(f"The model's greedy output follows the recorded new file for its first "
              f"{row['copied_from_trace']} tokens; match4 (the share of output tokens a 4-gram "
              f"lookup of the text so far predicts) is {row['match4_live']:.2f} for the live "
              f"output and {row['match4_recorded']:.2f} for the recorded one, cut to the same "
              f"length.")
            p("")
        p("| configuration | tokens per CPU-s | × plain | tokens/s (wall) | × plain (wall) "
          "| modeled × plain | outputs | tok/step live | tok/step replay | accepted / drafted "
          "| mean batch | target ms/step | proposer µs/step |")
        p("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name in names:
            p(_prompt_row(name, row["configs"][name], row.get("replay", {}).get(name)))
        p("")


def _batch_section(p, b) -> None:
    """The cost of verifying k tokens versus one, when the run measured it."""
    if b:
        p("## Cost of verifying k tokens versus one")
        p("")
        p(f"One target decode of k tokens with all logits (plus the argmax), KV cache holding "
          f"{b['position']} tokens, median of {b['reps']} interleaved rounds; c(k) = t(k) / t(1).")
        p("")
        threads = list(b["ms"])
        ks = list(next(iter(b["ms"].values())))
        p("| k | " + " | ".join(f"{t} thread(s): ms | c(k) | k / c(k)" for t in threads) + " |")
        p("|---|" + "---|---|---|" * len(threads))
        for k in ks:
            cells = []
            for t in threads:
                ms = b["ms"][t]
                c = ms[k] / ms[ks[0]]
                cells += [f"{ms[k]:.1f}", f"{c:.2f}", f"{float(k) / c:.2f}"]
            p(f"| {k} | " + " | ".join(cells) + " |")
        p("")
        cpu = b.get("cpu_ms_1_thread")
        if cpu:
            p("")
            p("The same, 1 thread, CPU time of the decoding thread: " + ", ".join(
                f"k = {k}: {cpu[k]:.1f} ms (c = {cpu[k] / cpu[ks[0]]:.2f})" for k in ks) + ".")
            up, n = b["ceiling_cpu_1_thread"]
            p(f"Ceiling from CPU time: **{up:.2f}×** (at k = {n}).")
            p("")
        for t in threads:
            up, n = b["ceiling"][t]
            p(f"- {t} thread(s), wall clock: ceiling **{up:.2f}×** (at k = {n}), reached only "
              f"if every drafted token were accepted.")
        p("")

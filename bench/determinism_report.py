"""Which decode paths change one sequence's logits bit-wise on this CPU build (issue 38).

    python bench determinism [--threads 1] [--prompt-tokens 300] [--n-check 12]
                             [--json bench/results/determinism.json]
                             [--md bench/results/determinism.md]

One fixed token sequence of the embedded SmolLM2-135M (the README's code-edit example: a prompt
of ``--prompt-tokens`` tokens, then ``--n-check`` more) is decoded along every path a serving
engine may take, through llama-cpp-python's low-level API only (``llama_init_from_model``,
``llama_decode``, ``llama_memory_seq_rm``); the logits each path gives at the last
``--n-check`` positions are compared bit for bit with two references:

* ``plain``: the prompt in one batch, then one token per ``llama_decode`` (llama-server's and
  ``generate``'s plain greedy decoding);
* ``padded``: the same, but every decode holds at least two tokens and asks for at least two
  rows of logits (a single step decodes ``[token, pad]`` and drops the pad's cell): the
  reference of ngramspec's deterministic mode (`ngramspec.llama.deterministic`).

Each path runs with flash attention off and on (llama.cpp's ``flash_attn_type``; its default,
"auto", turns it on for the CPU). Prompts of about 300 tokens put the KV cache past 256 cells,
where llama.cpp pads ``n_kv`` to 512 and the CPU flash-attention kernel of a one-token decode
switches to its split-KV path. Weight repacking (extra buffer types) is off in every load: on
AMX hosts its kernel crashes on multi-token batches (issue 14), and the embedded Q4_1 model has no
tensor the AVX2 repacking takes.

A path equal to ``padded`` everywhere with flash attention off is one the deterministic mode can
use; a path that differs names a source of the noise.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Callable, Dict, List

import numpy as np

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
from ngramspec.llama import load_model
from ngramspec.llama.batch import MultiSeqBatch
from ngramspec.llama.decoder import context_params
from ngramspec.llama.repack import host_has_amx

ROOT = benchlib.ROOT
EXAMPLE = ROOT / "ngramspec" / "examples" / "code_edit_prompt.txt"
N_BATCH = 512        # prompt chunk of the plain path (llama-server's default n_batch)
CAPACITY = 1024      # tokens of one decode (two sequences' prompts), one ubatch


class Ctx:
    """One llama context on the shared weights, decoding runs of (seq, tokens, pos0, outputs)."""

    def __init__(self, llm, *, n_seq: int = 1, threads: int = 1, unified: bool = False,
                 flash: bool = False, n_ctx_seq: int = 1024, n_ubatch: int = CAPACITY):
        import llama_cpp as lc
        self.lc = lc
        cp = context_params(n_ctx=n_ctx_seq * n_seq, n_batch=CAPACITY, n_seq_max=n_seq,
                            n_threads=threads, unified=unified, flash_attn=flash)
        cp.n_ubatch = n_ubatch
        self.ctx = lc.llama_init_from_model(llm.model, cp)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = MultiSeqBatch(CAPACITY)

    def decode(self, runs) -> List[np.ndarray]:
        """Decode the runs in one ``llama_decode``; each run's output rows (copies)."""
        b = self.batch
        b.clear()
        spans = []
        for seq, toks, pos0, outputs in runs:
            i = b.add(seq, np.asarray(toks, np.int32), pos0,
                      "all" if outputs == "all" else "none")
            if isinstance(outputs, int):   # the last `outputs` tokens
                b.logits[i + len(toks) - outputs:i + len(toks)] = 1
            spans.append((i, i + len(toks)))
        rows = b.decode(self.ctx)
        row_of = np.cumsum(b.logits[:b.n]) - 1
        out = []
        for lo, hi in spans:
            sel = [int(row_of[j]) for j in range(lo, hi) if b.logits[j]]
            out.append(np.array(rows[sel]) if sel else np.empty((0, 0), np.float32))
        return out

    def rm(self, seq: int, p0: int) -> None:
        self.lc.llama_memory_seq_rm(self.mem, seq, p0, -1)

    def close(self) -> None:
        self.lc.llama_free(self.ctx)


# -- the paths: each returns the logits rows at positions P-1 .. N-2 (predicting P .. N-1) -------

def _prompt(c: Ctx, S, P: int, seq: int = 0, padded: bool = False, chunk: int = N_BATCH,
            other=None):
    """The prompt S[:P] in chunks of ``chunk``; returns the row at P-1. ``other``: a second
    sequence's tokens decoded beside it in the same batches (seq 1-seq)."""
    row = None
    for lo in range(0, P, chunk):
        hi = min(P, lo + chunk)
        last = hi == P
        runs = [(seq, S[lo:hi], lo, (2 if padded and hi - lo >= 2 else 1) if last else "none")]
        if other is not None:
            runs.append((1 - seq, other[lo:hi], lo, "none"))
        out = c.decode(runs)[0]
        if last:
            row = out[-1]
    return row


def path_plain(c: Ctx, S, P: int, padded: bool = False, prompt_chunk: int = N_BATCH,
               seq: int = 0, other=None):
    rows = [_prompt(c, S, P, seq, padded, prompt_chunk, other)]
    for q in range(P, len(S) - 1):
        if padded:
            runs = [(seq, [S[q], S[q]], q, "all")]
            if other is not None:
                runs.append((1 - seq, [other[q], other[q]], q, "all"))
            rows.append(c.decode(runs)[0][0])
            c.rm(seq, q + 1)
            if other is not None:
                c.rm(1 - seq, q + 1)
        else:
            runs = [(seq, [S[q]], q, "all")]
            if other is not None:
                runs.append((1 - seq, [other[q]], q, "all"))
            rows.append(c.decode(runs)[0][0])
    return np.stack(rows)


def path_verify(c: Ctx, S, P: int, k: int, padded_prompt: bool = True):
    """The continuation in verification batches of ``k`` tokens (logits at each)."""
    rows = [_prompt(c, S, P, padded=padded_prompt)]
    q = P
    while q < len(S) - 1:
        hi = min(len(S) - 1, q + k)
        toks = S[q:hi] if hi - q >= 2 else [S[q], S[q]]
        out = c.decode([(0, toks, q, "all")])[0]
        rows.extend(out[:hi - q])
        if hi - q < 2:
            c.rm(0, q + 1)
        q = hi
    return np.stack(rows)


def path_cache_reuse(c: Ctx, S, P: int, lcp: int):
    """An earlier request sharing ``lcp`` tokens left its KV in the sequence; the new request
    keeps that prefix (prompt-cache reuse) and decodes the rest of its prompt, then pads."""
    other = np.concatenate([S[:lcp], S[::-1][:P - lcp]])
    _prompt(c, other, P, padded=True)
    c.rm(0, lcp)
    rows = []
    hi = P
    out = c.decode([(0, S[lcp:hi], lcp, 2)])[0]
    rows.append(out[-1])
    for q in range(P, len(S) - 1):
        rows.append(c.decode([(0, [S[q], S[q]], q, "all")])[0][0])
        c.rm(0, q + 1)
    return np.stack(rows)


PATHS: Dict[str, tuple] = {
    # name: (what it changes, context keywords, function)
    "plain": ("reference: prompt in one batch, one token per decode", {},
              lambda c, S, P: path_plain(c, S, P)),
    "padded": ("reference of the mode: every decode >= 2 tokens and >= 2 logits rows", {},
               lambda c, S, P: path_plain(c, S, P, padded=True)),
    "verify-4": ("continuation in 4-token verification batches", {},
                 lambda c, S, P: path_verify(c, S, P, 4)),
    "verify-9": ("continuation in 9-token verification batches", {},
                 lambda c, S, P: path_verify(c, S, P, 9)),
    "prompt-chunks-7": ("prompt in 7-token chunks (a scheduler step's leftover), padded",
                        {}, lambda c, S, P: path_plain(c, S, P, True, 7)),
    "prompt-chunks-64": ("prompt in 64-token chunks, padded", {},
                         lambda c, S, P: path_plain(c, S, P, True, 64)),
    "ubatch-32": ("n_ubatch 32 (llama.cpp splits each batch), padded", {"n_ubatch": 32},
                  lambda c, S, P: path_plain(c, S, P, padded=True)),
    "threads-2": ("2 threads instead of 1, padded", {"threads": 2},
                  lambda c, S, P: path_plain(c, S, P, padded=True)),
    "cache-reuse": ("prompt-cache reuse: 100 tokens kept from an earlier request, padded", {},
                    lambda c, S, P: path_cache_reuse(c, S, P, 100)),
    "seq1-alone": ("sequence 1 of a 2-sequence context, alone in its batches, padded",
                   {"n_seq": 2}, lambda c, S, P: path_plain(c, S, P, True, seq=1)),
    "unified-2seq": ("beside another sequence in one unified KV cache, padded",
                     {"n_seq": 2, "unified": True},
                     lambda c, S, P: path_plain(c, S, P, True, seq=1, other=S[::-1].copy())),
    "streams-2seq": ("beside another sequence, per-sequence KV streams, padded",
                     {"n_seq": 2, "unified": False},
                     lambda c, S, P: path_plain(c, S, P, True, seq=1, other=S[::-1].copy())),
}


def _compare(a: np.ndarray, b: np.ndarray) -> dict:
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"identical": bool(np.array_equal(a, b)),
            "rows_differing": int(np.count_nonzero(diff.max(axis=1) > 0)),
            "max_abs": float(diff.max()),
            "argmax_changes": int(np.count_nonzero(a.argmax(1) != b.argmax(1)))}


def measure(llm, S, P: int, threads: int, paths=PATHS, log: Callable = print) -> dict:
    out = {}
    for flash in (False, True):
        logits = {}
        for name, (_, kw, fn) in paths.items():
            kw = dict(kw)
            kw.setdefault("threads", threads)
            c = Ctx(llm, flash=flash, **kw)
            try:
                t0 = time.perf_counter()
                logits[name] = fn(c, S, P)
                log(f"flash={'on' if flash else 'off'} {name}: {time.perf_counter() - t0:.1f} s")
            finally:
                c.close()
        out["on" if flash else "off"] = {
            name: {"vs_plain": _compare(v, logits["plain"]),
                   "vs_padded": _compare(v, logits["padded"])} for name, v in logits.items()}
    return out


# -- part 2: what the mode costs --------------------------------------------------------------

COST_PROMPTS = [("code-edit", None),
                ("Write a Python function that adds two numbers, with a docstring.", True),
                ("List the planets of the solar system, one per line.", True),
                ("Repeat after me: " + " ".join(["The quick brown fox jumps over the lazy dog."]
                                                * 6), True)]
COST_CONFIGS = [(det, slots, spec) for slots in (1, 4) for spec in ("plain", "spec")
                for det in (False, True)]


def cost_prompts(llm):
    from ngramspec.llama import tokenize_prompt
    out = []
    for text, chat in COST_PROMPTS:
        if chat is None:
            text, chat = EXAMPLE.read_text(encoding="utf-8"), True
        out.append(tokenize_prompt(llm, text, chat=chat))
    return out


def cost_run(llm, prompts, det: bool, slots: int, spec: str, n_predict: int,
             threads: int) -> dict:
    """The prompts submitted at once to a scheduler of ``slots`` slots; aggregate tokens/s by
    wall clock and per CPU second of the decode thread (llama.cpp computes on it with one
    thread, so other processes on the machine do not inflate it); the greedy outputs."""
    from ngramspec.config import SpecConfig
    from ngramspec.llama import Scheduler
    from ngramspec.request_params import SamplingParams, SpeculationParams
    sampling = SamplingParams(temperature=0.0, max_tokens=n_predict)
    s = Scheduler(llm, SpecConfig.from_keywords("ngram-mod,ngram-simple"), n_slots=slots,
                  n_ctx=slots * 2048, n_batch=N_BATCH, n_threads=threads, deterministic=det,
                  queue_size=64)
    try:
        s.start()
        t0 = time.perf_counter()
        hs = [s.submit(p, sampling, SpeculationParams(enabled=spec == "spec")) for p in prompts]
        outs = [h.result(timeout=3600).tokens for h in hs]
        wall = time.perf_counter() - t0
        st = s.stats()
    finally:
        s.stop(cancel=True, timeout=600)
    n = sum(len(o) for o in outs)
    return {"tokens": n, "wall_s": wall, "cpu_s": st["t_steps_cpu_s"], "tok_s": n / wall,
            "tok_cpu_s": n / st["t_steps_cpu_s"], "decode_calls": st["decode_calls"],
            "outputs": outs}


def measure_cost(llm, threads: int, rounds: int, n_predict: int, log: Callable = print) -> dict:
    """Every configuration once per round, in an order rotated from round to round; ratios of
    the mode to the default within a round, then the median."""
    prompts = cost_prompts(llm)
    runs: Dict[str, list] = {}
    for r in range(rounds):
        order = COST_CONFIGS[r % len(COST_CONFIGS):] + COST_CONFIGS[:r % len(COST_CONFIGS)]
        got = {}
        for det, slots, spec in order:
            key = f"{'det' if det else 'default'}/{slots}/{spec}"
            got[key] = cost_run(llm, prompts, det, slots, spec, n_predict, threads)
            log(f"round {r + 1} {key}: {got[key]['tok_cpu_s']:.1f} tok/CPU-s, "
                f"{got[key]['tok_s']:.1f} tok/s")
        for k, v in got.items():
            runs.setdefault(k, []).append(v)
    table = []
    for slots in (1, 4):
        for spec in ("plain", "spec"):
            d, m = runs[f"default/{slots}/{spec}"], runs[f"det/{slots}/{spec}"]
            table.append({
                "slots": slots, "spec": spec,
                "default_tok_cpu_s": statistics.median(x["tok_cpu_s"] for x in d),
                "det_tok_cpu_s": statistics.median(x["tok_cpu_s"] for x in m),
                "ratio_cpu": statistics.median(b["tok_cpu_s"] / a["tok_cpu_s"]
                                               for a, b in zip(d, m)),
                "ratio_wall": statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(d, m)),
                "det_same_text_every_run": all(x["outputs"] == m[0]["outputs"] for x in m)
                and all(runs[f"det/{s2}/{sp2}"][0]["outputs"] == m[0]["outputs"]
                        for s2 in (1, 4) for sp2 in ("plain", "spec")),
                "default_same_text_every_run": all(x["outputs"] == d[0]["outputs"] for x in d)
                and all(runs[f"default/{s2}/{sp2}"][0]["outputs"] == d[0]["outputs"]
                        for s2 in (1, 4) for sp2 in ("plain", "spec"))})
    for v in runs.values():
        for x in v:
            x.pop("outputs")
    return {"table": table, "runs": runs}


def cost_markdown(cost: dict, n_prompts: int, n_predict: int, rounds: int) -> str:
    lines = ["", "## What the mode costs", "",
             f"{n_prompts} greedy chat requests submitted at once ({n_predict} tokens each; the "
             "README's code-edit example among them), ngram-mod,ngram-simple when speculative. "
             f"{rounds} interleaved rounds; ratios taken within a round, then the median. "
             "Tokens per CPU-second of the decode thread (llama.cpp computes on it with one "
             "thread, so the machine's other load does not inflate it) and by wall clock. "
             "'same text': every run of the row's mode, at 1 and 4 slots, plain and "
             "speculative, gave the same text for every request.", "",
             "| slots | decoding | default tok/CPU-s | deterministic tok/CPU-s | ratio (CPU) | "
             "ratio (wall) | same text: default | same text: deterministic |",
             "|---|---|---|---|---|---|---|---|"]
    for t in cost["table"]:
        lines.append(f"| {t['slots']} | {t['spec']} | {t['default_tok_cpu_s']:.1f} | "
                     f"{t['det_tok_cpu_s']:.1f} | {t['ratio_cpu']:.2f}x | "
                     f"{t['ratio_wall']:.2f}x | {t['default_same_text_every_run']} | "
                     f"{t['det_same_text_every_run']} |")
    return "\n".join(lines) + "\n"


def _cell(d: dict) -> str:
    if d["identical"]:
        return "identical"
    return (f"{d['rows_differing']} rows, max {d['max_abs']:.2g}"
            + (f", {d['argmax_changes']} argmax" if d["argmax_changes"] else ""))


def markdown(res: dict, meta: dict, cmd: str) -> str:
    lines = ["# Bit-wise reproducibility of one sequence's logits (issue 38)", "",
             f"`{cmd}` — {meta['cpu']}, {meta['threads']} thread(s), load {meta['load']}, "
             f"llama-cpp-python {meta['llama_cpp']}, embedded SmolLM2-135M Q4_1, repack off, "
             f"prompt {meta['P']} tokens, logits compared at the last {meta['n_check']} "
             "positions.", "",
             "Each cell: identical bit for bit, or how many of the compared rows differ, the "
             "largest logit difference and how many argmax tokens change.", "",
             "| path | what changes | FA off vs plain | FA off vs padded | FA on vs plain | "
             "FA on vs padded |", "|---|---|---|---|---|---|"]
    for name, (what, _, _) in PATHS.items():
        off, on = res["off"][name], res["on"][name]
        lines.append(f"| {name} | {what} | {_cell(off['vs_plain'])} | {_cell(off['vs_padded'])}"
                     f" | {_cell(on['vs_plain'])} | {_cell(on['vs_padded'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--n-check", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the cost part (0: skip)")
    ap.add_argument("--n-predict", type=int, default=64, help="tokens per request (cost part)")
    ap.add_argument("--json", default=benchlib.result_path("determinism.json"))
    ap.add_argument("--md", default=benchlib.result_path("determinism.md"))
    args = ap.parse_args(argv)
    llm = load_model(n_ctx=64, n_batch=64, n_threads=args.threads, repack="off")
    text = EXAMPLE.read_text(encoding="utf-8")
    S = np.asarray(llm.tokenize(text.encode(), add_bos=True), np.int32)
    while S.size < args.prompt_tokens + args.n_check:
        S = np.concatenate([S, S])
    P = args.prompt_tokens
    S = S[:P + args.n_check]
    res = measure(llm, S, P, args.threads)
    cost = measure_cost(llm, args.threads, args.rounds, args.n_predict) if args.rounds else None
    import llama_cpp
    import os
    meta = {"cpu": benchlib.machine(with_cpp=False).get("Model name", "?"),
            "threads": args.threads,
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg()), "amx": host_has_amx(),
            "llama_cpp": llama_cpp.__version__, "P": P, "n_check": args.n_check}
    cmd = benchlib.command_line("determinism", argv)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump({"command": cmd, "meta": meta, "results": res, "cost": cost}, fh, indent=1)
    md = markdown(res, meta, cmd)
    if cost is not None:
        md += cost_markdown(cost, len(COST_PROMPTS), args.n_predict, args.rounds)
    with open(args.md, "w", encoding="utf-8") as fh:
        fh.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

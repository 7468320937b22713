"""``ngramspec generate``: live greedy speculative generation on a GGUF model (llama-cpp-python)."""
from __future__ import annotations

import json
import os
import sys

from ngramspec import cost, registry
from ngramspec.cli.common import (add_context_flags, add_model_flags, add_policy_flags,
                                  add_repack_flag, add_spec_flags, check_spec_flags,
                                  check_writable, engine_params, int_arg, load_cache_files)
from ngramspec.engine import SpecEngine
from ngramspec.llama import calibration
from ngramspec.llama.decoder import check_engine_models
from ngramspec.llama.draft_model import check_draft_model_file
from ngramspec.llama.divergence import divergence_report
from ngramspec.llama.live import generate_plain, generate_speculative
from ngramspec.llama.model import load_model
from ngramspec.llama.tokenizer import tokenize_prompt
from ngramspec.tokens import token_array

# generate's own defaults, chosen from bench/results/e2e-fixed.md: on a CPU, verifying a batch of k
# tokens costs c(k) single-token decodes with c(2) = 2.1, c(32) = 18 (1.5k tokens of context, one
# thread), so a rejected draft is expensive: llama.cpp's 64-token drafts (tuned for GPUs) lose
# where the small model leaves its input, 16-token ones leave speed where it copies; 8..32 did best
# on both. replay and the engine keep llama.cpp's.
GENERATE_DEFAULTS = {"ngram_mod_n_min": 8, "ngram_mod_n_max": 32}


def add_parser(subparsers):
    p = subparsers.add_parser(
        "generate", help="generate text with speculative decoding on a GGUF model",
        description="Greedy generation on a GGUF model through llama-cpp-python, with drafts from "
                    "the proposer chain verified in one batch per step (llama-server's loop). The "
                    "output is plain greedy decoding's, except where the best candidates tie "
                    "within float noise; --compare measures the speed-up and explains any "
                    "difference. Defaults of generate only (on a CPU, verifying long drafts costs "
                    "almost as much as decoding them one by one): "
                    + ", ".join(f"--spec-{k.replace('_', '-')} {v}"
                                for k, v in GENERATE_DEFAULTS.items())
                    + "; replay keeps llama.cpp's.")
    add_model_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", metavar="TEXT", help="prompt text (special tokens parsed)")
    src.add_argument("-f", "--prompt-file", metavar="FILE", help="read the prompt text from FILE")
    src.add_argument("--prompt-tokens", metavar="FILE",
                     help="JSON list of token ids, used as-is (or '-' for stdin)")
    p.add_argument("--chat", action="store_true",
                   help="render the text prompt as one user message with the model's chat template")
    p.add_argument("-n", "--n-predict", type=int_arg(-1), default=256, metavar="N",
                   help="maximum output tokens, -1 = until EOS or a full context (default 256)")
    add_context_flags(p, ctx_help="context size in tokens (default %(default)s); bounds drafts "
                                  "as n_ctx - L - 2")
    p.add_argument("--compare", action="store_true",
                   help="also run plain greedy decoding; report both speeds, the speed-up and "
                        "whether the outputs match")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_repack_flag(p)
    add_spec_flags(p, include_live=True)
    add_policy_flags(p, default="auto")
    state_generate_defaults(p)
    p.set_defaults(run=run)
    return p


def state_generate_defaults(parser):
    """Show GENERATE_DEFAULTS instead of llama.cpp's defaults in the flags' help."""
    for action in parser._actions:
        if action.dest in GENERATE_DEFAULTS and action.help:
            head, _, rest = action.help.rpartition("(default ")
            rng = rest.partition(",")[2].rstrip(")")
            action.help = (f"{head}(default {GENERATE_DEFAULTS[action.dest]} for generate, "
                           f"llama.cpp's {rest.partition(',')[0].rstrip(')')};{rng})")


def generate_params(args) -> dict:
    """Engine keywords of the flags given, GENERATE_DEFAULTS filling the others.

    One of --spec-ngram-mod-n-min / -n-max given alone moves the other default along
    (n_min <= n_max), so the flag never silently turns ngram-mod's drafting off.
    """
    given = engine_params(args)
    params = {**GENERATE_DEFAULTS, **given}
    lo, hi = "ngram_mod_n_min", "ngram_mod_n_max"
    if hi in given and lo not in given:
        params[lo] = min(params[lo], params[hi])
    elif lo in given and hi not in given:
        params[hi] = max(params[hi], params[lo])
    check_spec_flags(args.spec_type, params)
    return params


def _read_text(flag, path):
    """A UTF-8 text file (a leading byte-order mark is dropped); errors name ``flag``."""
    if path == "-":
        text = sys.stdin.read()
        return text[1:] if text.startswith("\ufeff") else text
    try:
        with open(path, encoding="utf-8-sig") as fh:
            return fh.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{flag} {path}: is a directory") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise OSError(f"{flag} {path}: {exc.strerror or exc}") from None


def _read_prompt_tokens(path):
    text = _read_text("--prompt-tokens", path)
    try:
        toks = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--prompt-tokens {path}: not JSON: {exc.msg} (line {exc.lineno})") \
            from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more than 4300 digits
        msg = " ".join(str(exc).split()[:12])
        raise ValueError(f"--prompt-tokens {path}: unreadable JSON ({msg})") from None
    if isinstance(toks, dict) and "prompt" in toks:  # a trace record
        toks = toks["prompt"]
    if not isinstance(toks, list):
        raise ValueError(f"--prompt-tokens {path}: expected a JSON list of integer token ids")
    # the ids below the model's vocabulary size are checked once it is loaded
    return token_array(toks, f"--prompt-tokens {path}", non_empty=True)


def spec_types(args):
    types = registry.parse_types(args.spec_type)
    if args.model_draft and "draft-simple" not in types:
        types = registry.parse_types(types + ["draft-simple"])
    if "draft-simple" in types and not args.model_draft:
        raise ValueError("spec type draft-simple needs --model-draft")
    return types


def _build_engine(llm, types, params, args):
    if "draft-simple" in types:
        # another vocabulary is refused before any weights or caches are set up
        check_draft_model_file(llm, args.model_draft, args.repack)
        # the draft model gets the target's context size, batch size and threads
        params = dict(params, model_draft=args.model_draft, ctx_size_draft=args.ctx_size,
                      batch_size_draft=args.batch_size, threads_draft=args.threads,
                      repack_draft=args.repack)
    return SpecEngine.from_proposers(registry.build_proposers(types, 1, None, params), n_slots=1)


def _execute(args):
    if args.chat and args.prompt_tokens:
        raise ValueError("--chat applies to a text prompt, not to --prompt-tokens")
    # Flags first, then files: a bad flag is reported as such, whatever the files hold.
    check_spec_flags(args.spec_type, generate_params(args))
    spec_types(args)
    if args.lookup_cache_dynamic is not None:
        # It is written after the generation: find out now, not after minutes of decoding.
        check_writable("--lookup-cache-dynamic", args.lookup_cache_dynamic)
    # Cache files are loaded before the model (a bad file fails fast); one adds ngram-cache.
    args.spec_type, params = load_cache_files(args.spec_type, generate_params(args))
    types = spec_types(args)
    if args.model is not None and not os.path.isfile(args.model):
        raise ValueError(f"model file not found: {args.model}")
    if args.model_draft is not None and not os.path.isfile(args.model_draft):
        raise ValueError(f"draft model file not found: {args.model_draft}")
    # Inputs are read before the model load, so that a bad file fails fast.
    prompt_ids, text = None, args.prompt
    if args.prompt_tokens:
        prompt_ids = _read_prompt_tokens(args.prompt_tokens)
    elif args.prompt_file is not None:
        text = _read_text("--prompt-file", args.prompt_file)
    cost_model = None
    if args.cost_model is not None:
        cost_model = cost.load_cost_model(args.cost_model)
    llm = load_model(args.model, n_ctx=args.ctx_size, n_batch=args.batch_size,
                     n_threads=args.threads, repack=args.repack)
    prompt = prompt_ids if prompt_ids is not None else tokenize_prompt(llm, text, chat=args.chat)
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")

    engine = None
    if types:
        engine = _build_engine(llm, types, params, args)
        check_engine_models(llm, engine)    # before seconds of calibration: fail fast

    policy = None
    if engine is not None and args.spec_policy == "auto":
        policy = _auto_policy(llm, cost_model, quiet=args.json)

    spec = generate_speculative(llm, prompt, engine, n_predict=args.n_predict,
                                update_dynamic_cache=args.lookup_cache_dynamic, policy=policy)
    res = spec.to_dict()
    if args.lookup_cache_dynamic is not None:
        res["dynamic_cache_ngrams"] = spec.dynamic_cache_ngrams
    res["spec_type"] = ",".join(types) if types else "none"
    res["spec_policy"] = args.spec_policy
    if policy is not None:
        res["policy"] = policy.summary()
    res["stats_lines"] = spec.stats_lines
    plain = None
    if args.compare:
        plain = generate_plain(llm, prompt, n_predict=args.n_predict)
        match = plain.output_tokens == spec.output_tokens
        res.update({
            "plain_output_tokens": plain.output_tokens,
            "plain_tokens_per_s": plain.tokens_per_s,
            # None (n/a) when a run produced no timed tokens (-n 0, or EOS at once).
            "speedup": (spec.tokens_per_s / plain.tokens_per_s
                        if plain.tokens_per_s and spec.tokens_per_s else None),
            "outputs_match": match,
        })
        if not match:
            rep = divergence_report(llm, prompt, spec.output_tokens, plain.output_tokens)
            res["divergence"] = None if rep is None else rep.to_dict()
    return res, spec, plain


def _auto_policy(llm, cost_model, quiet):
    """AutoPolicy on `cost_model`, or on the loaded model's cached calibration (measured here at
    first use: a few seconds, said on stderr)."""
    if cost_model is None and not quiet and not cost.cache_path(calibration.key_for(llm)).exists():
        sys.stderr.write("calibrating the verify cost of this model (first use; "
                         "`ngramspec calibrate` shows it)...\n")
    return calibration.auto_policy(llm, cost_model)


def _print_text(res, spec, plain):
    out = sys.stdout
    out.write(res["text"])
    out.write("\n\n")
    t = res["timings"]
    lines = [
        f"spec-type {res['spec_type']}: prompt {res['n_prompt']} tokens, "
        f"output {res['n_output']} tokens (stop: {res['stop_reason']})",
        f"speculative: {t['tokens_per_s']:8.2f} tokens/s  "
        f"({res['n_target_decodes']} target decodes, {res['n_accepted']}/{res['n_drafted']} "
        f"draft tokens accepted)",
        f"  time split: target {t['target_s'] * 1e3:.1f} ms, draft model "
        f"{t['draft_model_s'] * 1e3:.1f} ms, proposers {t['proposers_s'] * 1e3:.1f} ms, "
        f"other {t['other_s'] * 1e3:.1f} ms; prompt pass {t['prompt_s'] * 1e3:.1f} ms",
    ]
    if plain is not None:
        lines.append(f"plain:       {res['plain_tokens_per_s']:8.2f} tokens/s")
        speedup = (f"{res['speedup']:8.2f}x" if res["speedup"] is not None
                   else "     n/a (nothing decoded after the prompt)")
        lines.append(f"speed-up:    {speedup}   outputs match: "
                     f"{'yes' if res['outputs_match'] else 'NO'}")
        div = res.get("divergence")
        if div:
            lines.append(f"  first difference at output token {div['index']}: logit gap "
                         f"{div['gap']:.4f}, float noise across decode paths {div['noise']:.4f} "
                         f"({'within' if div['within_float_noise'] else 'NOT within'} float noise)")
    if "policy" in res:
        pol = res["policy"]
        lines.append(f"policy auto (cost model {pol['cost_model']}): {pol['drafts']} drafts, "
                     f"{pol['verified']} verified, {pol['truncated']} shortened, "
                     f"{pol['plain']} plain steps, {pol['probes']} probes")
    lines.extend(res["stats_lines"])
    if "dynamic_cache_ngrams" in res:
        lines.append(f"dynamic cache: {res['dynamic_cache_ngrams']} n-grams saved")
    out.write("\n".join(lines) + "\n")


def run(args) -> int:
    res, spec, plain = _execute(args)
    if args.json:
        sys.stdout.write(json.dumps(res) + "\n")
    else:
        _print_text(res, spec, plain)
    return 0

"""``ngramspec generate``: live greedy speculative generation on a GGUF model (llama-cpp-python)."""
from __future__ import annotations

import json
import sys

from ngramspec import cost, registry
from ngramspec.cli.common import (CtrlC, add_context_flags, add_deterministic_flag,
                                  add_model_flags, add_repack_flag, amend_help,
                                  check_model_file, check_writable, int_arg)
from ngramspec.cli.live_flags import profile_defaults_text, spec_types
from ngramspec.config import (SpecConfig, add_policy_arguments, add_spec_arguments,
                              load_cache_files)
from ngramspec.engine import SpecEngine
from ngramspec.files import read_limited
from ngramspec.llama import calibration
from ngramspec.llama.draft_model import check_draft_model_file
from ngramspec.llama.divergence import divergence_report
from ngramspec.llama.live import GenerationInterrupted, LiveTarget, generate_plain
from ngramspec.llama.model import load_model
from ngramspec.llama.text import text_stream
from ngramspec.llama.tokenizer import tokenize_prompt
from ngramspec.tokens import token_array

#: Largest prompt file (-f, --prompt-tokens, or stdin): far above any context's worth of text
#: (a token stands for a few bytes), so that /dev/zero on stdin or a wrong file fails at once.
PROMPT_FILE_MAX = 64 << 20


def add_parser(subparsers):
    p = subparsers.add_parser(
        "generate", help="generate text with speculative decoding on a GGUF model",
        description="Greedy generation on a GGUF model through llama-cpp-python, with drafts from "
                    "the proposer chain verified in one batch per step (llama-server's loop). The "
                    "output is plain greedy decoding's, except where the best candidates tie "
                    "within float noise; --compare measures the speed-up and explains any "
                    "difference. The text streams to stdout as it is produced, the statistics "
                    "follow; Ctrl-C keeps the text and prints the statistics so far (exit code "
                    "130). Spec defaults of the commands that decode with a model (generate, serve, "
                    "run-batch): " + profile_defaults_text("generate")
                    + " (on a CPU, verifying long drafts costs almost as much as decoding them "
                      "one by one); replay and tune keep llama.cpp's 48..64, which the "
                      "llama-server they model drafts.")
    add_model_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", metavar="TEXT", help="prompt text (special tokens parsed)")
    src.add_argument("-f", "--prompt-file", metavar="FILE",
                     help="read the prompt text from FILE ('-': stdin); the whole file is one "
                          "prompt, so a JSONL file is refused; a regular file (a FIFO or "
                          f"device is refused) of at most {PROMPT_FILE_MAX >> 20} MiB")
    src.add_argument("--prompt-tokens", metavar="FILE",
                     help="JSON list of token ids, used as-is ('-': stdin; at most "
                          f"{PROMPT_FILE_MAX >> 20} MiB, as -f)")
    p.add_argument("--chat", action="store_true",
                   help="render the text prompt as one user message with the model's chat "
                        "template (an instruct model such as the embedded one needs it to "
                        "answer a question instead of continuing the text)")
    p.add_argument("-n", "--n-predict", type=int_arg(-1), default=256, metavar="N",
                   help="maximum output tokens, -1 = until EOS or a full context (default: "
                        "256, a first run that ends in seconds)")
    add_context_flags(p, ctx_help="context size in tokens; bounds drafts as n_ctx - L - 2 "
                                  "(default: %(default)s, room for a code edit's prompt and "
                                  "output)")
    p.add_argument("--compare", action="store_true",
                   help="also run plain greedy decoding; report both speeds, the speed-up and "
                        "whether the outputs match")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object at the end (the text is not streamed)")
    add_repack_flag(p)
    add_deterministic_flag(p)
    add_spec_arguments(p, "generate", include_live=True)
    add_policy_arguments(p, "generate", why="a draft is verified only where it pays on this "
                                            "machine; fixed gives llama.cpp's drafts",
                     cost_default="the loaded model's calibration on this machine, "
                                  "measured at first use and cached")
    amend_help(p, "lookup_cache_dynamic", "; generate merges each run's n-grams into it")
    p.set_defaults(run=run)
    return p


def _read_text(flag, path):
    """A UTF-8 text file (a leading byte-order mark is dropped) of at most `PROMPT_FILE_MAX`
    bytes, a regular file or stdin (``-``); errors name ``flag``."""
    try:
        data = read_limited(path, "prompts", PROMPT_FILE_MAX)
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{flag} {path}: is a directory") from None
    except OSError as exc:      # a FIFO or a device too (NotRegularFileError)
        raise OSError(f"{flag} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from None
    return text[1:] if text.startswith("\ufeff") else text


def _refuse_jsonl(path, text):
    """A prompt file that is JSONL (one request per line) is not one prompt: say so."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    name = path.lower()
    looks = name.endswith((".jsonl", ".jsonl.gz", ".ndjson"))
    if not looks and len(lines) >= 2:
        try:
            looks = all(isinstance(json.loads(ln), dict) for ln in lines)
        except ValueError:
            looks = False
    if looks:
        raise ValueError(f"--prompt-file {path}: a JSONL file (one JSON object per line), while "
                         f"generate reads the whole file as one prompt text; pass one prompt's "
                         f"text (-f FILE or -p TEXT), or run one generate per request")


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


def _build_engine(llm, types, params, args):
    if "draft-simple" in types:
        # another vocabulary is refused before any weights or caches are set up
        check_draft_model_file(llm, args.model_draft, args.repack)
        # the draft model gets the target's context size, batch size and threads
        params = dict(params, model_draft=args.model_draft, ctx_size_draft=args.ctx_size,
                      batch_size_draft=args.batch_size, threads_draft=args.threads,
                      repack_draft=args.repack)
    return SpecEngine.from_proposers(registry.build_proposers(types, 1, None, params), n_slots=1)


def _check_inputs(args):
    """Every flag, then every file, before the model loads: ``(types, params, prompt ids or
    None, prompt text or None, cost model or None)``."""
    if args.chat and args.prompt_tokens:
        raise ValueError("--chat applies to a text prompt, not to --prompt-tokens")
    # Flags first, then files: a bad flag is reported as such, whatever the files hold.
    params = dict(SpecConfig.from_args(args, "generate").params)
    types = spec_types(args)
    if args.lookup_cache_dynamic is not None:
        # It is written after the generation: find out now, not after minutes of decoding.
        check_writable("--lookup-cache-dynamic", args.lookup_cache_dynamic)
    # Cache files are loaded before the model (a bad file fails fast); one adds ngram-cache.
    spec_type, params = load_cache_files(args.spec_type, params)
    if spec_type != args.spec_type:
        types = registry.parse_types(types + ["ngram-cache"])
    check_model_file("--model", args.model)
    check_model_file("--model-draft", args.model_draft)
    prompt_ids, text = None, args.prompt
    if args.prompt_tokens:
        prompt_ids = _read_prompt_tokens(args.prompt_tokens)
    elif args.prompt_file is not None:
        text = _read_text("--prompt-file", args.prompt_file)
        _refuse_jsonl(args.prompt_file, text)
    cost_model = None
    if args.cost_model is not None:
        cost_model = cost.load_cost_model(args.cost_model)
    return types, params, prompt_ids, text, cost_model


def _execute(args, ctrl_c: CtrlC):
    types, params, prompt_ids, text, cost_model = _check_inputs(args)
    llm = load_model(args.model, n_ctx=args.ctx_size, n_batch=args.batch_size,
                     n_threads=args.threads, repack=args.repack,
                     deterministic=args.deterministic)
    ctrl_c.check()      # a Ctrl-C during the load (where llama-cpp-python's logging drops it)
    prompt = prompt_ids if prompt_ids is not None else tokenize_prompt(llm, text, chat=args.chat)
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    engine = _build_engine(llm, types, params, args) if types else None
    target = LiveTarget(llm, engine)    # checks the engine against the model: before calibrating
    policy = None
    if engine is not None and args.spec_policy == "auto":
        policy = _auto_policy(llm, cost_model, quiet=args.json)

    stream = _Stream(llm, ctrl_c, text=not args.json)
    interrupted = False
    try:
        spec = target.generate(prompt, n_predict=args.n_predict, policy=policy,
                               update_dynamic_cache=args.lookup_cache_dynamic, on_tokens=stream)
    except GenerationInterrupted as exc:
        spec, interrupted = exc.result, True
    stream.finish(spec.output_tokens)
    res = spec.to_dict()
    if args.lookup_cache_dynamic is not None:
        res["dynamic_cache_ngrams"] = spec.dynamic_cache_ngrams
    res["spec_type"] = ",".join(types) if types else "none"
    res["spec_policy"] = args.spec_policy
    if policy is not None:
        res["policy"] = policy.summary()
    res["stats_lines"] = spec.stats_lines
    plain = None
    if args.compare and not interrupted:
        plain, interrupted = _compare(llm, prompt, args.n_predict, spec, res)
    res["interrupted"] = interrupted or ctrl_c.seen
    return res, spec, plain


def _compare(llm, prompt, n_predict, spec, res):
    """``--compare``: plain decoding of the same prompt, its speed and output beside the
    speculative run's in `res`; ``(plain result or None, interrupted)``."""
    try:
        plain = generate_plain(llm, prompt, n_predict=n_predict)
    except KeyboardInterrupt:
        res["plain_interrupted"] = True
        return None, True
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
    return plain, False


class _Stream:
    """``on_tokens`` of the generation: the text on stdout as it is produced, flushed per step
    (UTF-8 never split: `TextStream`); with ``text=False`` (``--json``) one line on stderr says
    the generation began instead. Each step first checks for a Ctrl-C that C code swallowed
    (`CtrlC`): raised here, it ends the generation as interrupted."""

    def __init__(self, llm, ctrl_c: CtrlC, text: bool = True):
        self.text = text_stream(llm) if text else None
        self.ctrl_c = ctrl_c
        self.n_tokens = 0

    def __call__(self, tokens):
        self.ctrl_c.check()
        if self.text is None and self.n_tokens == 0:
            # the prompt is in: from here on a Ctrl-C prints the result so far
            sys.stderr.write("generating (Ctrl-C stops and prints the result so far)\n")
            sys.stderr.flush()
        self._push(tokens)

    def finish(self, output_tokens):
        """Write what the generation emitted but did not stream (a Ctrl-C between the two)."""
        self._push(output_tokens[self.n_tokens:])
        if self.text is not None:
            self._write(self.text.finish())

    def _push(self, tokens):
        self.n_tokens += len(tokens)
        if self.text is not None:
            self._write(self.text.push(tokens)[1])

    @staticmethod
    def _write(chunk):
        if chunk:
            sys.stdout.write(chunk)
            sys.stdout.flush()


def _auto_policy(llm, cost_model, quiet):
    """AutoPolicy on `cost_model`, or on the loaded model's cached calibration (measured here at
    first use: a few seconds, said on stderr)."""
    path = cost.cache_path(calibration.key_for(llm))
    if cost_model is None and not quiet and not path.exists():
        # say where it goes: a file the user did not ask for ($NGRAMSPEC_CACHE_DIR moves it)
        sys.stderr.write(f"calibrating the verify cost of this model (first use; cached in "
                         f"{path}; `ngramspec calibrate` shows it)...\n")
    return calibration.auto_policy(llm, cost_model)


def _draft_count_lines(res) -> list:
    """The policy's line and llama.cpp's statistics, each saying which drafted tokens it counts:
    under auto the proposers' drafts (llama.cpp's ``#gen tokens``) are cut before they are
    verified, so the verified count above is smaller."""
    lines = []
    if "policy" in res:
        pol = res["policy"]
        proposed = sum(st.get("gen_tokens", 0) for st in res["stats"])
        lines.append(f"policy auto (cost model {pol['cost_model']}): the proposers drafted "
                     f"{proposed} tokens in {pol['drafts']} drafts; {res['n_draft_tokens']} of "
                     f"them verified ({pol['verified']} drafts verified, {pol['truncated']} "
                     f"shortened, {pol['plain']} plain steps, {pol['probes']} probes)")
    if res["stats_lines"]:
        counted = (" #gen tokens counts every drafted token, before the policy's cut;"
                   if "policy" in res else "")
        lines.append(f"llama.cpp's statistics ({counted.strip()}{' ' if counted else ''}"
                     f"#mean acc len = 1 + #acc tokens / #calls a: the target's own token of "
                     f"each verified draft is counted too):")
        lines.extend(res["stats_lines"])
    return lines


def _print_text(res, spec, plain):
    out = sys.stdout
    out.write("\n\n")     # after the streamed text
    t = res["timings"]
    lines = [
        f"spec-type {res['spec_type']}: prompt {res['n_prompt']} tokens, "
        f"output {res['n_output']} tokens (finish: {res['finish_reason']})",
        f"speculative: {t['tokens_per_s']:8.2f} tokens/s  "
        f"({res['n_target_decodes']} target decodes, "
        f"{res['n_acc_tokens']}/{res['n_draft_tokens']} "
        f"{'verified ' if 'policy' in res else ''}draft tokens accepted)",
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
    lines += _draft_count_lines(res)
    if res.get("dynamic_cache_ngrams") is not None:
        lines.append(f"dynamic cache: {res['dynamic_cache_ngrams']} n-grams saved")
    if res["interrupted"]:
        lines.append("interrupted: the statistics cover the output so far"
                     + ("; the plain run was cut short" if res.get("plain_interrupted") else "")
                     + ("; the dynamic cache file was left as it was"
                        if res.get("dynamic_cache_ngrams", 0) is None else ""))
    out.write("\n".join(lines) + "\n")


def run(args) -> int:
    """Generate; the text streams to stdout as it is produced (not with ``--json``).

    Ctrl-C keeps what was generated: the statistics so far are printed (one JSON object with
    ``--json``) and the exit code is 130, as for any interrupted command.
    """
    with CtrlC() as ctrl_c:
        res, spec, plain = _execute(args, ctrl_c)
    if args.json:
        sys.stdout.write(json.dumps(res) + "\n")
    else:
        _print_text(res, spec, plain)
    sys.stdout.flush()
    if res["interrupted"]:
        sys.stderr.write("interrupted\n")
        return 130
    return 0

"""The speculative flags of the commands that decode with a model (generate, serve, run-batch and
the engines embedding ngramspec): their defaults, the engine keywords and the spec types.

Notes
-----
Thread-safety: plain functions over an argparse namespace; nothing is kept between calls.
"""
from __future__ import annotations

from ngramspec import registry
from ngramspec.cli.common import check_spec_flags, engine_params

__all__ = ["GENERATE_DEFAULTS", "generate_params", "spec_types", "state_generate_defaults"]

# generate's own defaults, chosen from bench/results/e2e-fixed.md: on a CPU, verifying a batch of k
# tokens costs c(k) single-token decodes with c(2) = 2.1, c(32) = 18 (1.5k tokens of context, one
# thread), so a rejected draft is expensive: llama.cpp's 64-token drafts (tuned for GPUs) lose
# where the small model leaves its input, 16-token ones leave speed where it copies; 8..32 did best
# on both. Every command that decodes with a model takes them (generate, serve, run-batch and the
# engines' $NGRAMSPEC_SPEC); replay, tune and SpecEngine keep llama.cpp's, which is what the
# llama-server they model drafts (and what the golden files hold).
GENERATE_DEFAULTS = {"ngram_mod_n_min": 8, "ngram_mod_n_max": 32}


def state_generate_defaults(parser) -> None:
    """Show GENERATE_DEFAULTS instead of llama.cpp's defaults in the flags' help, and why."""
    for action in parser._actions:
        if action.dest in GENERATE_DEFAULTS and action.help:
            head, _, rest = action.help.rpartition("(default: ")
            rng = rest.partition(",")[2].rstrip(")")
            action.help = (f"{head}(default: {GENERATE_DEFAULTS[action.dest]}, shorter than "
                           f"llama.cpp's {rest.partition(',')[0].rstrip(')')} for a CPU, where "
                           f"a rejected draft costs nearly its length in decodes;{rng})")


def generate_params(args) -> dict:
    """Engine keywords of the flags given, GENERATE_DEFAULTS filling the others, checked.

    One of --spec-ngram-mod-n-min / -n-max given alone moves the other default along
    (n_min <= n_max), so the flag never silently turns ngram-mod's drafting off.

    Raises
    ------
    ValueError, TypeError
        A flag out of its range, named as typed (`ngramspec.cli.common.check_spec_flags`).
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


def spec_types(args) -> list:
    """``--spec-type``'s types in llama.cpp's order, ``draft-simple`` added by ``--model-draft``.

    Raises
    ------
    ValueError
        ``draft-simple`` without ``--model-draft``.
    """
    types = registry.parse_types(args.spec_type)
    if args.model_draft and "draft-simple" not in types:
        types = registry.parse_types(types + ["draft-simple"])
    if "draft-simple" in types and not args.model_draft:
        raise ValueError("spec type draft-simple needs --model-draft")
    return types

"""The speculative flags of the commands that decode with a model (generate, serve, run-batch):
their spec types, ``draft-simple`` following ``--model-draft``. Their defaults and checks are
`ngramspec.config`'s (the ``generate`` and ``serve`` profiles).

Notes
-----
Thread-safety: plain functions over an argparse namespace; nothing is kept between calls.
"""
from __future__ import annotations

from ngramspec import registry
from ngramspec.config import SPEC_PROFILES

__all__ = ["profile_defaults_text", "spec_types"]


def profile_defaults_text(profile: str) -> str:
    """``--spec-ngram-mod-n-min 8, --spec-ngram-mod-n-max 32``: a profile's own defaults as
    flags, for a command's description."""
    return ", ".join(f"--spec-{k.replace('_', '-')} {v}"
                     for k, v in SPEC_PROFILES[profile].params.items())


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

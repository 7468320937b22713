"""Speculative decoding's configuration, below every command line: the spec types, their
parameters, the draft-length policy and its cost model, with the commands' defaults as named
profiles.

`SpecConfig` is built from keywords (a library user), from a parsed command line (the
commands) or from llama-server's flags in a string (an engine embedding ngramspec:
``$NGRAMSPEC_SPEC``); all three fill the same profile defaults and raise the same errors, named
by keyword or by flag. The command line renders its speculative and policy flags, and their
help, from here (`add_spec_arguments`, `add_policy_arguments`), so a default is stated once.

Notes
-----
Thread-safety: `SpecConfig` and `Profile` are frozen; the functions keep no state.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Union

from ngramspec.cache_file import NgramCache, load_cache
from ngramspec.cost import CostModel, load_cost_model
from ngramspec.policy import POLICIES, make_policy
from ngramspec.registry import TYPES, check_values, parse_types
from ngramspec.validation import OutOfRange, check_choice, check_int, check_real, range_text

__all__ = ["SPEC_PROFILES", "Profile", "SpecConfig", "add_policy_arguments", "add_spec_arguments",
           "engine_params", "load_cache_files", "number_arg"]

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Profile:
    """A command's defaults over llama.cpp's (the registry's).

    Attributes
    ----------
    name : str
    params : mapping of str to int
        Engine keywords whose default differs from llama.cpp's.
    policy : str
        The draft-length policy of a configuration that names none.
    why : str
        Why `params` differ (the flags' help says it).
    """

    name: str
    params: Mapping[str, int] = field(default_factory=dict)
    policy: str = "fixed"
    why: str = ""


# The CPU profile, chosen from bench/results/e2e-fixed.md: on a CPU, verifying a batch of k
# tokens costs c(k) single-token decodes with c(2) = 2.1, c(32) = 18 (1.5k tokens of context, one
# thread), so a rejected draft is expensive: llama.cpp's 64-token drafts (tuned for GPUs) lose
# where the small model leaves its input, 16-token ones leave speed where it copies; 8..32 did
# best on both. Every command that decodes with a model takes them (generate, serve, run-batch
# and the engines' $NGRAMSPEC_SPEC); replay, tune and SpecEngine keep llama.cpp's, which is what
# the llama-server they model drafts (and what the golden files hold).
_CPU_PARAMS = MappingProxyType({"ngram_mod_n_min": 8, "ngram_mod_n_max": 32})
_CPU_WHY = "for a CPU, where a rejected draft costs nearly its length in decodes"

#: The commands' defaults by name: ``llama.cpp`` (replay, tune, `ngramspec.engine.SpecEngine`),
#: ``serve`` (serve, run-batch and the engines' ``$NGRAMSPEC_SPEC``), ``generate``.
SPEC_PROFILES: Mapping[str, Profile] = MappingProxyType({
    "llama.cpp": Profile("llama.cpp"),
    "serve": Profile("serve", _CPU_PARAMS, "fixed", _CPU_WHY),
    "generate": Profile("generate", _CPU_PARAMS, "auto", _CPU_WHY),
})

# The cache-file parameters of ngram-cache (--lookup-cache-static / --lookup-cache-dynamic).
CACHE_FILE_PARAMS = ("lookup_cache_static", "lookup_cache_dynamic")


def _profile(name: str) -> Profile:
    return SPEC_PROFILES[check_choice("profile", name, tuple(SPEC_PROFILES))]


def profile_params(spec_type: str, given: Mapping, profile: str, by_flag: bool = False) -> dict:
    """Engine keywords: `given`, the profile's defaults filling the others, checked.

    One bound of a ``*_n_min`` / ``*_n_max`` pair given alone moves the other default along
    (n_min <= n_max), so the value never silently turns the proposer's drafting off.

    Raises
    ------
    ValueError, TypeError
        A value out of its range, named by keyword (``by_flag``: by flag, as typed).
    """
    defaults = _profile(profile).params
    params = {**defaults, **given}
    for lo in (k for k in defaults if k.endswith("_n_min")):
        hi = lo[:-len("min")] + "max"
        if hi in given and lo not in given:
            params[lo] = min(params[lo], params[hi])
        elif lo in given and hi not in given and hi in defaults:
            params[hi] = max(params[hi], params[lo])
    check_values(spec_type, params, by_flag=by_flag)
    return params


def engine_params(args: argparse.Namespace) -> dict:
    """The engine keywords of the flags given on a command line (unchecked)."""
    options = vars(args)
    return {p.name: options[p.name] for spec in TYPES.values() for p in spec.params
            if options.get(p.name) is not None}


def load_cache_files(spec_type: str, params: Mapping) -> tuple:
    """Load the n-gram cache files named in ``params``, once, before any model.

    Returns ``(spec_type, params)``: ``ngram-cache`` added to the type list if a cache file is
    given and it is absent, the paths in ``params`` replaced by the loaded `NgramCache` objects
    (every engine built from them shares them, e.g. one per request in ``--state fresh``). A
    dynamic file that does not exist yet is an empty cache (the first run starts it). A static
    file must exist. A corrupt or truncated file raises `CacheFileError` (a ValueError naming
    the file and the byte offset).
    """
    # a cache already loaded (a configuration whose files were loaded once) stays as it is
    given = [name for name in CACHE_FILE_PARAMS
             if params.get(name) is not None and not isinstance(params[name], NgramCache)]
    if not any(params.get(name) is not None for name in CACHE_FILE_PARAMS):
        return spec_type, dict(params)
    types = parse_types(spec_type)
    if "ngram-cache" not in types:
        spec_type = ",".join(parse_types(types + ["ngram-cache"]))
    params = dict(params)
    for name in given:
        path = params[name]
        try:
            params[name] = load_cache(path)
        except FileNotFoundError:
            if name != "lookup_cache_dynamic":
                raise FileNotFoundError(f"--{name.replace('_', '-')} {path}: no such "
                                        f"file") from None
            params[name] = NgramCache()
    return spec_type, params


@dataclass(frozen=True)
class SpecConfig:
    """One speculative-decoding configuration: what an engine, a scheduler or an embedding
    engine's requests draft with.

    Build it with `from_keywords`, `from_args` or `from_flags` (they fill the profile's
    defaults and check every value); the constructor takes the values as they are.

    Attributes
    ----------
    spec_type : str
        The comma list of spec types (``"none"``: no speculation).
    params : mapping
        Engine keywords (`ngramspec.registry`), the profile's defaults included; cache files
        as paths (`engine_parts` loads them). Read-only when built by the class methods.
    policy : str
        ``fixed`` or ``auto`` (`ngramspec.policy.POLICIES`).
    cost_model : str or CostModel, optional
        auto's verify-cost curve: a JSON file or a profile name (`ngramspec.cost`), or a
        curve already loaded or measured.
    """

    spec_type: str = "ngram-mod"
    params: Mapping = field(default_factory=dict)
    policy: str = "fixed"
    cost_model: Optional[Union[str, CostModel]] = None

    @classmethod
    def from_keywords(cls, spec_type: str = "ngram-mod", *, profile: str = "llama.cpp",
                      policy: Optional[str] = None, cost_model: Optional[str] = None,
                      **params) -> "SpecConfig":
        """A configuration of keywords (``SpecConfig.from_keywords("ngram-mod",
        ngram_mod_n_max=16)``); errors name the keyword."""
        policy = _profile(profile).policy if policy is None else policy
        check_choice("policy", policy, POLICIES)
        if cost_model is not None and not isinstance(cost_model, (str, CostModel)):
            raise TypeError(f"cost_model must be a file path, a profile name or a CostModel, "
                            f"got {type(cost_model).__name__}")
        return cls(spec_type, MappingProxyType(profile_params(spec_type, params, profile)),
                   policy, cost_model)

    @classmethod
    def from_args(cls, args: argparse.Namespace, profile: str) -> "SpecConfig":
        """The configuration of a parsed command line (`add_spec_arguments`' and
        `add_policy_arguments`' flags); errors name the flag as typed."""
        options = vars(args)
        policy = options.get("spec_policy") or _profile(profile).policy
        params = profile_params(args.spec_type, engine_params(args), profile, by_flag=True)
        return cls(args.spec_type, MappingProxyType(params), policy, options.get("cost_model"))

    @classmethod
    def from_flags(cls, argv, *, prog: str = "NGRAMSPEC_SPEC", profile: str = "serve",
                   default_cost_model: str = "gpu") -> "SpecConfig":
        """llama-server's speculative flags in a string or list, as ``serve`` takes them, plus
        ``--spec-policy {fixed,auto}`` and ``--cost-model FILE|NAME`` (for an engine that
        embeds ngramspec: ``$NGRAMSPEC_SPEC``).

        Raises
        ------
        ValueError
            A bad flag or value, named as ``serve`` names it, prefixed by `prog`.
        """
        if isinstance(argv, str):
            argv = shlex.split(argv)
        parser = _RaisingParser(prog=prog, add_help=False)
        add_spec_arguments(parser, profile)
        add_policy_arguments(parser, profile, why="llama.cpp's behaviour",
                             cost_default=default_cost_model)
        args = parser.parse_args(list(argv))
        try:
            config = cls.from_args(args, profile)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{prog}: {exc}") from None
        if config.policy == "auto" and config.cost_model is None:
            config = cls(config.spec_type, config.params, config.policy, default_cost_model)
        return config

    @property
    def types(self) -> tuple:
        """The chain's proposer types in llama.cpp's order: `spec_type`'s (``none`` dropped),
        ``draft-simple`` added when a draft model is given (``model_draft``), as
        ``--model-draft`` adds it on the command line."""
        types = parse_types(self.spec_type)
        if self.params.get("model_draft") is not None and "draft-simple" not in types:
            types = parse_types(types + ["draft-simple"])
        return tuple(types)

    def with_params(self, **changes) -> "SpecConfig":
        """This configuration with `changes` to its engine keywords (checked, named by
        keyword): e.g. ``model_draft=`` a draft model already loaded."""
        params = {**self.params, **changes}
        check_values(self.spec_type, params)
        return replace(self, params=MappingProxyType(params))

    def with_files_loaded(self) -> "SpecConfig":
        """This configuration with its files loaded once, before any model (a bad file fails
        fast): the n-gram cache files (`load_cache_files`: every engine built from it shares
        them; ``ngram-cache`` added to the types when a file is given) and the cost model (a
        `CostModel`, from a profile name or a file: `ngramspec.cost.load_cost_model`).

        Raises
        ------
        ValueError, OSError
            A corrupt cache file, a missing static one, an unknown or malformed cost model.
        """
        spec_type, params = load_cache_files(self.spec_type, self.params)
        cost = self.cost_model
        if cost is not None and not isinstance(cost, CostModel):
            cost = load_cost_model(cost)
        return replace(self, spec_type=spec_type, params=MappingProxyType(params),
                       cost_model=cost)

    def engine_parts(self, prog: Optional[str] = None) -> tuple:
        """``(spec_type, params, make)`` for `ngramspec.engine.SpecEngine` and its policy:
        cache files loaded, ``make()`` a new policy (`ngramspec.policy.make_policy`; auto's
        cost model loaded, a profile of another machine, so this one's proposer time is not
        counted). Errors are prefixed by `prog` when given.

        Raises
        ------
        ValueError, OSError
            A corrupt cache file, a missing static one, an unknown cost model.
        """
        try:
            loaded = self.with_files_loaded()
        except (ValueError, TypeError, OSError) as exc:
            if prog is None:
                raise
            raise ValueError(f"{prog}: {exc}") from None
        spec_type, params = loaded.spec_type, dict(loaded.params)
        cost = loaded.cost_model if self.policy == "auto" else None
        extra = {"proposer_time": False} if self.policy == "auto" else {}
        policy = self.policy
        make: Callable = lambda: make_policy(policy, cost, **extra)  # noqa: E731
        return spec_type, params, make


class _RaisingParser(argparse.ArgumentParser):
    """argparse whose bad flag is a ValueError with argparse's message (a host process such
    as vLLM must get an exception, not an exit)."""

    def error(self, message):
        raise ValueError(f"{self.prog}: {message}")


def number_arg(kind: type, lo=None, hi=None, *, allowed: Optional[str] = None):
    """argparse ``type=`` for a number flag, checked by `ngramspec.validation`.

    Text that is no ``kind`` is argparse's ``invalid int value: 'x'``; a value out of range
    reads ``argument --slots: 0 is out of range: allowed 1 .. 65536`` (argparse names the
    flag: the package's one message format). The upper bound of an integer flag keeps values
    that C cannot hold (OverflowError) and sizes no machine can allocate out of the kernels.

    Parameters
    ----------
    kind : int or float
    lo, hi : number, optional
        Inclusive bounds (None: unbounded).
    allowed : str, optional
        The range the message states, when the flag's own range is checked later (the spec
        parameters, by the registry): default ``lo .. hi``.
    """
    check = check_int if kind is int else check_real

    def convert(text):
        value = kind(text)      # ValueError: argparse's "invalid int value: 'x'"
        try:
            return check("value", value, lo, hi)
        except OutOfRange as exc:
            raise argparse.ArgumentTypeError(
                f"{exc.value} is out of range: allowed {allowed or exc.allowed}") from None
    convert.__name__ = kind.__name__  # argparse names the type in its message
    return convert


def _shown(default) -> str:
    """A default as the help texts show it: ``none`` for an unset value (not Python's None)."""
    return "none" if default is None else str(default)


def _param_help(spec, p, profile: Profile) -> str:
    """A parameter flag's help: what it does, its default (the profile's, and why), its range."""
    rng = ""
    if p.lo is not None:
        rng = f", {p.lo}..{p.hi}" if p.hi is not None else f", >= {p.lo}"
    if p.name not in profile.params:
        return f"{spec.name}: {p.help} (default: {_shown(p.default)}{rng})"
    return (f"{spec.name}: {p.help} (default: {profile.params[p.name]}, shorter than "
            f"llama.cpp's {_shown(p.default)} {profile.why};{rng[1:]})")


def add_spec_arguments(parser: argparse.ArgumentParser, profile: str = "llama.cpp",
                       include_live: bool = False) -> None:
    """``--spec-type`` and every parameter flag of the registered spec types (``include_live``:
    the live-only ones too), their help stating `profile`'s defaults. Flags left out parse to
    None (the profile fills them: `SpecConfig.from_args`)."""
    prof = _profile(profile)
    group = parser.add_argument_group("speculative decoding (llama-server flags)")
    names = ["none"] + [t.name for t in TYPES.values() if include_live or not t.live]
    group.add_argument("--spec-type", default="ngram-mod", metavar="TYPE[,TYPE...]",
                       help=f"comma list of spec types, applied in llama.cpp's priority order: "
                            f"{', '.join(names)} (default: %(default)s)")
    for spec in TYPES.values():
        if spec.live and not include_live:
            continue
        for p in spec.params:
            if p.kind is object or not p.cli:
                continue
            kind = p.kind if p.kind in (int, float) else str
            if kind is int:
                # Range checks stay with the registry; only values no C int holds stop here.
                kind = number_arg(int, -INT32_MAX - 1, INT32_MAX,
                                  allowed=range_text(p.lo, INT32_MAX if p.hi is None else p.hi))
            group.add_argument(p.flag, dest=p.name, type=kind, default=None, metavar="N"
                               if p.kind is int else ("X" if kind is float else "FILE"),
                               help=_param_help(spec, p, prof))


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores like the new one, with a note on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stderr.write(f"{parser.prog}: {option_string} is deprecated, use "
                         f"{self.metavar} instead\n")
        setattr(namespace, self.dest, values)


def add_policy_arguments(parser: argparse.ArgumentParser, profile: str, why: str,
                         cost_default: str, auto: str = "") -> None:
    """``--spec-policy`` (`ngramspec.policy.POLICIES`, `profile`'s default), its deprecated old
    spelling ``--policy``, and ``--cost-model FILE|NAME``.

    ``why`` says why the command's default is the profile's, ``auto`` what auto means for this
    command beyond the common text, ``cost_default`` in words what the command prices drafts
    with without ``--cost-model``.
    """
    group = parser.add_argument_group("draft-length policy")
    group.add_argument("--spec-policy", choices=POLICIES, default=_profile(profile).policy,
                       help=f"auto: verify only the part of each draft expected to pay under the "
                            f"verify-cost curve{auto}; fixed: llama.cpp's behaviour, the whole "
                            f"draft (default: %(default)s, {why})")
    group.add_argument("--policy", dest="spec_policy", choices=POLICIES,
                       action=DeprecatedAlias, metavar="--spec-policy", help=argparse.SUPPRESS)
    add_cost_model_argument(group, "verify-cost curve for --spec-policy auto", cost_default)


def add_cost_model_argument(parser, what: str, cost_default: str) -> None:
    """``--cost-model FILE|NAME`` (`ngramspec.cost.load_cost_model`), one text in every
    command: ``what`` the curve is for, ``cost_default`` what the command uses without it."""
    parser.add_argument("--cost-model", metavar="FILE|NAME", default=None,
                        help=f"{what}: a JSON file of `ngramspec calibrate --json`, or a profile: "
                             f"gpu, gpu-h200 (ngramspec measured on an H200), "
                             f"cpu-embedded, local (this machine's cached calibration of the "
                             f"embedded model) (default: {cost_default})")

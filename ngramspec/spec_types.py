"""The spec types llama-server knows, their parameters, and how to build a chain from them.

Names, flags, defaults and ranges are llama.cpp's (spec section 2). Each parameter is a flat
keyword of `SpecEngine` named after its server flag (``--spec-ngram-mod-n-match`` ->
``ngram_mod_n_match``). Types outside the n-gram family live in their own modules and are
imported only when used.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

# llama.cpp's fixed priority order (spec 1.1); ngramspec's own ngram-suffix goes first.
PRIORITY = (
    "ngram-suffix",
    "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
    "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash",
)
# Names llama-server accepts but ngramspec cannot run.
UNSUPPORTED = {"draft-eagle3", "draft-mtp", "draft-dflash"}


class CacheFile:
    """Param kind of an n-gram cache file: a path (str or os.PathLike) or an already loaded
    ``ngramspec.NgramCache`` (so that one loaded file can serve many engines)."""

    @staticmethod
    def check(name: str, value):
        from ngramspec.cache_file import NgramCache, as_path
        if isinstance(value, NgramCache):
            return value
        return as_path(name, value, also=" or an NgramCache")


@dataclass(frozen=True)
class Param:
    """One engine keyword: its default and allowed range (inclusive; None = unbounded)."""
    name: str
    default: Any
    lo: Any = None
    hi: Any = None
    kind: type = int          # int, float, str, CacheFile or object (passed through)
    help: str = ""

    @property
    def flag(self) -> str:
        if self.name.startswith(("ngram_", "spec_draft_")):
            return "--spec-" + self.name.replace("spec_", "", 1).replace("_", "-")
        return "--" + self.name.replace("_", "-")

    def check(self, value):
        if self.kind is object or value is None and self.default is None:
            return value
        if self.kind is CacheFile:
            return CacheFile.check(self.name, value)
        if self.kind is str:
            return str(value)
        if self.kind is int:
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise TypeError(f"{self.name} must be an integer, got {type(value).__name__}")
            value = value.__index__()
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{self.name} must be a number, got {type(value).__name__}")
            value = float(value)
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            rng = f"{self.lo} .. {self.hi}" if self.hi is not None else f">= {self.lo}"
            raise ValueError(f"{self.name} = {value} is out of range: allowed {rng}")
        return value


@dataclass(frozen=True)
class SpecType:
    name: str
    params: tuple = ()
    # builder(n_slots, pool, values) -> Proposer; `values` maps short names (size_n, ...) too
    builder: Callable | None = None
    uses_pool: bool = False


def _lazy(module: str, func: str) -> Callable:
    def build(n_slots, pool, values):
        return getattr(importlib.import_module(module), func)(n_slots, values)
    return build


def _simple(n_slots, pool, v):
    from ngramspec._core import SimpleProposer
    return SimpleProposer(v["ngram_simple_size_n"], v["ngram_simple_size_m"],
                          v["ngram_simple_min_hits"], n_slots=n_slots)


def _map(prefix, key_only):
    def build(n_slots, pool, v):
        from ngramspec._core import MapProposer
        return MapProposer(v[prefix + "size_n"], v[prefix + "size_m"], v[prefix + "min_hits"],
                           key_only=key_only, n_slots=n_slots, reindex=bool(v[prefix + "reindex"]))
    return build


def _mod(n_slots, pool, v):
    from ngramspec._core import ModProposer
    return ModProposer(v["ngram_mod_n_match"], v["ngram_mod_n_min"], v["ngram_mod_n_max"],
                       pool=pool, n_slots=n_slots)


def _nm(prefix, n=12, m=48):
    return (Param(prefix + "size_n", n, 1, 1024, help="key length (tokens)"),
            Param(prefix + "size_m", m, 1, 1024, help="draft length (tokens)"),
            Param(prefix + "min_hits", 1, 1, None, help="minimum hits"))


REGISTRY: dict[str, SpecType] = {}


def register(spec: SpecType) -> None:
    """Add (or replace) a spec type."""
    REGISTRY[spec.name] = spec


register(SpecType("ngram-simple", _nm("ngram_simple_"), _simple))
def _reindex(prefix):
    return Param(prefix + "reindex", 0, 0, 1, help="ngramspec option, not llama.cpp: 1 = a new "
                 "prompt that does not extend the previous one re-indexes the slot's map")


register(SpecType("ngram-map-k", _nm("ngram_map_k_") + (_reindex("ngram_map_k_"),),
                  _map("ngram_map_k_", True)))
register(SpecType("ngram-map-k4v", _nm("ngram_map_k4v_") + (_reindex("ngram_map_k4v_"),),
                  _map("ngram_map_k4v_", False)))
register(SpecType("ngram-mod", (
    Param("ngram_mod_n_match", 24, 1, 1024, help="n-gram length"),
    Param("ngram_mod_n_min", 48, 0, 1024, help="minimum draft length"),
    Param("ngram_mod_n_max", 64, 0, 1024, help="maximum draft length"),
), _mod, uses_pool=True))
def _suffix_params():
    from ngramspec._suffix import PARAMS
    return tuple(Param(name, d, lo, hi, kind, help)
                 for name, (d, lo, hi, kind, help) in PARAMS.items())


try:  # ngramspec's own proposer (C++ module)
    register(SpecType("ngram-suffix", _suffix_params(),
                      _lazy("ngramspec._suffix", "build_ngram_suffix")))
except ImportError:  # pragma: no cover - partial developer build
    pass
register(SpecType("ngram-cache", (
    Param("lookup_cache_static", None, kind=CacheFile,
          help="static n-gram cache file; giving it adds ngram-cache"),
    Param("lookup_cache_dynamic", None, kind=CacheFile,
          help="dynamic n-gram cache file (absent = empty; generate merges each run into it); "
               "giving it adds ngram-cache"),
    Param("ngram_cache_restart", 0, 0, 1, help="ngramspec option, not llama.cpp: 1 = begin() "
          "restarts the slot's context cache (each request learns only its own tokens)"),
), _lazy("ngramspec._cache", "build_ngram_cache")))
register(SpecType("draft-simple", (
    Param("model_draft", None, kind=object, help="draft model (GGUF path or llama_cpp.Llama)"),
    Param("spec_draft_n_max", 3, 0, None, help="draft model: maximum draft length"),
    Param("spec_draft_n_min", 0, 0, None, help="draft model: minimum draft length"),
    Param("spec_draft_p_min", 0.0, 0.0, 1.0, kind=float,
          help="draft model: minimum probability of a drafted token"),
), _lazy("ngramspec.draft_model", "build_draft_simple")))


def all_params() -> dict[str, Param]:
    """Every known engine keyword (all types), by name."""
    return {p.name: p for spec in REGISTRY.values() for p in spec.params}


def parse_types(spec_type) -> list[str]:
    """The type names of a ``--spec-type`` list, in llama.cpp's priority order."""
    if isinstance(spec_type, str):
        names = [s.strip() for s in spec_type.split(",") if s.strip()]
    elif isinstance(spec_type, (list, tuple)) and all(isinstance(s, str) for s in spec_type):
        names = [s.strip() for s in spec_type]
    else:
        raise TypeError(f"spec_type must be a comma-separated string or a list of names, got "
                        f"{type(spec_type).__name__}")
    known = set(PRIORITY) | {"none"}
    for name in names:
        if name not in known:
            raise ValueError(f"unknown spec type {name!r}: allowed {', '.join(['none', *PRIORITY])}")
        if name in UNSUPPORTED:
            raise ValueError(f"spec type {name!r} is not supported by ngramspec")
        if name not in REGISTRY and name != "none":
            raise ValueError(f"spec type {name!r} is not available in this build")
    return [name for name in PRIORITY if name in names]


def build_proposers(spec_type, n_slots: int, pool, params: dict) -> list:
    """Validate `params` and build the chain's proposers in priority order."""
    types = parse_types(spec_type)
    known = all_params()
    for name in params:
        if name not in known:
            raise TypeError(f"unknown parameter {name!r}; known: {', '.join(sorted(known))}")
    values = {name: p.check(params[name]) if name in params else p.default
              for name, p in known.items()}
    if pool is None and any(REGISTRY[t].uses_pool for t in types):
        from ngramspec._core import ModPool
        pool = ModPool()
    return [REGISTRY[t].builder(n_slots, pool, values) for t in types]

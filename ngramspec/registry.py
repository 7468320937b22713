"""Every spec type llama-server knows: its parameters, ranges, defaults and flag names, once.

Names, flags, defaults and ranges are llama.cpp's (``common_params_speculative`` in
``common/common.h``, the ``--spec-*`` options of ``common/arg.cpp``). Each parameter is a flat
keyword of `ngramspec.SpecEngine` named after its server flag (``--spec-ngram-mod-n-match`` ->
``ngram_mod_n_match``). The command line, the engine, the draft model and ngram-suffix all check
values here, through `ngramspec.validation` (one message format: ``<name> = <value> is out of
range: allowed <lo> .. <hi>``, ``<name>`` being the flag on the command line and the keyword in
Python).

Types outside the n-gram family live in their own modules and are imported only when used.
"""
from __future__ import annotations

import importlib
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from ngramspec._cache import NgramCacheProposer
from ngramspec._map import MapProposer
from ngramspec._mod import ModPool, ModProposer
from ngramspec._simple import SimpleProposer
from ngramspec._suffix import SuffixProposer
from ngramspec.cache_file import NgramCache, as_path, load_cache
from ngramspec.validation import Refused, check_int, check_real, range_text

__all__ = ["CacheFile", "Param", "SpecType", "TYPES", "UNSUPPORTED", "all_params",
           "build_proposers", "check_slot_memory", "check_values", "parse_types"]

# Names llama-server accepts but ngramspec cannot run.
UNSUPPORTED = ("draft-eagle3", "draft-mtp", "draft-dflash")
# ngram-map's per-slot hash index (MAP_INDEX_SIZE uint32 in _map.pyx).
MAP_SLOT_BYTES = 1 << 20
# The engine's and every proposer's per-slot bookkeeping, at least (flags, draft positions).
SLOT_BASE_BYTES = 32


class CacheFile:
    """`Param` kind of an n-gram cache file: a path or an already loaded ``NgramCache``.

    A loaded cache lets one file serve many engines.

    Notes
    -----
    Memory: none (never instantiated; `check` is the kind's validator).

    Thread-safety: stateless.
    """

    @staticmethod
    def check(label: str, value):
        """`value` as a cache parameter.

        Parameters
        ----------
        label : str
            The flag or keyword to name in an error.
        value : str, os.PathLike or NgramCache

        Returns
        -------
        NgramCache or str
            The cache as given, or the path as a string.

        Raises
        ------
        TypeError
            Neither a path nor an ``NgramCache``.
        """
        if isinstance(value, NgramCache):
            return value
        return as_path(label, value, also=" or an NgramCache")


@dataclass(frozen=True)
class Param:
    """One engine keyword: default, allowed range (inclusive; None = unbounded), flag.

    Attributes
    ----------
    name : str
        The engine keyword (``ngram_mod_n_min``).
    default : object
    lo, hi : number or None
    kind : type
        int, float, str, `CacheFile`, or object (passed through unchecked).
    help : str
    cli : bool
        Has a command-line flag (`flag`); False for keywords only Python callers pass.

    Notes
    -----
    Memory: a few fields.

    Thread-safety: immutable.
    """
    name: str
    default: Any
    lo: Any = None
    hi: Any = None
    kind: type = int
    help: str = ""
    cli: bool = True

    @property
    def flag(self) -> str:
        """llama-server's flag (``--spec-ngram-mod-n-min``, ``--lookup-cache-static``)."""
        if self.name.startswith(("ngram_", "spec_draft_")):
            return "--spec-" + self.name.replace("spec_", "", 1).replace("_", "-")
        return "--" + self.name.replace("_", "-")

    def range_text(self) -> str:
        """The allowed range as the error messages and ``--help`` give it."""
        return range_text(self.lo, self.hi)

    def check(self, value, label: str | None = None):
        """`value` converted to the parameter's kind and checked against its range.

        Parameters
        ----------
        value : object
        label : str, optional
            The name to report (a flag, a constructor keyword); default `name`.

        Returns
        -------
        object
            The value as `kind` (an int, a float, a str, a path or cache), unchanged for
            ``kind=object``.

        Raises
        ------
        ngramspec.validation.WrongType
            Not a number of the right kind (a TypeError).
        ngramspec.validation.OutOfRange
            Out of range (a ValueError): ``<label> = <value> is out of range: allowed <lo> ..
            <hi>``.
        """
        label = label or self.name
        if self.kind is object or value is None and self.default is None:
            return value
        if self.kind is CacheFile:
            return CacheFile.check(label, value)
        if self.kind is str:
            return str(value)
        if self.kind is int:
            return check_int(label, value, self.lo, self.hi)
        return check_real(label, value, self.lo, self.hi)


@dataclass(frozen=True)
class SpecType:
    """One ``--spec-type`` name: its parameters and how to build its proposer.

    Attributes
    ----------
    name : str
        The ``--spec-type`` name (``ngram-mod``).
    params : tuple of Param
        Its engine keywords.
    builder : callable
        ``builder(n_slots, pool, values)`` returns the proposer; `values` holds every known
        keyword, checked, with defaults filled in.
    uses_pool : bool
        Drafts from the shared ngram-mod ``ModPool``.
    live : bool
        Needs a live model (its flags exist on ``generate`` only).
    slot_bytes : int
        Bytes each slot's state takes at least, allocated when the proposer is built (ngram-map's
        hash index); `build_proposers` refuses an ``n_slots`` whose total exceeds the machine's
        memory.

    Notes
    -----
    Memory: a few fields.

    Thread-safety: immutable.
    """
    name: str
    params: tuple = ()
    builder: Callable | None = None
    uses_pool: bool = False
    live: bool = False           # needs a live model (its flags only on ``generate``)
    slot_bytes: int = 0


def _lazy(module: str, func: str) -> Callable:
    def build(n_slots, pool, values):
        return getattr(importlib.import_module(module), func)(n_slots, values)
    return build


def _simple(n_slots, pool, v):
    return SimpleProposer(v["ngram_simple_size_n"], v["ngram_simple_size_m"],
                          v["ngram_simple_min_hits"], n_slots=n_slots)


def _map(prefix, key_only):
    def build(n_slots, pool, v):
        return MapProposer(v[prefix + "size_n"], v[prefix + "size_m"], v[prefix + "min_hits"],
                           key_only=key_only, n_slots=n_slots, reindex=bool(v[prefix + "reindex"]))
    return build


def _mod(n_slots, pool, v):
    return ModProposer(v["ngram_mod_n_match"], v["ngram_mod_n_min"], v["ngram_mod_n_max"],
                       pool=pool, n_slots=n_slots)


SUFFIX = "ngram_suffix_"


def _suffix(n_slots, pool, v):
    return SuffixProposer(n_slots, **{k[len(SUFFIX):]: x for k, x in v.items()
                                      if k.startswith(SUFFIX)})


# Frozen caches loaded from files, by file identity: engines built one after another (the
# "fresh" replay state, one engine per request) share one copy instead of re-reading the file.
# Weak values: a cache lives only as long as some proposer uses it. A rewritten file (atomic
# save = new inode, size, mtime) gets a new key, so a changed file is always re-read.
_loaded_caches = weakref.WeakValueDictionary()


def _cache_file(value, missing_ok: bool):
    if value is None or isinstance(value, NgramCache):
        return value
    path = os.fspath(value)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise FileNotFoundError(2, "No such file or directory", path) from None
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    cache = _loaded_caches.get(key)
    if cache is None:
        cache = _loaded_caches[key] = load_cache(path)   # the proposer freezes it
    return cache


def _ngram_cache(n_slots, pool, v):
    # A static file must exist (llama-server aborts otherwise); a dynamic one that does not
    # exist yet is empty, so a first run can start the cache that later runs read.
    return NgramCacheProposer(n_slots, _cache_file(v["lookup_cache_static"], False),
                              _cache_file(v["lookup_cache_dynamic"], True),
                              restart=bool(v["ngram_cache_restart"]))


def _nm(prefix, reindex=False):
    params = (Param(prefix + "size_n", 12, 1, 1024, help="key length (tokens)"),
              Param(prefix + "size_m", 48, 1, 1024, help="draft length (tokens)"),
              Param(prefix + "min_hits", 1, 1, None, help="minimum hits"))
    if reindex:
        params += (Param(prefix + "reindex", 0, 0, 1, help="ngramspec option, not llama.cpp: "
                         "1 = a new prompt that does not extend the previous one re-indexes the "
                         "slot's map"),)
    return params


def _types(*specs: SpecType) -> dict:
    return {s.name: s for s in specs}


# In llama.cpp's fixed priority order (common_speculative_init instantiates them so, whatever
# order --spec-type lists them); ngramspec's own ngram-suffix goes first.
TYPES: dict[str, SpecType] = _types(
    SpecType("ngram-suffix", (
        Param(SUFFIX + "max_draft", 256, 1, 4096, help="longest draft (tokens)"),
        Param(SUFFIX + "min_prob", 0.005, 0.0, 1.0, float,
              "lowest probability that the whole draft is accepted"),
        Param(SUFFIX + "gain_cost", 0.02, 0.0, 1.0, float,
              "a token is drafted only while the whole draft's acceptance probability is at "
              "least this times the slot's accepted draft tokens per step (counted up to 8): a "
              "slot that already gains much per step drafts only likelier tokens"),
        Param(SUFFIX + "draft_cost", 0.0078125, 0.0, 1.0, float,
              "that probability threshold rises by this much per token already drafted"),
        Param(SUFFIX + "max_context", 65536, 256, 1 << 26, help="tokens of a request indexed "
              "per slot"),
        Param(SUFFIX + "global_tokens", 1048576, 0, 1 << 26,
              help="global store budget in tokens (0 = off)"),
        Param(SUFFIX + "global_prompt", 8, 0, 1 << 20,
              help="newest prompt tokens stored with each output"),
    ), _suffix),
    SpecType("ngram-simple", _nm("ngram_simple_"), _simple),
    SpecType("ngram-map-k", _nm("ngram_map_k_", reindex=True), _map("ngram_map_k_", True),
             slot_bytes=MAP_SLOT_BYTES),
    SpecType("ngram-map-k4v", _nm("ngram_map_k4v_", reindex=True),
             _map("ngram_map_k4v_", False), slot_bytes=MAP_SLOT_BYTES),
    SpecType("ngram-mod", (
        Param("ngram_mod_n_match", 24, 1, 1024, help="n-gram length"),
        Param("ngram_mod_n_min", 48, 0, 1024, help="minimum draft length (<= n-max)"),
        Param("ngram_mod_n_max", 64, 0, 1024, help="maximum draft length"),
    ), _mod, uses_pool=True),
    SpecType("ngram-cache", (
        Param("lookup_cache_static", None, kind=CacheFile,
              help="static n-gram cache file; giving it adds ngram-cache"),
        Param("lookup_cache_dynamic", None, kind=CacheFile,
              help="dynamic n-gram cache file (absent = empty); giving it adds ngram-cache"),
        Param("ngram_cache_restart", 0, 0, 1, help="ngramspec option, not llama.cpp: 1 = "
              "begin() restarts the slot's context cache (each request learns only its own "
              "tokens)"),
    ), _ngram_cache),
    SpecType("draft-simple", (
        Param("model_draft", None, kind=object, help="draft model (GGUF path or llama_cpp.Llama)"),
        Param("spec_draft_n_max", 3, 0, None, help="draft model: maximum draft length"),
        Param("spec_draft_n_min", 0, 0, None, help="draft model: minimum draft length"),
        Param("spec_draft_p_min", 0.0, 0.0, 1.0, kind=float,
              help="draft model: minimum probability of a drafted token"),
        # llama-server's -cd / -td; generate passes its own -c / -t / -b
        Param("ctx_size_draft", 4096, 16, None, cli=False, help="draft KV cache per slot"),
        Param("threads_draft", None, 1, None, cli=False, help="draft model threads"),
        Param("batch_size_draft", 512, 1, None, cli=False, help="largest draft decode"),
        Param("repack_draft", "auto", kind=object, cli=False,
              help="draft model weight repacking: auto|on|off (ngramspec.llama.repack)"),
    ), _lazy("ngramspec.llama.draft_model", "build_draft_simple"), live=True),
)

# (lower, upper) pairs that must be ordered when both are given; both names are reported.
ORDERED = (("ngram_mod_n_min", "ngram_mod_n_max"),)


def all_params() -> dict[str, Param]:
    """Every known engine keyword (all types), by name."""
    return {p.name: p for spec in TYPES.values() for p in spec.params}


def parse_types(spec_type) -> list[str]:
    """The type names of a ``--spec-type`` list, in llama.cpp's priority order.

    Parameters
    ----------
    spec_type : str or list of str
        A comma-separated string (``"ngram-mod,ngram-simple"``) or a list of names; ``none``
        is allowed and drops out.

    Returns
    -------
    list of str
        The names in `TYPES` order (the order ``common_speculative_init`` builds them in).

    Raises
    ------
    TypeError
        Not a string or a list of strings.
    ValueError
        An unknown name (the message lists the valid ones), or one ngramspec cannot run.
    """
    if isinstance(spec_type, str):
        names = [s.strip() for s in spec_type.split(",") if s.strip()]
    elif isinstance(spec_type, (list, tuple)) and all(isinstance(s, str) for s in spec_type):
        names = [s.strip() for s in spec_type]
    else:
        raise TypeError(f"spec_type must be a comma-separated string or a list of names, got "
                        f"{type(spec_type).__name__}")
    for name in names:
        if name in UNSUPPORTED:
            raise ValueError(f"spec type {name!r} is not supported by ngramspec: allowed "
                             f"{valid_types_text()}")
        if name not in TYPES and name != "none":
            raise ValueError(f"unknown spec type {name!r}: allowed {valid_types_text()}")
    return [name for name in TYPES if name in names]


def valid_types_text() -> str:
    """The names ``--spec-type`` accepts, as help and error messages list them."""
    return ", ".join(["none", *TYPES])


def check_values(spec_type, params: dict, *, by_flag: bool = False) -> dict:
    """Every known keyword, checked, with defaults for those not given.

    Parameters
    ----------
    spec_type : str or list of str
        The chain (its names are checked too).
    params : dict
        Keywords given.
    by_flag : bool
        Name parameters by their command-line flag in errors (the CLI), else by keyword.

    Returns
    -------
    dict
        name -> checked value, every parameter of every type.

    Raises
    ------
    TypeError, ValueError
        An unknown keyword, a value of the wrong kind or out of range, an unordered pair.
    """
    parse_types(spec_type)          # the chain's names are checked too
    known = all_params()
    for name in params:
        if name not in known:
            raise TypeError(f"unknown parameter {name!r}; known: {', '.join(sorted(known))}")

    def label(p):
        return p.flag if by_flag and p.cli else p.name

    values = {name: p.check(params[name], label(p)) if name in params else p.default
              for name, p in known.items()}
    for lo, hi in ORDERED:
        # Only a pair given together is refused: one given alone keeps llama.cpp's behaviour
        # with the other's default (llama-server accepts --spec-ngram-mod-n-max 0 alone).
        if lo in params and hi in params and values[lo] > values[hi]:
            bound = f"{label(known[lo])} <= {label(known[hi])}"
            raise Refused(label(known[lo]), f"{values[lo]} is greater than {label(known[hi])} = "
                                            f"{values[hi]}: allowed {bound}",
                          value=values[lo], allowed=bound, sep=" = ")
    return values


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return None


def check_slot_memory(types, n_slots: int) -> None:
    """Refuse an ``n_slots`` whose per-slot state could not fit this machine's memory.

    The allocations are lazy, so without this check a huge count (``n_slots = 10**7`` with
    ngram-map-k: 10 TB of hash indexes) is not refused up front but grows until the kernel
    kills the process.

    Parameters
    ----------
    types : list of str
        The chain (`parse_types`).
    n_slots : int

    Raises
    ------
    MemoryError
        ``n_slots = N is out of range: allowed 1 .. M``, with what a slot needs and the memory
        (a MemoryError as the allocation's own would be: the command line names ``--slots``).
    """
    per_slot = SLOT_BASE_BYTES * (1 + len(types)) + sum(TYPES[t].slot_bytes for t in types)
    memory = _physical_memory()
    if memory is None or n_slots * per_slot <= memory:
        return
    raise MemoryError(f"n_slots = {n_slots} is out of range: allowed 1 .. {memory // per_slot} "
                     f"(the proposers' per-slot state takes at least {per_slot} bytes a slot, "
                     f"{n_slots * per_slot / 2**30:.1f} GiB in all, more than this machine's "
                     f"{memory / 2**30:.1f} GiB of memory)")


def build_proposers(spec_type, n_slots: int, pool, params: dict) -> list:
    """Check `params` and build the chain's proposers in priority order.

    Parameters
    ----------
    spec_type : str or list of str
        The chain (`parse_types`).
    n_slots : int
        Slots of every proposer.
    pool : ModPool or None
        ngram-mod's table; a new one when the chain needs it and none is given.
    params : dict
        Engine keywords (`check_values`).

    Returns
    -------
    list of Proposer
        One per type, in priority order.

    Raises
    ------
    TypeError, ValueError
        As `check_values`.
    MemoryError
        `check_slot_memory`.
    """
    types = parse_types(spec_type)
    values = check_values(types, params)
    check_slot_memory(types, n_slots)
    if pool is None and any(TYPES[t].uses_pool for t in types):
        pool = ModPool()
    return [TYPES[t].builder(n_slots, pool, values) for t in types]

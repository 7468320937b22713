"""Tuning: replay a user's requests under every proposer setting and rank the settings.

The requests are split in order: the first part trains (it builds the static n-gram cache that
``--lookup-cache-static`` configurations use, as ``llama-lookup-create`` would from older logs),
the last part (``holdout``) is held out, and every configuration is replayed on the held-out part
only, with `ngramspec.replay.replay` in server state (one engine for all requests; request t on
slot t % K). Because llama.cpp's proposers are bit-exact, the figures are what llama-server
would draft and accept on those requests.

Figures per configuration: tokens per verification step and acceptance rate (replay's summary,
unchanged), and the modeled speed-up over plain decoding with a cost model
(`ngramspec.cost.modeled_speedup`)::

    speed-up = output tokens after the first / sum over steps of c(n_draft + 1, L)

where ``c(k, L)`` is the cost of verifying k tokens at L tokens of context relative to one
single-token decode; plain decoding spends c(1) = 1 per token (the first output token comes
from the prompt pass in both cases), so a configuration that never drafts scores exactly 1.

The sweep (`sweep_configs`, `GRIDS`): each llama.cpp type over its grid; ngram-cache with and
without the static cache; ngramspec's own options (map re-indexing, ngram-cache restart,
ngram-suffix); every configuration at each server slot count; then chains of the best
configuration of each type (`chain_configs`) and the cost-aware ``auto`` draft-length policy on
the best ones (`auto_configs`). Configurations run in parallel processes.
"""
from __future__ import annotations

import itertools
import math
import os
import shlex
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from ngramspec.cache_file import build_static_cache, load_cache, save_cache
from ngramspec.cost import modeled_speedup
from ngramspec.policy import POLICIES, AutoPolicy
from ngramspec.replay import replay
from ngramspec.registry import TYPES as _TYPES, all_params, parse_types
from ngramspec.traces import Request

__all__ = ["type_param_names", "GRIDS", "NGRAMSPEC_GRIDS", "LLAMA_TYPES", "NGRAMSPEC_OPTIONS",
           "Config", "Entry", "TuneReport", "split_requests", "sweep_configs", "chain_configs",
           "auto_configs", "evaluate", "tune", "STATIC"]

#: The types llama-server has (``--spec-type``); a configuration of these alone, with none of
#: `NGRAMSPEC_OPTIONS` switched on, runs on llama-server as it is.
LLAMA_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
#: ngramspec's switches beyond llama.cpp (off = llama.cpp's behaviour).
NGRAMSPEC_OPTIONS = ("ngram_map_k_reindex", "ngram_map_k4v_reindex", "ngram_cache_restart")

#: Marks "the static cache built from the training split" in a grid; `tune` puts the path of
#: that cache file in its place.
STATIC = "<static>"

#: The llama.cpp grid: for each type, the values of each parameter; configurations are the
#: cross product. ngram-simple's and ngram-map-k's ``min_hits`` are unused by llama.cpp
#: (``common_ngram_simple_draft`` never reads it, ``common_ngram_map_draft`` returns a key-only
#: draft before checking it), so they are not swept. ngram-mod's ``n_min`` is given as
#: fractions of ``n_max`` (`MOD_N_MIN_FRACTIONS`); llama.cpp's default 24/48/64 is on the grid.
#: ngram-cache has no parameter but its files; it runs without and with the static cache
#: (``-lcs``).
GRIDS: dict = {
    "ngram-simple": {"ngram_simple_size_n": (2, 3, 4, 6, 8, 12, 16),
                     "ngram_simple_size_m": (4, 8, 16, 32, 48, 64)},
    "ngram-map-k": {"ngram_map_k_size_n": (2, 3, 4, 6, 8, 12),
                    "ngram_map_k_size_m": (8, 16, 32, 48, 64)},
    "ngram-map-k4v": {"ngram_map_k4v_size_n": (3, 4, 6, 8, 12),
                      "ngram_map_k4v_size_m": (8, 16, 32, 64),
                      "ngram_map_k4v_min_hits": (1, 2)},
    "ngram-mod": {"ngram_mod_n_match": (8, 12, 16, 24, 32),
                  "ngram_mod_n_max": (8, 16, 32, 48, 64)},
    "ngram-cache": {"lookup_cache_static": (None, STATIC)},
}
MOD_N_MIN_FRACTIONS = (0.25, 0.5, 0.75)

#: ngramspec's own options, swept on top: the map types re-indexing a prompt that does not
#: extend the previous one (over the same grids), ngram-cache restarting its context cache per
#: request (with and without the static cache), and ngram-suffix's draft-length controls.
NGRAMSPEC_GRIDS: dict = {
    "ngram-map-k": {"ngram_map_k_reindex": (1,)},
    "ngram-map-k4v": {"ngram_map_k4v_reindex": (1,)},
    "ngram-cache": {"ngram_cache_restart": (1,)},
    "ngram-suffix": {"ngram_suffix_max_draft": (16, 32, 64, 256),
                     "ngram_suffix_min_prob": (0.005, 0.05)},
}

# The longest draft each type makes, for the speed-up-against-n_max plot (ngram-cache's is
# llama.cpp's hard-coded n_draft = 8).
_N_MAX_PARAM = {"ngram-simple": "ngram_simple_size_m", "ngram-map-k": "ngram_map_k_size_m",
                "ngram-map-k4v": "ngram_map_k4v_size_m", "ngram-mod": "ngram_mod_n_max",
                "ngram-suffix": "ngram_suffix_max_draft"}
_CACHE_N_DRAFT = 8


@dataclass(frozen=True)
class Config:
    """One setting: spec types (priority order), engine keywords, server slots.

    ``params`` is a sorted tuple of ``(name, value)`` so a Config is hashable and orders the
    same way every run. A static cache is named by its file path (or `STATIC` in a grid).

    Notes
    -----
    Memory: a few small tuples.

    Thread-safety: immutable; safe to share and to pickle to worker processes.
    """
    spec_type: str
    params: tuple
    n_slots: int = 1
    policy: str = "fixed"

    @classmethod
    def make(cls, types, params: dict, n_slots: int = 1, policy: str = "fixed") -> "Config":
        """A Config from spec types and keywords (None values dropped, the types in priority order).

        Parameters
        ----------
        types : str or list of str
            ``--spec-type`` names.
        params : dict
            Engine keywords.
        n_slots : int
        policy : {"fixed", "auto"}

        Returns
        -------
        Config

        Raises
        ------
        ValueError
            An unknown policy or spec type.
        """
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: allowed {', '.join(POLICIES)}")
        return cls(",".join(parse_types(types)),
                   tuple(sorted((k, v) for k, v in params.items() if v is not None)), n_slots,
                   policy)

    @property
    def types(self) -> list:
        """The spec types, in priority order."""
        return self.spec_type.split(",")

    @property
    def params_dict(self) -> dict:
        """`params` as a new dict."""
        return dict(self.params)

    @property
    def llama_compatible(self) -> bool:
        """True when llama-server runs it as it is (its types and llama.cpp's options only)."""
        p = self.params_dict
        return all(t in LLAMA_TYPES for t in self.types) and self.policy == "fixed" and \
            not any(p.get(name) for name in NGRAMSPEC_OPTIONS)

    @property
    def family(self) -> str:
        """The plot series: the type, with ngramspec options and the static cache named.

        The policy is not part of it.
        """
        p = self.params_dict
        extra = [name.rsplit("_", 1)[-1] for name in NGRAMSPEC_OPTIONS if p.get(name)]
        if p.get("lookup_cache_static"):
            extra.append("static")
        return self.spec_type + (f" +{'+'.join(extra)}" if extra else "")

    @property
    def n_max(self) -> Optional[int]:
        """The longest draft of a single-type configuration (None for chains)."""
        if len(self.types) != 1:
            return None
        t = self.types[0]
        if t == "ngram-cache":
            return _CACHE_N_DRAFT
        name = _N_MAX_PARAM.get(t)
        return self.params_dict.get(name, all_params()[name].default) if name else None

    def ordered_params(self) -> list:
        """``params`` in the registry's order (a type's flags in llama.cpp's order)."""
        order = {name: i for i, name in enumerate(all_params())}
        return sorted(self.params, key=lambda p: order[p[0]])

    def label(self) -> str:
        """The spec types and the parameters, short: ``ngram-mod n_match=24 n_min=48 ...``.

        A chain keeps the type in each name: ``mod_n_match=24``.
        """
        parts = [self.spec_type]
        for name, value in self.ordered_params():
            if name == "lookup_cache_static":
                parts.append("static")
                continue
            prefix = (self.spec_type.replace("-", "_") + "_") if len(self.types) == 1 \
                else "ngram_"
            parts.append(f"{name[len(prefix):] if name.startswith(prefix) else name}={value}")
        if self.policy != "fixed":
            parts.append(f"policy={self.policy}")
        return " ".join(parts)

    def engine_params(self, caches: Optional[dict] = None) -> dict:
        """Keywords for `SpecEngine`.

        Parameters
        ----------
        caches : dict, optional
            Path -> loaded ``NgramCache``: a static cache path found here is replaced by the cache.

        Returns
        -------
        dict
        """
        p = self.params_dict
        path = p.get("lookup_cache_static")
        if path is not None and caches is not None and path in caches:
            p["lookup_cache_static"] = caches[path]
        return p

    def flags(self, cost_model: str = "") -> list:
        """The command-line flags of this configuration.

        Parameters
        ----------
        cost_model : str
            For the auto policy, the ``--cost-model`` name or file to print ("" prints none).

        Returns
        -------
        list of str
            ``--spec-type``, one flag per parameter, and ``--spec-policy auto [--cost-model NAME]``.
        """
        known = all_params()
        argv = ["--spec-type", self.spec_type]
        for name, value in self.ordered_params():
            argv += [known[name].flag, str(value)]
        if self.policy != "fixed":
            argv += ["--spec-policy", self.policy]
            if cost_model:
                argv += ["--cost-model", cost_model]
        return argv

    def policy_factory(self, cost_model) -> Optional[Callable]:
        """What `replay` takes for this policy.

        Parameters
        ----------
        cost_model : CostModel
            The auto policy's cost model.

        Returns
        -------
        callable or None
            A factory of `AutoPolicy` (proposer time not counted); None for llama.cpp's fixed
            policy.
        """
        if self.policy == "fixed":
            return None
        # proposer time measured here says nothing about the machine the cost model describes
        # (as `ngramspec replay --spec-policy auto` does)
        return lambda: AutoPolicy(cost_model, proposer_time=False)


def type_param_names(spec_type: str) -> set:
    """The engine keywords of one spec type (from the registry).

    Parameters
    ----------
    spec_type : str

    Returns
    -------
    set of str
    """
    return {p.name for p in _TYPES[spec_type].params}


def _product(grid: dict) -> list:
    names = list(grid)
    return [dict(zip(names, values)) for values in itertools.product(*grid.values())]


def _type_grid(spec_type: str, grid: dict) -> list:
    combos = _product(grid)
    if spec_type == "ngram-mod":       # n_min as fractions of n_max
        combos = [dict(c, ngram_mod_n_min=max(1, int(c["ngram_mod_n_max"] * f)))
                  for c in combos for f in MOD_N_MIN_FRACTIONS]
    return combos


def sweep_configs(slots: Sequence[int] = (1,), types: Optional[Iterable[str]] = None,
                  ngramspec_options: bool = True, grids: Optional[dict] = None,
                  ngramspec_grids: Optional[dict] = None) -> list:
    """The single-type configurations of the sweep, at each slot count.

    Parameters
    ----------
    slots : sequence of int
        Slot counts.
    types : iterable of str, optional
        Restrict the sweep to these types (default: every llama.cpp type and ngram-suffix).
    ngramspec_options : bool
        Add ngramspec's own options (`NGRAMSPEC_GRIDS`) and ngram-suffix.
    grids, ngramspec_grids : dict, optional
        Replace `GRIDS` / `NGRAMSPEC_GRIDS`.

    Returns
    -------
    list of Config
        Without duplicates, in a fixed order.
    """
    grids = GRIDS if grids is None else grids
    extra = NGRAMSPEC_GRIDS if ngramspec_grids is None else ngramspec_grids
    wanted = None if types is None else set(parse_types(list(types)))
    out = []
    for t in parse_types(list(set(grids) | set(extra) if ngramspec_options else grids)):
        if wanted is not None and t not in wanted:
            continue
        base = _type_grid(t, grids.get(t, {})) if t in grids else [{}]
        combos = [dict(c) for c in base] if t in LLAMA_TYPES else []
        if ngramspec_options and t in extra:
            if t in LLAMA_TYPES:      # an option on top of the type's own grid
                combos += [dict(c, **o) for o in _product(extra[t]) for c in base]
            else:
                combos += _product(extra[t])
        for k in slots:
            out += [Config.make(t, c, k) for c in combos]
    return list(dict.fromkeys(out))


def chain_configs(best: Sequence[Config], max_len: int = 3) -> list:
    """Chains of single-type configurations: every pair, and the first `max_len` together.

    Parameters
    ----------
    best : sequence of Config
        One per type, best first (chains keep their slot count).
    max_len : int

    Returns
    -------
    list of Config
    """
    best = [c for c in best if len(c.types) == 1]
    chains = []
    for combo in itertools.combinations(best, 2):
        chains.append(combo)
    if len(best) >= 3 and max_len >= 3:
        chains.append(tuple(best[:max_len]))
    out = []
    for combo in chains:
        params = {}
        for c in combo:
            params.update(c.params_dict)
        out.append(Config.make([c.spec_type for c in combo], params, combo[0].n_slots))
    return list(dict.fromkeys(out))


def auto_configs(entries: Sequence, slots: Sequence[int]) -> list:
    """The auto policy (`ngramspec.policy.AutoPolicy`) on the best fixed-policy configurations.

    Parameters
    ----------
    entries : sequence of Entry
        Ranked, best first.
    slots : sequence of int

    Returns
    -------
    list of Config
        At each slot count, the best configuration of each type and the best chain, with
        ``policy="auto"``.
    """
    out = []
    for k in slots:
        best: dict = {}
        for e in entries:
            c = e.config
            if c.n_slots == k and c.policy == "fixed":
                best.setdefault(c.spec_type if len(c.types) == 1 else "chain", c)
        out += [Config.make(c.spec_type, c.params_dict, k, "auto") for c in best.values()]
    return out


def split_requests(requests: Sequence[Request], holdout: float) -> tuple:
    """Split requests into training and held-out parts, in order.

    Parameters
    ----------
    requests : sequence of Request
    holdout : float
        Fraction held out, 0 < holdout < 1: the last ``ceil(holdout * n)`` requests.

    Returns
    -------
    tuple of (list of Request, list of Request)
        (train, held-out).

    Raises
    ------
    ValueError
        `holdout` out of range, or a split that would be empty.
    """
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"--holdout {holdout}: allowed 0 < holdout < 1")
    n = len(requests)
    n_test = math.ceil(holdout * n)
    if n_test < 1 or n - n_test < 1:
        raise ValueError(f"--holdout {holdout} of {n} request(s) leaves an empty training or "
                         f"held-out split: give at least 2 requests")
    return list(requests[:n - n_test]), list(requests[n - n_test:])


FIGURES = ("n_traces", "n_output", "n_steps", "n_drafts", "n_draft_tokens", "n_acc_tokens",
           "tokens_per_step", "acc_rate")


def evaluate(config: Config, requests: Sequence[Request], cost_model, *, n_ctx: int = 0,
             caches: Optional[dict] = None) -> dict:
    """Replay `requests` with `config` (shared server state) and return its figures.

    Parameters
    ----------
    config : Config
    requests : sequence of Request
    cost_model : CostModel
    n_ctx : int
        Context size bounding drafts (0: none).
    caches : dict, optional
        Loaded static caches by path (`Config.engine_params`).

    Returns
    -------
    dict
        replay's summary fields (`FIGURES`, unchanged) plus `ngramspec.cost.modeled_speedup`'s
        ``tokens`` / ``cost`` (as ``modeled_tokens`` / ``modeled_cost``) and ``speedup``.
    """
    result = replay(requests, config.spec_type, config.engine_params(caches), state="shared",
                    n_slots=config.n_slots, n_ctx=n_ctx,
                    policy_factory=config.policy_factory(cost_model))
    figures = {k: result.summary[k] for k in FIGURES}
    m = modeled_speedup(result.requests, cost_model)
    figures.update(modeled_tokens=m["tokens"], modeled_cost=m["cost"], speedup=m["speedup"])
    return figures


# Per-process state of the worker pool: the held-out requests, the cost model and the loaded
# static caches, sent once per process instead of once per configuration.
_WORKER: dict = {}


def _init_worker(requests, cost_model, static_paths, n_ctx):
    _WORKER.update(requests=requests, cost_model=cost_model, n_ctx=n_ctx,
                   caches={p: load_cache(p) for p in static_paths})


def _run_one(index: int, config: Config):
    w = _WORKER
    return index, evaluate(config, w["requests"], w["cost_model"], n_ctx=w["n_ctx"],
                           caches=w["caches"])


@dataclass
class Entry:
    """A configuration and its figures (`evaluate`'s dict).

    Notes
    -----
    Memory: one small dict.

    Thread-safety: plain data; do not mutate one from several threads.
    """
    config: Config
    figures: dict

    def key(self):
        """Ranking key: speed-up, then tokens per step, then acceptance (all descending).

        Equal figures put the simpler configuration first (fewer types, fewer parameters), then
        order by label and slot count, so the ranking is the same every run.
        """
        f = self.figures
        return (-f["speedup"], -f["tokens_per_step"], -f["acc_rate"], len(self.config.types),
                len(self.config.params), self.config.label(), self.config.n_slots)

    def to_dict(self) -> dict:
        """The configuration's fields and label, and the figures, JSON-ready."""
        c = self.config
        return {"spec_type": c.spec_type, "params": c.params_dict, "slots": c.n_slots,
                "policy": c.policy, "label": c.label(), "llama_compatible": c.llama_compatible,
                **self.figures}


@dataclass
class TuneReport:
    """The ranked entries and what they were computed on (see `tune`).

    Notes
    -----
    Memory: one `Entry` per configuration replayed (a few hundred bytes each).

    Thread-safety: plain data; read-only use from several threads is safe.
    """
    entries: list                      # ranked, best first
    n_train: int
    n_heldout: int
    slots: tuple
    cost_model: str
    static_cache: Optional[str] = None
    n_ctx: int = 0
    extra: dict = field(default_factory=dict)

    def best(self, n_slots: int, llama_compatible: bool) -> Optional[Entry]:
        """The best entry at `n_slots`.

        Parameters
        ----------
        n_slots : int
        llama_compatible : bool
            Only entries llama-server runs as they are.

        Returns
        -------
        Entry or None
        """
        for e in self.entries:
            if e.config.n_slots == n_slots and (e.config.llama_compatible or
                                                not llama_compatible):
                return e
        return None

    def server_command(self, entry: Entry, model: str = "MODEL.gguf") -> str:
        """The llama-server command line of a llama.cpp-compatible entry.

        Parameters
        ----------
        entry : Entry
        model : str
            The model path to print.

        Returns
        -------
        str

        Raises
        ------
        ValueError
            The entry uses ngramspec options llama-server does not have.
        """
        if not entry.config.llama_compatible:
            raise ValueError(f"{entry.config.label()} uses ngramspec options llama-server "
                             f"does not have")
        argv = ["llama-server", "-m", model, *entry.config.flags(),
                "--parallel", str(entry.config.n_slots)]
        if self.n_ctx:
            argv += ["--ctx-size", str(self.n_ctx)]
        return shlex.join(argv)

    def replay_command(self, entry: Entry, heldout: str) -> str:
        """The ``ngramspec replay`` command that reproduces an entry's figures, its modeled
        speed-up included (``--cost-model`` always given).

        Parameters
        ----------
        entry : Entry
        heldout : str
            The held-out trace file to print.

        Returns
        -------
        str
        """
        argv = ["ngramspec", "replay", heldout, *entry.config.flags(self.cost_model),
                "--slots", str(entry.config.n_slots)]
        if self.n_ctx:
            argv += ["--ctx-size", str(self.n_ctx)]
        if self.cost_model and "--cost-model" not in argv:
            # replay prints the modeled speed-up too, priced as tune priced it
            argv += ["--cost-model", self.cost_model]
        return shlex.join(argv)

    def to_dict(self) -> dict:
        """The report as JSON-ready data: settings and the ranking (rank from 1)."""
        return {"n_train": self.n_train, "n_heldout": self.n_heldout, "slots": list(self.slots),
                "cost_model": self.cost_model, "static_cache": self.static_cache,
                "n_ctx": self.n_ctx, **self.extra,
                "ranking": [dict(rank=i + 1, **e.to_dict()) for i, e in enumerate(self.entries)]}


def _best_per_type(entries: Sequence[Entry], n_slots: int, llama_compatible: bool) -> list:
    best: dict = {}
    for e in entries:             # entries are ranked: the first of a type is its best
        c = e.config
        if c.n_slots != n_slots or len(c.types) != 1 or \
                (llama_compatible and not c.llama_compatible):
            continue
        best.setdefault(c.spec_type, c)
    return list(best.values())


def _rank(configs: Sequence[Config], figures: Sequence[dict]) -> list:
    return sorted((Entry(c, f) for c, f in zip(configs, figures)), key=Entry.key)


#: Worker processes per core at most: a replay is CPU-bound, so more workers than this only
#: add forked processes and their memory (``--jobs 1500`` forked ~1,400 for ~60 settings).
JOBS_PER_CORE = 2


def available_cores() -> int:
    """The cores this process may run on (its affinity), at least one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:      # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def worker_count(jobs: int, n_work: int, cores: Optional[int] = None) -> int:
    """The worker processes `tune` starts for ``jobs`` asked: at most one per configuration of
    the sweep's first round (``n_work``, its largest) and `JOBS_PER_CORE` per core."""
    cores = available_cores() if cores is None else cores
    return max(1, min(jobs, n_work, JOBS_PER_CORE * cores))


def tune(train: Sequence[Request], heldout: Sequence[Request], cost_model, *,
         slots: Sequence[int] = (1,), types: Optional[Iterable[str]] = None,
         ngramspec_options: bool = True, chains: bool = True, auto: bool = True,
         static_path: Optional[str] = None,
         n_ctx: int = 0, jobs: int = 1, progress: Optional[Callable] = None,
         grids: Optional[dict] = None, ngramspec_grids: Optional[dict] = None,
         cost_name: str = "", note: Optional[Callable[[str], None]] = None) -> TuneReport:
    """Sweep, replay every configuration on `heldout`, rank.

    Parameters
    ----------
    train, heldout : sequences of `traces.Request`
        `train` only builds the static cache (written to `static_path`; without a path the
        static-cache configurations are left out).
    cost_model
        An object with ``cost(n_tokens, n_past)`` (`ngramspec.cost`); must pickle when
        ``jobs > 1``.
    slots : sequence of int
        Server slot counts to sweep.
    types : iterable of str, optional
        Restrict the sweep to these types (default all).
    ngramspec_options, chains, auto : bool
        Sweep ngramspec's own options too; try chains of the best setting of each type; try
        the ``auto`` draft-length policy on the best of each type and the best chain (an
        ngramspec option: left out without `ngramspec_options`).
    static_path : str, optional
        Where the static cache built from `train` is written.
    n_ctx : int
        Context size bounding drafts (0: none).
    jobs : int
        Worker processes asked for (1: in this process); capped by `worker_count` (the
        configurations to replay, `JOBS_PER_CORE` per core), which `note` is told.
    progress : callable, optional
        Called as ``progress(done, total)`` after each configuration.
    grids, ngramspec_grids : dict, optional
        Replace `GRIDS` / `NGRAMSPEC_GRIDS`.
    cost_name : str
        The cost model's name or file, as the printed commands give it.
    note : callable(str), optional
        Told, in one sentence, when fewer worker processes start than `jobs` asked for.

    Returns
    -------
    TuneReport
        Ranked by modeled speed-up; ties by tokens per step, acceptance, label (deterministic).

    Notes
    -----
    Memory: each worker holds the held-out requests, the static cache and one engine at a time.

    Thread-safety: call from one thread; the work runs in `jobs` processes.
    """
    slots = tuple(dict.fromkeys(int(k) for k in slots))
    if not slots or min(slots) < 1:
        raise ValueError(f"--slots {slots}: allowed integers >= 1")
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: allowed >= 1")
    static_paths = []
    if static_path is not None:
        save_cache(build_static_cache(np.concatenate([r.prompt, r.output]) for r in train),
                   static_path)
        static_paths = [static_path]
    configs = [c for c in sweep_configs(slots, types, ngramspec_options, grids, ngramspec_grids)
               if static_path is not None or c.params_dict.get("lookup_cache_static") is None]
    configs = [_with_static(c, static_path) for c in configs]
    if not configs:
        swept = parse_types(list(set(GRIDS) | set(NGRAMSPEC_GRIDS)))
        raise ValueError(f"--types: nothing to sweep; the types tune sweeps are "
                         f"{', '.join(swept)}")
    workers = worker_count(jobs, len(configs))
    if workers < jobs and note is not None:
        note(f"--jobs {jobs}: {workers} worker processes ({len(configs)} configurations to "
             f"replay, at most {JOBS_PER_CORE} per core on {available_cores()} cores)")
    with _Runner(workers, progress, (list(heldout), cost_model, static_paths, n_ctx)) as runner:
        figures = runner.run(configs)
        if chains:
            configs, figures = _add_chains(runner, configs, figures, slots)
        if auto and ngramspec_options:
            extra = auto_configs(_rank(configs, figures), slots)
            figures = figures + runner.run(extra)
            configs = configs + extra
    entries = _rank(configs, figures)
    return TuneReport(entries, len(train), len(heldout), slots, cost_name,
                      static_path, n_ctx)


class _Runner:
    """Replays configurations in this process or in `jobs` worker processes, ticking the
    progress callback after each; a ``with`` block shuts the workers down (Ctrl-C included:
    the queued rest does not run)."""

    def __init__(self, jobs: int, progress: Optional[Callable], worker_args: tuple):
        self.progress = progress
        self.done = self.total = 0
        self.pool = None
        if jobs > 1:
            self.pool = ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker,
                                            initargs=worker_args)
        else:
            _init_worker(*worker_args)

    def __enter__(self) -> "_Runner":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def _tick(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)

    def run(self, batch: Sequence[Config]) -> list:
        """Each configuration's figures, in `batch`'s order."""
        self.total += len(batch)
        figures = [None] * len(batch)
        if self.pool is None:
            for i, c in enumerate(batch):
                figures[i] = _run_one(i, c)[1]
                self._tick()
            return figures
        futures = [self.pool.submit(_run_one, i, c) for i, c in enumerate(batch)]
        for fut in as_completed(futures):
            i, f = fut.result()
            figures[i] = f
            self._tick()
        return figures


def _add_chains(runner: _Runner, configs: list, figures: list, slots) -> tuple:
    """The chains of each slot count's best settings per type (llama.cpp-compatible ones, then
    any), replayed; a chain that drafted exactly as one of its members is left out."""
    entries = _rank(configs, figures)
    extra = []
    for k in slots:
        for compatible in (True, False):
            extra += chain_configs(_best_per_type(entries, k, compatible))
    extra = [c for c in dict.fromkeys(extra) if c not in set(configs)]
    extra_figures = runner.run(extra)
    single = dict(zip(configs, figures))
    configs, figures = list(configs), list(figures)
    for c, f in zip(extra, extra_figures):
        if not _same_as_a_member(c, f, single):
            configs.append(c)
            figures.append(f)
    return configs, figures


# Replay's counters: two configurations with equal counters drafted exactly the same.
_COUNTERS = ("n_steps", "n_drafts", "n_draft_tokens", "n_acc_tokens")


def _same_as_a_member(chain: Config, figures: dict, single: dict) -> bool:
    """True when a chain drafted exactly as one of its members alone (the first type always
    drafted first, say): it adds nothing but a longer command line."""
    params = chain.params_dict
    for t in chain.types:
        names = type_param_names(t)
        member = Config.make(t, {k: v for k, v in params.items() if k in names}, chain.n_slots)
        f = single.get(member)
        if f is not None and all(f[k] == figures[k] for k in _COUNTERS):
            return True
    return False


def _with_static(config: Config, path: Optional[str]) -> Config:
    if config.params_dict.get("lookup_cache_static") != STATIC:
        return config
    return Config.make(config.spec_type, dict(config.params_dict, lookup_cache_static=path),
                       config.n_slots, config.policy)

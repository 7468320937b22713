"""The store log: a replicated log of finished requests that the replicas of an engine share,
so that each replica's ngram-suffix store learns from every replica's traffic.

One setting selects the log everywhere: ``NGRAMSPEC_STORE`` for the vLLM and SGLang plug-ins,
``--store`` for ``serve``, ``run-batch`` and ``replay``:

* ``memory:NAME`` -- in-process (tests, benchmarks);
* ``dir:PATH`` -- a directory shared by the processes of one host (no server);
* ``redis://HOST:PORT/DB?stream=NAME`` (``rediss://`` too) -- Redis >= 7 or Valkey Streams,
  for replicas on several nodes (the ``store`` extra installs the client).

`attach` starts a `Replica` for an engine's ngram-suffix proposer: a background thread that
publishes its finished requests and ingests the others' (see `ngramspec.store_log.replica`).

Thread-safety: `open_log` and `attach` may be called from any thread; see each class.
"""
from __future__ import annotations

import os

from ngramspec._suffix import SuffixProposer
from ngramspec.store_log.backends import DirectoryLog, LogUnavailable, MemoryLog, memory_log
from ngramspec.store_log.entry import FORMAT_VERSION, BadEntry
from ngramspec.store_log.redis_log import RedisLog
from ngramspec.store_log.replica import Replica, replicas
from ngramspec.validation import Refused

__all__ = ["ENV", "FORMAT_VERSION", "BadEntry", "DirectoryLog", "LogUnavailable", "MemoryLog",
           "RedisLog", "Replica", "attach", "attach_from_env", "check_spec", "open_log",
           "replicas"]

#: The environment variable the plug-ins read.
ENV = "NGRAMSPEC_STORE"
_FORMS = "memory:NAME, dir:PATH or redis://HOST:PORT/DB?stream=NAME"


def check_spec(spec: str, field: str = "--store") -> str:
    """`spec` if it names a log in one of the accepted forms, else `Refused` naming `field`
    (checked before any connection, so a command line fails at once)."""
    if not isinstance(spec, str) or not spec.strip():
        raise Refused(field, f"must name a store log: {_FORMS}", value=spec)
    kind, _, rest = spec.partition(":")
    if kind in ("memory", "dir") and rest:
        return spec
    if kind in ("redis", "rediss") and rest.startswith("//") and len(rest) > 2:
        return spec
    raise Refused(field, f"{spec!r} is not a store log: allowed {_FORMS}", value=spec)


def open_log(spec: str, field: str = "--store"):
    """The backend `spec` names (`check_spec`'s forms). A Redis log needs the ``redis``
    package (ImportError says which extra); its server is first contacted by the replica."""
    kind, _, rest = check_spec(spec, field).partition(":")
    if kind == "memory":
        return memory_log(rest)
    if kind == "dir":
        return DirectoryLog(rest)
    return RedisLog(spec, field=field)


def suffix_proposer(engine, field: str = "--store") -> SuffixProposer:
    """The engine's ngram-suffix proposer (the one with a global store), or `Refused`."""
    found = [p for p in engine.proposers if isinstance(p, SuffixProposer)]
    if not found or found[0].global_stats()["budget"] < 2:
        raise Refused(field, "shares ngram-suffix's global store: the engine has no "
                             "ngram-suffix proposer with a global store (--spec-type "
                             "ngram-suffix, global_tokens >= 2)")
    return found[0]


def attach(engine, spec: str, *, model: str = "", n_vocab=None, field: str = "--store",
           start: bool = True, **options) -> Replica:
    """A `Replica` of `engine`'s ngram-suffix store on the log `spec`, its thread started.

    Parameters
    ----------
    engine : SpecEngine
        With an ngram-suffix proposer (``Refused`` naming `field` otherwise).
    spec : str
        ``memory:NAME``, ``dir:PATH`` or ``redis://...?stream=NAME``.
    model, n_vocab
        The vocabulary's identity and size (`Replica`): replicas of one model must agree.
    start : bool
        False: no thread; the caller runs `Replica.sync` (deterministic benchmarks).
    **options
        `Replica`'s other keywords.
    """
    replica = Replica(suffix_proposer(engine, field), open_log(spec, field), model=model,
                      n_vocab=n_vocab, **options)
    return replica.start() if start else replica


_FROM_ENV: list = []


def attach_from_env(engine, *, model: str = "", n_vocab=None, environ=None):
    """`attach` to the log ``NGRAMSPEC_STORE`` names, or None when it is unset or empty (the
    plug-ins' one call where they build their engine).

    One replica per process: a new call first stops the replica of the previous one (a
    plug-in that rebuilds its engine, e.g. on SGLang's cache flush, leaves no thread behind).
    The plug-ins pass no `model`: replicas of one deployment share a stream, and a stream
    (``?stream=NAME``, a directory) per model keeps vocabularies apart."""
    spec = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not spec:
        return None
    while _FROM_ENV:
        _FROM_ENV.pop().stop()
    replica = attach(engine, spec, model=model, n_vocab=n_vocab, field=ENV)
    _FROM_ENV.append(replica)
    return replica


"""``ngramspec serve``: the OpenAI-compatible server (`ngramspec.server`) under uvicorn.

Everything that can fail on the command line fails before the model loads, as one line on
stderr with exit code 2: a bad flag, a missing model file, a corrupt cache file, a port that
cannot be bound (the socket is bound here, before the model, and handed to uvicorn).
"""
from __future__ import annotations

import os
import signal
import socket
import sys

from ngramspec import store_log
from ngramspec.cli.common import (add_context_flags, add_deterministic_flag, add_model_flags,
                                  add_slots_flag, add_store_flag, amend_help, check_model_file,
                                  int_arg, positive_int)
from ngramspec.cli.live_flags import profile_defaults_text, spec_types
from ngramspec.config import SpecConfig, add_policy_arguments, add_spec_arguments, number_arg
from ngramspec.llama.backend import LlamaBackend
from ngramspec.llama.model import default_model_path, load_model
from ngramspec.llama.scheduler import Scheduler
from ngramspec.server import limits
from ngramspec.server.reasoning import REASONING_FORMATS
from ngramspec.validation import OutOfRange

# Seconds uvicorn lets running requests finish after SIGTERM/SIGINT before cancelling them;
# at most a day (asyncio's timers overflow on values such as 1e308).
GRACEFUL_S = 5.0
MAX_GRACEFUL_S = 86400.0


def add_parser(subparsers):
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with per-request speculative decoding",
        description="Serve /v1/completions and /v1/chat/completions (streaming with SSE), "
                    "/v1/models, /health and /metrics (Prometheus) on the batched scheduler: "
                    "--slots requests decode together, each with its own proposer state; a "
                    "request's \"speculative\" object chooses its proposers, n_max, n_min, "
                    "policy, or switches speculation off. Spec defaults of the commands that decode "
                    "with a model: " + profile_defaults_text("serve")
                    + " (llama.cpp's 48..64 are tuned for GPUs).")
    add_serving_flags(p)
    add_request_limit_flags(p, "a larger one is answered 413 before it is read")
    p.add_argument("--queue-size", type=positive_int, default=64, metavar="N",
                   help="requests waiting for a slot before new ones get 503 "
                        "(default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s: this machine only)")
    p.add_argument("--port", type=int_arg(0, 65535), default=8080,
                   help="port to bind, 0 = any free port (default: %(default)s)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("NGRAMSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on the API and its /openapi.json "
                        "(the /docs pages are then off); comma list for several keys, an empty "
                        "or blank key is refused (default: $NGRAMSPEC_API_KEY, else no key)")
    p.add_argument("--read-timeout", type=number_arg(float, 0.001), default=None, metavar="S",
                   help="seconds a client may take to send a request's headers, and then its "
                        "body, before the connection is closed (headers) or answered 408 "
                        "(body) (default: 30)")
    p.add_argument("--cache-isolation", choices=("shared", "per-key"), default="shared",
                   help="whose cached prompt a request may reuse: shared = anyone's, as "
                        "llama-server (timings.cache_n and the prompt's time then tell a client "
                        "how much of its prompt others sent: see the README's security notes); "
                        "per-key = only what requests of the same API key left (without "
                        "--api-key: of the same client address) (default: %(default)s)")
    p.add_argument("--hide-cache-n", action="store_true",
                   help="leave timings.cache_n out of responses, with the prompt's other "
                        "timings that give it away (prompt_n, prompt_ms, prompt rates)")
    p.add_argument("--limit-concurrency", type=int_arg(1, 65536), default=None, metavar="N",
                   help="connections and requests the server holds at once; more are answered "
                        "503 at once (uvicorn's limit_concurrency), so that many simultaneous "
                        "large bodies cannot add up (default: 2 x (slots + queue size) + 128)")
    p.add_argument("--timeout-graceful-shutdown", type=number_arg(float, 0.0, MAX_GRACEFUL_S),
                   default=GRACEFUL_S,
                   metavar="S", help="seconds running requests may finish after SIGTERM before "
                                     "they are cancelled (default: %(default)s)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default: %(default)s)")
    p.set_defaults(run=run)
    return p


def add_serving_flags(p, temp: float = 0.8) -> None:
    """The flags of the served models shared by ``serve`` and ``run-batch``: model, context,
    slots, request defaults, reasoning format and speculation."""
    add_model_flags(p)
    add_context_flags(p, ctx_help="context size in tokens for all slots together, split evenly "
                                  "between them as llama-server does (default: %(default)s: "
                                  "1024 tokens per request, prompt included, with the default "
                                  "4 slots; raise it for longer prompts)")
    add_slots_flag(p, default=4, help="requests decoded together, each in a slot of --ctx-size "
                                      "/ N tokens (default: %(default)s: up to four "
                                      "requests share each decode)")
    p.add_argument("-a", "--alias", metavar="NAME", default=None,
                   help="model id reported by /v1/models (default: the GGUF's file name)")
    p.add_argument("--temp", type=number_arg(float, 0.0), default=temp, metavar="X",
                   help="temperature of requests that give none (default: %(default)s, "
                        "llama-server's; 0 = greedy)")
    p.add_argument("-n", "--n-predict", type=int, default=-1, metavar="N",
                   help="max_tokens of requests that give none; -1 = until EOS or the slot's "
                        "context is full (default: %(default)s, as llama-server)")
    p.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="none",
                   help="none: a chat output's <think>...</think> stays in message.content; "
                        "deepseek: it becomes message.reasoning_content (delta.reasoning_content "
                        "when streamed), as llama-server's flag (default: %(default)s)")
    add_spec_arguments(p, "serve", include_live=True)
    add_store_flag(p)
    # the policy of requests that choose none; --policy is its old spelling
    add_policy_arguments(p, "serve", why="what llama-server does; auto first measures the "
                                             "server's context at start",
                     auto=" (all slots' drafts of a step chosen together)",
                     cost_default="the server's own calibration of its context: measured at "
                                  "start with --spec-policy auto, cached per model, threads "
                                  "and batch size")
    amend_help(p, "lookup_cache_dynamic", "; the server only reads it")
    add_deterministic_flag(p)


def add_request_limit_flags(p, too_large: str) -> None:
    """The bounds on what one request may hold, shared by ``serve`` and ``run-batch`` (one
    definition, `ngramspec.server.limits`' defaults); ``too_large`` says what happens to a
    larger body. `request_limits` turns them into `create_app`'s keywords."""
    p.add_argument("--max-body-size", type=int_arg(1024), default=None, metavar="BYTES",
                   help=f"largest request body; {too_large} (default: "
                        f"{limits.MAX_BODY_SIZE >> 20} MiB)")
    p.add_argument("--escape-special-in-input", action="store_true",
                   help="tokenize chat messages' content as plain text: '<|im_start|>' in a "
                        "message stays text instead of becoming the special token, so a user "
                        "cannot forge system turns (llama-server parses it; default: parsed, "
                        "as llama-server)")


def request_limits(args) -> dict:
    """`create_app`'s keywords of `add_request_limit_flags`' flags."""
    return {"max_body_size": args.max_body_size or limits.MAX_BODY_SIZE,
            "special_in_content": not args.escape_special_in_input}


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot bind: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def build_scheduler(args):
    """The scheduler of the parsed flags (model loaded, not started), and with
    ``--model-draft`` the draft model's own scheduler (its weights shared with the target's
    draft-simple proposer, its own context and slots, no speculation) to serve it alone.

    Returns
    -------
    (model path, Scheduler, dict of model id to Scheduler)
    """
    # flags, files and the cost model first: each fails before any model loads
    spec = SpecConfig.from_args(args, "serve").with_files_loaded()
    spec_types(args)        # draft-simple needs --model-draft
    check_model_file("--model", args.model)
    check_model_file("--model-draft", args.model_draft)
    model = args.model
    if model is None:
        model = default_model_path()
    draft, others = args.model_draft, {}
    if draft is not None:
        draft = load_model(args.model_draft, n_ctx=64, n_batch=64,
                           n_threads=spec.params.get("threads_draft") or args.threads,
                           repack=spec.params.get("repack_draft", "auto"),
                           deterministic=args.deterministic)
        spec = spec.with_params(model_draft=draft)   # its weights shared with its own server
        name = os.path.basename(args.model_draft)
        # the embedded model as its own draft (or two files of one name): the draft's id differs
        others[name if name != (args.alias or os.path.basename(model)) else name + "-draft"] \
            = draft
    sizes = dict(n_slots=args.slots, n_ctx=args.ctx_size, n_batch=args.batch_size,
                 n_threads=args.threads, queue_size=args.queue_size,
                 deterministic=args.deterministic)
    target = Scheduler(model, spec, **sizes)
    if args.store:
        store_log.attach(target.engine, args.store, model=os.path.basename(model),
                         n_vocab=target.n_vocab)
    for name, llm in others.items():
        # the small model alone, as if it were a separate one: plain decoding in its own
        # context (its n-gram caches would otherwise share the target's files)
        others[name] = Scheduler(llm, SpecConfig.from_keywords("none"), **sizes)
    return model, target, others


def check_serving_flags(args) -> None:
    """What `add_serving_flags`' types cannot check alone, before any model loads."""
    try:
        import fastapi  # noqa: F401  (the serve extra)
    except ImportError as exc:
        raise ImportError(f"{args.command} needs the 'serve' extra "
                          f"(pip install 'ngramspec[serve]'): {exc}") from None
    # a request without max_tokens gets --n-predict: more than a slot's context (llama.cpp may
    # round the context up, never down) would refuse every such request with a 400
    n_ctx_slot = args.ctx_size // args.slots
    if args.n_predict != -1 and not 1 <= args.n_predict <= n_ctx_slot:
        raise OutOfRange("--n-predict", args.n_predict,
                         f"-1 (until EOS or a full slot) or 1 .. {n_ctx_slot} (a slot's context: "
                         f"--ctx-size {args.ctx_size} / --slots {args.slots})")
    if args.store and "ngram-suffix" not in args.spec_type.split(","):
        raise ValueError("--store shares ngram-suffix's global store: add ngram-suffix to "
                         "--spec-type")


def build_app(args, **options):
    """The app (`ngramspec.server.create_app`) of the parsed serving flags, its models loaded.

    Returns
    -------
    (fastapi.FastAPI, LlamaBackend, str)
        The app, its main model's backend and its model id; ``options`` go to ``create_app``.
    """
    from ngramspec.server import create_app

    model, scheduler, others = build_scheduler(args)
    name = args.alias or os.path.basename(model)
    backend = LlamaBackend(scheduler)
    app = create_app(backend, model_name=name, defaults={"temperature": args.temp},
                     n_predict=args.n_predict, reasoning_format=args.reasoning_format,
                     models={k: LlamaBackend(s) for k, s in others.items()}, **options)
    return app, backend, name


def default_concurrency(args) -> int:
    """``--limit-concurrency``'s default: room for every request the scheduler can hold (its
    slots and queue) twice over — a request being read or refused beside each — and for idle
    kept-alive connections and probes (``/health``, ``/metrics``). The bodies' memory is
    bounded apart (`ngramspec.server.limits.BODY_BUDGET_BODIES`)."""
    return 2 * (args.slots + args.queue_size) + 128


def run(args) -> int:
    check_serving_flags(args)
    import uvicorn

    from ngramspec.server.auth import parse_api_keys
    from ngramspec.server.shutdown import DRAIN_S, DrainingServer

    parse_api_keys(args.api_key)  # a blank key fails here, before the model loads
    read_timeout = args.read_timeout or limits.READ_TIMEOUT_S
    sock = _bind(args.host, args.port)
    try:
        app, _, name = build_app(args, api_key=args.api_key,
                                 stop_timeout=max(5.0, args.timeout_graceful_shutdown),
                                 read_timeout=read_timeout, cache_isolation=args.cache_isolation,
                                 hide_cache_n=args.hide_cache_n, **request_limits(args))
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        # One line a supervisor (or a test) can wait for, printed before requests are served.
        sys.stdout.write(f"ngramspec serve: model {name}, {args.slots} slots, listening on "
                         f"http://{shown}:{port}\n")
        sys.stdout.flush()
        # The h11 protocol with a deadline on request headers (uvicorn has none); the
        # DrainingServer ends the requests still running when the grace period is over, and
        # uvicorn gives their answers DRAIN_S more seconds.
        config = uvicorn.Config(
            app, log_level=args.log_level, lifespan="on",
            limit_concurrency=args.limit_concurrency or default_concurrency(args),
            http=limits.HeaderTimeoutH11Protocol.with_header_timeout(read_timeout),
            timeout_graceful_shutdown=args.timeout_graceful_shutdown + DRAIN_S)
        # uvicorn re-raises the signal that stopped it once it has shut down; a no-op handler
        # makes that graceful stop an ordinary exit (code 0) instead of a death by SIGTERM.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        DrainingServer(config, app.state.drain, args.timeout_graceful_shutdown).run(
            sockets=[sock])
    finally:
        sock.close()
    return 0


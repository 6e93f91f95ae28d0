"""``exitlm serve``: the OpenAI-compatible HTTP server.

    exitlm serve                                   # SmolLM2-135M-Instruct on 127.0.0.1:8000
    exitlm serve default-ee --strategy self-spec --num-speculations 3 --port 8080
    exitlm serve ./runs/ls/model --strategy early-exit --threshold 0.8 --api-key secret
    exitlm serve default-ee --tp 2                 # two processes, each with half the model

The model loads the way ``exitlm generate`` loads it (a strategy other than ``ar`` on a model
without exits gets LayerSkip-style exits at every layer; a model without a tokenizer gets one
token per byte). It prints a line as each start-up phase begins (loading, preparing the
engine) and, once the server listens, ``exitlm serve: listening on URL`` (``--port 0`` picks
a free port) and the request limits (:mod:`exitlm.serve.limits`). SIGINT (Ctrl-C) or
SIGTERM stops accepting connections, lets requests in flight finish for up to
``--drain-timeout`` seconds, then stops the engine and exits with status 0; a second Ctrl-C
stops at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import time
from typing import Any

from exitlm.args import (
    float_at_least,
    int_at_least,
    non_negative_float,
    positive_float,
    thread_count,
)
from exitlm.config import ConfigError
from exitlm.infer.cli import DTYPES, load_for_strategy, rank_draft_vocab, tokenizer_for
from exitlm.infer.flags import add_head_dtype_flag, add_strategy_flags, strategy_overrides
from exitlm.infer.strategies import STRATEGIES, get_strategy

PREFILL_CHUNK = 256
"""``--prefill-chunk``'s default: about the most prompt positions prefilled in one step (the
engine's ``prefill_chunk``). SmolLM2-135M, one thread, a 1,024-token prompt arriving while two
requests decode: parts of 256 held them at most 0.73 s (fp32) / 0.96 s (int8) instead of
2.9 / 4.0 s, and the long request's first token came no later than with the whole prefill;
parts of 128 held them 0.43 / 0.64 s (docs/measurements/chunked_prefill_2026-11-27.md)."""

log = logging.getLogger("exitlm.serve")


def register(subparsers: Any) -> None:
    """Add the ``serve`` sub-command to the ``exitlm`` parser."""
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
                    "/metrics) on the decoding engine, with early-exit statistics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", nargs="?", default="default", metavar="MODEL",
                   help="'default' (embedded SmolLM2-135M-Instruct), 'default-ee', a "
                        "checkpoint directory, a .gguf file, or a preset name")
    p.add_argument("--strategy", default="ar", choices=sorted(STRATEGIES),
                   help="decoding strategy")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int_at_least(0, 65535), default=8000,
                   help="port to listen on (0: any free port)")
    p.add_argument("--max-batch", type=int_at_least(1), default=8,
                   help="the most requests decoded together (continuous batching)")
    p.add_argument("--max-queue", type=int_at_least(1), default=256,
                   help="the most requests waiting for a slot; beyond it requests get 503")
    p.add_argument("--max-seq-len", type=int_at_least(1), default=None,
                   help="the longest prompt + completion served (default: the model's context)")
    p.add_argument("--prefill-chunk", type=int_at_least(0), default=PREFILL_CHUNK, metavar="N",
                   help="prefill about N prompt tokens per step (longer prompts in parts), "
                        "so that the running requests keep decoding in between (0: every "
                        "prompt whole when admitted, holding the others for its prefill)")
    p.add_argument("--max-prompts", type=int_at_least(1), default=256,
                   help="the most prompts one /v1/completions request may hold (a 400 beyond)")
    p.add_argument("--max-request-bytes", type=int_at_least(1), default=4 * 2**20,
                   help="the largest request body read (a 400 beyond); parsing holds every "
                        "other request for about 5-20 ms per MiB")
    p.add_argument("--max-prompt-tokens", type=int_at_least(1), default=None,
                   help="the most tokens one prompt may have, a 400 beyond (None: the "
                        "context, --max-seq-len)")
    p.add_argument("--max-completion-tokens", type=int_at_least(1), default=None,
                   help="the largest max_tokens one choice may ask for, a 400 beyond (None: "
                        "the context); it also caps the default max_tokens")
    p.add_argument("--request-timeout", type=positive_float, default=60.0, metavar="S",
                   help="seconds a client has to send a whole request (head and body) once it "
                        "connects or starts one; then the connection is closed (generating "
                        "the answer has no deadline)")
    p.add_argument("--max-connections", type=int_at_least(1), default=1024, metavar="N",
                   help="connections open at once; one accepted beyond them is closed at once "
                        "(lowered to fit the process's open-file limit)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                        "/detokenize (default: $EXITLM_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: MODEL as given)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights: float32/float16/bfloat16, or int8/int4 weight-only quantized")
    add_head_dtype_flag(p)
    p.add_argument("--threads", type=thread_count, default=None,
                   help="CPU threads per decoding step (default: measured while decoding)")
    p.add_argument("--tp", type=int_at_least(1), default=1, metavar="T",
                   help="tensor-parallel decoding over T processes started here (ar, "
                        "early-exit, self-spec; one thread each unless --threads)")
    p.add_argument("--dist-timeout", type=float_at_least(1.0), default=300.0, metavar="S",
                   help="with --tp: seconds a process waits for another within a step")
    p.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                   help="seconds a shutdown waits for requests in flight")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   default="info", help="'info' logs one line per request")
    add_strategy_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``exitlm serve``: load, listen, serve until a signal, drain."""
    from exitlm.infer.engine import Engine  # lazy: loaded when the command runs

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = strategy_overrides(args, args.strategy)
    sock = _listen(args.host, args.port)  # fail before the model loads
    if args.threads is not None:
        from exitlm.infer.threads import set_threads  # lazy: the parser imports no torch

        set_threads(args.threads)
    t0 = time.perf_counter()
    _phase(f"loading model {args.model!r} ({args.dtype})")
    loaded = load_for_strategy(args.model, DTYPES[args.dtype], args.strategy, args.head_dtype)
    tokenizer = tokenizer_for(loaded, args.model)
    options = get_strategy(args.strategy).options(None, **overrides)
    if getattr(options, "draft_vocab", None):
        _phase("ranking the draft vocabulary")
    rank_draft_vocab(loaded.model, tokenizer, options)
    _phase(f"loaded in {time.perf_counter() - t0:.1f}s; preparing the {args.strategy} engine"
           + (f" on {args.tp} tensor-parallel processes" if args.tp > 1 else ""))
    limits = {"max_batch": args.max_batch, "max_seq_len": args.max_seq_len,
              "max_queue": args.max_queue, "prefill_chunk": args.prefill_chunk or None}
    with contextlib.ExitStack() as stack:
        target: Any = loaded.model
        if args.tp > 1:  # the ranks live as long as the server
            from exitlm.infer.executors.tp import TPExecutor  # lazy: loaded when the command runs

            target = stack.enter_context(TPExecutor(
                loaded.model, args.tp, threads=args.threads or 1, timeout_s=args.dist_timeout))
        engine = Engine(target, tokenizer, args.strategy, options, threads=args.threads,
                        **limits)
        _phase(f"engine ready after {time.perf_counter() - t0:.1f}s; starting the HTTP server")
        return _serve(args, sock, engine, tokenizer)


def _phase(what: str) -> None:
    """One line per start-up phase, as it begins (on a terminal and on a pipe alike)."""
    print(f"exitlm serve: {what}...", file=sys.stderr, flush=True)


def _serve(args: argparse.Namespace, sock: socket.socket, engine: Any, tokenizer: Any) -> int:
    """Serve ``engine`` on ``sock`` until a signal, then drain."""
    import uvicorn  # the server's modules load only for this command

    from exitlm.serve import server  # lazy: loaded when the command runs
    from exitlm.serve.app import create_app  # lazy: loaded when the command runs
    from exitlm.serve.limits import Limits  # lazy: loaded when the command runs
    from exitlm.serve.state import ServerState  # lazy: loaded when the command runs

    limits = Limits(max_prompts=args.max_prompts, max_request_bytes=args.max_request_bytes,
                    max_prompt_tokens=args.max_prompt_tokens,
                    max_completion_tokens=args.max_completion_tokens)
    state = ServerState(engine, tokenizer, args.served_model_name or args.model,
                        api_key=args.api_key or os.environ.get("EXITLM_API_KEY") or None,
                        drain_timeout=args.drain_timeout, limits=limits)
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    # descriptors beyond the connections: model files, threads' pipes, the engine's processes
    spare = 256
    files = server.raise_open_files_limit(args.max_connections + spare)
    max_connections = max(1, min(args.max_connections, files - spare))
    config = uvicorn.Config(
        create_app(state), log_config=None, access_log=False,
        log_level="debug" if args.log_level == "debug" else "warning",
        http=server.guarded_protocol(args.request_timeout, max_connections),
        timeout_graceful_shutdown=int(args.drain_timeout) + 2)

    def ready() -> None:
        tp = f", tensor-parallel over {args.tp} processes" if args.tp > 1 else ""
        print(f"exitlm serve: listening on {url} (model {state.model_name!r}, strategy "
              f"{state.strategy}, max batch {engine.max_batch}, context {state.context}{tp})",
              file=sys.stderr, flush=True)
        bound = state.prompts.bound
        print(f"exitlm serve: limits per request: {limits.max_prompts} prompts "
              f"(--max-prompts), {limits.max_request_bytes} bytes (--max-request-bytes), "
              f"{limits.prompt_tokens(state.context)} prompt tokens (--max-prompt-tokens"
              + (f", texts over {bound.bytes_per_token} bytes/token refused untokenized"
                 if bound is not None else "") + "), "
              f"{limits.max_completion_tokens or state.context} completion tokens "
              "(--max-completion-tokens)", file=sys.stderr, flush=True)

    with server.signals_end_quietly():
        server.Server(config, ready, state).run(sockets=[sock])
    print("exitlm serve: stopped", file=sys.stderr, flush=True)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket (uvicorn listens on it), or a one-line error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror or err}); choose "
                          "another --host/--port") from None
    sock.set_inheritable(True)
    return sock

"""`python -m ds4py serve [-m MODEL]`: the OpenAI + Anthropic compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ds4py.cli._options import (add_engine_arguments, add_engram_dir, add_spec_arguments, cpu_numerics, model_kwargs,
                                say_numerics)

NAME = "serve"
HELP = "OpenAI / Anthropic compatible HTTP server (chat, completions, responses, messages)"

DEMO_SEED = 0
# The demo model's random weights almost never sample EOS: without a cap a request that sends no max_tokens
# would run to the end of the context (minutes). A real model stops by itself.
DEMO_MAX_TOKENS = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file or a pulled model's name (default: $DS4PY_MODEL, the default of `ds4py list "
                        "--default`, or the one model `ds4py pull` fetched; when none is pulled, a small random-weight "
                        "demo model, generated once under ~/.cache/ds4py)")
    add_engine_arguments(p)
    p.add_argument("--ctx", type=int, default=32768,
                   help="context size in tokens (default 32768, capped at the model's)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="generation limit for requests that send none (Codex sends none); default: unlimited, "
                        f"i.e. up to the context size ({DEMO_MAX_TOKENS} for the demo model)")
    add_engram_dir(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route but "
                        "/health. A key given here is visible in the process list: prefer --api-key-file or "
                        "$DS4PY_API_KEY (the default when neither option is given)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from the first line of this file")
    p.add_argument("--cors", default=None, metavar="ORIGINS",
                   help="comma-separated browser origins allowed to call the API ('*' for any); default: no CORS, "
                        "and a POST from a web page of another origin is refused")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma-separated host names the Host header may carry ('*' for any; 'name' or '*.domain'). "
                        "Default: loopback names when --host is loopback, that address when it is one address, "
                        "any when it is 0.0.0.0 / ::")
    p.add_argument("--header-timeout", type=float, default=30.0, metavar="S",
                   help="close a connection that has not sent a complete request head within S seconds (default 30; "
                        "also the idle keep-alive time)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                   help="answer 408 when a request body has not arrived S seconds after its headers (default 60)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body in MB (default 32)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for the engine; more get 429 (default 64)")
    p.add_argument("--sessions", type=int, default=1, metavar="N",
                   help="resident KV sessions (default 1). With N > 1 up to N requests run together: their decode "
                        "rows advance in one batched model step, long prompts in chunks between them; a request "
                        "goes to the session holding the longest prefix of its prompt. Memory: N KV states "
                        "(and a few snapshots each) of up to --ctx tokens")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="keep KV checkpoints of long prompts in DIR (keyed by their token prefix) so that warm "
                        "prefixes survive a switch of conversation and a restart; also keeps the tool-call replay "
                        "map there")
    p.add_argument("--kv-disk-space-mb", type=float, default=None, metavar="MB",
                   help="bound on the checkpoints in --kv-disk-dir; least recently used ones are deleted "
                        "(default 8192)")
    p.add_argument("--replica-id", default=None, metavar="ID",
                   help="name of this replica behind a router: sent as the X-Replica-Id response header, in "
                        "/metrics (ds4py_replica_info) and in every log line")
    p.add_argument("--sse-keepalive", type=float, default=10.0, metavar="S",
                   help="send a keep-alive event on a stream that has been silent for S seconds (a long prefill), "
                        "so that idle timeouts of clients and routers keep it (default 10; 0: never)")
    p.add_argument("--tool-memory-max-ids", type=int, default=100_000,
                   help="tool-call ids remembered for exact DSML replay (default 100000)")
    p.add_argument("--disable-exact-dsml-tool-replay", action="store_true",
                   help="re-render tool calls from the client's JSON instead of the sampled DSML")

    add_spec_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log every request (with its speculative decoding: acceptance, tokens per round) and DSML "
                        "parse issue")


def demo_model_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ds4py"
    return base / f"demo-tiny-v4vocab-random-seed{DEMO_SEED}.gguf"


def ensure_demo_model() -> Path:
    """Generate the random-weight demo GGUF deterministically on first use (make_tiny writes a temporary file
    and renames it: never half-written)."""
    from ds4py.errors import Ds4Error

    path = demo_model_path()
    if path.exists():
        return path
    try:
        from ds4py.tiny import make_tiny
    except ImportError as e:
        raise Ds4Error(f"no -m MODEL given and the demo model generator is unavailable ({e})") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    # the real V4 vocabulary: agent prompts measure like the real model's, special tokens are the real ones
    progress = sys.stderr.isatty()         # a terminal sees the ~15 s wait; logs and pipes stay clean
    if progress:
        print(f"ds4py: generating the demo model once into {path} ...", file=sys.stderr, flush=True)
    make_tiny(str(path), seed=DEMO_SEED, vocab="v4", name="ds4py-demo-random", progress=progress)
    return path


DEFAULT_KV_DISK_MB = 8192


def make_engine(model_path: str, backend: str, ctx: int, tool_memory, mtp: str | None = None, spec: bool = True,
                sessions: int = 1, kv_disk_dir: str | None = None, kv_disk_space_mb: float = DEFAULT_KV_DISK_MB,
                **model_options):
    from ds4py.chat import chat_format
    from ds4py.disk_cache import DiskCache
    from ds4py.backends import open_model
    from ds4py.server.pool import SessionPool
    from ds4py.server.worker import Engine, PrefillPacer
    from ds4py.session import Session
    from ds4py.drafts import speculative
    from ds4py.tokenizer import Tokenizer

    script = os.environ.get("DS4PY_SCRIPTED_MODEL")    # tests only (ds4py/testing/scripted.py); announced on stderr
    if script:
        from ds4py.testing.scripted import open_scripted

        base = open_scripted(model_path, script, **model_options)
    else:
        base = open_model(model_path, backend=backend, ctx=ctx, **model_options)  # engram_dir= / sidecar= / posttrain=
    model = speculative(base, mtp, enabled=spec)     # with --sessions N: rounds of several sessions, one verify step
    # a speculative model saves the paired main + MTP state (spec.encode_pair) under the pair's fingerprint
    tok = Tokenizer.from_gguf(base.gguf if base.gguf is not None else model_path)
    ctx = min(ctx, int(model.config.context_length))
    disk = DiskCache(kv_disk_dir, kv_disk_space_mb, model) if kv_disk_dir else None
    fmt = chat_format(model.config.variant)                          # the V4 or V4.1 chat format
    fmt_args = dict(encode_prompt=fmt.encode_prompt, parser_factory=fmt.parser, native_mid_system=fmt.name == "v41")
    # one driver (server/scheduler.py) whatever the count: several sessions batch their steps (speculative rounds
    # verified together) on a fixed chunk grid; one session prefills in chunks of about a quarter second, so
    # that a client who goes away mid-prompt frees the engine soon
    pool = SessionPool(model, tok, sessions, ctx, disk=disk) if sessions > 1 else \
        SessionPool.of(Session(model, tok, ctx_size=ctx, prefill_chunk=PrefillPacer(), disk=disk))
    return Engine(pool, tok, tool_memory=tool_memory, **fmt_args)


def api_key(args) -> tuple[str | None, str]:
    """(the key or None, where it came from). An empty key is refused: it would silently turn authentication
    off. A key must be printable ASCII without spaces, since it travels in an HTTP header."""
    from ds4py.errors import Ds4Error

    if args.api_key is not None and args.api_key_file is not None:
        raise Ds4Error("give either --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as fh:
                key, source = fh.readline().strip(), f"--api-key-file {args.api_key_file}"
        except (OSError, UnicodeDecodeError) as e:
            raise Ds4Error(f"cannot read --api-key-file {args.api_key_file}: "
                           f"{getattr(e, 'strerror', None) or e}") from None
    elif args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif "DS4PY_API_KEY" in os.environ:
        key, source = os.environ["DS4PY_API_KEY"], "$DS4PY_API_KEY"
    else:
        return None, ""
    if not key:
        raise Ds4Error(f"{source} gives an empty API key, which would turn authentication off; give a non-empty "
                       f"key, or {'unset DS4PY_API_KEY' if source.startswith('$') else 'leave the option out'} to "
                       f"serve without one")
    if not all("!" <= c <= "~" for c in key):
        raise Ds4Error(f"the API key from {source} must be printable ASCII without spaces (it is sent in an HTTP "
                       f"header)")
    return key, source


def run(args) -> int:
    from ds4py.errors import Ds4Error
    from ds4py.server.app import ServerConfig, ServerState, bind, run_server
    from ds4py.server.protocol import MODEL_IDS
    from ds4py.server.toolmemory import ToolMemory

    replica = args.replica_id
    if replica is not None and not (0 < len(replica) <= 128 and all("!" <= c <= "~" for c in replica)):
        raise Ds4Error("--replica-id must be 1 to 128 printable ASCII characters without spaces (it is sent in an "
                       "HTTP header)")
    if not args.sse_keepalive >= 0:
        raise Ds4Error(f"--sse-keepalive must be >= 0 seconds, got {args.sse_keepalive}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s " + (f"[{replica}] " if replica else "") +
                               "%(name)s %(levelname)s %(message)s")
    if args.ctx < 2:
        raise Ds4Error(f"--ctx must be at least 2, got {args.ctx}")
    if not 0 <= args.port <= 65535:
        raise Ds4Error(f"--port must be between 0 and 65535 (0 picks a free port), got {args.port}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise Ds4Error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.max_queue < 1 or args.max_body_mb <= 0:
        raise Ds4Error("--max-queue must be >= 1 and --max-body-mb > 0")
    if not (args.header_timeout > 0 and args.body_timeout > 0):
        raise Ds4Error("--header-timeout and --body-timeout must be > 0 seconds")
    if args.sessions < 1:
        raise Ds4Error(f"--sessions must be >= 1, got {args.sessions}")
    if args.kv_disk_space_mb is not None and args.kv_disk_dir is None:
        raise Ds4Error("--kv-disk-space-mb needs --kv-disk-dir")
    disk_mb = DEFAULT_KV_DISK_MB if args.kv_disk_space_mb is None else args.kv_disk_space_mb
    if not disk_mb > 0:
        raise Ds4Error(f"--kv-disk-space-mb must be > 0, got {args.kv_disk_space_mb}")
    key, key_source = api_key(args)

    from ds4py.cli._options import choose_model

    # -m PATH, -m NAME (a pulled model), else $DS4PY_MODEL / the config's default / the one pulled model (its MTP
    # block paired); the demo model only when none is pulled
    demo = choose_model(args, "serve")
    hosts = None if args.allowed_hosts is None else [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    config = ServerConfig(host=args.host, port=args.port, api_key=key,
                          cors=[o.strip() for o in (args.cors or "").split(",") if o.strip()],
                          max_body_mb=args.max_body_mb, max_queue=args.max_queue, access_log=args.verbose,
                          allowed_hosts=hosts, header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          max_tokens=args.max_tokens, backend=args.backend, replica_id=replica,
                          sse_keepalive=args.sse_keepalive)
    if demo:
        config.max_tokens = args.max_tokens or DEMO_MAX_TOKENS
        config.model_ids = ("ds4py-demo",) + MODEL_IDS
        config.model_name = "ds4py demo (tiny, random weights)"
        config.model_note = "RANDOM WEIGHTS: a tiny generated demo model, its output is noise"
    else:
        if not Path(args.model).is_file():
            raise Ds4Error(f"model file not found: {args.model}")
    if args.mtp is not None and not Path(args.mtp).is_file():
        raise Ds4Error(f"MTP file not found: {args.mtp}")
    if args.sidecar or args.posttrain:                   # a mismatched pair is refused before listening
        from ds4py.vq.sidecar import check_files

        check_files(str(ensure_demo_model()) if demo else args.model, args.sidecar, args.posttrain)
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        raise Ds4Error(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None

    state = ServerState(config)
    journal = Path(args.kv_disk_dir) / "tool-memory.jsonl" if args.kv_disk_dir else None
    if journal is not None:
        try:
            journal.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Ds4Error(f"cannot use --kv-disk-dir {args.kv_disk_dir}: {e.strerror or e}") from None
    memory = ToolMemory(args.tool_memory_max_ids, enabled=not args.disable_exact_dsml_tool_replay, journal=journal)

    def load():
        from ds4py.spec import SpecModel

        t0 = time.perf_counter()
        path = str(ensure_demo_model()) if demo else args.model
        engine = make_engine(path, args.backend, args.ctx, memory, args.mtp, not args.no_spec, args.sessions,
                             args.kv_disk_dir, disk_mb, **model_kwargs(args), **cpu_numerics(args))
        spec = isinstance(engine.model, SpecModel)
        say_numerics(args, engine.model.model if spec else engine.model)
        mtp = engine.model.drafter if spec else None
        config.backend, config.model_context = engine.model.backend, int(engine.model.config.context_length)
        print(f"ds4py serve: model ready in {time.perf_counter() - t0:.1f} s (context {engine.ctx_size} tokens"
              f"{f'; speculative decoding with {mtp.path}' if mtp is not None else ''})", file=sys.stderr, flush=True)
        return engine

    what = (f"the DEMO model {demo_model_path()} (tiny, RANDOM WEIGHTS: output is noise; `ds4py pull v4-flash-q2` "
            f"or -m MODEL.gguf for a real model)") if demo else args.model
    print(f"ds4py serve{f' [{replica}]' if replica else ''}: listening on http://{args.host}:{sock.getsockname()[1]} with {what}; "
          f"backend {args.backend}, context {args.ctx}"
          f"{f', {args.sessions} sessions' if args.sessions > 1 else ''}"
          f"{f', disk KV cache {args.kv_disk_dir} ({disk_mb:g} MB)' if args.kv_disk_dir else ''}"
          f"{', API key required' if config.api_key else ''}"
          f"{f'; requests without max_tokens stop at {config.max_tokens} tokens' if config.max_tokens else ''}. "
          f"/health answers 503 until the model is loaded; open http://{args.host}:{sock.getsockname()[1]}/ in a "
          f"browser to chat.", file=sys.stderr, flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        print("ds4py serve: warning: listening beyond this machine without --api-key", file=sys.stderr, flush=True)
    if key_source == "--api-key":
        print("ds4py serve: note: a key given with --api-key is visible to other users in the process list; "
              "--api-key-file or $DS4PY_API_KEY keep it out", file=sys.stderr, flush=True)
    loader = state.load_in_background(load)

    def stop_if_load_failed():
        # nothing can be served: say why and exit non-zero (an embedding ServerState keeps its 503s instead)
        loader.join()
        if state.load_error is not None:
            os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=stop_if_load_failed, name="ds4py-load-watch", daemon=True).start()
    run_server(state, sock)
    if state.load_error is not None:
        raise Ds4Error(f"the model failed to load: {state.load_error}")
    return 0

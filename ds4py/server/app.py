"""The aiohttp application: routes, the safety middleware (auth, CORS, body limit, error JSON), and the glue
between a request handler and the engine worker.

    state = ServerState(config)                 # starts "loading": /health answers 503
    state.set_engine(engine)                    # ready
    with BackgroundServer(state) as srv:        # tests: a loopback port in a thread
        srv.base_url
    run_server(state)                           # the CLI: blocks until Ctrl-C
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import logging
import secrets
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError

from . import anthropic, openai, page, responses
from .affinity import session_key
from .engine_thread import Worker
from .metrics import Metrics
from .protocol import (MODEL_IDS, NONTHINKING_ALIASES, THINKING_ALIASES, ApiError, Done, Reasoning, Result, Started,
                       Text, ToolCallOut)
from .sse import next_or_keepalive
from .worker import Engine, Job

log = logging.getLogger("ds4py.server")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    cors: list[str] = field(default_factory=list)      # allowed origins; ["*"] for any; [] = no CORS headers
    max_body_mb: float = 32.0
    max_queue: int = 64
    model_ids: tuple[str, ...] = MODEL_IDS             # first one is the primary id
    model_name: str = "DeepSeek V4 Flash"
    model_note: str | None = None                      # e.g. "random weights (demo model)"
    access_log: bool = False                           # one log line per request (serve -v)
    # Host names / addresses a request's Host header may name (DNS-rebinding protection); None = derived from
    # `host` (see allowed_hosts_for), ["*"] = any
    allowed_hosts: list[str] | None = None
    header_timeout: float = 30.0       # seconds for a connection to deliver a request's headers (and idle keep-alive)
    body_timeout: float = 60.0         # seconds for the body to arrive once the headers are in
    max_tokens: int | None = None      # generation limit for requests that send none (serve --max-tokens)
    backend: str | None = None         # shown by `GET /` (the chat page's header); set once the model is loaded
    model_context: int | None = None   # the model's own context length: a max_tokens beyond it is a 400
    replica_id: str | None = None      # serve --replica-id: the X-Replica-Id header, /metrics and the log
    sse_keepalive: float = 10.0        # seconds of silence on an SSE stream before a keep-alive event (0: never)


class ServerState:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        self.engine: Engine | None = None
        self.worker: Worker | None = None
        self.load_error: str | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ds4py-render")
        self.started = int(time.time())
        self.draining = False              # SIGTERM received: not ready (/health 503), new requests refused
        self.metrics.model_name = config.model_ids[0]
        self.metrics.replica_id = config.replica_id

    @property
    def served_ids(self) -> tuple[str, ...]:
        return self.config.model_ids

    def set_engine(self, engine: Engine) -> None:
        engine.metrics = self.metrics
        n_sessions = len(engine.pool) if engine.pool is not None else 1
        self.metrics.kv_capacity_tokens = engine.ctx_size * n_sessions
        self.worker = Worker(engine, self.config.max_queue)
        self.engine = engine

    def load_in_background(self, make_engine) -> threading.Thread:
        from ds4py.errors import Ds4Error

        from ds4py.progress import LOAD

        LOAD.reset()              # this load's progress only (/health), not an earlier one's in this process

        def run():
            try:
                self.set_engine(make_engine())
                log.info("model ready")
            except Exception as e:  # reported by /health and every generation endpoint
                # a Ds4Error is already the one sentence naming the problem; anything else is a bug: keep its type
                self.load_error = str(e) if isinstance(e, Ds4Error) else f"{type(e).__name__}: {e}"
                log.error("model failed to load: %s", self.load_error)
        t = threading.Thread(target=run, name="ds4py-load", daemon=True)
        t.start()
        return t

    def ready_engine(self) -> Engine:
        if self.draining:
            raise ApiError(503, "the server is shutting down; send the request to another replica or retry later",
                           kind="service_unavailable", headers={"Retry-After": "5"})
        if self.engine is None:
            msg = f"the model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise ApiError(503, msg, kind="service_unavailable", headers={"Retry-After": "5"})
        if self.engine.broken:
            raise ApiError(503, self.engine.broken, kind="service_unavailable")
        return self.engine

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def stopped(self) -> bool:
        """After close(): True once the engine thread has finished its last job."""
        return self.worker is None or self.worker.join(0)


STATE = web.AppKey("state", ServerState)
# request[JOB]: the generation a request ran (AccessLogger); aiohttp >= 3.12 wants typed request keys
JOB = web.RequestKey("job", Job) if hasattr(web, "RequestKey") else "ds4py.job"


# ---- middleware ------------------------------------------------------------------------------------------

def _api_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


# Answers after which the connection is closed: the rest of the request (an oversized or stalled body) is
# never read, so the client must not send another request on it.
CLOSE_STATUSES = (408, 413)


def error_response(err: ApiError, path: str) -> web.Response:
    body = anthropic.error_body(err) if _api_of(path) == "anthropic" else openai.error_body(err)
    resp = web.Response(status=err.status, body=orjson.dumps(body), content_type="application/json",
                        headers=err.headers)
    if err.status in CLOSE_STATUSES:
        resp.force_close()              # "Connection: close"
    return resp


HTTP_ERRORS = {404: ("not_found_error", "no route {method} {path}"),
               405: ("invalid_request_error", "{path} does not accept {method}"),
               413: ("request_too_large", "the request body is larger than --max-body-mb ({mb} MB)")}


def too_large(cfg: ServerConfig) -> ApiError:
    return ApiError(413, HTTP_ERRORS[413][1].format(mb=cfg.max_body_mb), kind="request_too_large")


# ---- browser-facing safety: DNS rebinding (Host) and cross-site simple requests (Origin) ----------------------

LOOPBACK_NAMES = ("localhost",)


def _split_host(value: str) -> str:
    """The host part of a Host header or URL authority, lower-case, without port, brackets or a final dot."""
    value = value.strip().lower()
    if value.startswith("["):                       # [v6]:port
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):    # RFC 6761: *.localhost is loopback
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind_host: str) -> list[str] | None:
    """What the Host header may name when --allowed-hosts is not given: a loopback server answers only to
    loopback names (a web page whose DNS name was rebound to 127.0.0.1 is refused); a server bound to one
    address answers to that address and the loopback names; one bound to every interface (0.0.0.0, ::) to any
    name (None), since it cannot know its names - use --allowed-hosts (and --api-key) there."""
    h = _split_host(bind_host)
    if h in ("", "0.0.0.0", "::", "*"):
        return None
    if _is_loopback(h):
        return ["localhost", "*.localhost", "127.0.0.0/8", "::1"]
    return [h, "localhost", "*.localhost", "127.0.0.0/8", "::1"]


def host_allowed(host: str, allowed: list[str] | None) -> bool:
    if allowed is None or "*" in allowed:
        return True
    h = _split_host(host)
    for a in allowed:
        a = a.lower()
        if a.startswith("*.") and (h.endswith(a[1:]) or h == a[2:]):
            return True
        if "/" in a:
            try:
                if ipaddress.ip_address(h) in ipaddress.ip_network(a, strict=False):
                    return True
            except ValueError:
                pass
            continue
        if h == _split_host(a):
            return True
    return False


def _same_origin(origin: str, host: str) -> bool:
    u = urllib.parse.urlsplit(origin)
    return bool(u.netloc) and u.scheme in ("http", "https") and u.netloc.lower() == host.strip().lower()


def _allow_origin(cors, origin: str | None) -> str | None:
    """Access-Control-Allow-Origin for this request's Origin; None when CORS is off or the origin not allowed."""
    if not cors or not origin:
        return None
    return "*" if "*" in cors else (origin if origin in cors else None)


def _add_cors(resp: web.StreamResponse, allow_origin: str | None) -> None:
    if allow_origin:
        resp.headers["Access-Control-Allow-Origin"] = allow_origin
        resp.headers["Vary"] = "Origin"


def _check_browser_safety(request: web.Request, cfg: ServerConfig, allow_origin: str | None) -> None:
    host = request.headers.get("Host")
    allowed = cfg.allowed_hosts if cfg.allowed_hosts is not None else allowed_hosts_for(cfg.host)
    if host is not None and not host_allowed(host, allowed):
        raise ApiError(403, f"the Host header {host[:100]!r} does not name this server (DNS-rebinding protection);"
                            f" connect by its address, or start it with --allowed-hosts naming that host",
                       kind="permission_error", code="host_not_allowed")
    origin = request.headers.get("Origin")
    if request.method not in ("GET", "HEAD", "OPTIONS") and origin is not None and allow_origin is None \
            and not (host is not None and _same_origin(origin, host)):
        # A web page can POST a "simple" request (text/plain, no preflight) to a loopback server; its answer is
        # unreadable without CORS, but the request would still run. Browsers always send Origin on it.
        raise ApiError(403, f"cross-site request from origin {origin[:100]!r} refused; start the server with "
                            f"--cors naming that origin to allow it", kind="permission_error", code="origin_not_allowed")


@web.middleware
async def middleware(request: web.Request, handler):
    st: ServerState = request.app[STATE]
    cfg = st.config
    allow_origin = _allow_origin(cfg.cors, request.headers.get("Origin"))
    try:
        _check_browser_safety(request, cfg, allow_origin)
    except ApiError as e:
        st.metrics.request_done(_endpoint(request), e.status)
        return error_response(e, request.path)
    if cfg.cors and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        resp = web.Response(status=204 if allow_origin else 403)
        if allow_origin:
            resp.headers.update({
                "Access-Control-Allow-Origin": allow_origin, "Vary": "Origin",
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                    "authorization, content-type, x-api-key"),
                "Access-Control-Max-Age": "600"})
        return resp
    try:
        if cfg.api_key and request.path not in ("/health", "/livez") and not page.is_public(request):
            _check_auth(request, cfg.api_key)
        resp = await handler(request)
    except ApiError as e:
        resp = error_response(e, request.path)
    except web.HTTPException as e:
        kind, msg = HTTP_ERRORS.get(e.status, ("invalid_request_error", e.reason))
        msg = msg.format(method=request.method, path=request.path[:200], mb=cfg.max_body_mb)
        resp = error_response(ApiError(e.status, msg, kind=kind), request.path)
    except (asyncio.CancelledError, ConnectionResetError):
        st.metrics.request_done(_endpoint(request), 499)      # nginx's "client closed request"
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        resp = error_response(ApiError(500, f"internal server error: {type(e).__name__}", kind="api_error"),
                              request.path)
    if not resp.prepared:
        _add_cors(resp, allow_origin)
    st.metrics.request_done(_endpoint(request), resp.status)
    return resp


def _endpoint(request: web.Request) -> str:
    route = request.match_info.route
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else "other"


def _check_auth(request: web.Request, key: str) -> None:
    # either header may carry the key: Claude Code with both ANTHROPIC_API_KEY and ANTHROPIC_AUTH_TOKEN set
    # sends both. Header bytes that are not UTF-8 arrive as surrogate escapes: compare the bytes as sent.
    given = [request.headers.get("x-api-key", "")]
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        given.append(auth[7:].strip())
    want = key.encode()
    if not any(g and hmac.compare_digest(g.encode("utf-8", "surrogateescape"), want) for g in given):
        raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                       kind="authentication_error", code="invalid_api_key")


# ---- handlers --------------------------------------------------------------------------------------------

async def read_json(request: web.Request) -> dict:
    cfg = request.app[STATE].config
    if request.content_length is not None and request.content_length > int(cfg.max_body_mb * 1024 * 1024):
        raise too_large(cfg)             # before reading a byte of it (and the connection is closed)
    try:
        raw = await asyncio.wait_for(request.read(), cfg.body_timeout)   # raises 413 past client_max_size
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {cfg.body_timeout:g} s",
                       kind="invalid_request_error", code="request_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large(cfg) from None
    except (web.RequestPayloadError, HttpProcessingError) as e:
        # e.g. "Content-Encoding: gzip" on a body that is not gzip, or a broken chunked encoding
        why = (getattr(e, "message", "") or str(e)).strip().splitlines()[0][:200]
        raise ApiError(400, f"the request body cannot be read: {why}") from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def health(request: web.Request) -> web.Response:
    """Readiness: 200 only while requests can be served (not while loading, broken or draining)."""
    st = request.app[STATE]
    if st.draining:
        return web.json_response({"status": "draining"}, status=503)
    if st.engine is not None and not st.engine.broken:
        return web.json_response({"status": "ok"})
    if st.engine is not None:
        return web.json_response({"status": "error", "error": st.engine.broken}, status=503)
    if st.load_error:
        return web.json_response({"status": "error", "error": st.load_error}, status=503)
    return web.json_response({"status": "loading", "error": None, **loading_progress()}, status=503)


def loading_progress() -> dict:
    """While the model loads: how far the weight upload is (the CUDA engine feeds ds4py.progress.LOAD); empty
    before it starts and on backends that upload nothing (the reference maps the file)."""
    from ds4py.progress import LOAD

    snap = LOAD.snapshot()
    if snap is None:
        return {}
    return {"progress": round(snap["fraction"], 4), "loaded_bytes": snap["done"], "total_bytes": snap["total"],
            "load_gbps": round(snap["rate"] / 1e9, 3),
            "detail": (f"uploading weights: {100 * snap['fraction']:.0f}% of {snap['total'] / 1e9:.2f} GB"
                       if snap["done"] < snap["total"] else "weights uploaded; preparing kernels and graphs")}


async def livez(request: web.Request) -> web.Response:
    """Liveness: the process and its event loop answer (loading, draining or a broken model are alive: a restart
    of a loading server only restarts the load)."""
    return web.json_response({"status": "alive"})


async def root(request: web.Request) -> web.Response:
    """`GET /` and `HEAD /` (Claude Code probes the base URL with HEAD before its first request): what this is;
    a browser gets the chat page."""
    if page.prefers_html(request.headers.get("Accept")):
        return page.page_response()
    st = request.app[STATE]
    status = "ok" if st.engine is not None and not st.engine.broken else ("error" if st.load_error or
                                                                          st.engine is not None else "loading")
    ctx = st.engine.ctx_size if st.engine is not None else None
    return web.json_response({"name": "ds4py", "model": st.config.model_name, "model_id": st.served_ids[0],
                              "model_note": st.config.model_note, "backend": st.config.backend,
                              "context_length": ctx, "default_max_tokens": st.config.max_tokens, "status": status,
                              "error": st.load_error or (st.engine.broken if st.engine is not None else None),
                              "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                            "/v1/messages", "/v1/models", "/health", "/metrics", "/chat"],
                              **(loading_progress() if status == "loading" else {})})


def _model_entry(st: ServerState, mid: str) -> dict:
    cfg = st.config
    ctx = st.engine.ctx_size if st.engine is not None else None
    e = {"id": mid, "object": "model", "type": "model", "created": 1767225600, "created_at": "2026-01-01T00:00:00Z",
         "owned_by": "ds4py", "name": cfg.model_name, "display_name": cfg.model_name, "context_length": ctx}
    if mid in NONTHINKING_ALIASES:
        e["description"] = "alias: thinking disabled"
    elif mid in THINKING_ALIASES:
        e["description"] = "alias: thinking enabled"
    else:      # a small max_tokens may be spent on reasoning alone: say where the default is and how to switch it
        e["description"] = ("thinking on by default on the OpenAI APIs (the reasoning comes first, in "
                            "reasoning_content; a small max_tokens may leave content empty), off on /v1/messages; "
                            "reasoning_effort 'none' or the model id deepseek-chat turn it off")
    if cfg.model_note:
        e["description"] = (e.get("description", "") + "; " if "description" in e else "") + cfg.model_note
    return e


def _all_ids(st: ServerState) -> list[str]:
    return list(st.served_ids) + list(NONTHINKING_ALIASES) + list(THINKING_ALIASES)


async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    data = [_model_entry(st, m) for m in _all_ids(st)]
    return web.json_response({"object": "list", "data": data, "has_more": False,
                              "first_id": data[0]["id"], "last_id": data[-1]["id"]})


async def get_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    mid = request.match_info["id"]
    if mid not in _all_ids(st):
        raise ApiError(404, f"model '{mid}' does not exist on this server", kind="not_found_error",
                       code="model_not_found")
    return web.json_response(_model_entry(st, mid))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[STATE].metrics.render(), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"})


async def _prepare(request: web.Request, parse, check_fits: bool = True) -> tuple[ServerState, object, list[int]]:
    from ds4py.errors import Ds4Error

    st = request.app[STATE]
    body = await read_json(request)
    req = parse(body, st.served_ids)
    req.session_key = session_key(request.headers, body)
    if req.max_tokens is None:
        req.max_tokens = st.config.max_tokens
    engine = st.ready_engine()

    limit = st.config.model_context
    if req.max_tokens is not None and limit and req.max_tokens > limit:
        raise ApiError(400, f"max_tokens is {req.max_tokens}, more than the model's whole context of {limit} tokens "
                            f"(prompt and answer together); send at most {limit}", param="max_tokens")

    def render():
        ids = engine.prompt_ids(req)
        if check_fits:
            engine.check_fits(ids)
            if req.max_tokens is not None:       # beyond what the context has left after the prompt: clamped
                req.max_tokens = max(1, min(req.max_tokens, engine.ctx_size - len(ids)))
        return ids
    try:
        ids = await asyncio.get_running_loop().run_in_executor(st.pool, render)
    except Ds4Error as e:          # ChatFormatError, TokenizerError: the request's content is the problem
        raise ApiError(400, str(e)) from None
    return st, req, ids


SHUTTING_DOWN = "the server is shutting down; this request was stopped before it finished (retry it)"


def _next_event(job: Job, ev):
    """A job's event as the handler passes it on. A live handler sees a cancelled job only when the server
    stopped it (a client that goes away takes its handler with it): that is an error, not a finished answer."""
    if job.t_first is None and isinstance(ev, (Reasoning, Text, ToolCallOut)):
        job.t_first = time.monotonic()
    if isinstance(ev, Done) and ev.finish_reason == "cancelled":
        ev = Done("error", ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, ev.reasoning_tokens,
                  error=SHUTTING_DOWN)
    if isinstance(ev, Done):
        job.done = ev
    return ev


def generation_handler(parse, encoder_cls, id_prefix: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        st, req, ids = await _prepare(request, parse)
        job = Job(req, ids, asyncio.get_running_loop(), id_prefix, session_key=req.session_key)
        request[JOB] = job                         # for the access log's token counts and speeds
        st.worker.submit(job)
        enc = encoder_cls(req, secrets.token_hex(12), int(time.time()))
        try:
            started = _next_event(job, await job.events.get())
            if isinstance(started, Done):          # failed or cancelled before the first token
                status = 503 if st.engine.broken or started.error == SHUTTING_DOWN else 500
                raise ApiError(status, started.error or "generation did not start", kind="api_error")
            if req.stream:
                return await _stream(request, job, enc, started)
            result = Result()
            while result.done is None:
                result.add(_next_event(job, await job.events.get()))
            if result.done.finish_reason == "error":
                status = 503 if st.engine.broken or result.done.error == SHUTTING_DOWN else 500
                raise ApiError(status, result.done.error, kind="api_error")
            return web.Response(body=orjson.dumps(enc.body(result)), content_type="application/json")
        finally:
            job.cancel.set()       # no-op after a finished job; stops the engine within one token otherwise
    return handle


async def _stream(request: web.Request, job: Job, enc, started: Started) -> web.StreamResponse:
    """SSE: headers go out when the engine picks the job up (a queued request can still get a clean error)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    _add_cors(resp, _allow_origin(request.app[STATE].config.cors, request.headers.get("Origin")))
    await resp.prepare(request)
    try:
        first = enc.start(started)
        if first:
            await resp.write(first)
        done = False
        while not done:
            ev = _next_event(job, await next_or_keepalive(job.events, request.app[STATE].config.sse_keepalive,
                                                          resp, enc.keepalive))
            buf = enc.event(ev)
            done = isinstance(ev, Done)
            while not done and not job.events.empty():      # batch what piled up into one write
                ev = _next_event(job, job.events.get_nowait())
                buf += enc.event(ev)
                done = isinstance(ev, Done)
            if buf:
                await resp.write(buf)
        await resp.write_eof()
    except ConnectionResetError:
        job.cancel.set()
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    # counting is what a client does to decide whether to shorten a prompt: a prompt longer than --ctx is
    # counted, not refused
    _, _, ids = await _prepare(request, anthropic.parse_count_tokens, check_fits=False)
    return web.json_response({"input_tokens": len(ids)})


async def _replica_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Replica-Id"] = request.app[STATE].config.replica_id


def make_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[middleware], client_max_size=int(state.config.max_body_mb * 1024 * 1024))
    app[STATE] = state
    if state.config.replica_id is not None:
        app.on_response_prepare.append(_replica_header)
    r = app.router
    r.add_get("/", root)
    page.add_routes(r)
    r.add_get("/health", health)
    r.add_get("/livez", livez)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/models/{id}", get_model)
    r.add_post("/v1/chat/completions", generation_handler(openai.parse_chat, openai.ChatEncoder, "call_"))
    r.add_post("/v1/completions", generation_handler(openai.parse_completion, openai.CompletionEncoder, "call_"))
    r.add_post("/v1/responses", generation_handler(responses.parse_responses, responses.ResponsesEncoder, "call_"))
    r.add_post("/v1/messages", generation_handler(anthropic.parse_messages, anthropic.MessagesEncoder, "toolu_"))
    r.add_post("/v1/messages/count_tokens", count_tokens)
    return app


# ---- running -----------------------------------------------------------------------------------------------

def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class ApiErrorHandler(web.RequestHandler):
    """aiohttp's connection handler, with its own error answers replaced: a request the HTTP parser cannot read
    (bad request line or headers, an unsupported Content-Encoding, ...) gets the API's JSON error shape (the
    OpenAI one: the route is unknown at that point) and one log line, not a plain-text body and a traceback.
    Made per connection by `Listener` (aiohttp's public web.RequestHandler and web.Server, no private name)."""

    def __init__(self, manager: web.Server, metrics: Metrics | None, **kw):
        super().__init__(manager, **kw)
        self.ds4py_metrics = metrics

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError) or status < 500:
            why = ((getattr(exc, "message", None) or message or "").strip().splitlines() or [""])[0][:200]
            if isinstance(exc, ContentEncodingError):   # aiohttp's text suggests installing a package: not the client's business
                why = "unsupported Content-Encoding (send the body uncompressed, gzip or deflate)"
            log.info("malformed HTTP request from %s: %s", request.remote, why)
            text = f"malformed HTTP request: {why}" if why else "malformed HTTP request"
            kind = "invalid_request_error"
        else:                                        # the last resort: a bug, logged with its traceback
            log.error("unhandled error on %s", request.path, exc_info=exc)
            text, kind = "internal server error", "api_error"
        if self.ds4py_metrics is not None:
            self.ds4py_metrics.request_done("malformed" if status < 500 else "other", status)
        if request.writer.output_size > 0:
            raise ConnectionError("the answer has started; cannot send an error now")
        # the route is unknown here: a body that both the OpenAI and the Anthropic SDKs read as their error
        err = {"type": kind, "message": text, "param": None, "code": None}
        resp = web.Response(status=status, body=orjson.dumps({"type": "error", "error": err}),
                            content_type="application/json")
        resp.force_close()
        return resp


    def log_exception(self, *args, **kw) -> None:
        # after an answer to a body that could not be decoded, aiohttp's lingering read of the rest raises the
        # same payload error again; that is the client's problem, already answered: one line, no traceback
        exc = kw.get("exc_info")
        if isinstance(exc, (HttpProcessingError, web.RequestPayloadError)):
            why = ((getattr(exc, "message", None) or str(exc)).strip().splitlines() or [""])[0][:200]
            log.info("malformed HTTP request body: %s", why)
            return
        super().log_exception(*args, **kw)


class AccessLogger(AbstractAccessLogger):
    """serve -v: one line per request; a generation adds its token counts and speeds."""

    def log(self, request, response, time_s: float) -> None:
        line = (f'{request.remote} "{request.method} {request.path_qs[:200]} HTTP/{request.version.major}.'
                f'{request.version.minor}" {response.status} {response.body_length} B {time_s:.3f} s')
        job = request.get(JOB)
        d = job.done if job is not None else None
        if d is not None:
            line += (f"; prompt {d.prompt_tokens} tokens ({d.cached_tokens} cached), generated {d.completion_tokens}"
                     f"{f' ({d.reasoning_tokens} reasoning)' if d.reasoning_tokens else ''}, finish {d.finish_reason}")
            if job.t_first is not None:
                end = time.monotonic()              # called as the answer's last byte went out
                rate = (d.completion_tokens - 1) / (end - job.t_first) if d.completion_tokens > 1 and \
                    end > job.t_first else None
                line += f"; first token {job.t_first - job.t_arrival:.2f} s"
                line += f", {rate:.1f} tok/s" if rate is not None else ""
        self.logger.info(line)


class Listener:
    """The server's socket, served by an AppRunner's web.Server with ApiErrorHandler connections (public API only:
    runner.server is the runner's connection manager; asyncio makes one handler per accepted connection, as
    web.SockSite would with aiohttp's own handler class). cleanup(): stop accepting, then the runner closes the
    open connections (shutdown_timeout) and the application."""

    def __init__(self, runner: web.AppRunner, server: asyncio.AbstractServer):
        self.runner, self.server = runner, server

    async def cleanup(self) -> None:
        self.server.close()
        await self.runner.cleanup()


async def _start(state: ServerState, sock: socket.socket) -> Listener:
    # handler_cancellation: a client that disconnects cancels its handler, whose `finally` stops generation.
    # keepalive_timeout: aiohttp closes a connection that has not delivered a complete request head within it,
    # both at the start of a connection and between requests: the header timeout for stalled clients.
    # lingering_time: after an answer to a request whose body was not read (413, 408, a body that could not be
    # decoded), the rest is read and dropped for at most this long before closing, so that the client sees the
    # answer instead of a connection reset
    cfg = state.config
    access_log = logging.getLogger("ds4py.server.access") if cfg.access_log else None
    per_connection = dict(access_log=access_log, access_log_class=AccessLogger, keepalive_timeout=cfg.header_timeout,
                          lingering_time=2.0)
    runner = web.AppRunner(make_app(state), handler_cancellation=True, shutdown_timeout=1.0, **per_connection)
    await runner.setup()
    loop = asyncio.get_running_loop()
    manager = runner.server
    server = await loop.create_server(lambda: ApiErrorHandler(manager, state.metrics, loop=loop, **per_connection),
                                      sock=sock)
    return Listener(runner, server)


SHUTDOWN_WAIT_S = 10.0       # how long a SIGTERM waits for the engine to stop at its next prefill chunk / token


def run_server(state: ServerState, sock: socket.socket) -> None:
    """Serve until SIGINT / SIGTERM. Shutdown cancels every job first (the engine stops at the next paced
    prefill chunk or token, so no handler has to be timed out), closes the connections, then waits up to
    SHUTDOWN_WAIT_S for the engine thread; a second signal stops waiting."""
    import signal

    async def main():
        runner = await _start(state, sock)
        stop = asyncio.Event()
        signals = [0]
        loop = asyncio.get_running_loop()

        def on_signal():
            signals[0] += 1
            state.draining = True          # /health answers 503 from now on: a router stops sending here
            stop.set()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal)
            except (NotImplementedError, RuntimeError):
                pass
        try:
            await stop.wait()
        finally:
            t0 = time.monotonic()
            state.close()
            await runner.cleanup()
            while not state.stopped() and signals[0] < 2 and time.monotonic() - t0 < SHUTDOWN_WAIT_S:
                await asyncio.sleep(0.05)
            log.info("shut down in %.2f s", time.monotonic() - t0)
    asyncio.run(main())


class BackgroundServer:
    """The server on its own event loop in a daemon thread (tests, embedding)."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0):
        self.state = state
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.loop = asyncio.new_event_loop()
        self._runner = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="ds4py-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "BackgroundServer":
        self._thread.start()
        self._runner = asyncio.run_coroutine_threadsafe(_start(self.state, self.sock), self.loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
            self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.state.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

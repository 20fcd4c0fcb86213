"""The OpenAI-compatible HTTP server: ``create_app(engine_dir, config) -> FastAPI``.

::

    client ── _Gate (API key, body limit) ── FastAPI routes ── Service ── Scheduler (continuous batching) ── Engine
                                               /v1/completions        submit() -> Request; Request.stream() events
                                               /v1/chat/completions   cancel() when the client goes away
                                               /v1/models[/{id}], /health, /metrics

The engine loads in a background thread when the app starts, so ``/health`` answers 503 until it is ready (and the
generation routes answer 503 too). Every refusal is an OpenAI-shaped error body (``{"error": {"message", "type",
"param", "code"}}``) with a 4xx status; an unexpected failure is logged with its traceback and answered with a bare
500. The app is a plain factory of an engine directory (or a loaded :class:`Engine`) and a :class:`ServeConfig`, so
another host (uvicorn here; a Ray Serve deployment) can wrap it as it is.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trtinfer.artifact import Manifest, read_manifest
from trtinfer.errors import InputError, QueueFullError, TrtInferError
from trtinfer.runtime.engine import Engine
from trtinfer.runtime.request import Finished
from trtinfer.runtime.scheduler import Scheduler
from trtinfer.runtime.tokenizer import load_chat_template
from trtinfer.serving import protocol as P
from trtinfer.serving.config import ServeConfig
from trtinfer.serving.handler import Handler, log_failure, status_of
from trtinfer.serving.metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger(__name__)

#: routes open without the API key, as vLLM leaves them: a load balancer's probe and a Prometheus scrape carry no key
OPEN_PATHS = frozenset({"/health", "/metrics"})
#: ``Retry-After`` of a 429 (queue full), in seconds. The queue drains as running requests end, which under
#: continuous batching is every few decode steps, but how long depends on load we cannot foresee: the shortest
#: whole second HTTP can say brings clients (the openai client honours it) back soon, and a queue still full
#: answers them another cheap 429.
RETRY_AFTER_S = 1


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(status, message, param, code), status_code=status, headers=headers)


# ------------------------------------------------------------------------------------------------------------------
# the engine and its scheduler, loaded in the background


class Service:
    """The engine and its scheduler: ``loading`` until :meth:`start`'s thread is done, then ``ready`` or ``failed``.

    ``on_failure`` callbacks run (on the loading thread) when loading fails: ``trtinfer serve`` stops there.
    ``on_finish`` (set before :meth:`start`) is the :class:`Scheduler`'s: it runs on the scheduler's thread as each
    request finishes or is cancelled, before the scheduler counts it: the latency histograms.
    """

    def __init__(self, source: Engine | str | Path, config: ServeConfig) -> None:
        self.config = config
        self._source = source
        self._owns_engine = not isinstance(source, Engine)
        path = source.path if isinstance(source, Engine) else Path(source)
        self.model_name = config.model_name or path.resolve().name
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.pieces = P.TokenPieces(str, lambda i: str(i).encode())  # the engine's once loaded (logprobs' tokens)
        self.error: BaseException | None = None
        self.created = P.now()
        self.on_failure: list[Callable[[BaseException], None]] = []
        self.on_finish: Callable[[Finished], None] | None = None
        self.chat_template: str | None = None
        self._closing = False
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        """``loading``, ``ready`` or ``failed``."""
        return "failed" if self.error is not None else "ready" if self.scheduler is not None else "loading"

    def start(self) -> None:
        """Load in a background thread (a loaded Engine is wrapped at once)."""
        if isinstance(self._source, Engine):
            self._load()
        else:
            threading.Thread(target=self._load, name="trtinfer-load", daemon=True).start()

    def _load(self) -> None:
        engine = None
        try:
            t0 = time.perf_counter()
            # the chat route's template: --chat-template's (read first: a bad one fails fast), else the model's
            template = None if self.config.chat_template is None else load_chat_template(self.config.chat_template)
            engine = self._source if isinstance(self._source, Engine) else load_engine(self._source, self.config)
            self.chat_template = engine.tokenizer.chat_template if template is None else template
            scheduler = self.config.scheduler(engine, self.on_finish).start()
        except Exception as e:  # reported through /health and on_failure, never lost
            if engine is not None and self._owns_engine:
                engine.close()
            self.error = e
            # said once: by whoever stops on it (trtinfer serve prints the one error line), else here
            log.log(logging.DEBUG if self.on_failure else logging.ERROR, "the engine failed to load: %s", e,
                    exc_info=not isinstance(e, TrtInferError))
            for fn in self.on_failure:
                fn(e)
            return
        tok = engine.tokenizer
        self.pieces = P.TokenPieces(lru_cache(maxsize=1 << 16)(lambda i: tok.decode([i], skip_special_tokens=False)),
                                    lru_cache(maxsize=1 << 16)(tok.token_bytes))
        with self._lock:
            self.engine, self.scheduler = engine, scheduler
            closing = self._closing
        if closing:  # the server stopped while the engine loaded
            self.close()
            return
        log.info("model %s ready in %.1f s (%d slots of %d positions, %.0f MiB of KV cache reserved)",
                 self.model_name, time.perf_counter() - t0, scheduler.cache.slots, scheduler.max_seq_len,
                 scheduler.cache.nbytes / 2**20)

    def close(self) -> None:
        """Stop the scheduler (its requests end) and close the engine when this service loaded it."""
        with self._lock:
            self._closing = True
            scheduler, engine = self.scheduler, self.engine
            self.scheduler = self.engine = None
        if scheduler is not None:
            scheduler.close()
        if engine is not None and self._owns_engine:
            engine.close()

    def stats(self) -> dict[str, Any] | None:
        """The scheduler's stats, or None while loading."""
        scheduler = self.scheduler
        return None if scheduler is None else scheduler.stats()

    def ready(self) -> tuple[Engine, Scheduler]:
        """The engine and scheduler; 503 while loading or after a failed load."""
        engine, scheduler = self.engine, self.scheduler
        if engine is None or scheduler is None:
            why = "the model is still loading; retry when /health answers 200" if self.error is None else \
                f"the model failed to load: {self.error}"
            raise P.BadRequest(why, status=503, code="model_not_ready")
        return engine, scheduler

    def check_model(self, name: str) -> None:
        """404 (OpenAI's ``model_not_found``) unless ``name`` is the served model's."""
        if name != self.model_name:
            raise P.BadRequest(f"the model {name!r} does not exist here; this server serves {self.model_name!r}",
                               param="model", status=404, code="model_not_found")


def decoder_manifest(path: str | Path) -> Manifest:
    """The manifest of the engine at ``path``, which must be a decoder's: ``trtinfer serve`` serves those."""
    manifest = read_manifest(Path(path))
    if manifest.kind != "decoder":
        raise InputError(f"{path} is an encoder engine (embeddings); trtinfer serve serves decoder engines")
    return manifest


def load_engine(path: str | Path, config: ServeConfig) -> Engine:
    """The engine of a directory (a seam for tests that hold loading back); an encoder's is refused unloaded."""
    decoder_manifest(path)
    return Engine(path, config.runtime())


# ------------------------------------------------------------------------------------------------------------------
# ASGI gate: API key and body size, before any route runs


class _Gate:
    """Refuses requests without the API key (401) and bodies over the limit (413) before the app sees them.

    A body is read here in full (up to the limit) and handed on: a chunked upload without Content-Length is limited
    as well as one that declares its size.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app, self.max_body = app, max_body
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                await _error(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        if (declared := headers.get(b"content-length")) is not None:
            if not declared.isdigit():
                await _error(400, "Content-Length is not a number")(scope, receive, send)
                return
            if int(declared) > self.max_body:
                await self._too_large(scope, receive, send)
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:  # after the body: http.disconnect when the client goes away
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _error(413, f"request body exceeds this server's limit of {self.max_body} bytes",
                     code="request_too_large")(scope, receive, send)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "null"})


def _param_of(loc: Any) -> str | None:
    """A pydantic error location as the parameter's dotted name (``messages.0.role``), without the union member
    tags pydantic puts in (``prompt.list[int].0`` -> ``prompt.0``)."""
    parts = [str(x) for x in loc if x != "body" and not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]
    return ".".join(parts) or None


# ------------------------------------------------------------------------------------------------------------------
# the app


def create_app(engine: Engine | str | Path, config: ServeConfig | None = None) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving ``engine`` (a directory, loaded in the background, or an Engine).

    Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``),
    ``GET /health`` (503 while loading), ``GET /metrics`` (Prometheus). ``app.state.service`` is the :class:`Service`
    (engine, scheduler, ``stats()``); ``app.state.metrics`` the :class:`ServerMetrics`.
    """
    config = config or ServeConfig()
    service = Service(engine, config)
    metrics = ServerMetrics(service.model_name, service.stats)
    service.on_finish = metrics.finished
    handler = Handler(service)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            await run_in_threadpool(service.close)

    app = FastAPI(title="trtinfer", summary="OpenAI-compatible server of a trtinfer engine", lifespan=lifespan)
    app.state.service, app.state.metrics = service, metrics

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
        param = _param_of(first.get("loc", ()))
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid body"))
        if sum(_param_of(e.get("loc", ())) == param for e in errors) > 1:  # a union: no accepted form fits
            message = f"{param}: no accepted form fits; for one, {first.get('msg', 'invalid value')}"
        if first.get("input") is not None and param:
            message += f" (got {json.dumps(first['input'], default=str)[:80]})"
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(TrtInferError)
    async def refused(_: Request, exc: TrtInferError) -> JSONResponse:
        status, message = status_of(exc)
        if status >= 500:
            log_failure("request", status, exc)
        return _error(status, message, getattr(exc, "param", None) or getattr(exc, "field", None),
                      getattr(exc, "code", None),
                      {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, QueueFullError) else None)

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception) -> JSONResponse:  # only what escapes `answer` below reaches here
        log.error("request failed: %s", exc, exc_info=exc)
        return _error(500, "internal server error; the server log has the details")

    async def answer(body: P.CompletionRequest | P.ChatCompletionRequest, request: Request) -> Response:
        """The routes' handler, a bug in it answered here: Starlette's catch-all handler answers outside the app's
        middleware (a Ray replica's 500 lost its x-trtinfer-replica header) and then re-raises (uvicorn logged the
        traceback a second time)."""
        try:
            return await handler.handle(body, request)
        except (TrtInferError, StarletteHTTPException, RequestValidationError):
            raise
        except Exception as exc:  # noqa: BLE001 - the client gets a 500; the log has the traceback once
            return await failed(request, exc)

    @app.get("/health")
    async def health() -> Response:
        if service.state == "ready":
            return JSONResponse({"status": "ok"})
        return _error(503, "the model is still loading" if service.error is None else
                      f"the model failed to load: {service.error}", code="model_not_ready")

    @app.get("/v1/models")
    async def models() -> Response:
        _, scheduler = service.ready()
        return JSONResponse(P.models_list(service.model_name, scheduler.max_seq_len, service.created))

    @app.get("/v1/models/{model_id:path}")  # :path: a served name may hold a slash (org/model)
    async def model(model_id: str) -> Response:
        _, scheduler = service.ready()
        service.check_model(model_id)
        return JSONResponse(P.model_card(service.model_name, scheduler.max_seq_len, service.created))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        return await answer(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        return await answer(body, request)

    app.add_middleware(_Gate, api_key=config.api_key, max_body=config.max_body_bytes)  # type: ignore[arg-type]
    return app

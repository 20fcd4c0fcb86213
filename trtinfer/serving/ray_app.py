"""Scale-out on Ray Serve: the OpenAI server of :mod:`trtinfer.serving.app` as a deployment, one engine per replica.

::

    openai client ── Ray Serve HTTP proxy (host:port) ── router: a replica with the fewest ongoing requests
                                                           (of two picked), at most max_ongoing_requests each
                        ├── replica 1 (a Ray actor, its own process): create_app routes ── Scheduler ── Engine
                        └── replica 2 ...                             each with its own continuous batcher

Each replica is a Ray actor that loads the engine in its constructor (off the event loop), then builds the same
FastAPI app ``trtinfer serve`` runs on uvicorn around that engine (``__serve_build_asgi_app__``, Ray Serve's
late-bound ingress). Ray Serve runs the app's lifespan, which starts the scheduler; on shutdown it lets requests in
flight finish (``graceful_shutdown_timeout_s``), runs the lifespan's end (the scheduler stops) and then ``__del__``
(the engine closes). Every response names the replica that answered in the ``x-trtinfer-replica`` header.

More machines: ``ray start --head`` on one, ``ray start --address HEAD:6379`` on the others, then
``trtinfer serve DIR --ray --ray-address auto --replicas N`` (the engine directory must exist at the same path on
every node). Ray is optional: ``pip install "trtinfer[ray]"``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

try:
    import ray
    from ray import serve
except ModuleNotFoundError:  # the [ray] extra is optional; name "ray" lets the CLI say which extra to install
    raise ModuleNotFoundError('trtinfer.serving.ray_app needs Ray Serve: pip install "trtinfer[ray]"',
                              name="ray") from None

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trtinfer.errors import ConfigError, EngineLoadError
from trtinfer.runtime.config import describe, is_number
from trtinfer.runtime.engine import Engine
from trtinfer.serving import app as app_module
from trtinfer.serving.config import ServeConfig, check_ints

log = logging.getLogger(__name__)

#: the response header naming the replica that answered (Ray Serve's replica id)
REPLICA_HEADER = "x-trtinfer-replica"


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """How the server runs on Ray Serve (what :class:`ServeConfig` says about one server holds for each replica).

    ``replicas``: engines, each in its own Ray actor with its own continuous batcher. ``replica_cpus``: the CPUs Ray
    reserves for each (a fraction shares a core; the default 1 fits two replicas on a 2-core machine: Serve's
    controller and proxy reserve none). ONNX Runtime gets ``max(1, floor(replica_cpus))`` intra-op threads unless
    ``ServeConfig.intra_op_threads`` says otherwise, so replicas on one machine do not fight over its cores.
    ``max_ongoing_requests``: requests Ray lets into one replica at once (default: see :func:`max_ongoing`).
    ``address``: a running Ray cluster to join (``auto``, ``HOST:6379``, ``ray://HOST:10001``); None starts a
    private local Ray instance, stopped at exit. ``app_name``: the Serve application's name on that cluster.
    """

    replicas: int = 1
    replica_cpus: float = 1.0
    max_ongoing_requests: int | None = None
    address: str | None = None
    app_name: str = "trtinfer"
    health_check_period_s: float = 10.0
    graceful_shutdown_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        check_ints(self, {"replicas": 1, "max_ongoing_requests": 1}, optional=("max_ongoing_requests",))
        for name in ("replica_cpus", "health_check_period_s", "graceful_shutdown_timeout_s"):
            value = getattr(self, name)
            if not (is_number(value) and value > 0):
                raise ConfigError(f"{name} must be a number > 0, got {describe(value)}", field=name)
        for name in ("address", "app_name"):
            value = getattr(self, name)
            if (value is not None or name == "app_name") and not (isinstance(value, str) and value.strip()):
                raise ConfigError(f"{name} must be a non-empty string, got {describe(value)}", field=name)


def max_ongoing(max_batch_size: int, max_queue: int) -> int:
    """Requests Ray lets into one replica at once: ``min(2 * max_batch_size, max_batch_size + max_queue)``.

    Ray Serve's default (5) would cap the scheduler's batch at 5 rows whatever the engine's max batch size: requests
    Ray holds back never reach the continuous batcher. Twice the batch fills every slot and keeps as many waiting in
    the scheduler's queue, so a freed slot is taken at the next step without a trip through Ray's router; beyond
    that, requests wait in Ray's router, where the next free replica (any node) takes them. Never more than the
    batch plus the scheduler's queue, which would answer the rest 429 while Ray could still route them elsewhere.
    """
    return max(1, min(2 * max_batch_size, max_batch_size + max_queue))


class _ReplicaHeader:
    """ASGI middleware: every HTTP response carries ``x-trtinfer-replica: <replica id>``."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def named(message: Message) -> None:  # other scopes (lifespan) send no http.response.start
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


@serve.deployment(name="trtinfer")
@serve.ingress()  # late-bound: __serve_build_asgi_app__ makes the app in the replica, around its engine
class EngineReplica:
    """One replica: an engine loaded in this actor's process, served by ``create_app``'s routes and scheduler."""

    # Ray Serve awaits an ingress class's constructor (mypy knows only plain ones)
    async def __init__(self, engine_dir: str, config: ServeConfig) -> None:  # type: ignore[misc]
        self.config = config
        self.replica = serve.get_replica_context().replica_id.unique_id
        t0 = time.perf_counter()
        # off the replica's event loop: Ray's own calls to this actor keep being answered while it loads
        self.engine: Engine | None = await asyncio.to_thread(app_module.load_engine, engine_dir, config)
        self.service: app_module.Service | None = None
        log.info("replica %s loaded %s in %.1f s (%d ONNX Runtime threads)", self.replica, engine_dir,
                 time.perf_counter() - t0, config.intra_op_threads)

    def __serve_build_asgi_app__(self) -> Any:
        """The FastAPI app of ``trtinfer serve`` around this replica's engine (Ray runs its lifespan next)."""
        assert self.engine is not None, "the engine is closed"
        app = app_module.create_app(self.engine, self.config)
        app.add_middleware(_ReplicaHeader, replica=self.replica)  # type: ignore[arg-type]
        self.service = app.state.service
        return app

    def check_health(self) -> None:
        """Ray Serve's periodic probe: raising marks this replica unhealthy (Ray replaces it)."""
        service = self.service
        if service is None or service.state != "ready":
            why = "no app yet" if service is None else service.state + (
                "" if service.error is None else f": {service.error}")
            raise RuntimeError(f"replica {self.replica} is not serving ({why})")

    def __del__(self) -> None:
        # Ray calls this after the app's lifespan ended (the scheduler is stopped): the engine goes last
        engine = getattr(self, "engine", None)
        if engine is not None:
            self.engine = None
            engine.close()
            log.info("replica %s closed its engine", getattr(self, "replica", "?"))


def build(engine_dir: str | Path, config: ServeConfig | None = None, ray_config: RayConfig | None = None) -> Any:
    """The Serve application (``serve.run`` it): ``ray_config.replicas`` replicas of the engine at ``engine_dir``.

    ``engine_dir`` is checked here (a decoder engine's manifest) and handed to replicas as an absolute path: every
    node that runs one must see the engine there.
    """
    config, ray_config = config or ServeConfig(), ray_config or RayConfig()
    path = Path(engine_dir).resolve()
    manifest = app_module.decoder_manifest(path)
    ongoing = ray_config.max_ongoing_requests or max_ongoing(config.slots_for(manifest.max_batch_size),
                                                             config.max_queue)
    # ONNX Runtime intra-op threads per replica: the config's, else one per reserved CPU (at least 1)
    threads = config.intra_op_threads or max(1, math.floor(ray_config.replica_cpus))
    replica_config = dataclasses.replace(config, intra_op_threads=threads)
    return EngineReplica.options(  # type: ignore[attr-defined]  # a serve.Deployment, not the class
        name=ray_config.app_name,
        num_replicas=ray_config.replicas,
        ray_actor_options={"num_cpus": ray_config.replica_cpus},
        max_ongoing_requests=ongoing,
        # waiting at each proxy beyond what replicas take: bounded like the scheduler's queue, answered 429 as it is
        max_queued_requests=config.max_queue * ray_config.replicas,
        backpressure_config={"status_code": 429, "retry_after_s": app_module.RETRY_AFTER_S},
        health_check_period_s=ray_config.health_check_period_s,
        graceful_shutdown_timeout_s=ray_config.graceful_shutdown_timeout_s,
    ).bind(str(path), replica_config)


def _free_port(host: str) -> int:
    """A port free on ``host`` now (Ray's proxy binds by number, so port 0 is chosen here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start(engine_dir: str | Path, config: ServeConfig | None = None, ray_config: RayConfig | None = None) -> str:
    """Connect to (or start) Ray, deploy the replicas and wait until every one is ready; the server's base URL.

    Stop with :func:`stop`. A replica that fails to load raises :class:`EngineLoadError` (after Ray gave up).
    """
    config, ray_config = config or ServeConfig(), ray_config or RayConfig()
    app = build(engine_dir, config, ray_config)  # a bad directory fails here, before Ray starts
    local = ray_config.address is None
    t0 = time.perf_counter()
    if not ray.is_initialized():
        ray.init(address="local" if local else ray_config.address, include_dashboard=False if local else None)
    cpus = float(ray.cluster_resources().get("CPU", 0))
    need = ray_config.replicas * ray_config.replica_cpus
    if need > cpus:
        message = (f"{ray_config.replicas} replica(s) x {ray_config.replica_cpus:g} CPU need {need:g} CPUs; this Ray "
                   f"cluster has {cpus:g}")
        if local:
            stop(ray_config)
            raise ConfigError(f"{message}: lower --replicas or --replica-cpus (0.5 shares a core), or add machines "
                              f"(ray start) and pass --ray-address", field="replicas")
        log.warning("%s: the rest wait until nodes join (ray start --address ...)", message)
    port = _free_port(config.host) if config.port == 0 else config.port
    serve.start(http_options={"host": config.host, "port": port})
    try:
        serve.run(app, name=ray_config.app_name, route_prefix="/", blocking=False)
    except Exception as e:  # Ray's message is a traceback; its last line says what failed
        stop(ray_config)
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise EngineLoadError(f"the Ray Serve deployment of {engine_dir} failed: "
                              f"{lines[-1] if lines else type(e).__name__}") from e
    shown = f"[{config.host}]" if ":" in config.host else config.host
    log.info("%d replica(s) ready in %.1f s", ray_config.replicas, time.perf_counter() - t0)
    return f"http://{shown}:{port}"


def stop(ray_config: RayConfig) -> None:
    """Take the application down: a private local Ray instance stops whole; on a joined cluster only this app goes."""
    if not ray.is_initialized():
        return
    try:
        if ray_config.address is None:
            serve.shutdown()
        else:
            serve.delete(ray_config.app_name)
    finally:
        ray.shutdown()


def serve_ray(engine_dir: str | Path, config: ServeConfig, ray_config: RayConfig) -> int:
    """``trtinfer serve DIR --ray``: deploy, then serve until Ctrl-C/SIGTERM (0); a failed deployment raises."""
    stopping = [False]  # a plain flag: a handler that takes a lock (Event.set) deadlocks when a second signal
    # arrives while the first one's handler holds it (Ctrl-C twice, or timeout(1) forwarding its own signal)
    url = start(engine_dir, config, ray_config)
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets handlers of its own
                signal.signal(sig, lambda *_: stopping.__setitem__(0, True))
        log.info("serving %s at %s/v1 on Ray Serve (%d replica(s); Ctrl-C stops)", engine_dir, url,
                 ray_config.replicas)
        if config.api_key is None and config.host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("listening on %s without --api-key: anyone who reaches this port can use the model",
                        config.host)
        while not stopping[0]:
            time.sleep(0.2)
    finally:
        log.info("stopping (requests in flight finish first)")
        stop(ray_config)
    log.info("stopped")
    return 0

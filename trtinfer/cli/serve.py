"""``trtinfer serve DIR``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one engine.

The engine loads in the background: ``/health`` answers 503 until it is ready, then 200. Ctrl-C (or SIGTERM) stops
the server cleanly: requests in flight end, the engine is closed, the exit status is 0. A load that fails stops the
server with the load error as one line and a non-zero exit.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from trtinfer.cli._flags import add_cpu_runtime_flags, add_provider_flag, path_arg

log = logging.getLogger("trtinfer.serve")

#: ServeConfig field -> flag (errors about a field are reported under its flag)
SERVE_FLAGS = {"host": "--host", "port": "--port", "api_key": "--api-key", "model_name": "--model-name",
               "max_queue": "--max-queue", "max_body_bytes": "--max-body-bytes", "prefill_chunk": "--prefill-chunk",
               "max_n": "--max-n", "provider": "--provider", "intra_op_threads": "--threads",
               "max_slots": "--max-slots", "max_model_len": "--max-model-len", "prefix_caching": "--prefix-caching",
               "speculative_ngram": "--speculative-ngram", "chat_template": "--chat-template",
               "prefill_graph": "--prefill-graph", "huge_pages": "--huge-pages", "spinning": "--spinning"}
#: RayConfig field -> flag (``--ray`` itself chooses Ray Serve)
RAY_FLAGS = {"replicas": "--replicas", "replica_cpus": "--replica-cpus", "address": "--ray-address"}
#: where --api-key is read from when the flag is not given (a key on the command line shows in `ps`)
API_KEY_ENV = "TRTINFER_API_KEY"


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("serve", help="serve an engine over an OpenAI-compatible HTTP API")
    p.add_argument("engine", type=path_arg, help="engine directory from `trtinfer build`")
    # flags default to None: ServeConfig holds the defaults (one place)
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000; 0: any free port)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV})")
    p.add_argument("--model-name", default=None, help="the model's name in the API (default: the engine folder's)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="sequences (prompts x n) waiting for a batch slot before new requests get 429; a request "
                        "is refused or queued whole, so an idle server takes one of any size (default 64)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 1 MiB)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens a step may prefill (default 256; in one call while requests decode)")
    p.add_argument("--max-n", type=int, default=None, help="the most choices (n) per request (default 16)")
    p.add_argument("--max-slots", type=int, default=None,
                   help="requests decoded at once (default: the engine's max batch size, at most 8)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="positions per request, prompt + output (default: the engine's max sequence length, at most "
                        "2048); slots x this is the KV cache reserved at start")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of the longest prompt prefix a batch row holds (a shared system prompt, the "
                        "earlier turns of a chat); --no-prefix-caching prefills every prompt whole (default: on)")
    p.add_argument("--speculative-ngram", type=int, default=None, metavar="K",
                   help="prompt lookup (vLLM's ngram speculation): each request drafts up to K tokens from its own "
                        "n-grams and verifies them in one pass; same tokens, faster where output copies its input "
                        "(default 0: off)")
    p.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help="the chat route's template instead of the model's: a jinja file, or built in: chatml-tools "
                        "(SmolLM2, Qwen2 and other ChatML models), gemma3-tools; both render tools (function "
                        "calling) and parse <tool_call> blocks back")
    add_provider_flag(p, default=None, help="default cpu")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default 0: one per core)")
    add_cpu_runtime_flags(p, prefill_graph=None, huge_pages=None, spinning=None)
    ray = p.add_argument_group("scale-out on Ray Serve (pip install 'trtinfer[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve as a Ray Serve deployment: one engine per replica, each with its own batcher")
    ray.add_argument("--replicas", type=int, default=None, help="engines, one per Ray replica (default 1)")
    ray.add_argument("--replica-cpus", type=float, default=None,
                     help="CPUs Ray reserves per replica, also its ONNX Runtime threads unless --threads (default 1)")
    ray.add_argument("--ray-address", default=None,
                     help="join a running Ray cluster (auto, HOST:6379) instead of starting a private local one")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`ServeConfig` the flags ask for (checked, errors named by flag)."""
    from trtinfer.cli._flags import config_from_flags
    from trtinfer.serving.config import ServeConfig

    chosen = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in SERVE_FLAGS.items()}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    if "api_key" not in chosen and os.environ.get(API_KEY_ENV):
        from trtinfer.errors import ConfigError

        try:  # said under the variable that set it, not under a flag that was not given
            ServeConfig(api_key=os.environ[API_KEY_ENV])
        except ConfigError as e:
            raise ConfigError(str(e).replace("api_key", f"${API_KEY_ENV}", 1)) from None
        chosen["api_key"] = os.environ[API_KEY_ENV]
    return config_from_flags(ServeConfig, SERVE_FLAGS, **chosen)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.serving.app import decoder_manifest

    config = config_from_args(args)
    ray_config = ray_config_from_args(args)
    path = Path(args.engine)
    manifest = decoder_manifest(path)  # a bad directory or an encoder engine fails here, before anything listens
    if config.chat_template is not None:  # so does a template that is neither built in nor a readable jinja file
        from trtinfer.runtime.tokenizer import load_chat_template

        load_chat_template(config.chat_template)
    config.slots_for(manifest.max_batch_size)  # --max-slots / --max-model-len past the engine's: before any port opens
    config.model_len_for(manifest.max_seq_len)
    if ray_config is not None:  # the same create_app in every Ray replica
        from trtinfer.serving.ray_app import serve_ray

        return serve_ray(path, config, ray_config)
    return serve_uvicorn(path, config)


def ray_config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`RayConfig` of ``--ray`` and its flags (None without ``--ray``); imports Ray, so a missing
    ``[ray]`` extra is reported before anything else happens."""
    from trtinfer.cli._flags import config_from_flags
    from trtinfer.errors import ConfigError

    chosen = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in RAY_FLAGS.items()}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    if not args.ray:
        if chosen:
            flags = ", ".join(RAY_FLAGS[k] for k in chosen)
            raise ConfigError(f"{flags} {'needs' if len(chosen) == 1 else 'need'} --ray", field=next(iter(chosen)))
        return None
    from trtinfer.serving.ray_app import RayConfig

    return config_from_flags(RayConfig, RAY_FLAGS, **chosen)


class _Stopped(Exception):
    """SIGTERM, raised once uvicorn has shut down (uvicorn re-raises the signals it caught)."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped


#: seconds requests in flight get to finish once the server is asked to stop; then the scheduler is closed, which
#: ends what is left as it ends requests at any close (a 503, or a stream's error event and [DONE]), and
#: SHUTDOWN_MARGIN_S more let their handlers write that before uvicorn cancels what is still running
SHUTDOWN_GRACE_S, SHUTDOWN_MARGIN_S = 10.0, 5.0


def _server(app: Any, service: Any) -> Any:
    """uvicorn's server, whose shutdown closes the scheduler after the grace period: uvicorn cancels the request
    tasks at its own timeout first and runs the app's shutdown only after, so requests running past it were cut
    mid-stream (incomplete chunked reads, a bare 500)."""
    import asyncio

    import uvicorn
    from starlette.concurrency import run_in_threadpool

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            async def close_after_grace() -> None:
                await asyncio.sleep(SHUTDOWN_GRACE_S)
                if self.server_state.tasks:
                    log.warning("%d request(s) still running %.0f s after the stop: ending them",
                                len(self.server_state.tasks), SHUTDOWN_GRACE_S)
                await run_in_threadpool(service.close)

            closer = asyncio.create_task(close_after_grace())
            try:
                await super().shutdown(sockets)
            finally:
                closer.cancel()

    return Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                 timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S + SHUTDOWN_MARGIN_S)))


def serve_uvicorn(path: Path, config: Any) -> int:
    """Serve ``path`` with uvicorn until Ctrl-C/SIGTERM (0) or a failed engine load (its error)."""

    from trtinfer.errors import EngineLoadError, TrtInferError
    from trtinfer.serving.app import create_app

    app = create_app(path, config)
    service = app.state.service
    sock = _bind(config.host, config.port)
    server = _server(app, service)
    service.on_failure.append(lambda e: setattr(server, "should_exit", True))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info("serving %s as %r at http://%s:%d/v1 (loading the engine: /health answers 200 once it is ready; "
             "Ctrl-C stops)", path, service.model_name, shown, port)
    if config.api_key is None and not _is_loopback(host):
        log.warning("listening on %s without --api-key: anyone who reaches this port can use the model", host)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_stopped) if main else None
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        sock.close()
        service.close()  # a second Ctrl-C skips the app's shutdown, which closes it (closing twice is fine)
    if service.error is not None:
        err = service.error
        if isinstance(err, TrtInferError):
            raise err
        raise EngineLoadError(f"the engine {path} failed to load: {type(err).__name__}: {err}") from err
    log.info("stopped")
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (IPv4 or IPv6); ServingError when it cannot be."""
    from trtinfer.errors import ServingError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise ServingError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port or --host") from e
    return sock


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

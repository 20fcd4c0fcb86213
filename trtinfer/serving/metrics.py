"""Prometheus metrics of the server, named after vLLM's with a ``trtinfer:`` prefix, in a registry per app.

Gauges and counters (tokens, finished requests) are read from the scheduler's ``stats()`` when scraped (one source
of truth: the scheduler counts, the exposition reads); latency histograms are observed from the request's own
timestamps by :meth:`ServerMetrics.finished`, which the scheduler's ``on_finish`` hook calls as each request ends.

``request_success`` and the histograms count the same requests, each once, as vLLM's do (both from its finished
requests): every request that finishes (``stop``, ``length``) or is cancelled (``abort``: the client went away),
whoever submitted it and whether or not anyone still reads it. A request that fails (the scheduler's ``error``) is
in neither. So ``e2e_request_latency_seconds_count`` equals the sum of ``request_success`` over its reasons (the hook
runs before the scheduler counts: a scrape never sees the count ahead of the histogram); ``time_to_first_token``
counts those of them that produced a token.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from trtinfer.runtime.request import Finished

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: the scheduler's finish reasons as vLLM names them
FINISHED_AS = {"cancelled": "abort"}

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class _SchedulerCollector(Collector):
    """Running/waiting requests, KV slot usage and token counters, from ``stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], Mapping[str, Any] | None], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        s = dict(self.stats() or {})
        total = s.get("slots_total") or 0
        s["kv_cache_usage"] = s.get("slots_used", 0) / total if total else 0.0
        names, values = ["model_name"], [self.model_name]
        G, C = GaugeMetricFamily, CounterMetricFamily
        for cls, name, doc, key in (
                (G, "num_requests_running", "Requests holding a batch slot.", "running"),
                (G, "num_requests_waiting", "Requests queued for a batch slot.", "waiting"),
                (G, "kv_cache_usage_perc", "Fraction of KV cache slots in use (1 = full).", "kv_cache_usage"),
                (C, "prompt_tokens", "Prompt tokens processed (prefilled, or reused from the prefix cache).",
                 "prompt_tokens"),
                (C, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
                (C, "prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).",
                 "prefix_cache_hits"),
                (C, "spec_decode_num_draft_tokens", "Prompt-lookup draft tokens proposed.", "spec_decode_draft_tokens"),
                (C, "spec_decode_num_accepted_tokens", "Prompt-lookup draft tokens accepted.",
                 "spec_decode_accepted_tokens"),
                (C, "generation_tokens", "Tokens generated.", "generation_tokens")):
            family = cls(f"trtinfer:{name}", doc, labels=names)
            family.add_metric(values, s.get(key, 0))
            yield family
        done = CounterMetricFamily("trtinfer:request_success", "Finished requests by finish reason (abort: cancelled, "
                                   "e.g. the client went away).", labels=[*names, "finished_reason"])
        for reason, count in sorted((s.get("requests_finished") or {}).items()):
            if reason != "error":  # a failed request is no success
                done.add_metric([*values, FINISHED_AS.get(reason, reason)], count)
        yield done


class ServerMetrics:
    """The app's metrics in their own :class:`CollectorRegistry` (several apps in one process never collide)."""

    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, Any] | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(stats, model_name))

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(f"trtinfer:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, submit to last token (or cancellation).",
                             E2E_BUCKETS)

    def finished(self, done: Finished) -> None:
        """Record one finished request's TTFT, inter-token gaps and end-to-end latency (one clock, in seconds)."""
        if done.t_first_token is not None:
            self.ttft.observe(max(0.0, done.t_first_token - done.t_submit))
        for a, b in itertools.pairwise(done.token_times):
            self.itl.observe(max(0.0, b - a))
        self.e2e.observe(max(0.0, done.t_end - done.t_submit))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

"""``GET /metrics``: Prometheus counters of what the server did, early exits included.

Every series is prefixed ``exitlm_``:

* ``http_requests_total{path,status}``; ``requests_total{finish_reason}`` (engine requests,
  one per choice; ``cancelled`` when the client went away, ``error`` after an engine failure);
  ``engine_failures_total``;
* ``prompt_tokens_total``, ``prompt_tokens_cached_total`` (of those, positions copied from
  another request's cache: shared prompts and starts), ``generation_tokens_total``, and
  ``generation_tokens_by_exit_layer_total{layer}`` (the 1-based layer whose output chose each
  token; ``layer == num_layers`` is the full depth);
* ``layer_evaluations_total`` (transformer-layer evaluations spent decoding, recomputation and
  rejected drafts included), ``layer_evaluations_full_depth_total`` (what the same tokens
  cost through every layer) and two gauges, never negative: ``layer_evaluations_saved``
  (evaluations plain decoding would have spent that were not: early exits) and
  ``layer_evaluations_extra`` (evaluations spent beyond plain decoding: rejected drafts,
  recomputation); at most one of them is non-zero;
* ``strategy_events_total{event}``: the strategy's counters (self-spec: ``rounds``,
  ``drafted``, ``accepted``; PPD: ``forks``, ``matches``) and the gauge
  ``strategy_rate{rate}`` of their derived rates (``acceptance_rate``, ``p_correct``, ...);
* ``queue_depth`` (waiting requests), ``running_requests`` (requests holding a KV row);
* histograms ``time_to_first_token_seconds`` and ``request_latency_seconds``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from exitlm.infer.request import Update
from exitlm.infer.result import DecodeStats

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The server's Prometheus registry (one per server, so tests may run several).

    Args:
        num_layers: the model's depth (full-depth cost of a token).
        stats_type: the strategy's statistics type (summed over finished requests).
        queue_depth, running: read at scrape time.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, num_layers: int, stats_type: type[DecodeStats],
                 queue_depth: Callable[[], float], running: Callable[[], float],
                 failures: Callable[[], float]) -> None:
        self.num_layers = num_layers
        disable_created_metrics()  # no *_created series: timestamps nobody graphs
        self.registry = r = CollectorRegistry()
        self.http = Counter("exitlm_http_requests", "HTTP requests answered",
                            ["path", "status"], registry=r)
        self.requests = Counter("exitlm_requests", "engine requests (one per choice) finished",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("exitlm_prompt_tokens", "prompt tokens of finished "
                                     "engine requests", registry=r)
        self.prompt_cached = Counter("exitlm_prompt_tokens_cached", "prompt positions of "
                                     "finished engine requests copied from another request's "
                                     "cache instead of prefilled", registry=r)
        self.generation_tokens = Counter("exitlm_generation_tokens", "tokens generated",
                                         registry=r)
        self.by_exit = Counter("exitlm_generation_tokens_by_exit_layer",
                               "tokens generated, by the 1-based layer whose output chose them",
                               ["layer"], registry=r)
        self.evaluations = Counter("exitlm_layer_evaluations", "transformer-layer evaluations "
                                   "(token x layer) spent decoding", registry=r)
        self.full_depth = Counter("exitlm_layer_evaluations_full_depth", "layer evaluations "
                                  "the same tokens cost through every layer", registry=r)
        Gauge("exitlm_layer_evaluations_saved", "layer evaluations plain decoding would have "
              "spent on the same tokens that were not spent (never negative)",
              registry=r).set_function(self._saved)
        Gauge("exitlm_layer_evaluations_extra", "layer evaluations spent beyond what plain "
              "decoding would have spent on the same tokens (rejected drafts, recomputation)",
              registry=r).set_function(self._extra)
        self.events = Counter("exitlm_strategy_events", "the decoding strategy's counters "
                              "(drafted/accepted tokens, PPD forks/matches, ...)", ["event"],
                              registry=r)
        Gauge("exitlm_queue_depth", "requests waiting for a KV row",
              registry=r).set_function(queue_depth)
        Gauge("exitlm_running_requests", "requests holding a KV row",
              registry=r).set_function(running)
        Gauge("exitlm_engine_failures", "engine steps that raised",
              registry=r).set_function(failures)
        self.ttft = Histogram("exitlm_time_to_first_token_seconds", "submit to first token",
                              registry=r, buckets=_BUCKETS)
        self.latency = Histogram("exitlm_request_latency_seconds", "submit to last token",
                                 registry=r, buckets=_BUCKETS)
        self._lock = threading.Lock()
        self._stats = stats_type()
        self._spent = 0
        self._full = 0
        r.register(_RateCollector(self))

    def observe(self, update: Update) -> None:
        """Count one engine update (called on the engine thread)."""
        if update.token_ids:
            self.generation_tokens.inc(len(update.token_ids))
        for layer in update.exit_layers:
            self.by_exit.labels(str(layer)).inc()
        if not update.finished:
            return
        r = update.request
        self.requests.labels(r.finish_reason or "length").inc()
        self.prompt_tokens.inc(len(r.prompt_ids))
        self.prompt_cached.inc(r.prompt_copied)
        full = len(r.token_ids) * self.num_layers
        self.evaluations.inc(r.layer_evaluations)
        self.full_depth.inc(full)
        for f in dataclasses.fields(r.stats):
            value = getattr(r.stats, f.name)
            if value:
                self.events.labels(f.name).inc(value)
        with self._lock:
            self._stats = self._stats.add(r.stats)
            self._spent += r.layer_evaluations
            self._full += full
        if r.finish_reason not in ("cancelled", "error"):
            self.ttft.observe(max(0.0, r.t_first - r.t_submit))
            self.latency.observe(max(0.0, r.t_end - r.t_submit))

    def http_request(self, path: str, status: int) -> None:
        self.http.labels(path, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _saved(self) -> float:
        with self._lock:
            return float(max(0, self._full - self._spent))

    def _extra(self) -> float:
        with self._lock:
            return float(max(0, self._spent - self._full))

    def rates(self) -> dict[str, float]:
        with self._lock:
            return self._stats.derived()


class _RateCollector(Collector):
    """``exitlm_strategy_rate{rate}``: the strategy's derived rates over finished requests."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):  # type: ignore[no-untyped-def]
        family = GaugeMetricFamily("exitlm_strategy_rate", "the strategy's rates over "
                                   "finished requests (acceptance_rate, p_correct, ...)",
                                   labels=["rate"])
        for name, value in self.metrics.rates().items():
            family.add_metric([name], value)
        yield family

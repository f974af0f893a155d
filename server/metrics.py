"""Prometheus metrics of the service (one registry per process; each worker exposes its own)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ckptstore.telemetry_schema import ReplicationLag

__all__ = ["METRICS", "Metrics", "replication_metrics"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ckptstore_requests_total", "HTTP requests", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "ckptstore_request_seconds",
            "HTTP request latency",
            ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.commits = Counter(
            "ckptstore_commits_total", "checkpoint commits recorded", ["outcome"], registry=self.registry
        )
        self.refused = Counter(
            "ckptstore_refused_total", "requests refused, by error code", ["code"], registry=self.registry
        )
        self.last_good_queries = Counter(
            "ckptstore_last_good_queries_total", "last-good-epoch queries", registry=self.registry
        )
        self.db_errors = Counter("ckptstore_db_errors_total", "database errors answered 503", registry=self.registry)
        self.fast_path = Counter(
            "ckptstore_fast_path_total",
            "writes answered before routing (server/fastpath.py)",
            ["route"],
            registry=self.registry,
        )


METRICS = Metrics()


class _Replication(Collector):
    def __init__(self, lags: dict[str, dict[str, ReplicationLag]]):
        self.lags = lags

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pending = GaugeMetricFamily(
            "ckptstore_replication_pending_copies", "local copies not yet on the durable tier", labels=["job", "node"]
        )
        lag = GaugeMetricFamily(
            "ckptstore_replication_lag_seconds",
            "how long the oldest local copy not yet on the durable tier has waited",
            labels=["job", "node"],
        )
        for job, nodes in sorted(self.lags.items()):
            for node, state in sorted(nodes.items()):
                pending.add_metric([job, node], state.pending)
                lag.add_metric([job, node], state.oldest_pending_seconds or 0.0)
        yield pending
        yield lag


def replication_metrics(lags: dict[str, dict[str, ReplicationLag]]) -> bytes:
    """Replication gauges per job and node, read from the records at scrape time (every replica agrees)."""
    registry = CollectorRegistry()
    registry.register(_Replication(lags))
    return generate_latest(registry)

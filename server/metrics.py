"""Prometheus metrics of the service (one registry per process; each worker exposes its own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["METRICS", "Metrics"]


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


METRICS = Metrics()

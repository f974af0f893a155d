"""Prometheus metrics of the service (one registry per process; each worker exposes its own)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ckptstore.wire.schema import Advice, ReplicationLag

__all__ = ["METRICS", "Metrics", "scrape_metrics"]


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
        self.presigned_urls = Counter(
            "ckptstore_presigned_urls_total",
            "presigned URLs handed out (server/presign/signer.py)",
            registry=self.registry,
        )
        self.fast_path = Counter(
            "ckptstore_fast_path_total",
            "writes answered before routing (server/http/fastpath.py)",
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


class _Advice(Collector):
    """Each recently active job's goodput, its parts and the recommended interval (server/records/advice.py)."""

    FIELDS = (
        ("goodput", "ckptstore_job_goodput_ratio", "share of the job's wall time spent training"),
        ("wall_seconds", "ckptstore_job_wall_seconds", "the job's wall time so far"),
        ("lost_seconds", "ckptstore_job_lost_seconds", "work redone after failures"),
        ("blocked_seconds", "ckptstore_job_blocked_seconds", "time training waited for saves and restores"),
        ("failures", "ckptstore_job_failures", "restarts of the job's most restarted node"),
        ("interval_seconds", "ckptstore_job_recommended_interval_seconds", "Young/Daly checkpoint interval"),
    )

    def __init__(self, advice: list[Advice]):
        self.advice = advice

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for field, name, documentation in self.FIELDS:
            family = GaugeMetricFamily(name, documentation, labels=["job"])
            for answer in sorted(self.advice, key=lambda a: a.job):
                value = getattr(answer, field)
                if value is not None:  # a history too short for it: no sample, rather than a made-up one
                    family.add_metric([answer.job], float(value))
            yield family


def scrape_metrics(lags: dict[str, dict[str, ReplicationLag]], advice: list[Advice]) -> bytes:
    """The gauges read from the records at scrape time (every replica agrees): replication per job and
    node, and the operations advice per recently active job."""
    registry = CollectorRegistry()
    registry.register(_Replication(lags))
    registry.register(_Advice(advice))
    return generate_latest(registry)

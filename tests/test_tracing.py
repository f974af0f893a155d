"""OpenTelemetry (the [otel] extra): with a tracer provider configured, the client records spans for
snapshot, write, commit, replicate, restore read and assign (job, node, position, bytes), the
service one per request, and the service's span joins the client's trace; with none configured,
nothing is recorded and the service adds no middleware. Checked with the SDK's in-memory exporter."""

from __future__ import annotations

import uuid

import pytest

torch = pytest.importorskip("torch", reason="the [torch] extra is not installed")
pytest.importorskip("opentelemetry.sdk", reason="the [otel] extra is not installed")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.util._once import Once  # noqa: E402

from ckptstore import tracing  # noqa: E402
from tests.conftest import service_settings  # noqa: E402
from tests.live import LiveService  # noqa: E402


def _reset_provider(provider) -> None:
    """Set (or, with None, unset) the global tracer provider, which OpenTelemetry lets a process set once."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    if provider is not None:
        trace.set_tracer_provider(provider)


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _reset_provider(provider)
    yield exporter
    _reset_provider(None)
    assert not tracing.enabled()


def test_a_save_and_a_restore_are_traced_from_the_client_into_the_service(spans, tmp_path):
    from ckptstore.client.torch import CheckpointManager

    live = LiveService(service_settings(str(tmp_path), f"sqlite:///{tmp_path}/service.db"))
    try:
        job = f"traced-{uuid.uuid4().hex[:6]}"
        options = dict(
            storage=f"{tmp_path}/storage", local_storage=str(tmp_path / "local"), service=live.url, job=job, node="n0"
        )
        model = torch.nn.Linear(64, 32)
        with CheckpointManager(objects={"model": model}, **options) as mgr:
            assert mgr.restore_or_initialize() == 0
            with trace.get_tracer("training").start_as_current_span("epoch 0") as epoch_span:
                mgr.save(0)
            mgr.wait()
        with CheckpointManager(objects={"model": torch.nn.Linear(64, 32)}, **options) as mgr:
            assert mgr.restore_or_initialize() == 1
    finally:
        live.stop()

    finished = spans.get_finished_spans()
    by_name: dict[str, list] = {}
    for span in finished:
        by_name.setdefault(span.name, []).append(span)
    for name in ("snapshot", "write", "commit", "replicate", "restore.read", "restore.assign"):
        assert f"ckptstore.{name}" in by_name, f"no ckptstore.{name} span in {sorted(by_name)}"
    (write,) = by_name["ckptstore.write"]
    attributes = dict(write.attributes)
    assert attributes["ckptstore.job"] == job and attributes["ckptstore.node"] == "n0"
    assert attributes["ckptstore.position"] == "epoch 0" and attributes["ckptstore.tier"] == "local"
    assert attributes["ckptstore.bytes"] >= (64 * 32 + 32) * 4, "the model's bytes at least (plus the RNG state)"
    assert write.parent.span_id == epoch_span.get_span_context().span_id, "the writer thread continues the trace"
    fresh, read = by_name["ckptstore.restore.read"]  # the first start found nothing; the second restored
    assert "ckptstore.position" not in dict(fresh.attributes)
    assert dict(read.attributes)["ckptstore.position"] == "epoch 0"
    assert dict(by_name["ckptstore.replicate"][0].attributes)["ckptstore.bytes"] > 0

    commit_ids = {span.context.span_id for span in by_name["ckptstore.commit"]}
    joined = [s for s in finished if s.kind == trace.SpanKind.SERVER and s.parent and s.parent.span_id in commit_ids]
    assert joined, "the service's request span is a child of the client's commit span"
    assert all(s.context.trace_id in {c.context.trace_id for c in by_name["ckptstore.commit"]} for s in joined)
    assert any("checkpoints" in s.name for s in joined), [s.name for s in joined]


def test_without_a_tracer_provider_nothing_is_recorded_and_the_service_adds_no_middleware(tmp_path):
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    from ckptstore.server.app import create_app

    assert not tracing.enabled()
    with tracing.span("ckptstore.write", job="j") as span:
        assert span is None
    headers: dict[str, str] = {}
    tracing.inject(headers)
    assert headers == {}
    app = create_app(service_settings(str(tmp_path), f"sqlite:///{tmp_path}/service.db"))
    assert all(m.cls is not OpenTelemetryMiddleware for m in app.user_middleware)

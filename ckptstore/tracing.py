"""OpenTelemetry spans, when the `[otel]` extra is installed and a tracer provider is configured
(by the standard OTEL_* variables under `opentelemetry-instrument`, or by the application);
otherwise every call here is a no-op that costs an attribute lookup.

The client's spans (snapshot, write, commit, replicate, restore read, assign) carry job, node,
position and bytes; `inject` puts the current trace context into a request's headers, so the
service's span for that request joins the client's trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from typing import Any

try:
    from opentelemetry import context as _context
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace

    _INSTALLED = True
except ImportError:  # the [otel] extra is not installed
    _INSTALLED = False

__all__ = ["enabled", "span", "set_attributes", "capture", "attached", "inject"]


def enabled() -> bool:
    """Whether spans are recorded: OpenTelemetry is installed and a real tracer provider is set."""
    return _INSTALLED and not isinstance(_trace.get_tracer_provider(), _trace.ProxyTracerProvider)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Any]:
    """A span named `name` (with the non-None `attributes`) around the block; yields it (None when off)
    so the block can add attributes it learns later (`bytes` of a write)."""
    if not enabled():
        yield None
        return
    tracer = _trace.get_tracer("ckptstore")
    with tracer.start_as_current_span(name, attributes=_clean(attributes)) as current:
        yield current


def set_attributes(current: Any, **attributes: Any) -> None:
    if current is not None:
        current.set_attributes(_clean(attributes))


def capture() -> Any:
    """The current trace context, to continue in a background thread (None when off)."""
    return _context.get_current() if enabled() else None


@contextlib.contextmanager
def attached(captured: Any) -> Iterator[None]:
    """Run the block in a context `capture` took on another thread."""
    if captured is None:
        yield
        return
    token = _context.attach(captured)
    try:
        yield
    finally:
        _context.detach(token)


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current trace context (`traceparent`) to outgoing request headers."""
    if enabled():
        _propagate.inject(headers)


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """`ckptstore.<name>` keys; values OpenTelemetry cannot hold (a Position) as their text."""
    return {
        f"ckptstore.{key}": value if isinstance(value, (str, int, float, bool)) else str(value)
        for key, value in attributes.items()
        if value is not None
    }

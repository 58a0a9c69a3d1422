"""The caller's W3C trace context, when OpenTelemetry is importable and a span is active."""

from __future__ import annotations

try:
    from opentelemetry import propagate as _propagate
except ImportError:  # tracing is optional
    _propagate = None


def headers() -> tuple[str | None, str | None]:
    """``(traceparent, tracestate)`` of the current context, or Nones."""
    if _propagate is None:
        return None, None
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    return carrier.get("traceparent"), carrier.get("tracestate")

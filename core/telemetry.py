"""OpenTelemetry setup and the trace-context helpers that carry a capture's span to the step.

Exporters follow the standard environment: `OTEL_TRACES_EXPORTER=console` prints spans,
`otlp` uses the OTLP exporter when its package is installed, unset/`none` records spans
without exporting (links still work). `OTEL_SERVICE_NAME` overrides the service name.
Context travels as W3C `traceparent` headers: `inject()` on the producer, `extract_link()`
on the trainer (a step links to every capture it trained on).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

log = logging.getLogger(__name__)
_configured = False


def _exporter_from_env() -> SpanExporter | None:
    name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if name in ("", "none"):
        return None
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning(
                "OTEL_TRACES_EXPORTER=otlp but opentelemetry-exporter-otlp is not installed; spans are not exported"
            )
            return None
        return OTLPSpanExporter()
    log.warning("OTEL_TRACES_EXPORTER=%r is not supported here (console, otlp, none)", name)
    return None


def setup_tracing(
    service_name: str = "specbus", exporter: SpanExporter | None = None
) -> TracerProvider:
    """Install a TracerProvider once per process. `exporter` (tests) wins over the environment."""
    global _configured
    provider = trace.get_tracer_provider()
    if _configured and isinstance(provider, TracerProvider):
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return provider
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    chosen = exporter or _exporter_from_env()
    if chosen is not None:
        provider.add_span_processor(BatchSpanProcessor(chosen))
    trace.set_tracer_provider(provider)
    _configured = True
    return provider


def tracer(name: str = "specbus") -> trace.Tracer:
    """The OpenTelemetry tracer of `name` (a no-op one when tracing is off)."""
    return trace.get_tracer(name)


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """The current span's context as message headers (adds to `headers`)."""
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers


def extract_link(headers: Mapping[str, str] | None) -> trace.Link | None:
    """A span link to the span whose context rides in `headers`, or None when there is none."""
    if not headers:
        return None
    ctx = propagate.extract(dict(headers))
    span_ctx = trace.get_current_span(ctx).get_span_context()
    return trace.Link(span_ctx) if span_ctx.is_valid else None

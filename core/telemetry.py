"""OpenTelemetry setup and the spans that follow one sample across processes.

Exporters follow the standard environment. `OTEL_TRACES_EXPORTER=otlp` (or, when it is unset,
any `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) exports over
OTLP/HTTP protobuf (`opentelemetry-exporter-otlp-proto-http`; the endpoint, headers, timeout
and compression come from the exporter's own `OTEL_EXPORTER_OTLP_*` variables);
`console` prints spans; unset/`none` records spans without exporting (links still work).
`OTEL_SERVICE_NAME` overrides the service name, `OTEL_TRACES_SAMPLER(_ARG)` samples,
`OTEL_SDK_DISABLED=true` turns it all off.

One sample's trace (W3C `traceparent` in the message headers carries it between processes):

    feed (feeder, one per published batch)
      publish                               TASKS; every task's headers carry this span
        capture (producer, one per batch; parent: its first task, links: all of them)
          publish                           one per SampleRef; its headers carry this span
            lease (trainer, one per ref taken: the store read; recapture, dead_letter inside)
              train_step (parent: the window's first lease, links: every lease of the window)
                ack, release
          ack                               the batch's tasks
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

log = logging.getLogger(__name__)
_configured = False
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-http"


def _exporter_name() -> str:
    name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if name:
        return name.split(",")[0].strip()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return "otlp" if endpoint else "none"


def _exporter_from_env() -> SpanExporter | None:
    name = _exporter_name()
    if name == "none":
        return None
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        protocol = (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        if protocol != "http/protobuf":
            log.warning("OTLP protocol %r is not supported here; exporting http/protobuf", protocol)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTLP export asked for, but %s is not installed (pip install "
                        "'specbus[demo]'); spans are not exported", OTLP_PACKAGE)  # fmt: skip
            return None
        return OTLPSpanExporter()
    log.warning("OTEL_TRACES_EXPORTER=%r is not supported here (otlp, console, none)", name)
    return None


def setup_tracing(
    service_name: str = "specbus", exporter: SpanExporter | None = None
) -> TracerProvider:
    """Install a TracerProvider once per process (flushed at exit). `exporter` (tests) wins
    over the environment."""
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
        log.info("exporting traces as %s (%s)", name, type(chosen).__name__)
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


def link_to_current() -> trace.Link | None:
    """A link to the current span (None when there is none): what an item carries to its step."""
    span_ctx = trace.get_current_span().get_span_context()
    return trace.Link(span_ctx) if span_ctx.is_valid else None


@contextmanager
def span(
    name: str,
    *,
    parent: trace.SpanContext | Mapping[str, str] | None = None,
    links: list[trace.Link] | None = None,
    attributes: Mapping[str, Any] | None = None,
    component: str = "specbus",
) -> Iterator[trace.Span]:
    """A span named `name`, current inside the block. `parent`: a span context, or message
    headers carrying one (None: the current span); `links`: spans it follows from (None
    entries are dropped); `attributes`: `specbus.<key>` unless the key has a dot."""
    ctx = None
    if isinstance(parent, trace.SpanContext):
        if parent.is_valid:
            ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    elif parent is not None:
        extracted = propagate.extract(dict(parent))
        if trace.get_current_span(extracted).get_span_context().is_valid:
            ctx = extracted
    attrs = {
        (k if "." in k else f"specbus.{k}"): v
        for k, v in (attributes or {}).items()
        if v is not None
    }
    with tracer(component).start_as_current_span(
        name,
        context=ctx,
        links=[link for link in links or () if link is not None],
        attributes=attrs,
    ) as current:
        yield current

"""Message headers specbus sets, and OpenTelemetry trace context carried in them.

`Nats-Msg-Id` is the broker's dedup header. The `Specbus-*` headers are ours; the W3C
`traceparent`/`tracestate` (and `baggage`) headers come from the globally configured
OpenTelemetry propagator, so a consumer's span can link to the producer's.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate
from opentelemetry.context import Context

MSG_ID = "Nats-Msg-Id"

# Dead letters (explicit): why, and where the original came from.
DEAD_REASON = "Specbus-Dead-Reason"
DEAD_DETAIL = "Specbus-Dead-Detail"
SOURCE_STREAM = "Specbus-Source-Stream"
SOURCE_SEQ = "Specbus-Source-Seq"
SOURCE_SUBJECT = "Specbus-Source-Subject"
DELIVERIES = "Specbus-Deliveries"
CONSUMER = "Specbus-Consumer"

# Header values must be one line; the server rejects CR/LF in them.
MAX_HEADER_VALUE = 1024


def inject_trace(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context to `headers` (no-op when no span is active)."""
    propagate.inject(headers)
    return headers


def extract_trace(headers: Mapping[str, str] | None) -> Context:
    """The producer's trace context from a message's headers (an empty context if none)."""
    return propagate.extract(dict(headers or {}))


def one_line(text: str) -> str:
    """A header-safe rendering of free text (single line, bounded)."""
    return " ".join(str(text).split())[:MAX_HEADER_VALUE]

"""Prometheus metrics of a long-running process: one registry, served at `GET /metrics`.

Every specbus process that serves HTTP for a long time (`specbus serve`; the intake, a
producer's feature server, ...) keeps one `Metrics`: a `prometheus_client` registry of its
own (not the library's global one, so several servers in one process, as in tests, stay
apart) with the usual instruments, plus `read` series whose values are read at scrape time
from counters the process keeps anyway (no second bookkeeping on the request path).
`exposition()` is the body and content type of `/metrics` (text format 0.0.4, what
`prometheus_client.parser.text_string_to_metric_families` and a Prometheus server read).

Names: `specbus_<process>_<what>`, counters end in `_total` (the library adds it), seconds
and bytes in the unit's name. Labels stay of bounded cardinality: a route, an outcome, a
draft version (one per checkpoint), never a request id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

Reading = float | dict[tuple[str, ...], float]


class _Read:
    """A collector whose samples come from `read()` at scrape time."""

    def __init__(self, name: str, doc: str, kind: str, labels: tuple[str, ...],
                 read: Callable[[], Reading]):  # fmt: skip
        self.name, self.doc, self.kind, self.labels, self.read = name, doc, kind, labels, read

    def collect(self) -> Iterable:
        family = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        metric = family(self.name, self.doc, labels=list(self.labels))
        value = self.read()
        if isinstance(value, dict):
            for key, v in sorted(value.items()):
                metric.add_metric([str(k) for k in key], float(v))
        else:
            metric.add_metric([], float(value))
        yield metric

    def describe(self) -> Iterable:
        return []  # the samples come at scrape time; nothing to check at registration


class Metrics:
    """One process's registry (module doc). Instruments are `prometheus_client`'s own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        """A counter (`name` without `_total`: the exposition adds it)."""
        return Counter(name, doc, labelnames=labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        """A gauge."""
        return Gauge(name, doc, labelnames=labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...],
                  labels: tuple[str, ...] = ()) -> Histogram:  # fmt: skip
        """A histogram with `buckets` (upper bounds; +Inf is added)."""
        return Histogram(name, doc, labelnames=labels, buckets=buckets, registry=self.registry)

    def read(self, name: str, doc: str, read: Callable[[], Reading], *,
             kind: Literal["counter", "gauge"] = "gauge",
             labels: tuple[str, ...] = ()) -> None:  # fmt: skip
        """A series read at scrape time: `read()` returns the value, or with `labels` a dict
        {label values: value}. A counter's `name` is without `_total`."""
        self.registry.register(_Read(name, doc, kind, labels, read))

    def exposition(self) -> tuple[bytes, str]:
        """The `/metrics` body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

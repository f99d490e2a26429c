"""Publishing: broker dedup of retries, trace context in headers, size and routing errors."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.core.contracts import PromptTask
from specbus.core.errors import BusError, RecordError
from specbus.core.telemetry import setup_tracing

from tests.fixtures.nats import make_ref, open_run


def test_retried_publish_is_dropped_by_dedup(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        pub = Publisher(bus)
        first = await pub.publish(topo.names.samples, make_ref(run_id, 0))
        retry = await pub.publish(topo.names.samples, make_ref(run_id, 0))
        assert (first.duplicate, retry.duplicate) == (False, True)
        assert retry.seq == first.seq
        # A batch mixing retries and new records: the broker stores only the new ones.
        acks = await pub.publish_many(topo.names.samples, [make_ref(run_id, i) for i in range(4)])
        assert [a.duplicate for a in acks] == [True, False, False, False]
        info = await bus.js.stream_info(topo.names.samples_stream)
        assert info.state.messages == 4
        # A recapture (new generation) is a new message, not a duplicate.
        again = make_ref(run_id, 1).model_copy(update={"generation": 1})
        assert (await pub.publish(topo.names.samples, again)).duplicate is False
        await bus.close()

    asyncio.run(body())


def test_trace_context_rides_in_headers(nats_server, run_id, bus_cfg):
    """The message carries its `publish` span, a child of the span current at the publish."""
    exporter = InMemorySpanExporter()
    provider = setup_tracing("specbus-test", exporter=exporter)
    tracer = provider.get_tracer("test")

    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        with tracer.start_as_current_span("capture") as span:
            await Publisher(bus).publish(topo.names.samples, make_ref(run_id, 0))
        group = await Leases.join(bus, run_id, "trainers")
        (lease,) = await group.fetch(1)
        assert "traceparent" in lease.headers
        remote = trace.get_current_span(lease.trace_context()).get_span_context()
        assert remote.trace_id == span.get_span_context().trace_id
        provider.force_flush()
        (publish,) = [
            s for s in exporter.get_finished_spans() if s.context.span_id == remote.span_id
        ]
        assert publish.name == "publish"
        assert publish.parent.span_id == span.get_span_context().span_id
        await lease.ack()
        await bus.close()

    asyncio.run(body())


def test_oversize_batch_is_rejected_before_anything_is_sent(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        huge = PromptTask(task_id="big", run_id=run_id, input_ids=tuple(range(1_100_000)))
        small = PromptTask(task_id="small", run_id=run_id, input_ids=(1, 2))
        with pytest.raises(RecordError) as e:
            await Publisher(bus).publish_many(topo.names.tasks, [small, huge])
        assert e.value.reason == "oversize"
        assert (await bus.js.stream_info(topo.names.tasks_stream)).state.messages == 0
        await bus.close()

    asyncio.run(body())


def test_publish_to_an_undeclared_run_raises(nats_server, run_id, bus_cfg):
    async def body():
        bus, _ = await open_run(nats_server.url, bus_cfg, run_id)
        with pytest.raises(BusError, match="no stream"):
            await Publisher(bus).publish(f"specbus.{run_id}x.samples", make_ref(run_id, 0))
        await bus.close()

    asyncio.run(body())

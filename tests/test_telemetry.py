"""A training step's span links to the capture spans of the samples it trained on, through
the trace context the producer put in the SampleRef headers (real broker, shm store)."""

from __future__ import annotations

import asyncio
import threading

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from specbus.core.telemetry import setup_tracing
from specbus.ops.produce import run_feeder, run_producer
from specbus.ops.train import run_trainer

from tests.fixtures.pipeline import pipeline_config, write_tokenised_data


def test_step_spans_link_to_capture_spans(tmp_path, tiny_target, nats_server, run_id):
    exporter = InMemorySpanExporter()
    provider = setup_tracing("specbus-test", exporter=exporter)
    data = write_tokenised_data(tmp_path / "data.jsonl", 8)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri=f"shm://{run_id}")
    asyncio.run(run_feeder(cfg, bus_url=nats_server.url))
    producer = threading.Thread(
        target=lambda: asyncio.run(run_producer(cfg, bus_url=nats_server.url))
    )
    producer.start()
    result = run_trainer(cfg, bus_url=nats_server.url)
    producer.join(60)
    provider.force_flush()
    spans = exporter.get_finished_spans()
    captures = {s.context.span_id for s in spans if s.name == "capture"}
    steps = [s for s in spans if s.name == "train_step"]
    assert result.steps == 4 and len(steps) == 4 and captures
    for step in steps:
        assert step.links, "a step span without links to its captures"
        assert {link.context.span_id for link in step.links} <= captures

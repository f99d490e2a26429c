"""Long samples end to end: records of any length, refusal of over-long ones, long captures.

A 40k-token record travels as any other (fed, captured, trained exactly once); a record over
the run's maximum is refused by the feeder with one error naming it, before anything is
published; a task over the broker's `max_payload` likewise; a long live capture goes through
the intake, and one over the handshake's maximum is refused naming the sample.
"""

from __future__ import annotations

import asyncio
import json
import random

import orjson
import pytest
import torch
from specbus.bus.connection import connect
from specbus.bus.replay import replay
from specbus.bus.run import open_run
from specbus.bus.subjects import Names
from specbus.core.config import BusConfig
from specbus.core.contracts import MAX_RECORD_BYTES, PromptTask, SampleRef
from specbus.core.data.tokenize import SampleTooLong
from specbus.core.errors import RecordError

from tests.fixtures.pipeline import Cluster, build_tiny_target, pipeline_config


def write_records(path, lengths, *, vocab: int, seed: int = 0):
    """Pre-tokenised records of these lengths, the second half of each supervised."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for n in lengths:
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            f.write(
                json.dumps({"input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)})
            )
            f.write("\n")
    return path


def stream_payloads(url: str, stream: str) -> list[bytes]:
    async def go():
        async with await connect(BusConfig(), url) as bus:
            return [m.data async for m in replay(bus, stream)]

    return asyncio.run(go())


def run_exists(url: str, run: str) -> bool:
    async def go():
        async with await connect(BusConfig(), url) as bus:
            return await open_run(bus, run) is not None

    return asyncio.run(go())


@pytest.mark.slow
def test_a_40k_token_record_is_fed_captured_and_trained_exactly_once(tmp_path, nats_server, run_id):
    """Feed -> producer (hf engine, shm store) -> trainer, on a tiny random target with a 64k
    context. Its version-1 task would be ~276 KB: over the old 256 KiB record limit."""
    vocab, long = 8192, 40_000
    target = build_tiny_target(tmp_path / "target", vocab=vocab, context=65536, heads=1)
    data = write_records(tmp_path / "data.jsonl", [long, 30], vocab=vocab)
    record = json.loads(data.read_text().splitlines()[0])
    old_task = orjson.dumps({"schema_version": 1, "task_id": "t0", "run_id": run_id,
                             "input_ids": record["input_ids"], "loss_mask": record["loss_mask"]})  # fmt: skip
    assert len(old_task) > MAX_RECORD_BYTES  # what stopped a 32k sample before
    cfg = pipeline_config(run_id, tmp_path / "run", target, data, store_uri=f"shm://{run_id}",
                          overrides=["data.max_length=40000", "strategy.ttt_length=1",
                                     "strategy.chunk_tokens=2048", "training.micro_batch=1"])  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    try:
        cluster.start("feeder", "feed")
        cluster.start("producer-0", "produce", "--id", "p0")
        cluster.trainers(1)
        cluster.assert_ok(cluster.wait("feeder", "producer-0", "trainer-0", timeout=900))
    finally:
        cluster.stop()
    names = Names(run_id)
    tasks = [PromptTask.from_bytes(p) for p in stream_payloads(nats_server.url, names.tasks_stream)]
    assert sorted(len(t.input_ids) for t in tasks) == [30, long]
    assert list(next(t for t in tasks if len(t.input_ids) == long).input_ids) == record["input_ids"]
    refs = [SampleRef.from_bytes(p) for p in stream_payloads(nats_server.url, names.samples_stream)]
    assert sorted(r.num_tokens for r in refs) == [30, long]
    lineage = cluster.checkpoint_state()["lineage"]
    assert sorted(lineage) == ["t0-e0", "t1-e0"]  # each trained, once


def test_an_over_long_record_is_refused_with_one_error_and_nothing_is_published(
    tmp_path, tiny_target, nats_server, run_id, capsys
):
    """`specbus feed` exits 2 with one line naming the record, its length and the key; the run
    is not even declared (the feeder tokenises before it connects)."""
    from specbus.core.config import dump_config
    from specbus.ops.cli import main

    data = write_records(tmp_path / "data.jsonl", [20, 30, 100, 25], vocab=128)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=["data.over_length=refuse"])  # fmt: skip
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    assert main(["feed", "--config", str(config), "--url", nats_server.url]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert line.startswith("specbus feed: error: record 2 of data.source")
    assert "has 100 tokens" in line and "(data.max_length)" in line
    assert not run_exists(nats_server.url, run_id)


def test_the_targets_context_bounds_the_feed_when_it_is_shorter(tmp_path, tiny_target, run_id):
    from specbus.producers.feeder import prepare

    data = write_records(tmp_path / "data.jsonl", [20, 300], vocab=128)
    over = "data.over_length=refuse"
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=["data.max_length=400", over])  # fmt: skip
    with pytest.raises(SampleTooLong, match="record 1 .* has 300 tokens, over the run's maximum "
                       "of 256 \\(the target's context\\)") as e:  # fmt: skip
        prepare(cfg)
    assert e.value.over == [(1, 300)]
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=["data.max_length=400", "target.context_length=200", over])  # fmt: skip
    with pytest.raises(SampleTooLong, match=r"maximum of 200 \(target.context_length\)"):
        prepare(cfg)


def test_over_long_records_are_skipped_by_default_or_truncated(
    tmp_path, tiny_target, run_id, caplog
):
    """data.over_length: skip (the default) feeds every other record and names the skipped
    ones in one warning; truncate cuts them to the run's maximum (SpecForge's way)."""
    from specbus.producers.feeder import prepare

    data = write_records(tmp_path / "data.jsonl", [20, 300, 30, 290], vocab=128)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=["data.max_length=200"])  # fmt: skip
    with caplog.at_level("WARNING"):
        skipped = prepare(cfg)
    assert sorted(len(s) for s in skipped.samples) == [20, 30]
    (line,) = [r.getMessage() for r in caplog.records if "over the run's maximum" in r.getMessage()]
    assert "record 1 " in line and "has 300 tokens" in line and "(and 1 more over it)" in line
    assert "(data.max_length)" in line and "skipped" in line
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=["data.max_length=200", "data.over_length=truncate"])  # fmt: skip
    assert sorted(len(s) for s in prepare(cfg).samples) == [20, 30, 200, 200]


def test_a_task_over_the_brokers_max_payload_is_refused_before_anything_is_fed(
    tmp_path, tiny_target, run_id
):
    """A broker with a 64 KiB max_payload (a stock one has 1 MiB): the 20k-token task does
    not fit; the feed fails naming max_payload, with no manifest and no task written."""
    from specbus.ops.produce import run_feeder
    from specbus.ops.services.nats import NatsServer

    data = write_records(tmp_path / "data.jsonl", [30, 20_000], vocab=128)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=["data.max_length=20000", "target.context_length=20000"])  # fmt: skip
    server = NatsServer(tmp_path / "nats", max_payload=64 << 10).start()
    try:
        with pytest.raises(RecordError, match="over the broker's max_payload of 65536") as e:
            asyncio.run(run_feeder(cfg, bus_url=server.url))
        assert e.value.reason == "oversize"

        async def state():
            async with await connect(BusConfig(), server.url) as bus:
                run = await open_run(bus, run_id)
                info = await bus.js.stream_info(run.names.tasks_stream)
                return await run.kv.get_manifest(), info.state.messages

        assert asyncio.run(state()) == (None, 0)
    finally:
        server.stop()


def test_a_long_live_capture_goes_through_the_intake(tmp_path, chat_target, nats_server, run_id):
    """A 40k-row capture from a real sink is accepted and published like a short one; a
    record over the handshake's maximum is refused naming the sample, its rows and the key."""
    from tests.fixtures.live import start_intake_thread, wait_until
    from tests.test_live_intake import TOKEN, _capture, _sink, lease_refs, put_capture

    cfg, store, cap, intake = start_intake_thread(
        run_id, tmp_path, chat_target, nats_server.url, TOKEN,
        ["live.max_num_tokens=50000", "store.budget_bytes=268435456"],
    )  # fmt: skip
    sink = _sink(intake)
    try:
        assert sink.submit(_capture(cap, "long-1", 40_000, 8))
        wait_until(sink.idle, 120, "the sink's writer")
        assert sink.counts["accepted"] == 1, sink.counts
        (ref,) = lease_refs(intake.bus_url, cfg.run, 4)
        assert ref.num_tokens == 40_007
        tensors = store.get(ref)
        assert tensors["input_ids"].shape == (40_007,)
        assert int(tensors["loss_mask"].sum()) == 7
        record, _ = put_capture(store, cap, "too-long", prompt=49_990, generated=20)
        with intake.client() as c:
            answer = c.post("/v1/spec-capture/records", content=record.model_dump_json().encode())
        assert answer.status_code == 422 and answer.json()["reason"] == "too_long"
        detail = answer.json()["detail"]
        assert record.sample_id in detail and "50010 rows" in detail
        assert "max_num_tokens" in detail
    finally:
        sink.close()
        intake.stop()
        store.close()


def test_a_long_sequence_is_captured_alone_and_unchanged(tiny_target, monkeypatch):
    """The hf engine captures a sequence over SOLO_TOKENS in a forward of its own (no padding
    mask): features equal to capturing it by itself, the order of the batch kept."""
    from specbus.core.config import StrategyConfig, TargetConfig
    from specbus.core.models.target import load_target_info
    from specbus.core.strategies.base import build_strategy
    from specbus.producers.engines import hf

    monkeypatch.setattr(hf, "SOLO_TOKENS", 50)
    engine = hf.HFEngine(TargetConfig(model=str(tiny_target), device="cpu", capture_batch=4))
    contract = build_strategy(StrategyConfig(), load_target_info(tiny_target)).feature_contract()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (n,), generator=g) for n in (20, 120, 35, 25, 90, 10, 15)]
    calls = []
    forward = engine._capture_chunk
    monkeypatch.setattr(engine, "_capture_chunk",
                        lambda chunk, *a: calls.append([len(c) for c in chunk]) or forward(chunk, *a))  # fmt: skip
    together = engine.capture(seqs, None, contract)
    assert calls == [[20], [120], [35, 25], [90], [10, 15]]
    for seq, got in zip(seqs, together, strict=True):
        alone = engine.capture([seq], None, contract)[0]
        for name, tensor in alone.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)

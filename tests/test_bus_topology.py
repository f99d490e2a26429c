"""Topology: idempotent declaration, in-place updates, KV markers, run isolation, lag."""

from __future__ import annotations

import asyncio

import pytest
from specbus.bus.dead import list_dead
from specbus.bus.lag import lag
from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.bus.run import declare
from specbus.bus.status import run_status
from specbus.core.contracts import Manifest, ManifestTarget, VocabTable
from specbus.core.errors import BusError, ConfigError

from tests.fixtures.nats import make_ref, make_task, open_run


async def _snapshot(bus, names):
    streams = {
        s: (await bus.js.stream_info(s))
        for s in (names.tasks_stream, names.samples_stream, names.dead_stream)
    }
    consumers = {
        g: (await bus.js.consumer_info(names.stream_of(g), g)) for g in ("producers", "trainers")
    }
    return (
        {s: (i.config.as_dict(), i.state.messages, i.state.last_seq) for s, i in streams.items()},
        {
            g: (
                i.config.as_dict(),
                i.delivered.stream_seq,
                i.ack_floor.stream_seq,
                i.num_ack_pending,
            )
            for g, i in consumers.items()
        },
    )


def test_declaring_twice_changes_nothing(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(5)]
        )
        group = await Leases.join(bus, run_id, "trainers")
        leases = await group.fetch(3)
        await group.ack_all(leases[:2])
        await topo.kv.mark_feed_complete(5)
        before = await _snapshot(bus, topo.names)
        again = await declare(bus, bus_cfg, run_id)
        assert await _snapshot(bus, topo.names) == before
        assert await again.kv.feed_complete() == 5
        await leases[2].ack()  # the lease taken before the re-declare is still valid
        await bus.close()

    asyncio.run(body())


def test_redeclaring_with_a_changed_config_updates_in_place(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish(topo.names.samples, make_ref(run_id, 0))
        changed = bus_cfg.model_copy(
            update={"ack_wait_s": 7.0, "max_ack_pending": 9, "samples_max_age_s": 3600.0}
        )
        await declare(bus, changed, run_id)
        consumer = await bus.js.consumer_info(topo.names.samples_stream, "trainers")
        assert (consumer.config.ack_wait, consumer.config.max_ack_pending) == (7.0, 9)
        stream = await bus.js.stream_info(topo.names.samples_stream)
        assert stream.config.max_age == 3600.0 and stream.state.messages == 1
        await bus.close()

    asyncio.run(body())


def test_a_stream_the_server_cannot_change_in_place_is_refused(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        info = await bus.js.stream_info(topo.names.tasks_stream)
        await bus.js.delete_stream(topo.names.tasks_stream)
        from nats.js.api import StorageType

        info.config.storage = StorageType.MEMORY  # someone else declared it differently
        await bus.js.add_stream(info.config)
        with pytest.raises(BusError, match=f"{topo.names.tasks_stream}.*storage"):
            await declare(bus, bus_cfg, run_id)
        await bus.close()

    asyncio.run(body())


def test_kv_markers_round_trip(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        kv = topo.kv
        assert (await kv.get_manifest(), await kv.feed_complete(), await kv.get_checkpoint()) == (
            None,
            None,
            None,
        )
        manifest = Manifest(
            run=run_id, plan={"strategy": {"name": "eagle3"}}, plan_hash="abc", planned_tasks=4,
            target=ManifestTarget(model="m", fingerprint="fp", tokenizer_fingerprint="tfp",
                                  num_layers=2, hidden_size=8, vocab_size=16),
            strategy="eagle3", vocab=VocabTable(d2t=(0, 1, 3), target_vocab_size=16),
        )  # fmt: skip
        await kv.put_manifest(manifest)
        await kv.mark_feed_complete(1234)
        await kv.put_checkpoint({"step": 10, "path": "/ckpt/10", "floor": 80})
        await kv.put_checkpoint({"step": 20, "path": "/ckpt/20", "floor": 160})
        await kv.mark_train_complete({"steps": 20})
        assert await kv.get_manifest() == manifest
        assert await kv.feed_complete() == 1234
        assert await kv.get_checkpoint() == {"step": 20, "path": "/ckpt/20", "floor": 160}
        assert await kv.train_complete() == {"steps": 20}
        await bus.close()

    asyncio.run(body())


def test_two_runs_on_one_broker_do_not_see_each_other(nats_server, run_id, bus_cfg):
    other_run = run_id + "b"

    async def body():
        bus, a = await open_run(nats_server.url, bus_cfg, run_id)
        _, b = await open_run(nats_server.url, bus_cfg, other_run)
        pub = Publisher(bus)
        await pub.publish_many(a.names.samples, [make_ref(run_id, i) for i in range(4)])
        await pub.publish(a.names.tasks, make_task(run_id, 0))
        await a.kv.mark_feed_complete(1)
        in_a = await Leases.join(bus, run_id, "trainers")
        (poison,) = await in_a.fetch(1)
        await poison.term("poison")

        in_b = await Leases.join(bus, other_run, "trainers")
        producers_b = await Leases.join(bus, other_run, "producers")
        assert await in_b.fetch(10, timeout_s=0.3) == []
        assert await producers_b.fetch(10, timeout_s=0.3) == []
        assert (await lag(bus, other_run)).messages == 0
        assert (await lag(bus, run_id)).messages == 3 + 0  # 3 left, the termed one is done
        assert await list_dead(bus, other_run) == []
        assert len(await list_dead(bus, run_id)) == 1
        assert await b.kv.feed_complete() is None
        await bus.close()

    asyncio.run(body())


def test_lag_counts_pending_and_in_flight_in_messages_and_bytes(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        assert (await lag(bus, run_id)).bytes_method == "empty"
        # Two sizes, so the sampled figure is an estimate and the scan is exact.
        sizes = [4096] * 6 + [8192] * 4
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i, n) for i, n in enumerate(sizes)]
        )
        group = await Leases.join(bus, run_id, "trainers")
        leases = await group.fetch(4)
        await group.ack_all(leases[:2])
        now = await lag(bus, run_id)
        assert (now.pending, now.ack_pending, now.messages) == (6, 2, 8)
        exact = sum(sizes[2:])
        scanned = await lag(bus, run_id, scan=True)
        assert scanned.bytes == exact and scanned.bytes_method == "scan"
        sampled = await lag(bus, run_id, sample=4)
        assert sampled.bytes_method == "sampled"
        assert 4096 * 8 <= sampled.bytes <= 8192 * 8
        status = await run_status(bus, run_id)
        assert status["declared"] and status["lag"]["trainers"]["messages"] == 8
        assert status["streams"][topo.names.samples_stream]["messages"] == 10
        assert status["consumers"]["trainers"]["ack_pending"] == 2
        await bus.close()

    asyncio.run(body())


def test_run_names_that_are_not_subject_tokens_are_refused():
    from specbus.bus.subjects import Names

    with pytest.raises(ConfigError, match="run name"):
        Names("a.b")


def test_bus_errors_keep_the_servers_codes(nats_server, run_id, bus_cfg):
    """A refusal reaches the caller as a specbus error that keeps what the server said (status,
    JetStream error code, the stream) with the nats exception as its cause."""
    from specbus.bus.connection import connect
    from specbus.bus.replay import get
    from specbus.core.errors import BusNotFound, BusRejected

    async def body():
        bus = await connect(bus_cfg, nats_server.url, name=f"test-{run_id}")
        with pytest.raises(BusNotFound) as e:
            await lag(bus, run_id)  # never declared
        assert e.value.code == 404 and e.value.err_code == 10059 and e.value.__cause__ is not None
        bus2, topo = await open_run(nats_server.url, bus_cfg, run_id)
        assert await get(bus2, topo.names.tasks_stream, 99) is None  # absent: None, not an error
        with pytest.raises(BusRejected) as e:
            await Publisher(bus2).publish(f"nowhere.{run_id}", make_task(run_id, 1))
        assert e.value.code == 503
        await bus.close()
        await bus2.close()

    asyncio.run(body())

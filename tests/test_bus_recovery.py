"""Recovery: a kill -9 of the broker keeps streams and consumer state and redelivers what
was unacked; replay reads a stream from a sequence without touching the group; a durable
consumer can be repositioned for resume."""

from __future__ import annotations

import asyncio

from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.bus.replay import get, replay, reposition
from specbus.core.contracts import SampleRef

from tests.fixtures.nats import make_ref, open_run


def test_kill9_and_restart_keeps_streams_consumer_state_and_redelivers_unacked(
    private_nats_server, run_id, bus_cfg
):
    server = private_nats_server

    async def body():
        bus, topo = await open_run(server.url, bus_cfg, run_id)
        pub = Publisher(bus)
        await pub.publish_many(topo.names.samples, [make_ref(run_id, i) for i in range(10)])
        group = await Leases.join(bus, run_id, "trainers")
        leases = await group.fetch(6)
        await group.ack_all(leases[:4])  # confirmed; seqs 5, 6 stay leased and unacked
        # The server persists consumer state asynchronously: acks younger than ~0.1 s can be
        # lost to a kill -9 (then redelivered, which consumers tolerate). Let them land.
        await asyncio.sleep(0.5)
        server.kill()
        server.start()
        # Same connection: the client reconnects by itself, and publishing works again.
        await pub.publish(topo.names.samples, make_ref(run_id, 10))
        info = await bus.js.stream_info(topo.names.samples_stream)
        assert (info.state.messages, info.state.last_seq) == (11, 11)
        consumer = await bus.js.consumer_info(topo.names.samples_stream, "trainers")
        assert consumer.ack_floor.stream_seq == 4
        got = []
        while len(got) < 7:
            batch = await group.fetch(10, timeout_s=3 * bus_cfg.ack_wait_s)
            assert batch, "nothing redelivered after the restart"
            got += batch
        assert sorted(lease.seq for lease in got) == list(range(5, 12))
        redelivered = {lease.seq for lease in got if lease.deliveries > 1}
        assert redelivered == {5, 6}
        await group.ack_all(got)
        assert await group.fetch(10, timeout_s=1.5 * bus_cfg.ack_wait_s) == []
        await bus.close()

    asyncio.run(body())


def test_replay_from_a_sequence_leaves_the_group_alone(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        refs = [make_ref(run_id, i) for i in range(10)]
        await Publisher(bus).publish_many(topo.names.samples, refs)
        group = await Leases.join(bus, run_id, "trainers")
        leases = await group.fetch(5)
        await group.ack_all(leases[:3])
        before = await bus.js.consumer_info(topo.names.samples_stream, "trainers")

        stored = [s async for s in replay(bus, topo.names.samples_stream, 4)]
        assert [s.seq for s in stored] == list(range(4, 11))
        assert [SampleRef.from_bytes(s.data) for s in stored] == refs[3:]
        assert [s.seq async for s in replay(bus, topo.names.samples_stream, 2, end_seq=4)] == [
            2,
            3,
            4,
        ]
        assert [s async for s in replay(bus, topo.names.samples_stream, 11)] == []
        assert SampleRef.from_bytes((await get(bus, topo.names.samples_stream, 7)).data) == refs[6]
        assert await get(bus, topo.names.samples_stream, 99) is None

        after = await bus.js.consumer_info(topo.names.samples_stream, "trainers")
        assert (
            after.delivered.stream_seq,
            after.ack_floor.stream_seq,
            after.num_ack_pending,
            after.num_pending,
        ) == (
            before.delivered.stream_seq,
            before.ack_floor.stream_seq,
            before.num_ack_pending,
            before.num_pending,
        )
        await group.ack_all(leases[3:])
        await bus.close()

    asyncio.run(body())


def test_reposition_resumes_the_trainers_at_a_sequence(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(10)]
        )
        group = await Leases.join(bus, run_id, "trainers")
        await group.ack_all(await group.fetch(10))
        await group.close()
        # A checkpoint says: everything below seq 7 is trained.
        await reposition(bus, run_id, "trainers", 7)
        resumed = await Leases.join(bus, run_id, "trainers")
        got = await resumed.fetch(10)
        assert [lease.seq for lease in got] == [7, 8, 9, 10]
        info = await bus.js.consumer_info(topo.names.samples_stream, "trainers")
        assert (
            info.config.ack_wait == bus_cfg.ack_wait_s
            and info.config.max_deliver == bus_cfg.max_deliver
        )
        await resumed.ack_all(got)
        await bus.close()

    asyncio.run(body())


def test_replay_reads_by_direct_get_past_gaps_without_a_consumer(nats_server, run_id, bus_cfg):
    """A replay creates no consumer (roles may replay without the right to create one,
    docs/cluster.md): while it runs, the stream has its declared group only; its batches
    step over a removed message and end at the stream's end (or `end_seq`)."""

    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        stream = topo.names.samples_stream
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(10)]
        )
        await bus.js.delete_msg(stream, 5)
        seqs = []
        async for stored in replay(bus, stream, 2, batch=3):
            seqs.append(stored.seq)
            assert (await bus.js.stream_info(stream)).state.consumer_count == 1  # "trainers"
        assert seqs == [2, 3, 4, 6, 7, 8, 9, 10]
        assert [s.seq async for s in replay(bus, stream, 4, end_seq=99, batch=2)] == [
            4, 6, 7, 8, 9, 10,
        ]  # fmt: skip
        assert [s.seq async for s in replay(bus, stream, 5, end_seq=5)] == []
        await bus.close()

    asyncio.run(body())


def test_reposition_resets_in_place_and_recreates_what_it_cannot_reset(
    nats_server, run_id, bus_cfg
):
    """A reposition keeps the consumer (a reset: deliver-all, same config, the members keep
    their subscription); a missing group is created, and one created at a start sequence by
    an earlier specbus (which the server will not reset below it) is recreated deliver-all."""
    from nats.js.api import DeliverPolicy

    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        stream = topo.names.samples_stream
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(6)]
        )
        group = await Leases.join(bus, run_id, "trainers")
        await group.ack_all(await group.fetch(6))
        created = (await bus.js.consumer_info(stream, "trainers")).created
        await reposition(bus, run_id, "trainers", 3)
        assert [lease.seq for lease in await group.fetch(6)] == [3, 4, 5, 6]  # same member
        info = await bus.js.consumer_info(stream, "trainers")
        assert info.created == created and info.config.deliver_policy == DeliverPolicy.ALL
        # what an earlier specbus left: the group recreated at a start sequence
        await bus.js.delete_consumer(stream, "trainers")
        legacy = info.config
        legacy.deliver_policy, legacy.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, 5
        await bus.js.add_consumer(stream, legacy)
        await reposition(bus, run_id, "trainers", 2)
        fresh = await Leases.join(bus, run_id, "trainers")
        assert [lease.seq for lease in await fresh.fetch(6)] == [2, 3, 4, 5, 6]
        info = await bus.js.consumer_info(stream, "trainers")
        assert info.config.deliver_policy == DeliverPolicy.ALL
        assert info.config.ack_wait == bus_cfg.ack_wait_s
        # a group that is gone is created
        await bus.js.delete_consumer(stream, "trainers")
        await reposition(bus, run_id, "trainers", 6)
        assert [lease.seq for lease in await fresh.fetch(6)] == [6]
        await bus.close()

    asyncio.run(body())

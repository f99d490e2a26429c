"""Ride-through: every bus call issued while the broker is down completes once it is back.

Each test kills the broker (kill -9), issues the call, and restarts the broker on the same
port and store dir after `OUTAGE_S`: longer than every timeout of the config below (request
timeout 1 s, PubAck timeout 0.5 s), so a call that does not ride through fails instead of
being saved by the client's reconnect buffer. The outage's duration is the fault itself; the
restart waits for the server's readiness line.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from specbus.bus.lag import lag
from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.bus.replay import get, last, replay, reposition
from specbus.bus.topology import open_kv
from specbus.core.contracts import SampleRef
from specbus.core.errors import BusError

from tests.fixtures.nats import make_ref, open_run

OUTAGE_S = 4.0


@pytest.fixture
def rt_cfg(bus_cfg):
    """Short request timeouts (a call that only waits for the client to reconnect fails),
    long leases (nothing expires during an outage unless a test wants it)."""
    return bus_cfg.model_copy(
        update=dict(connect_timeout_s=1.0, reconnect_wait_s=0.1, ack_wait_s=30.0)
    )


def restart_after(server, seconds: float = OUTAGE_S) -> asyncio.Task:
    """The broker is down now (kill -9); it comes back on the same port and store dir after
    `seconds`. Returns the restart task (await it before the test ends)."""
    server.kill()

    async def back() -> float:
        await asyncio.sleep(seconds)
        await asyncio.to_thread(server.start)
        return time.monotonic()

    return asyncio.create_task(back())


def outage_lines(caplog) -> tuple[list[str], list[str], list[str]]:
    """(begin lines, back lines, other WARNING+ lines) logged by the bus."""
    records = [
        r for r in caplog.records if r.name == "specbus.bus" and r.levelno >= logging.WARNING
    ]
    begin = [r.getMessage() for r in records if "unavailable while" in r.getMessage()]
    back = [r.getMessage() for r in records if " back after " in r.getMessage()]
    other = [r.getMessage() for r in records if r.getMessage() not in begin + back]
    return begin, back, other


def test_kv_reads_and_writes_ride_through(private_nats_server, run_id, rt_cfg):
    async def body():
        bus, topo = await open_run(private_nats_server.url, rt_cfg, run_id)
        await topo.kv.mark_feed_complete(7)
        down = restart_after(private_nats_server)
        t0 = time.monotonic()
        got, _ = await asyncio.gather(
            topo.kv.feed_complete(), topo.kv.mark_train_complete({"steps": 3})
        )
        back_at = await down
        assert got == 7
        assert time.monotonic() - t0 >= OUTAGE_S and time.monotonic() >= back_at
        assert await topo.kv.train_complete() == {"steps": 3}
        await bus.close()

    asyncio.run(body())


def test_lag_rides_through(private_nats_server, run_id, rt_cfg):
    async def body():
        bus, topo = await open_run(private_nats_server.url, rt_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i, nbytes=1024) for i in range(5)]
        )
        down = restart_after(private_nats_server)
        got = await lag(bus, run_id)
        await down
        assert (got.messages, got.bytes) == (5, 5 * 1024)
        await bus.close()

    asyncio.run(body())


def test_publish_rides_through_and_stores_each_message_once(private_nats_server, run_id, rt_cfg):
    async def body():
        bus, topo = await open_run(private_nats_server.url, rt_cfg, run_id)
        pub = Publisher(bus, ack_timeout_s=0.5)
        refs = [make_ref(run_id, i) for i in range(10)]
        down = restart_after(private_nats_server)
        acks = await pub.publish_many(topo.names.samples, refs)
        await down
        assert sorted(a.seq for a in acks) == list(range(1, 11))
        # Re-sent with the same ids across the outage: stored once each.
        await pub.publish_many(topo.names.samples, refs)
        info = await bus.js.stream_info(topo.names.samples_stream)
        assert (info.state.messages, info.state.last_seq) == (10, 10)
        await bus.close()

    asyncio.run(body())


def test_replay_get_and_last_ride_through(private_nats_server, run_id, rt_cfg):
    async def body():
        bus, topo = await open_run(private_nats_server.url, rt_cfg, run_id)
        refs = [make_ref(run_id, i) for i in range(6)]
        await Publisher(bus).publish_many(topo.names.samples, refs)
        stream = topo.names.samples_stream
        down = restart_after(private_nats_server)
        one, final = await asyncio.gather(
            get(bus, stream, 3), last(bus, stream, topo.names.samples)
        )
        await down
        assert SampleRef.from_bytes(one.data) == refs[2]
        assert (final.seq, SampleRef.from_bytes(final.data)) == (6, refs[5])
        await bus.close()

    asyncio.run(body())


def test_a_replay_interrupted_by_a_restart_goes_on_where_it_was(
    private_nats_server, run_id, rt_cfg
):
    """A batch of the replay's direct gets lost to the restart is asked again: the replay
    must neither end early (an outage is not the end of the stream) nor repeat anything."""

    async def body():
        bus, topo = await open_run(private_nats_server.url, rt_cfg, run_id)
        refs = [make_ref(run_id, i) for i in range(9)]
        await Publisher(bus).publish_many(topo.names.samples, refs)
        seqs, down = [], None
        async for stored in replay(bus, topo.names.samples_stream, 2, batch=2):
            seqs.append(stored.seq)
            assert SampleRef.from_bytes(stored.data) == refs[stored.seq - 1]
            if stored.seq == 4:
                down = restart_after(private_nats_server)
        assert down is not None
        await down
        assert seqs == list(range(2, 10))
        await bus.close()

    asyncio.run(body())


def test_fetch_during_an_outage_returns_nothing_then_leases_after(
    private_nats_server, run_id, rt_cfg, caplog
):
    """A fetch in an outage waits its timeout and returns [] (no error); the outage is logged
    as one line gone, one line back, and nothing else at WARNING."""

    async def body():
        bus, topo = await open_run(private_nats_server.url, rt_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(4)]
        )
        group = await Leases.join(bus, run_id, "trainers")
        down = restart_after(private_nats_server)
        empty, leases = 0, []
        while not down.done():
            t0, was_down = time.monotonic(), not bus.connected
            got = await group.fetch(2, timeout_s=0.3)
            if was_down and not bus.connected:
                assert got == [] and time.monotonic() - t0 >= 0.29
                empty += 1
            leases += got
        await down
        assert empty >= OUTAGE_S / 0.3 - 3
        while len(leases) < 4:
            more = await group.fetch(4, timeout_s=5)
            assert more, "nothing delivered after the broker came back"
            leases += more
        assert sorted(lease.seq for lease in leases) == [1, 2, 3, 4]
        await group.ack_all(leases)
        await bus.close()

    with caplog.at_level(logging.INFO, logger="specbus.bus"):
        asyncio.run(body())
    begin, back, other = outage_lines(caplog)
    assert len(begin) == 1 and "fetching from" in begin[0] and "retrying" in begin[0], begin
    assert len(back) == 1, back
    assert other == []


def test_concurrent_calls_in_one_outage_log_one_line_each_way(
    private_nats_server, run_id, rt_cfg, caplog
):
    async def body():
        bus, topo = await open_run(private_nats_server.url, rt_cfg, run_id)
        await Publisher(bus).publish(topo.names.samples, make_ref(run_id, 0))
        group = await Leases.join(bus, run_id, "trainers")
        down = restart_after(private_nats_server)
        got = await asyncio.gather(
            topo.kv.feed_complete(),
            lag(bus, run_id),
            get(bus, topo.names.samples_stream, 1),
            Publisher(bus, ack_timeout_s=0.5).publish(topo.names.samples, make_ref(run_id, 1)),
            group.fetch(1, timeout_s=OUTAGE_S / 2),
        )
        await down
        assert got[0] is None and got[1].messages >= 1 and got[2].seq == 1
        await bus.close()

    with caplog.at_level(logging.INFO, logger="specbus.bus"):
        asyncio.run(body())
    begin, back, other = outage_lines(caplog)
    assert len(begin) == 1 and "until" in begin[0] and "outage_give_up_s" in begin[0], begin
    assert len(back) == 1 and "back after" in back[0], back
    assert other == []


def test_confirmed_acks_ride_through(private_nats_server, run_id, rt_cfg):
    async def body():
        bus, topo = await open_run(private_nats_server.url, rt_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(6)]
        )
        group = await Leases.join(bus, run_id, "trainers")
        leases = await group.fetch(6)
        assert len(leases) == 6
        down = restart_after(private_nats_server)
        assert await group.ack_all(leases) == 6
        await down
        # Applied, or (the broker persists consumer state asynchronously) forgotten by the
        # crash and delivered again: never left hanging, never an error.
        info = await bus.js.consumer_info(topo.names.samples_stream, "trainers")
        applied = info.ack_floor.stream_seq
        assert applied + group.acks_forgotten == 6
        again = await group.fetch(6, timeout_s=1.0) if group.acks_forgotten else []
        assert sorted(lease.seq for lease in again) == list(range(applied + 1, 7))
        await bus.close()

    asyncio.run(body())


def test_an_ack_the_broker_can_never_answer_does_not_hang(nats_server, run_id, rt_cfg, caplog):
    """nats-server never answers an ack above its consumer's delivered pointer (its state went
    back: a crash before the asynchronous flush, here a reposition). A confirmed ack of it
    must return, count it as forgotten, and the message comes again as a first delivery."""

    async def body():
        bus, topo = await open_run(nats_server.url, rt_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(4)]
        )
        group = await Leases.join(bus, run_id, "trainers")
        leases = await group.fetch(4)
        await reposition(bus, run_id, "trainers", 1)  # delivered pointer back to 0
        t0 = time.monotonic()
        assert await group.ack_all(leases) == 4
        assert time.monotonic() - t0 < 10
        assert group.acks_forgotten == 4
        fresh = await Leases.join(bus, run_id, "trainers")
        again = await fresh.fetch(4, timeout_s=2.0)
        assert [(lease.seq, lease.deliveries) for lease in again] == [(s, 1) for s in range(1, 5)]
        await fresh.ack_all(again)
        await bus.close()

    with caplog.at_level(logging.WARNING, logger="specbus.bus"):
        asyncio.run(body())
    assert any("can never be confirmed" in r.getMessage() for r in caplog.records)


def test_join_and_declare_ride_through(private_nats_server, run_id, rt_cfg):
    async def body():
        bus, topo = await open_run(private_nats_server.url, rt_cfg, run_id)
        down = restart_after(private_nats_server)
        group, kv = await asyncio.gather(Leases.join(bus, run_id, "trainers"), open_kv(bus, run_id))
        await down
        assert group.max_ack_pending == rt_cfg.max_ack_pending and kv is not None
        await bus.close()

    asyncio.run(body())


def test_give_up_raises_broker_unavailable_after_the_configured_outage(
    private_nats_server, run_id, rt_cfg
):
    from specbus.core.errors import BrokerUnavailable

    async def body():
        cfg = rt_cfg.model_copy(update=dict(outage_give_up_s=2.0))
        bus, topo = await open_run(private_nats_server.url, cfg, run_id)
        private_nats_server.kill()
        t0 = time.monotonic()
        with pytest.raises(BrokerUnavailable) as e:
            await topo.kv.feed_complete()
        elapsed = time.monotonic() - t0
        assert 2.0 <= elapsed < 6.0
        assert isinstance(e.value, BusError)
        assert "outage_give_up_s=2" in str(e.value) and "reading KV key" in str(e.value)
        assert private_nats_server.url in str(e.value)
        await bus.close()

    asyncio.run(body())


def test_outage_state_logs_once_and_gives_up_on_its_clock(caplog):
    from specbus.bus.outage import Outage
    from specbus.core.errors import BrokerUnavailable

    now = [100.0]
    outage = Outage("nats://x:1", give_up_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="specbus.bus"):
        outage.lost()
        now[0] += 3
        for _ in range(5):
            outage.failed("reading KV key 'k'", TimeoutError("nats: timeout"))
        now[0] += 6.9
        outage.failed("fetching", None)  # 9.9 s after the connection was lost: still retrying
        now[0] += 0.2
        with pytest.raises(BrokerUnavailable, match="unavailable for 10 s while fetching"):
            outage.failed("fetching", None)
        outage.recovered()
        outage.recovered()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "reading KV key 'k'" in lines[0] and "TimeoutError" in lines[0]
    assert "back after 10.1 s" in lines[1]
    # A connection blip no operation noticed is no outage.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specbus.bus"):
        outage.lost()
        now[0] += 0.5
        outage.reconnected()
        assert not outage.active and not caplog.records
        # A long outage nobody waited on (a rank blocked in a collective) is said once, after.
        outage.lost()
        now[0] += 8
        outage.reconnected()
    assert not outage.active
    (line,) = [r.getMessage() for r in caplog.records]
    assert "unavailable while idle" in line and "back after 8.0 s" in line


def test_a_connection_lost_under_a_waiting_call_is_announced_at_once(caplog):
    """A call blocked in a request only notices the outage when the request times out (or
    never, if the broker is back by then): the connection loss itself announces it."""
    from specbus.bus.outage import Outage

    outage = Outage("nats://x:1", give_up_s=900.0)
    with caplog.at_level(logging.WARNING, logger="specbus.bus"):
        outage.lost()  # no call waiting: nothing to say yet
        outage.reconnected()
        with outage.doing("confirming 2 acks on S/trainers"):
            outage.lost()
            outage.failed("confirming 2 acks on S/trainers", TimeoutError("nats: timeout"))
        outage.recovered()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "unavailable while confirming 2 acks on S/trainers (connection lost)" in lines[0]
    assert "back after" in lines[1]

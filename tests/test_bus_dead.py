"""Dead letters: term and max-deliver land in DEAD with the reason and the original; bad
records are dead-lettered at fetch and the consumer keeps going."""

from __future__ import annotations

import asyncio

import orjson
from specbus.bus import headers as H
from specbus.bus.dead import list_dead
from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.core.contracts import MAX_RECORD_BYTES, SampleRef

from tests.fixtures.nats import make_ref, open_run


def test_term_lands_in_dead_with_reason_and_original(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        ref = make_ref(run_id, 7)
        await Publisher(bus).publish(topo.names.samples, ref, headers={"X-Origin": "unit"})
        group = await Leases.join(bus, run_id, "trainers")
        (lease,) = await group.fetch(1)
        await lease.term("nan_loss", "loss was NaN at step 3")
        assert group.outstanding == 0
        # Terminated: never redelivered.
        assert await group.fetch(1, timeout_s=1.5 * bus_cfg.ack_wait_s) == []
        (dead,) = await list_dead(bus, run_id)
        assert (dead.kind, dead.reason, dead.detail) == (
            "explicit",
            "nan_loss",
            "loss was NaN at step 3",
        )
        assert (dead.stream, dead.seq, dead.consumer, dead.deliveries) == (
            topo.names.samples_stream,
            lease.seq,
            "trainers",
            1,
        )
        assert SampleRef.from_bytes(dead.data) == ref
        assert dead.headers["X-Origin"] == "unit"
        assert dead.subject == topo.names.samples
        await bus.close()

    asyncio.run(body())


def test_max_deliver_lands_in_dead_with_the_original(nats_server, run_id, bus_cfg):
    cfg = bus_cfg.model_copy(update={"max_deliver": 2})

    async def body():
        bus, topo = await open_run(nats_server.url, cfg, run_id)
        ref = make_ref(run_id, 3)
        await Publisher(bus).publish(topo.names.samples, ref)
        group = await Leases.join(bus, run_id, "trainers")
        deliveries = []
        for _ in range(2):  # a worker that keeps failing silently: the lease expires twice
            got = await group.fetch(1, timeout_s=3 * cfg.ack_wait_s)
            deliveries += [lease.deliveries for lease in got]
        assert deliveries == [1, 2]
        assert await group.fetch(1, timeout_s=1.5 * cfg.ack_wait_s) == []  # no third delivery
        for _ in range(20):  # the advisory is emitted when the second lease expires
            dead = await list_dead(bus, run_id)
            if dead:
                break
            await asyncio.sleep(0.1)
        (entry,) = dead
        assert (entry.kind, entry.reason, entry.deliveries) == (
            "max_deliveries",
            "max_deliveries",
            2,
        )
        assert (entry.stream, entry.seq, entry.consumer) == (
            topo.names.samples_stream,
            1,
            "trainers",
        )
        assert SampleRef.from_bytes(entry.data) == ref
        await bus.close()

    asyncio.run(body())


def _bad_payloads(run: str) -> dict[str, bytes]:
    good = orjson.loads(make_ref(run, 99).to_bytes())
    newer = dict(good, schema_version=2)
    with_tensor = dict(good, hidden_states=[[0.25] * 64] * 8)  # a tensor smuggled into a record
    oversize = dict(good, store_uri="mem://" + "x" * MAX_RECORD_BYTES)
    return {
        "garbage": b"\x00\x9f not json at all",
        "schema": orjson.dumps(newer),
        "invalid": orjson.dumps(with_tensor),
        "oversize": orjson.dumps(oversize),
    }


def test_bad_records_go_to_dead_and_the_consumer_keeps_going(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        pub = Publisher(bus)
        bad = _bad_payloads(run_id)
        # good, bad, good, bad, ... so the consumer has to step over each bad one.
        items, good_ids = [], []
        for i, (reason, payload) in enumerate(bad.items()):
            ref = make_ref(run_id, i)
            items.append((topo.names.samples, ref.to_bytes(), {H.MSG_ID: ref.msg_id}))
            items.append((topo.names.samples, payload, {H.MSG_ID: f"bad-{reason}"}))
            good_ids.append(ref.sample_id)
        await pub.publish_payloads(items)
        group = await Leases.join(bus, run_id, "trainers")
        got = []
        while len(got) < len(good_ids):
            leases = await group.fetch(3)
            assert leases, "the consumer stalled on a bad record"
            got += leases
        assert [lease.record.sample_id for lease in got] == good_ids
        await group.ack_all(got)
        assert (
            await group.fetch(10, timeout_s=1.5 * bus_cfg.ack_wait_s) == []
        )  # bad ones terminated
        # counted after the last fetch: the last bad record follows the last good one, and the
        # fetch that returned that good one may have ended before it (a flake when it did)
        assert group.dead_lettered == len(bad)

        dead = await list_dead(bus, run_id)
        assert {d.reason: d.data for d in dead} == bad
        assert all(d.kind == "explicit" and d.detail for d in dead)
        assert [d.seq for d in dead] == [2, 4, 6, 8]
        await bus.close()

    asyncio.run(body())

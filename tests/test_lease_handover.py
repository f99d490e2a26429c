"""A lease handed over to another process's connection is kept alive and settled there."""

from __future__ import annotations

import asyncio

import pytest
from specbus.bus.connection import connect
from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.core.errors import BusError

from tests.fixtures.nats import make_ref, open_run


def test_handed_over_lease_is_heartbeated_and_acked_by_the_other_connection(
    nats_server, run_id, bus_cfg
):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        peer_bus = await connect(bus_cfg, nats_server.url)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(2)]
        )
        leader = await Leases.join(bus, run_id, "trainers")
        peer = await Leases.join(peer_bus, run_id, "trainers")
        mine, theirs = await leader.fetch(2)
        (wire,) = leader.hand_over([theirs])
        assert leader.outstanding == 1 and theirs not in leader.held  # credit freed, unsettled
        adopted = peer.adopt(*wire)
        assert (adopted.seq, adopted.deliveries, adopted.record) == (
            theirs.seq, theirs.deliveries, theirs.record,
        )  # fmt: skip
        # Past 2x ack_wait, each side beating its own lease: nothing is redelivered.
        async with peer.heartbeat([adopted], interval_s=0.3), leader.heartbeat(interval_s=0.3):
            assert await leader.fetch(2, timeout_s=2 * bus_cfg.ack_wait_s) == []
        assert await peer.ack_all([adopted]) == 1 and await leader.ack_all([mine]) == 1
        info = await bus.js.consumer_info(topo.names.samples_stream, "trainers")
        assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (0, 0, 0)
        with pytest.raises(BusError, match="already settled"):
            leader.hand_over([mine])
        with pytest.raises(BusError, match="not a delivery of"):
            peer.adopt(wire[0].replace("trainers", "producers", 1), wire[1])
        await peer_bus.close()
        await bus.close()

    asyncio.run(body())

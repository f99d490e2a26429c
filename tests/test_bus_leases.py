"""Leases: a consumer group splits work, expired leases move, heartbeats hold, naks delay,
credit bounds what is in flight, confirmed acks are applied."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from specbus.bus.connection import connect
from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.core.errors import BrokerUnavailable, BusError

from tests.fixtures.nats import make_ref, open_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A group member in its own process: consumes until the run's trainers have nothing left,
# printing one JSON line per batch of acked stream sequences. It never imports torch (the bus
# does not), so there are no BLAS threads to pin.
MEMBER = r"""
import asyncio, json, sys, time
from specbus.bus.connection import connect
from specbus.bus.lag import lag
from specbus.bus.lease import Leases
from specbus.core.config import BusConfig

url, run, mode = sys.argv[1], sys.argv[2], sys.argv[3]

async def main():
    bus = await connect(BusConfig(ack_wait_s=1.0, fetch_timeout_s=0.3), url)
    group = await Leases.join(bus, run, "trainers")
    print(json.dumps({"ready": True}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
    if mode == "hold":  # lease 3 and never settle them: the caller kills us
        leases = await group.fetch(3, 5.0)
        print(json.dumps({"held": [l.seq for l in leases]}), flush=True)
        await asyncio.sleep(60)
    while True:
        leases = await group.fetch(5)
        if not leases:
            if (await lag(bus, run)).messages == 0:
                break
            continue
        await asyncio.sleep(0.01)  # "work", so both members get a share
        await group.ack_all(leases)
        print(json.dumps({"acked": [l.seq for l in leases]}), flush=True)
    await bus.close()

asyncio.run(main())
"""


def _spawn(url: str, run: str, mode: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", MEMBER, url, run, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )


def _go(*procs: subprocess.Popen) -> None:
    """Start members together, once all are connected and joined."""
    for proc in procs:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()


def test_two_member_processes_split_the_work_without_overlap(nats_server, run_id, bus_cfg):
    async def publish():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(200)]
        )
        await bus.close()

    asyncio.run(publish())
    members = [_spawn(nats_server.url, run_id, "consume") for _ in range(2)]
    _go(*members)
    shares = []
    for proc in members:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        shares.append([seq for line in out.splitlines() for seq in json.loads(line)["acked"]])
    a, b = (set(s) for s in shares)
    assert len(shares[0]) == len(a) and len(shares[1]) == len(b), "a member saw a message twice"
    assert a.isdisjoint(b)
    assert a | b == set(range(1, 201))
    assert a and b, "both members took work"


def test_expired_lease_of_a_killed_member_is_redelivered_to_the_other(nats_server, run_id, bus_cfg):
    async def publish():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(3)]
        )
        await bus.close()

    asyncio.run(publish())
    holder = _spawn(nats_server.url, run_id, "hold")
    _go(holder)
    held = json.loads(holder.stdout.readline())["held"]
    assert held == [1, 2, 3]
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    killed_at = time.monotonic()

    async def take_over():
        bus = await connect(bus_cfg, nats_server.url)
        group = await Leases.join(bus, run_id, "trainers")
        got = []
        while len(got) < 3:
            got += await group.fetch(3, 3.0)
        waited = time.monotonic() - killed_at
        await group.ack_all(got)
        await bus.close()
        return got, waited

    got, waited = asyncio.run(take_over())
    assert sorted(lease.seq for lease in got) == held
    assert all(lease.deliveries == 2 for lease in got)
    assert waited < bus_cfg.ack_wait_s + 2.0


def test_heartbeat_holds_a_lease_past_ack_wait(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        other_bus = await connect(bus_cfg, nats_server.url)
        await Publisher(bus).publish(topo.names.samples, make_ref(run_id, 0))
        worker = await Leases.join(bus, run_id, "trainers")
        other = await Leases.join(other_bus, run_id, "trainers")
        (lease,) = await worker.fetch(1)
        async with worker.heartbeat([lease], interval_s=0.3) as hb:
            # 3x ack_wait of "long work": the other member never gets the message.
            stolen = await other.fetch(1, timeout_s=3 * bus_cfg.ack_wait_s)
        assert stolen == []
        assert hb.beats >= 5
        assert await worker.ack_all([lease]) == 1
        assert await other.fetch(1, timeout_s=1.5 * bus_cfg.ack_wait_s) == []
        await other_bus.close()
        await bus.close()

    asyncio.run(body())


def test_nak_with_delay_redelivers_after_the_delay(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish(topo.names.samples, make_ref(run_id, 0))
        group = await Leases.join(bus, run_id, "trainers")
        (lease,) = await group.fetch(1)
        await lease.nak(delay_s=0.8)
        t0 = time.monotonic()
        assert await group.fetch(1, timeout_s=0.5) == []
        (again,) = await group.fetch(1, timeout_s=2.0)
        assert time.monotonic() - t0 >= 0.7
        assert (again.seq, again.deliveries) == (lease.seq, 2)
        await again.nak(delay_s=0)  # no delay: straight back
        t0 = time.monotonic()
        (third,) = await group.fetch(1, timeout_s=2.0)
        assert time.monotonic() - t0 < 0.5 and third.deliveries == 3
        await third.ack()
        await bus.close()

    asyncio.run(body())


def test_fetch_never_exceeds_max_ack_pending(nats_server, run_id, bus_cfg):
    # Leases long enough not to expire (an expiry would free credit by itself).
    cfg = bus_cfg.model_copy(update={"max_ack_pending": 5, "ack_wait_s": 30.0})

    async def body():
        bus, topo = await open_run(nats_server.url, cfg, run_id)
        other_bus = await connect(cfg, nats_server.url)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(20)]
        )
        group = await Leases.join(bus, run_id, "trainers")
        other = await Leases.join(other_bus, run_id, "trainers")
        leases = await group.fetch(100)
        assert len(leases) == 5 and group.credit == 0
        # No credit left: returns at once instead of waiting out the timeout.
        t0 = time.monotonic()
        assert await group.fetch(100, timeout_s=5.0) == []
        assert time.monotonic() - t0 < 0.1
        # Another member shares the consumer's credit: the broker delivers nothing beyond it.
        assert await other.fetch(100, timeout_s=0.5) == []
        info = await bus.js.consumer_info(topo.names.samples_stream, "trainers")
        assert info.num_ack_pending == 5 and info.num_waiting == 0
        # Acks free credit, and the other member's waiting fetch gets exactly that much.
        waiting = asyncio.create_task(other.fetch(100, timeout_s=3.0))
        while not (await bus.js.consumer_info(topo.names.samples_stream, "trainers")).num_waiting:
            assert not waiting.done(), waiting  # its pull request waits at the server, unanswered
            await asyncio.sleep(0.01)
        await group.ack_all(leases[:2])
        freed = await waiting
        assert len(freed) == 2
        await group.ack_all(leases[2:])
        await other.ack_all(freed)
        await other_bus.close()
        await bus.close()

    asyncio.run(body())


def test_ack_all_is_confirmed_and_settling_is_idempotent(nats_server, run_id, bus_cfg):
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish_many(
            topo.names.samples, [make_ref(run_id, i) for i in range(8)]
        )
        group = await Leases.join(bus, run_id, "trainers")
        leases = await group.fetch(8)
        assert len(leases) == 8 and group.outstanding == 8
        assert await group.ack_all(leases, confirm=True) == 8
        # Confirmed: the consumer already applied every ack, no waiting needed.
        info = await bus.js.consumer_info(topo.names.samples_stream, "trainers")
        assert (info.num_ack_pending, info.ack_floor.stream_seq) == (0, 8)
        assert group.outstanding == 0
        assert await group.ack_all(leases) == 0  # second settlement: no-op
        await leases[0].nak()  # no-op too: the first settlement won
        assert await group.fetch(1, timeout_s=1.5 * bus_cfg.ack_wait_s) == []
        await bus.close()

    asyncio.run(body())


def test_a_fetch_on_a_closed_connection_raises_instead_of_returning_at_once(
    nats_server, run_id, bus_cfg
):
    # A fetch that returned [] at once, nothing awaited, let a consumer's fetch loop spin on
    # the event loop: nothing else on it ran again, not even the cancellation of that loop
    # (a CI run's simulated trainer kill waited on it forever).
    async def body():
        bus, topo = await open_run(nats_server.url, bus_cfg, run_id)
        await Publisher(bus).publish(topo.names.samples, make_ref(run_id, 0))
        group = await Leases.join(bus, run_id, "trainers")
        assert len(await group.fetch(1, timeout_s=2.0)) == 1
        await bus.nc.close()  # closed under it, as when the reconnect attempts run out
        with pytest.raises(BrokerUnavailable, match="reconnect attempts"):
            await group.fetch(1, timeout_s=0.5)
        bus.closing = True  # ... and as when this process closed it
        with pytest.raises(BusError, match="is closed"):
            await group.fetch(1, timeout_s=0.5)

    asyncio.run(body())

"""End to end: every process rides through a broker outage longer than its timeouts.

Feeder, one producer and two trainer ranks (shm store) run as real processes; the broker is
killed (kill -9) once the trainers acked their first window, while the feeder is still
waiting on the producers' lag, and restarted on the same port and store dir 8 s later. Every
process must carry on and exit 0, and the run must complete with every fed sample trained
exactly once.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.errors import NotFoundError
from specbus.bus.connection import connect
from specbus.bus.subjects import Names
from specbus.bus.topology import open_kv
from specbus.core.config import BusConfig

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

pytestmark = pytest.mark.slow  # multi-process runs of 15-40 s each on 2 cores

WORLD, MICRO = 2, 2
WINDOW = WORLD * MICRO
N, EPOCHS = 48, 3  # 144 tasks, 36 steps
# ~18 captured samples (~14 KB each): the producer waits for the trainers, and the feeder (it
# publishes an epoch while the producers' lag is under 4 x max_ack_pending) for the producer,
# so all of them are still running when the first window is acked.
BUDGET = 256 << 10
OUTAGE_S = 8.0


def consumer_state(url: str, run: str) -> tuple[int, int]:
    """(ack floor, delivered) of the trainers' consumer, read on a connection of its own;
    (0, 0) before the run is declared."""

    async def go():
        async with await connect(BusConfig(), url) as bus:
            try:
                info = await bus.js.consumer_info(Names(run).samples_stream, "trainers")
            except NotFoundError:
                return 0, 0
            return info.ack_floor.stream_seq, info.delivered.stream_seq

    return asyncio.run(go())


def kv_train_complete(url: str, run: str):
    async def go():
        async with await connect(BusConfig(), url) as bus:
            return await (await open_kv(bus, run)).train_complete()

    return asyncio.run(go())


def test_every_process_rides_through_an_8s_broker_outage(
    tmp_path, tiny_target, private_nats_server, run_id
):
    server = private_nats_server
    data = write_tokenised_data(tmp_path / "data.jsonl", N)
    cfg = pipeline_config(
        run_id, tmp_path / "run", tiny_target, data, store_uri=f"shm://{run_id}",
        overrides=[f"data.epochs={EPOCHS}", "bus.max_ack_pending=8", f"store.budget_bytes={BUDGET}"],
    )  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", server.url)
    names = ["feeder", "producer-0", "trainer-0", "trainer-1"]
    try:
        cluster.start("feeder", "feed")
        cluster.start("producer-0", "produce", "--id", "p0")
        cluster.trainers(WORLD)
        # Readiness: the first window is acked (the trainers' ack floor moved).
        deadline = time.monotonic() + 180
        floor = 0
        while floor < 1:
            assert time.monotonic() < deadline, "no window acked in 180 s"
            ended = {
                n: cluster.procs[n].poll() for n in names if cluster.procs[n].poll() is not None
            }
            assert not ended, "\n".join(
                f"--- {n} ended early ({c})\n{cluster.log(n)[-2000:]}" for n, c in ended.items()
            )
            floor, delivered = consumer_state(server.url, run_id)
            time.sleep(0.05)
        server.kill()
        alive_at_kill = [n for n in names if cluster.procs[n].poll() is None]
        time.sleep(OUTAGE_S)  # the fault itself: the broker stays down this long
        server.start()  # waits for the server's readiness line
        codes = cluster.wait(*names, timeout=300)
    finally:
        cluster.stop()
    cluster.assert_ok(codes)
    # The fault landed mid-run: after the first ack, before the last step, with every
    # process (the feeder too, still waiting on the producers' lag) running.
    total = N * EPOCHS
    assert 1 <= floor < total - WINDOW, (floor, delivered)
    assert alive_at_kill == names, alive_at_kill
    # Every process noticed the outage and said so: one line gone, one line back.
    for name in names:
        log = cluster.log(name)
        assert log.count("unavailable while") >= 1 and log.count(" back after ") >= 1, (
            f"--- {name}\n{log[-3000:]}"
        )
    # The run completed: every fed sample trained.
    done = kv_train_complete(server.url, run_id)
    assert done is not None, "training never marked complete"
    lineage = cluster.checkpoint_state()["lineage"]
    assert set(lineage) == {f"t{i}-e{e}" for i in range(N) for e in range(EPOCHS)}
    # ... exactly once. The broker persists consumer state asynchronously: a kill right after
    # an ack can bring acked refs back as first deliveries; the trainers' ledger filters them.
    twice = sorted({s for s in lineage if lineage.count(s) > 1})
    assert not twice, f"trained twice after the broker lost acks: {twice}"
    assert done["steps"] == total // WINDOW, done

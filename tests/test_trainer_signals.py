"""SIGINT/SIGTERM to trainer ranks: stop at a step boundary, save the last step, give back the
leases, exit 0; a resume then completes the run with every sample trained exactly once.

Real processes (feeder, producer, trainer ranks) on a real broker and shm store, as in
tests/test_pipeline.py. The signals are sent once the trainers have logged a step (mid-run)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from specbus.bus.connection import connect
from specbus.bus.lease import Leases
from specbus.bus.subjects import TRAINERS, Names
from specbus.core.config import BusConfig

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

pytestmark = pytest.mark.slow  # multi-process runs of 15-40 s each on 2 cores

WORLD, MICRO = 2, 2
WINDOW = WORLD * MICRO


def trainers_consumer(url: str, run: str):
    async def go():
        async with await connect(BusConfig(), url) as bus:
            return await bus.js.consumer_info(Names(run).samples_stream, TRAINERS)

    return asyncio.run(go())


def take_given_back(url: str, run: str, n: int) -> list[int]:
    """Deliveries of the trainers' group a new member gets within 2 s (then nak'd back): with
    leases of 10 s, only what was nak'd comes back that soon."""

    async def go():
        async with await connect(BusConfig(), url) as bus:
            group = await Leases.join(bus, run, TRAINERS)
            got = []
            deadline = time.monotonic() + 2.0
            while len(got) < n and time.monotonic() < deadline:
                got += await group.fetch(n - len(got), 0.2)
            await group.close(nak_held=True)
            return [lease.deliveries for lease in got]

    return asyncio.run(go())


@pytest.fixture
def cluster(tmp_path, tiny_target, nats_server, run_id):
    n = 96
    data = write_tokenised_data(tmp_path / "data.jsonl", n)
    cfg = pipeline_config(
        run_id, tmp_path / "run", tiny_target, data, store_uri=f"shm://{run_id}",
        overrides=["training.checkpoint_every=1000", "training.log_every=1", "bus.ack_wait_s=10"],
    )  # fmt: skip
    c = Cluster(cfg, tmp_path / "procs", nats_server.url)
    c.n = n
    yield c
    c.stop()


def _resume_and_check(cluster: Cluster, stopped_at: int) -> None:
    cluster.trainers(WORLD, "--resume")
    cluster.assert_ok(cluster.wait("feeder", "producer-0", "trainer-0", "trainer-1"))
    state = cluster.checkpoint_state()
    lineage = state["lineage"]
    assert len(lineage) == len(set(lineage)), "a sample was trained twice"
    assert set(lineage) == {f"t{i}-e0" for i in range(cluster.n)}
    assert state["step"] == cluster.n // WINDOW > stopped_at
    info = trainers_consumer(cluster.url, cluster.cfg.run)
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


def test_sigterm_to_every_rank_saves_the_last_step_and_gives_back_the_leases(cluster):
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    cluster.trainers(WORLD)
    cluster.wait_for_line("trainer-0", r"step 2\b")  # mid-run: steps trained, more to come
    for rank in range(WORLD):
        cluster.procs[f"trainer-{rank}"].send_signal(signal.SIGTERM)
    codes = cluster.wait("trainer-0", "trainer-1", timeout=60)
    cluster.assert_ok(codes)
    stopped = cluster.wait_for_line("trainer-0", r"training stopped: (\d+) steps")
    step = int(stopped.split()[2])
    assert cluster.checkpoint_state()["step"] == step
    assert step < cluster.n // WINDOW, "the signal landed after the last step"
    # every lease given back (nak'd): what the broker still counts as delivered-and-unacked
    # comes back at once to a new member, not after the 10 s leases lapse
    held = trainers_consumer(cluster.url, cluster.cfg.run).num_ack_pending
    deliveries = take_given_back(cluster.url, cluster.cfg.run, held)
    assert held > 0 and len(deliveries) == held and min(deliveries) >= 2, (held, deliveries)
    _resume_and_check(cluster, step)


def test_a_dead_peer_then_sigterm_saves_the_last_step_on_rank_0(cluster):
    """torchrun's behaviour when a rank dies: the survivors get SIGTERM. Rank 0 saves the last
    optimizer step by itself (its peer cannot join a collective any more) and exits 0."""
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    cluster.trainers(WORLD)
    logged = cluster.wait_for_line("trainer-0", r"step 3\b")
    cluster.kill("trainer-1")
    cluster.procs["trainer-0"].send_signal(signal.SIGTERM)
    cluster.assert_ok(cluster.wait("trainer-0", timeout=60))
    step = cluster.checkpoint_state()["step"]
    assert step >= int(logged.split()[1]) and step < cluster.n // WINDOW
    _resume_and_check(cluster, step)

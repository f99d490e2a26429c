"""Backpressure never spends a delivery (issue 33): a full store is waited out, nothing is lost.

The end-to-end runs are the issue's reproduction on Mooncake: a real mooncake_master and store
node sized by the run's budget (`start_mooncake`, what `specbus store` runs), a real
nats-server, the feeder, 2 producers and 2 trainer ranks as real processes, a budget small
enough that capture is paced by training, nak delay 0.2 s and max_deliver 5, no fault. Before
the fix, such runs dead-lettered 12-28 % of the samples (MAX_DELIVERIES) while the producers
said "0 dead letters".
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from specbus.bus.connection import connect
from specbus.bus.dead import list_dead
from specbus.bus.subjects import PRODUCERS, TRAINERS, Names
from specbus.core.config import BusConfig

from tests.fixtures.mooncake import FAST
from tests.fixtures.nats import make_task, open_run
from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

WORLD = 2
# ~14 samples of the tiny target (12-40 tokens, ~7-21 KB each): capture (2 producers, ~ms a
# task) runs far ahead of training and meets the budget all the time. The trainers hold up to
# ((world - 1) x (1 + prefetch) + 1) x micro_batch = 6 samples while one waits for a window.
BUDGET = 200_000


def broker_state(url: str, run: str) -> dict:
    """The trainers' and producers' consumers and the run's dead letters, from the broker."""

    async def go():
        async with await connect(BusConfig(), url) as bus:
            names = Names(run)
            out = {}
            for group in (TRAINERS, PRODUCERS):
                info = await bus.js.consumer_info(names.stream_of(group), group)
                out[group] = {"pending": info.num_pending, "ack_pending": info.num_ack_pending,
                              "redelivered": info.num_redelivered}  # fmt: skip
            out["dead"] = await list_dead(bus, run)
            return out

    return asyncio.run(go())


def master_allocated(admin: str) -> int:
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("master_allocated_bytes"):
                return int(float(line.split()[-1]))
    return -1


@pytest.fixture
def busy_cpu():
    """A CPU load generator: one busy process per core, started and stopped by PID."""
    procs = []

    def start(n: int = 2):
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.parametrize("loaded", [False, True], ids=["idle", "cpu-load"])
def test_tight_mooncake_budget_trains_every_sample_once(
    loaded, tmp_path, tiny_target, nats_server, run_id, busy_cpu
):
    from specbus.core.config import StoreConfig
    from specbus.ops.services.mooncake import start_mooncake

    n = 200
    store = StoreConfig(uri=f"mooncake://s{run_id}", budget_bytes=BUDGET)
    services, store_cfg = start_mooncake(store, tmp_path / "run", **FAST)
    try:
        data = write_tokenised_data(tmp_path / "data.jsonl", n, lengths=(12, 40))
        cfg = pipeline_config(
            run_id, tmp_path / "run", tiny_target, data, store_uri=store_cfg.uri,
            overrides=[f"store.budget_bytes={BUDGET}", "bus.max_deliver=5", "bus.nak_delay_s=0.2",
                       "bus.ack_wait_s=10",
                       "store.mooncake.release_retry_s=0.2",
                       "store.mooncake.force_release_after_s=3.0",
                       "store.mooncake.buffer_bytes=33554432", "training.checkpoint_every=10"],
        )  # fmt: skip
        cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
        try:
            if loaded:
                busy_cpu(2)
            cluster.start("feeder", "feed")
            for i in range(2):
                cluster.start(f"producer-{i}", "produce", "--id", f"p{i}")
            cluster.trainers(WORLD)
            names = ["feeder", "producer-0", "producer-1", *[f"trainer-{r}" for r in range(WORLD)]]
            cluster.assert_ok(cluster.wait(*names, timeout=600))
            state = broker_state(nats_server.url, run_id)
            lineage = cluster.checkpoint_state()["lineage"]
            assert len(lineage) == len(set(lineage)), "a sample was trained twice"
            assert set(lineage) == {f"t{i}-e0" for i in range(n)}, (
                f"{n - len(set(lineage))} samples never trained; dead: "
                f"{[(d.reason, d.stream, d.seq, d.deliveries) for d in state['dead']][:10]}"
            )
            assert state["dead"] == []
            for group in (TRAINERS, PRODUCERS):
                assert state[group]["pending"] == state[group]["ack_pending"] == 0, state
            # no task went back: every delivery of TASKS was its first (no fault here)
            assert state[PRODUCERS]["redelivered"] == 0, state
            # the store was full, mid-run: the producers waited for room (and said so)
            waits = [re.search(r"waited for store room (\d+) times", cluster.log(f"producer-{i}"))
                     for i in range(2)]  # fmt: skip
            assert all(waits) and sum(int(w.group(1)) for w in waits) > 0, [
                cluster.log(f"producer-{i}")[-2000:] for i in range(2)
            ]
            for i in range(2):  # the producers' summaries are the run's truth
                assert "0 dead letters in the run" in cluster.log(f"producer-{i}")
            deadline = time.monotonic() + 30  # removes under a read lease are retried
            while master_allocated(services.admin_address) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert master_allocated(services.admin_address) == 0
        finally:
            cluster.stop()
    finally:
        services.stop()


# ---------------------------------------------------------------- one producer, by hand
async def leased(bus, run, going, n: int, timeout_s: float = 60.0) -> None:
    """Until the producers' group has `n` tasks out (or redelivered: a nak), the worker
    still running."""
    t0 = time.monotonic()
    while True:
        info = await bus.js.consumer_info(run.names.tasks_stream, PRODUCERS)
        if info.num_ack_pending >= n or info.num_redelivered:
            return
        assert not going.done() and time.monotonic() - t0 < timeout_s, going
        await asyncio.sleep(0.05)


def _worker(run, group, store, tiny_target, **kw):
    from specbus.core.config import StrategyConfig, TargetConfig
    from specbus.core.strategies import build_strategy
    from specbus.producers.capture import CaptureWorker
    from specbus.producers.engines.registry import build_engine

    engine = build_engine(TargetConfig(model=str(tiny_target)))
    contract = build_strategy(StrategyConfig(), engine.info).feature_contract()
    return CaptureWorker(run, group, engine, store, contract, capture_batch=2, **kw)


def test_a_full_store_is_waited_out_without_spending_a_delivery(
    nats_server, run_id, bus_cfg, tiny_target, caplog
):
    """A producer whose put meets a full store keeps the task leased (heartbeats past several
    `ack_wait`s, `max_deliver` naks' worth of time) and publishes it once room is made: one
    delivery, nothing dead. Before the fix the task was nak'd per full put and dead-lettered
    (MAX_DELIVERIES) after `max_deliver` of them."""
    import logging

    import torch
    from specbus.core.store import open_store

    cfg = bus_cfg.model_copy(update={"max_deliver": 2, "ack_wait_s": 1.0, "heartbeat_s": 0.2})
    store = open_store(f"shm://{run_id}", budget_bytes=100_000)
    # 85 % of the budget resident: under the producers' 90 % pacing, so the worker leases,
    # but a ~20 KB sample (40 tokens of hidden 32) does not fit beside it.
    ballast = store.put("ballast", {"x": torch.zeros(85_000, dtype=torch.uint8)})

    async def body():
        bus, run = await open_run(nats_server.url, cfg, run_id)
        for i in range(2):
            task = make_task(run_id, i).model_copy(
                update={"input_ids": tuple(range(3, 43)), "loss_mask": (1,) * 40}
            )
            await run.publisher.publish(run.names.tasks, task)
        group = await run.join("producers")
        worker = _worker(run, group, store, tiny_target)
        worker.report_every_s = 1.0
        going = asyncio.create_task(worker.run())
        await leased(bus, run, going, 2)
        await asyncio.sleep(4 * cfg.ack_wait_s)  # leases outlive ack_wait, naks would be spent
        info = await bus.js.consumer_info(run.names.tasks_stream, "producers")
        assert (info.num_redelivered, info.num_ack_pending) == (0, 2)
        assert await list_dead(bus, run_id) == [] and worker.stats.samples == 0
        assert worker.stats.store_waits >= 1  # the puts met the full store, mid-run
        t0 = time.monotonic()
        await asyncio.to_thread(store.release, ballast)
        while worker.stats.samples < 2:
            assert not going.done() and time.monotonic() - t0 < 60, going
            await asyncio.sleep(0.05)
        await run.kv.mark_train_complete({"steps": 0})
        stats = await asyncio.wait_for(going, 30)
        info = await bus.js.consumer_info(run.names.tasks_stream, "producers")
        refs = await run.lag("trainers")
        counts = await run.count_dead("producers")
        await group.close()
        await bus.close()
        return stats, info, refs, counts

    try:
        with caplog.at_level(logging.INFO, logger="specbus.producer"):
            stats, info, refs, counts = asyncio.run(body())
    finally:
        store.close()
    assert (info.num_redelivered, info.num_ack_pending, info.num_pending) == (0, 0, 0)
    assert info.ack_floor.stream_seq == 2 and refs.messages == 2  # both published, once
    assert counts == {"explicit": 0, "max_deliveries": 0}
    assert stats.store_waits >= 1 and stats.store_wait_s >= 4 * cfg.ack_wait_s
    said = [r.getMessage() for r in caplog.records]
    assert any(  # the progress line says what it waits for
        m.startswith("waiting")
        and "the store holds 85000 of its 100000 B budget" in m
        and "trainers: 0 refs pending" in m
        for m in said
    ), said
    assert any(m.startswith("room for sample t") for m in said), said


def test_a_stop_while_waiting_for_room_gives_the_task_back(nats_server, run_id, bus_cfg,
                                                            tiny_target):  # fmt: skip
    """A stop is not backpressure: the task waiting for room goes back at once (nak, no
    delay) and the worker returns."""
    import torch
    from specbus.core.store import open_store

    store = open_store(f"shm://{run_id}", budget_bytes=100_000)
    store.put("ballast", {"x": torch.zeros(85_000, dtype=torch.uint8)})

    async def body():
        bus, run = await open_run(nats_server.url, bus_cfg, run_id)
        task = make_task(run_id, 0).model_copy(
            update={"input_ids": tuple(range(3, 43)), "loss_mask": (1,) * 40}
        )
        await run.publisher.publish(run.names.tasks, task)
        group = await run.join("producers")
        worker = _worker(run, group, store, tiny_target)
        going = asyncio.create_task(worker.run())
        await leased(bus, run, going, 1)
        await asyncio.sleep(1.0)  # 5 nak delays: the put keeps meeting the full store
        worker.stop()
        stats = await asyncio.wait_for(going, 10)
        other = await run.join("producers")  # the task is back: another member gets it
        (again,) = await other.fetch(1, timeout_s=5)
        await other.close()
        await group.close()
        await bus.close()
        return stats, again

    try:
        stats, again = asyncio.run(body())
    finally:
        store.close()
    assert stats.samples == 0 and again.deliveries == 2


def test_dead_letters_are_counted_from_the_broker(nats_server, run_id, bus_cfg, tiny_target):
    """The producer's summary counts the run's dead letters, the broker's max-deliveries ones
    too (a member that let a lease lapse `max_deliver` times), not only its own."""
    from specbus.core.store import open_store
    from specbus.ops.commands import dead_summary
    from specbus.ops.produce import count_dead_letters

    cfg = bus_cfg.model_copy(update={"max_deliver": 1})
    store = open_store(f"shm://{run_id}", budget_bytes=1 << 20)

    async def body():
        bus, run = await open_run(nats_server.url, cfg, run_id)
        for i in range(3):
            await run.publisher.publish(run.names.tasks, make_task(run_id, i))
        ghost = await run.join("producers")  # leases one task and never settles it
        (lost,) = await ghost.fetch(1, timeout_s=5)
        group = await run.join("producers")
        (poison,) = await group.fetch(1, timeout_s=5)
        await run.dead_letter(poison, "capture_failed", "by hand")
        worker = _worker(run, group, store, tiny_target)
        going = asyncio.create_task(worker.run())
        t0 = time.monotonic()  # the third task captured; the broker gives up on the lapsed one
        while (
            worker.stats.samples < 1 or (await run.count_dead("producers"))["max_deliveries"] == 0
        ):
            assert not going.done() and time.monotonic() - t0 < 60, going
            await asyncio.sleep(0.1)
        await run.kv.mark_train_complete({"steps": 0})
        stats = await asyncio.wait_for(going, 30)
        await count_dead_letters(run, stats)
        from specbus.bus.dead import count_dead

        everything = await count_dead(bus, run_id)
        await ghost.close(nak_held=False)
        await group.close()
        await bus.close()
        return stats, lost, everything

    try:
        stats, lost, everything = asyncio.run(body())
    finally:
        store.close()
    assert stats.samples == 1 and stats.dead_letters == 0  # this worker dead-lettered none
    assert stats.run_dead_letters == 2
    assert stats.dead_reasons == {"explicit": 1, "max_deliveries": 1}
    assert "2 dead letters in the run (1 explicit, 1 max_deliveries), 0 by this producer" in (
        stats.summary()
    )
    assert everything == {"tasks": {"explicit": 1, "max_deliveries": 1},
                          "samples": {"explicit": 0, "max_deliveries": 0}}  # fmt: skip
    assert dead_summary(everything) == (
        "2 dead letters (tasks: 1 explicit, 1 max deliveries; `specbus dead`)"
    )


def test_a_producer_rides_out_the_trainers_consumer_being_repositioned(
    nats_server, run_id, bus_cfg, tiny_target
):
    """A resuming trainer world deletes and recreates the trainers' consumer (reposition); a
    producer reading the trainers' lag in that moment keeps its last value instead of failing
    (a tight-budget chaos trial's producer died with "consumer .../trainers not found")."""
    from specbus.bus.run import declare
    from specbus.core.store import open_store

    store = open_store(f"shm://{run_id}", budget_bytes=1 << 20)

    async def body():
        bus, run = await open_run(nats_server.url, bus_cfg, run_id)
        group = await run.join(PRODUCERS)
        worker = _worker(run, group, store, tiny_target)
        going = asyncio.create_task(worker.run())
        await bus.js.delete_consumer(run.names.samples_stream, TRAINERS)
        await run.publisher.publish(run.names.tasks, make_task(run_id, 0))
        t0 = time.monotonic()
        while worker.stats.samples < 1:  # captured with the consumer gone (lag: the last)
            assert not going.done() and time.monotonic() - t0 < 60, going
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # four more polls of the lag
        assert not going.done(), going
        await declare(bus, bus_cfg, run_id)  # the reposition recreates it
        await run.kv.mark_train_complete({"steps": 0})
        stats = await asyncio.wait_for(going, 30)
        await group.close()
        await bus.close()
        return stats

    try:
        assert asyncio.run(body()).samples == 1
    finally:
        store.close()

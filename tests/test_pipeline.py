"""End to end: feeder -> producers -> trainers through a real broker and real stores.

Every test runs real processes (`python -m specbus.ops.commands ...`) on a tiny random target and
checks the lineage contract: each fed sample is trained exactly once or dead-lettered (a last
partial window is trained too, in a ragged last step).
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from nats.js.errors import NotFoundError
from specbus.bus.connection import connect
from specbus.bus.dead import list_dead
from specbus.bus.replay import replay
from specbus.bus.subjects import TRAINERS, Names
from specbus.bus.topology import open_kv
from specbus.core.config import BusConfig
from specbus.core.contracts import SampleRef
from specbus.core.errors import BusNotFound
from specbus.core.store import open_store

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

WORLD, MICRO = 2, 2


def fed_ids(n: int) -> set[str]:
    return {f"t{i}-e0" for i in range(n)}


def dead_letters(url: str, run: str):
    async def go():
        async with await connect(BusConfig(), url) as bus:
            return await list_dead(bus, run)

    return asyncio.run(go())


def train_complete(url: str, run: str):
    async def go():
        async with await connect(BusConfig(), url) as bus:
            return await (await open_kv(bus, run)).train_complete()

    return asyncio.run(go())


def checkpoint_pointer(url: str, run: str):
    async def go():
        async with await connect(BusConfig(), url) as bus:
            return await (await open_kv(bus, run)).get_checkpoint()

    return asyncio.run(go())


def assert_lineage(cluster: Cluster, n: int, *, dead: int = 0) -> list[str]:
    lineage = cluster.checkpoint_state()["lineage"]
    assert len(lineage) == len(set(lineage)), "a sample was trained twice"
    assert set(lineage) <= fed_ids(n)
    untrained = n - len(lineage) - dead
    assert untrained == 0, f"{untrained} samples neither trained nor dead-lettered"
    return lineage


def trainers_consumer(url: str, run: str) -> tuple[int, int]:
    """(num_pending, num_ack_pending) of the run's trainers group."""

    async def go():
        async with await connect(BusConfig(), url) as bus:
            info = await bus.js.consumer_info(Names(run).samples_stream, TRAINERS)
            return info.num_pending, info.num_ack_pending

    return asyncio.run(go())


def assert_settled(cluster: Cluster, *, store_wait_s: float = 0.0) -> None:
    """The end of a run left nothing behind: no ref pending or ack-pending at the broker, no
    dead letter, no byte in the store after gc (Mooncake: releases refused under a read lease
    are retried in the background, for up to `store_wait_s`)."""
    assert trainers_consumer(cluster.url, cluster.cfg.run) == (0, 0)
    assert dead_letters(cluster.url, cluster.cfg.run) == []
    store = open_store(cluster.cfg.store.uri)
    try:
        deadline = time.monotonic() + store_wait_s
        while True:
            store.gc()
            if store.usage().resident_bytes == 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        assert store.usage().resident_bytes == 0
    finally:
        store.close()


def publishers(cluster: Cluster) -> tuple[set[str], int]:
    """(ids of the producers that published a sample, the trainers' ack floor) of the run."""

    async def state():
        async with await connect(BusConfig(), cluster.url) as bus:
            names = Names(cluster.cfg.run)
            try:
                refs = [
                    SampleRef.from_bytes(m.data) async for m in replay(bus, names.samples_stream)
                ]
                info = await bus.js.consumer_info(names.samples_stream, "trainers")
            except (BusNotFound, NotFoundError):  # the feeder has not declared the run yet
                return set(), 0
            return {r.provenance.producer_id for r in refs}, info.ack_floor.stream_seq

    return asyncio.run(state())


def wait_for_samples(cluster: Cluster, *, producers: set[str], trained: bool = False,
                     timeout: float = 180.0) -> None:  # fmt: skip
    """Until each of `producers` (ids) published a sample and, with `trained`, the trainers
    acked one, the trainers still running: the run is under way, not over."""

    deadline = time.monotonic() + timeout
    while True:
        seen, floor = publishers(cluster)
        trainers = [p for name, p in cluster.procs.items() if name.startswith("trainer-")]
        if producers <= seen and (floor > 0 or not trained):
            assert all(p.poll() is None for p in trainers), "the run was over before the fault"
            return
        failed = {k: c for k, p in cluster.procs.items() if (c := p.poll()) not in (None, 0)}
        assert not failed, f"failed before the fault: {failed}"
        assert time.monotonic() < deadline, f"{seen} of {producers} captured, ack floor {floor}"
        time.sleep(0.1)


@pytest.fixture
def make_cluster(tmp_path, tiny_target, nats_server, run_id):
    clusters = []

    def make(
        n: int, *, store_uri: str | None = None, overrides=(), url: str | None = None, data_kw=None
    ):
        data = write_tokenised_data(tmp_path / f"{run_id}.jsonl", n, **(data_kw or {}))
        cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri=store_uri or f"shm://{run_id}",
                              overrides=overrides)  # fmt: skip
        cluster = Cluster(cfg, tmp_path / "procs", url or nats_server.url)
        clusters.append(cluster)
        return cluster

    yield make
    for c in clusters:
        c.stop()


def run_all(cluster: Cluster, producers: int = 2, timeout: float = 180.0) -> dict[str, int]:
    cluster.start("feeder", "feed")
    for i in range(producers):
        cluster.start(f"producer-{i}", "produce", "--id", f"p{i}")
    cluster.trainers(WORLD)
    names = [
        "feeder",
        *[f"producer-{i}" for i in range(producers)],
        *[f"trainer-{r}" for r in range(WORLD)],
    ]
    return cluster.wait(*names, timeout=timeout)


def test_two_producers_two_trainers_on_shm(make_cluster):
    n = 23  # 5 full windows of 4, and 3 over: trained in a ragged last step
    cluster = make_cluster(n)
    cluster.assert_ok(run_all(cluster))
    assert len(assert_lineage(cluster, n)) == 23
    assert cluster.checkpoint_state()["step"] == 6
    assert_settled(cluster)


@pytest.mark.slow
def test_the_last_partial_window_is_trained_with_accumulation(make_cluster):
    """Issue 33, item 2, as reported: 50 tasks on 2 ranks x micro-batch 2 x accumulation 2
    (steps of 8): 6 full steps, and the 2 left over are trained in a ragged last step (they
    were nak'd and stayed ack-pending at the broker). Every sample exactly once, nothing
    pending or ack-pending, no dead letter, the store empty after gc."""
    n = 50
    cluster = make_cluster(n, overrides=["training.accumulation=2"])
    cluster.assert_ok(run_all(cluster))
    assert len(assert_lineage(cluster, n)) == n
    assert cluster.checkpoint_state()["step"] == 7
    assert_settled(cluster)


@pytest.mark.slow
@pytest.mark.mooncake
def test_two_producers_two_trainers_on_mooncake(make_cluster, mooncake_services, store_id):
    n = 18  # 4 full windows of 4, and 2 over: their keys leave the store too
    cluster = make_cluster(n, store_uri=mooncake_services.uri(store_id))
    cluster.assert_ok(run_all(cluster))
    assert len(assert_lineage(cluster, n)) == 18
    assert_settled(cluster, store_wait_s=20.0)


def test_producer_killed_mid_capture_loses_nothing(make_cluster):
    n = 120
    cluster = make_cluster(n, overrides=["target.capture_batch=2"])
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    cluster.trainers(WORLD)
    # The victim is capturing before its peer joins the group: started together, either one
    # could capture the whole feed before the other published anything (both happened in CI).
    wait_for_samples(cluster, producers={"p0"})
    cluster.start("producer-1", "produce", "--id", "p1")
    assert cluster.procs["producer-0"].poll() is None
    cluster.kill("producer-0")
    codes = cluster.wait("feeder", "producer-1", "trainer-0", "trainer-1")
    cluster.assert_ok(codes)
    assert_lineage(cluster, n)
    assert "p1" in publishers(cluster)[0], "the victim captured the whole feed before its kill"


@pytest.mark.slow
def test_trainer_rank_killed_then_world_resumes_exactly_once(make_cluster):
    n = 200
    cluster = make_cluster(n, overrides=["training.checkpoint_every=5"])
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    cluster.trainers(WORLD)
    cluster.wait_past_checkpoint()
    # mid-run, past the checkpoint; the surviving rank is stuck in a collective: the world restarts
    cluster.kill("trainer-1")
    cluster.kill("trainer-0")
    before = cluster.checkpoint_state()["step"]
    cluster.trainers(WORLD, "--resume")
    cluster.assert_ok(cluster.wait("feeder", "producer-0", "trainer-0", "trainer-1"))
    state = cluster.checkpoint_state()
    assert state["step"] > before
    assert_lineage(cluster, n)


@pytest.mark.slow
def test_broker_killed_mid_run_and_restarted(make_cluster, private_nats_server):
    n = 160
    cluster = make_cluster(n, url=private_nats_server.url)
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    cluster.trainers(WORLD)
    wait_for_samples(cluster, producers={"p0"}, trained=True)  # mid-run: training under way
    private_nats_server.kill()
    for name in ("producer-0", "trainer-0", "trainer-1"):  # every client met the outage, running
        cluster.wait_for_line(name, r"disconnected; reconnecting", timeout_s=60)
    private_nats_server.start()
    cluster.assert_ok(cluster.wait("feeder", "producer-0", "trainer-0", "trainer-1"))
    assert_lineage(cluster, n)


@pytest.mark.slow
def test_poisoned_task_goes_to_dead_and_the_run_finishes(make_cluster, nats_server):
    # One record with a token id beyond the target's vocabulary: its capture always fails.
    n = 13
    cluster = make_cluster(n, data_kw={"lengths": (12, 40), "poison_at": 5})
    cluster.assert_ok(run_all(cluster, producers=1))
    dead = dead_letters(nats_server.url, cluster.cfg.run)
    capture_failed = [d for d in dead if d.reason == "capture_failed"]
    assert len(capture_failed) == 1 and "vocabulary" in capture_failed[0].detail
    lineage = assert_lineage(cluster, n, dead=1)
    assert "t5-e0" not in lineage


@pytest.mark.slow
def test_trainers_wait_on_an_idle_stream_then_stop_at_end_of_data(make_cluster):
    n = 8
    cluster = make_cluster(n)
    cluster.trainers(WORLD)  # nothing fed yet: the trainers wait, they do not exit or spin
    time.sleep(4.0)
    assert all(cluster.procs[f"trainer-{r}"].poll() is None for r in range(WORLD))
    cluster.start("producer-0", "produce", "--id", "p0")
    cluster.start("feeder", "feed")
    t0 = time.monotonic()
    cluster.assert_ok(cluster.wait("feeder", "producer-0", "trainer-0", "trainer-1", timeout=120))
    assert time.monotonic() - t0 < 60
    assert len(assert_lineage(cluster, n)) == 8


@pytest.mark.slow
def test_backpressure_keeps_store_under_budget(make_cluster):
    n = 40
    # Each sample is ~30 KB here; a 200 KB budget holds a handful at a time.
    cluster = make_cluster(n, overrides=["store.budget_bytes=200000"])
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    store = open_store(cluster.cfg.store.uri)
    try:
        deadline = time.monotonic() + 60
        while store.usage().resident_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3.0)  # no trainer yet: the producer must stop at the budget, not fill the store
        assert 0 < store.usage().resident_bytes <= 200000
        assert store.usage().num_samples < n
        cluster.trainers(WORLD)
        cluster.assert_ok(cluster.wait("feeder", "producer-0", "trainer-0", "trainer-1"))
        assert store.usage().peak_bytes <= 200000
    finally:
        store.close()
    assert len(assert_lineage(cluster, n)) == 40


def test_recapture_heals_deleted_features(make_cluster, nats_server):
    n = 12
    cluster = make_cluster(n)
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    store = open_store(cluster.cfg.store.uri)
    try:
        deadline = time.monotonic() + 60
        while store.usage().num_samples < n and time.monotonic() < deadline:
            time.sleep(0.1)
        refs = asyncio.run(_sample_refs(nats_server.url, cluster.cfg.run))
        for ref in refs[:3]:  # the tensors are a cache: lose three samples
            store.release(ref)
        cluster.trainers(WORLD)
        cluster.assert_ok(cluster.wait("feeder", "producer-0", "trainer-0", "trainer-1"))
    finally:
        store.close()
    lineage = assert_lineage(cluster, n)
    assert len(lineage) == 12
    assert {r.sample_id for r in refs[:3]} <= set(lineage)


async def _sample_refs(url: str, run: str):
    async with await connect(BusConfig(), url) as bus:
        return [SampleRef.from_bytes(m.data) async for m in replay(bus, Names(run).samples_stream)]


@pytest.mark.slow
def test_resume_with_a_mismatched_config_is_refused(make_cluster, tmp_path):
    n = 8
    cluster = make_cluster(n)
    cluster.assert_ok(run_all(cluster, producers=1))
    other = Cluster(
        cluster.cfg.model_copy(update={"training": cluster.cfg.training.model_copy(update={"micro_batch": 1})}),
        tmp_path / "other", cluster.url,
    )  # fmt: skip
    other.start("trainer-0", "train", "--resume")
    codes = other.wait("trainer-0", timeout=60)
    assert codes["trainer-0"] != 0
    assert "refusing to resume" in other.log("trainer-0") and "micro_batch" in other.log(
        "trainer-0"
    )


@pytest.mark.slow
def test_trainer_replicas_join_from_the_latest_checkpoint(make_cluster):
    """Elastic scale-out: one trainer rank trains a few steps, then the run goes on with two
    ranks (the new replica joins the "trainers" group) from the latest checkpoint."""
    n = 60
    cluster = make_cluster(n)
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    cluster.start("trainer-0", "train", "training.max_steps=4")  # world 1
    cluster.assert_ok(cluster.wait("feeder", "trainer-0", "producer-0"))
    first = cluster.checkpoint_state()
    assert first["step"] == 4 and len(first["lineage"]) == 4 * MICRO
    cluster.trainers(WORLD, "--resume")
    deadline = time.monotonic() + 60
    while train_complete(cluster.url, cluster.cfg.run) and time.monotonic() < deadline:
        time.sleep(0.1)
    # The resume cleared the train-complete marker: a producer captures again (the first one's
    # features left with it; the trainers' recapture requests bring them back).
    cluster.start("producer-1", "produce", "--id", "p1")
    cluster.assert_ok(cluster.wait("producer-1", "trainer-0", "trainer-1"))
    state = cluster.checkpoint_state()
    assert state["lineage"][: len(first["lineage"])] == first["lineage"]
    assert state["step"] > 4
    # The frozen copy of the target's embedding is rebuilt from the target, never saved; the
    # run's KV points at the latest checkpoint.
    assert "fc.weight" in state["model"] and "embed_tokens.weight" not in state["model"]
    pointer = checkpoint_pointer(cluster.url, cluster.cfg.run)
    assert pointer["step"] == state["step"] and pointer["path"].endswith(f"{state['step']:08d}")
    assert len(assert_lineage(cluster, n)) == n


def test_fsdp_trainers_reduce_gradients_once_per_step(make_cluster):
    """training.wrap=fsdp over 2 gloo ranks with accumulation 2: the run completes exactly once,
    and the profiled step shows one gradient reduce-scatter per rank (not one per micro-step).
    25 samples: the last one is trained in a ragged step in which the other rank holds nothing
    (it runs its forward and backward on a sample broadcast for it, at weight 0)."""
    import json

    n = 25
    cluster = make_cluster(
        n,
        overrides=["training.wrap=fsdp", "training.accumulation=2", "training.micro_batch=1",
                   "training.profile_step=1"],
    )  # fmt: skip
    cluster.assert_ok(run_all(cluster, producers=1))
    state = cluster.checkpoint_state()
    assert len(state["lineage"]) == n and len(set(state["lineage"])) == n
    assert "fc.weight" in state["model"] and state["optimizer"]["state"]
    assert "embed_tokens.weight" not in state["model"]  # frozen: not saved under FSDP either
    assert state["step"] == 7
    assert re.search(r"per rank: \[(1, 0|0, 1)\]", cluster.log("trainer-0"))  # one rank empty
    assert_settled(cluster)
    for rank in range(WORLD):
        report = json.loads(
            (cluster.cfg.resolved_run_dir / "profile" / f"step1-rank{rank}.json").read_text()
        )
        ops = report["collectives"]
        scatter = {k: v for k, v in ops.items() if "reduce_scatter" in k and k.startswith("c10d")}
        assert sum(scatter.values()) == 1, ops
        assert not any(k.startswith("c10d::allreduce") for k in ops if ops[k] > 1), ops

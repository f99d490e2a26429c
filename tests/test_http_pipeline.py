"""W3' end to end: 2 producers serving their features over HTTP, 2 trainer ranks fetching
them; a producer killed while it holds features the trainers still need."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest
from specbus.bus.connection import connect
from specbus.bus.lag import lag
from specbus.bus.replay import replay
from specbus.bus.subjects import Names
from specbus.core.config import BusConfig, StoreConfig
from specbus.core.contracts import SampleRef
from specbus.core.store import open_store

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

pytestmark = pytest.mark.slow  # multi-process runs of 15-40 s each on 2 cores

WINDOW = 4  # 2 ranks x micro-batch 2
HTTP = ["store.http.token=t0ken", "store.http.sweep_every_s=0.5"]


@pytest.fixture
def make_cluster(tmp_path, tiny_target, nats_server, run_id):
    clusters = []

    def make(n: int, *overrides: str) -> Cluster:
        data = write_tokenised_data(tmp_path / "data.jsonl", n, lengths=(30, 40))
        cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data,
                              store_uri="http://127.0.0.1:0", overrides=[*HTTP, *overrides])  # fmt: skip
        cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
        clusters.append(cluster)
        return cluster

    yield make
    for c in clusters:
        c.stop()


def served_url(cluster: Cluster, name: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"serving features at (\S+)", cluster.log(name))
        if m:
            return m.group(1)
        assert cluster.procs[name].poll() is None, cluster.log(name)[-2000:]
        time.sleep(0.05)
    raise AssertionError(f"{name} never served")


def refs_of(url: str, run: str) -> tuple[list[tuple[int, SampleRef]], int]:
    """Every (seq, ref) of the run's SAMPLES, and the last sequence delivered to a trainer."""

    async def go():
        async with await connect(BusConfig(), url) as bus:
            out = [(m.seq, SampleRef.from_bytes(m.data))
                   async for m in replay(bus, Names(run).samples_stream)]  # fmt: skip
            trainers = await lag(bus, run)
            return out, trainers.last_seq - trainers.pending

    return asyncio.run(go())


def samples_from(url: str, run: str, store_uri: str) -> int:
    """How many refs of the run's SAMPLES name the store at `store_uri`."""

    async def go():
        async with await connect(BusConfig(), url) as bus:
            return sum([1 async for m in replay(bus, Names(run).samples_stream)
                        if SampleRef.from_bytes(m.data).store_uri == store_uri])  # fmt: skip

    return asyncio.run(go())


def assert_exactly_once(cluster: Cluster, n: int) -> list[str]:
    lineage = cluster.checkpoint_state()["lineage"]
    assert len(lineage) == len(set(lineage)), "a sample was trained twice"
    assert set(lineage) <= {f"t{i}-e0" for i in range(n)}
    assert len(lineage) == n  # a remainder over the step size too (a ragged last step)
    return lineage


def test_two_producers_two_trainers_over_http(make_cluster, nats_server):
    """Features only travel over HTTP, with a bearer token; each producer's residency stays
    within its budget (backpressure) while the trainers drain it. 62 tasks: the last 2 are
    trained in a ragged last step."""
    n, budget = 62, 200_000  # ~21 KB per sample: a producer holds at most ~9 at a time
    cluster = make_cluster(n, f"store.budget_bytes={budget}")
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    cluster.start("producer-1", "produce", "--id", "p1")
    urls = [served_url(cluster, f"producer-{i}") for i in range(2)]
    clients = [open_store(StoreConfig(uri=u, http={"token": "t0ken"})) for u in urls]
    cluster.trainers(2)
    peak = 0
    while cluster.procs["trainer-0"].poll() is None:
        peak = max([peak, *(c.usage().resident_bytes for c in clients)])
        time.sleep(0.05)
    cluster.assert_ok(cluster.wait("feeder", "producer-0", "producer-1", "trainer-0", "trainer-1"))
    assert 0 < peak <= budget
    refs = [ref for _, ref in refs_of(nats_server.url, cluster.cfg.run)[0]]
    assert {r.store_uri for r in refs} == set(urls)  # both producers served
    assert len(assert_exactly_once(cluster, n)) == n


def test_producer_killed_holding_features_is_recaptured_exactly_once(make_cluster, nats_server):
    n = 120
    # a 400 KB budget: each producer holds ~19 samples at a time, so both capture
    cluster = make_cluster(n, "training.checkpoint_every=2", "store.budget_bytes=400000")
    cluster.start("feeder", "feed")
    cluster.start("producer-0", "produce", "--id", "p0")
    victim = served_url(cluster, "producer-0")
    # The trainers start once p0 has captured two windows (its budget holds ~19 samples):
    # started at once they can keep up with the producers on a busy box, leave nothing
    # undelivered past the fetch margin below, and finish before the fault can land. p1
    # joins after that: started with p0, it could lease most tasks while it waits for room
    # in its own full store, and p0 then captured nothing before training (CI, and 3 of 5
    # runs here).
    deadline = time.monotonic() + 120
    while samples_from(nats_server.url, cluster.cfg.run, victim) < 2 * WINDOW:
        assert time.monotonic() < deadline, "producer-0 captured too little before training"
        time.sleep(0.1)
    cluster.start("producer-1", "produce", "--id", "p1")
    cluster.trainers(2)
    ckpt = cluster.cfg.resolved_run_dir / "checkpoints" / "latest"
    trainers = [cluster.procs[f"trainer-{r}"].pid for r in range(2)]
    held = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # training runs, and p0 serves refs not yet trained
        assert cluster.procs["trainer-0"].poll() is None, "training ended before the fault"
        if not ckpt.exists():
            time.sleep(0.05)
            continue
        # Frozen trainers fetch nothing: a ref not delivered to them (with a margin for pull
        # requests the server may still answer) is one whose features they have not read.
        for pid in trainers:
            os.kill(pid, signal.SIGSTOP)
        try:
            # While they are frozen p0 goes on capturing into its store; wait for it a little
            # (under the 4 s ack wait) rather than let the trainers run on and maybe finish
            # the run before a held ref is seen (CI once: "training ended before the fault").
            frozen_until = time.monotonic() + 2.5
            while True:
                refs, delivered = refs_of(nats_server.url, cluster.cfg.run)
                held = [r for seq, r in refs
                        if seq > delivered + 4 * WINDOW and r.store_uri == victim]  # fmt: skip
                if held or time.monotonic() > frozen_until:
                    break
                time.sleep(0.1)
            if held:
                cluster.kill("producer-0")
        finally:
            for pid in trainers:
                os.kill(pid, signal.SIGCONT)
        if held:
            break
        time.sleep(0.05)
    assert held, "producer-0 held no undelivered features while training ran"
    assert cluster.procs["trainer-0"].poll() is None  # the fault landed mid-run
    cluster.assert_ok(cluster.wait("feeder", "producer-1", "trainer-0", "trainer-1"))
    logs = cluster.log("trainer-0") + cluster.log("trainer-1")
    assert "recapture of" in logs and "cannot be reached" in logs
    lineage = assert_exactly_once(cluster, n)
    assert {r.sample_id for r in held} <= set(lineage)  # recaptured and trained
    recaptured = [r for _, r in refs_of(nats_server.url, cluster.cfg.run)[0] if r.generation > 0]
    assert recaptured and {r.store_uri for r in recaptured} != {victim}

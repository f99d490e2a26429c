"""Driven capture through a running SGLang server (`target.engine: sglang_server`), end to end.

Real: the broker (tasks on TASKS, refs on SAMPLES, the producers' group), the shm store, the
intake (uvicorn, its driven routes), the `DrivenWorker` and `SGLangServerEngine` (real HTTP to
the server and the intake), and in the server process (`tests/sglang_server.py`, a real HTTP
server) SGLang 0.5.23's own request parsing (`GenerateReqInput`, `SamplingParams`), `Req`
made by the hooked constructor, the layer's hooks (installed by `specbus sglang apply`, loaded
by SGLang's plugin loader) and the real `CaptureSink`. Not real: the GPU forward (rows are
`rows_at` of each position, so every stored row is checked at its place).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from specbus.bus.connection import connect
from specbus.bus.run import declare
from specbus.bus.subjects import PRODUCERS
from specbus.core.config import TargetConfig
from specbus.core.contracts import PromptTask
from specbus.core.models.target import load_target_info
from specbus.core.strategies.base import build_strategy
from specbus.ops import sglang_layer as layer
from specbus.ops.services.common import free_port
from specbus.producers.driven import DrivenWorker
from specbus.producers.engines.sglang_server import (
    LayerNotApplied,
    ServerUnreachable,
    SGLangServerEngine,
)
from specbus.producers.live.driven import OUTCOMES_PATH
from specbus.producers.live.wire import driven_rid

from tests.sglang_driver import rows_at
from tests.test_live_intake import lease_refs
from tests.test_sglang_layer import TOKEN, intake  # noqa: F401 - the intake fixture

ROOT = Path(__file__).resolve().parent.parent


class Server:
    """`tests/sglang_server.py` in a subprocess on a fixed loopback port (restartable)."""

    def __init__(self, env: dict, opts: dict, log: Path):
        self.env, self.opts, self.log = env, opts, log
        self.url = f"http://127.0.0.1:{opts['port']}"
        self.proc = None

    def start(self) -> Server:
        with open(self.log, "a") as log:  # a pipe nobody reads would block the server
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_server",
                                          json.dumps(self.opts)], cwd=ROOT, env=self.env,
                                         stdout=log, stderr=log)  # fmt: skip
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("the stand-in SGLang server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def served(sglang_site, sglang_env, intake, chat_target, tmp_path):  # noqa: F811
    """(the intake fixture, a factory of servers with the layer applied and capture on)."""
    cfg, store, cap, thread = intake
    servers: list[Server] = []

    def make(port: int | None = None, delay_s: float = 0.0, capture: bool = True) -> Server:
        env = dict(sglang_env)
        if capture:
            env.update(SPECBUS_CAPTURE_INTAKE_URL=thread.url, SPECBUS_INTAKE_TOKEN=TOKEN,
                       SPECBUS_CAPTURE_SAMPLE_RATE="0")  # driven ids only  # fmt: skip
        opts = {"model": str(chat_target), "layer_ids": list(cap.aux_layers),
                "hidden": cap.hidden_size, "port": port or free_port(), "delay_s": delay_s}  # fmt: skip
        servers.append(Server(env, opts, tmp_path / f"server-{len(servers)}.log"))
        return servers[-1]

    layer.apply(sglang_site)
    try:
        yield intake, make
    finally:
        for s in servers:
            s.kill()
        layer.revert(sglang_site)


def tasks_of(run_id: str, n: int) -> list[PromptTask]:
    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        length = 6 + i % 9
        ids = torch.randint(4, 100, (length,), generator=g).tolist()
        mask = [0] * 3 + [1] * (length - 5) + [0, 1]  # not a prompt/answer split
        out.append(PromptTask(task_id=f"drv-{i}", run_id=run_id, input_ids=tuple(ids),
                               loss_mask=tuple(mask)))  # fmt: skip
    return out


async def drive(cfg, bus_url, engine, store, tasks, *, on_progress=None, batch=2):
    """Publish `tasks`, run a `DrivenWorker` until they are all acked (or it raises); returns
    (the worker, {task id: TASKS seq}, the producers' ack floor)."""
    async with await connect(cfg.bus, bus_url, name="test-driven") as bus:
        run = await declare(bus, cfg.bus, cfg.run)
        seqs = {}
        for t in tasks:
            seqs[t.task_id] = (await run.publisher.publish(run.names.tasks, t)).seq
        group = await run.join(PRODUCERS)
        info = load_target_info(engine.cfg.model)
        contract = build_strategy(cfg.strategy, info).feature_contract(info)
        worker = DrivenWorker(run, group, engine, store, contract, capture_batch=batch)
        job = asyncio.create_task(worker.run())
        try:
            while worker.stats.tasks + worker.stats.dead_letters < len(tasks) and not job.done():
                await asyncio.sleep(0.05)
                if on_progress is not None:
                    await asyncio.to_thread(on_progress, worker)
            worker.stop()
            await job
        finally:
            floor = await run.ack_floor(PRODUCERS)
            await group.close()
    return worker, seqs, floor


def ack_floor(cfg, bus_url) -> int:
    async def go():
        async with await connect(cfg.bus, bus_url, name="test-floor") as bus:
            return await (await declare(bus, cfg.bus, cfg.run)).ack_floor(PRODUCERS)

    return asyncio.run(go())


def engine_for(cfg, thread, url: str, **kw) -> SGLangServerEngine:
    target = TargetConfig(engine="sglang_server", model=str(cfg.target.model), server_url=url,
                          **{"server_give_up_s": 60.0, "capture_wait_s": 5.0, **kw})  # fmt: skip
    return SGLangServerEngine(target, intake_url=thread.url, token=TOKEN)


def check_refs(nats_url, cfg, store, cap, tasks, seqs) -> None:
    refs = lease_refs(nats_url, cfg.run, 2 * len(tasks) + 2)
    ids = [r.sample_id for r in refs]
    assert sorted(ids) == sorted(f"{t.task_id}-e0" for t in tasks), ids  # each exactly once
    by_id = {t.task_id: t for t in tasks}
    width = len(cap.aux_layers) * cap.hidden_size
    for ref in refs:
        task = by_id[ref.task_id]
        assert (ref.task_seq, ref.epoch, ref.generation) == (seqs[task.task_id], 0, 0)
        got = store.get(ref)
        src = {d.source: got[d.name] for d in cap.features}
        pos = list(range(len(task.input_ids)))
        assert src["input_ids"].tolist() == list(task.input_ids)
        assert src["loss_mask"].tolist() == list(task.loss_mask)
        torch.testing.assert_close(src["aux"], rows_at(pos, list(task.input_ids), width),
                                   rtol=0, atol=0)  # fmt: skip
        if "final" in src:
            torch.testing.assert_close(src["final"], -rows_at(pos, list(task.input_ids),
                                       cap.hidden_size), rtol=0, atol=0)  # fmt: skip


def test_driven_tasks_arrive_once_with_their_rows(served, nats_server):
    (cfg, store, cap, thread), make = served
    server = make().start()
    tasks = tasks_of(cfg.run, 6)
    engine = engine_for(cfg, thread, server.url)
    worker, seqs, floor = asyncio.run(drive(cfg, nats_server.url, engine, store, tasks))
    assert worker.stats.tasks == 6 and floor == max(seqs.values())
    # a producer killed after the publish, before its ack: the redelivered task is not driven again
    assert engine.drive(seqs["drv-0"], tasks[0])["status"] == "accepted"
    # a server retrying a request after its capture was published: the broker keeps one ref
    rid = driven_rid(seqs["drv-1"], "drv-1-e0")
    engine.generate(rid, list(tasks[1].input_ids))
    answer = wait_for(lambda: thread.client().get(f"{OUTCOMES_PATH}/{rid}").json(), "duplicate")
    assert answer["status"] == "duplicate", answer
    engine.close()
    check_refs(nats_server.url, cfg, store, cap, tasks, seqs)


def test_a_recapture_task_is_driven_at_its_generation(served, nats_server):
    """Tensors are a cache: when a trainer finds a driven ref's tensors gone it republishes the
    task at the next generation (`BusSource._request_recapture`). The driven producer captures
    it through the server like any task; the sink stores it under that generation (keys apart
    from the lost ones) and the intake publishes the ref at it, checked against the task."""
    (cfg, store, cap, thread), make = served
    server = make().start()
    first = tasks_of(cfg.run, 2)
    engine = engine_for(cfg, thread, server.url)
    _, seqs, _ = asyncio.run(drive(cfg, nats_server.url, engine, store, first))
    (lost,) = [r for r in lease_refs(nats_server.url, cfg.run, 4) if r.task_id == "drv-0"]
    store.release(lost)  # as after the ack of a trained ref, before a resume replays it
    again = first[0].model_copy(update={"generation": 1, "source": "recapture"})
    worker, reseqs, _ = asyncio.run(drive(cfg, nats_server.url, engine, store, [again]))
    engine.close()
    assert worker.stats.tasks == 1 and worker.stats.dead_letters == 0
    refs = {(r.sample_id, r.generation): r for r in lease_refs(nats_server.url, cfg.run, 6)}
    assert sorted(refs) == [("drv-0-e0", 0), ("drv-0-e0", 1), ("drv-1-e0", 0)]
    ref = refs["drv-0-e0", 1]
    assert ref.task_seq == reseqs["drv-0"] != seqs["drv-0"]
    assert all("/g1/" in spec.key for spec in ref.features.values())
    got = store.get(ref)
    src = {d.source: got[d.name] for d in cap.features}
    ids = list(again.input_ids)
    assert src["input_ids"].tolist() == ids and src["loss_mask"].tolist() == list(again.loss_mask)
    width = len(cap.aux_layers) * cap.hidden_size
    torch.testing.assert_close(src["aux"], rows_at(list(range(len(ids))), ids, width),
                               rtol=0, atol=0)  # fmt: skip


def wait_for(get, status: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (got := get()).get("status") != status and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_a_server_killed_mid_run_loses_and_duplicates_nothing(served, nats_server):
    (cfg, store, cap, thread), make = served
    server = make(delay_s=0.25).start()
    tasks = tasks_of(cfg.run, 12)
    # the stand-in server's restart (SGLang's request parsing imported again) took over 60 s on a
    # loaded 2-core machine: the engine must outwait the restart, not the test's patience
    engine = engine_for(cfg, thread, server.url, server_give_up_s=300.0)
    killed = {}

    def kill_once(worker):
        if not killed and worker.stats.tasks >= 3:
            killed["done_at_kill"] = worker.stats.tasks
            server.kill()
            deadline = time.monotonic() + 30
            while engine.retries == 0:  # the outage landed: a prefill found the server gone
                assert time.monotonic() < deadline, "no prefill met the killed server"
                time.sleep(0.05)
            server.start()  # the same port: the producer's retries reach it

    worker, seqs, _ = asyncio.run(
        drive(cfg, nats_server.url, engine, store, tasks, on_progress=kill_once)
    )
    engine.close()
    assert 3 <= killed["done_at_kill"] < 12  # the kill landed mid-run
    assert worker.stats.tasks == 12
    check_refs(nats_server.url, cfg, store, cap, tasks, seqs)


def test_unreachable_server_is_named_and_nothing_acked(served, nats_server):
    (cfg, store, cap, thread), _ = served
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    engine = engine_for(cfg, thread, url, server_give_up_s=1.0)
    with pytest.raises(ServerUnreachable, match=f"SGLang server {url} unreachable"):
        asyncio.run(drive(cfg, nats_server.url, engine, store, tasks_of(cfg.run, 2)))
    engine.close()
    assert ack_floor(cfg, nats_server.url) == 0  # nothing acked: the tasks stay for a producer
    assert lease_refs(nats_server.url, cfg.run, 2) == []


def test_a_server_without_the_layer_is_named(served, nats_server):
    (cfg, store, cap, thread), make = served
    server = make(capture=False).start()  # plugin present but capture off: nothing captured
    engine = engine_for(cfg, thread, server.url, capture_wait_s=1.5)
    with pytest.raises(LayerNotApplied, match=r"never heard of its capture.*specbus sglang apply"):
        asyncio.run(drive(cfg, nats_server.url, engine, store, tasks_of(cfg.run, 1), batch=1))
    engine.close()
    assert ack_floor(cfg, nats_server.url) == 0  # nothing acked: the tasks stay for a producer
    assert lease_refs(nats_server.url, cfg.run, 2) == []


def producers_consumer(cfg, bus_url) -> tuple[int, int, int]:
    """(redelivered, ack-pending, pending) of the run's producers' group."""

    async def go():
        async with await connect(cfg.bus, bus_url, name="test-consumer") as bus:
            run = await declare(bus, cfg.bus, cfg.run)
            info = await bus.js.consumer_info(run.names.tasks_stream, PRODUCERS)
            return info.num_redelivered, info.num_ack_pending, info.num_pending

    return asyncio.run(go())


@pytest.mark.slow
def test_a_shed_capture_waits_leased_and_spends_no_delivery(served, nats_server):
    """Issue 33: the intake sheds (429) while the store is at its watermark. The driven
    producer keeps the task leased and drives it again once there is room; before, each shed
    was a nak, and a task shed `max_deliver` times was dead-lettered and never trained."""
    from specbus.core.store import open_store

    (cfg, store, cap, thread), make = served
    server = make().start()
    tasks = tasks_of(cfg.run, 2)
    engine = engine_for(cfg, thread, server.url)
    # 95 % of the budget: the intake sheds every capture (its watermark is 90 %). The
    # producer paces on a view of the store with a larger budget, as one whose poll raced the
    # intake's would, so it leases the tasks and meets the shed.
    ballast = store.put("ballast", {"x": torch.zeros(int(0.95 * cfg.store.budget_bytes),
                                                     dtype=torch.uint8)})  # fmt: skip
    # the intake reads the store's usage every 0.1 s: wait until it has seen the ballast, or
    # a capture that beat that poll is accepted and nothing is shed (CI, 2026-12-03)
    deadline = time.monotonic() + 30
    while thread.intake.shed.resident_bytes < ballast["x"].nbytes:
        assert time.monotonic() < deadline, "the intake never read the ballast's residency"
        time.sleep(0.02)
    view = open_store(store.uri, budget_bytes=1 << 40)
    t0: list[float] = []

    def make_room(worker):  # after 5 s of sheds (25 nak delays, max_deliver 3): room
        t0.append(time.monotonic())
        if ballast and t0[-1] - t0[0] > 5.0:
            store.release(ballast)
            ballast.clear()
        # a task the broker dead-lettered is never acked: fail rather than wait forever
        assert t0[-1] - t0[0] < 120, f"{worker.stats.tasks} of 2 tasks acked in 120 s"

    try:
        worker, seqs, floor = asyncio.run(
            drive(cfg, nats_server.url, engine, view, tasks, on_progress=make_room)
        )
    finally:
        view.close()
    engine.close()
    assert not ballast  # the room came mid-run, after the sheds
    assert (worker.stats.tasks, worker.stats.dead_letters) == (2, 0)
    assert floor == max(seqs.values())
    assert producers_consumer(cfg, nats_server.url) == (0, 0, 0)  # one delivery each
    assert worker.stats.store_waits >= 1 and worker.stats.store_wait_s > 4.0  # it was shed
    check_refs(nats_server.url, cfg, store, cap, tasks, seqs)

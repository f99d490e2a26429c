"""Live mode end to end: real processes (`specbus intake`, `specbus serve`, `specbus train`), the
real `openai` client as users, a real broker and a real shm store, faults in the middle.

Every fault test checks that the fault landed mid-run (traffic still flowing, training under
way), waits for readiness instead of sleeping, and checks what users saw (no error) and
what the store and the streams hold afterwards.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest
from specbus.bus.connection import connect
from specbus.bus.lag import lag
from specbus.bus.replay import replay
from specbus.bus.subjects import Names
from specbus.core.config import BusConfig
from specbus.core.contracts import SampleRef
from specbus.core.errors import BusError
from specbus.core.store import open_store
from specbus.producers.live.wire import capture_decision, sample_id_of

from tests.fixtures.live import LiveRun, live_config, wait_until, write_chats

pytestmark = pytest.mark.slow  # multi-process runs of 15-40 s each on 2 cores

WINDOW = 4  # 2 ranks x micro-batch 2


@pytest.fixture
def make_live(tmp_path, chat_target, nats_server, run_id):
    runs = []

    def make(overrides=(), strategy: str = "eagle3"):
        chats = write_chats(tmp_path / "chats.jsonl", n=60)
        cfg = live_config(run_id, tmp_path / "run", chat_target, chats, store_uri=f"shm://{run_id}",
                          overrides=overrides, strategy=strategy)  # fmt: skip
        run = LiveRun(cfg, tmp_path / "procs", nats_server.url)
        run.chats = chats
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.stop()


def refs_of(url: str, run: str) -> list[SampleRef]:
    async def go():
        async with await connect(BusConfig(), url) as bus:
            return [SampleRef.from_bytes(m.data)
                    async for m in replay(bus, Names(run).samples_stream, 1)]  # fmt: skip

    return asyncio.run(go())


def trainers_lag(url: str, run: str) -> int | None:
    """Refs not yet acked by the trainers (None while a resume repositions their consumer)."""

    async def go():
        async with await connect(BusConfig(), url) as bus:
            try:
                return (await lag(bus, run)).messages
            except BusError:
                return None

    return asyncio.run(go())


def dead_letters_of(run: LiveRun):
    from specbus.bus.dead import list_dead

    async def go():
        async with await connect(BusConfig(), run.url) as bus:
            return await list_dead(bus, run.cfg.run)

    return asyncio.run(go())


def prompts_of(run: LiveRun):
    from specbus.ops.traffic import load_prompts

    return load_prompts(str(run.chats))


async def send(url: str, prompts, ids, max_tokens_of, concurrency: int = 4):
    """Requests with the given ids (half streaming) through AsyncOpenAI: {id: (prompt tokens,
    completion tokens)}, and the errors users saw."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="user", max_retries=0)
    slots = asyncio.Semaphore(concurrency)
    usage, errors = {}, []

    async def one(i: int, rid: str) -> None:
        async with slots:
            args = dict(model="m", messages=prompts[i % len(prompts)], max_tokens=max_tokens_of(i),
                        temperature=0, extra_headers={"X-Request-Id": rid})  # fmt: skip
            try:
                if i % 2:
                    stream = await client.chat.completions.create(
                        **args, stream=True, stream_options={"include_usage": True}
                    )
                    async for chunk in stream:
                        if chunk.usage is not None:
                            usage[rid] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                else:
                    r = await client.chat.completions.create(**args)
                    usage[rid] = (r.usage.prompt_tokens, r.usage.completion_tokens)
            except Exception as e:  # noqa: BLE001 - what a user would see
                errors.append(f"{rid}: {type(e).__name__}: {e}")

    await asyncio.gather(*(one(i, rid) for i, rid in enumerate(ids)))
    await client.close()
    return usage, errors


def expected_captures(usage, rate: float, min_tokens: int, max_rows: int) -> set[str]:
    """The requests the sink must capture: sampled by their id, with enough generated rows."""
    return {sample_id_of(rid) for rid, (p, g) in usage.items()
            if capture_decision(rid, rate) and min(p + g - 1, max_rows) - p >= min_tokens}  # fmt: skip


class Background:
    """A coroutine run to completion on a thread (traffic while the test fires a fault)."""

    def __init__(self, coro):
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(coro,), daemon=True)
        self.thread.start()

    def _run(self, coro) -> None:
        try:
            self.result = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self, timeout_s: float):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "traffic did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def trained_step(run: LiveRun) -> int:
    """The last step rank 0 logged (a row per step with `training.log_every=1`; a row is
    written after its step's ack, before its checkpoint)."""
    from specbus.ops.observe import METRICS_FILE, read_metrics

    rows = read_metrics(run.cfg.resolved_run_dir / "logs" / METRICS_FILE)
    return max((int(r["step"]) for r in rows if "step" in r and "final" not in r), default=0)


def checkpoint_step(run: LiveRun) -> int:
    """The step of the latest checkpoint (0: none yet)."""
    latest = run.cfg.resolved_run_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("-")[1]) if latest.exists() else 0


def test_live_traffic_is_trained_exactly_once_through_a_trainer_kill(make_live):
    """The world is killed mid-traffic one step after a checkpoint: that step's refs were
    trained and acked, and the resumed world replays them from the checkpoint's cursor. A live
    capture cannot be captured again, so their tensors must still be in the store: the live
    source holds a trained ref's tensors until a checkpoint covers it (docs/live.md, Failures;
    freed at the ack instead, the resumed world dead-letters them `lost`)."""
    rate, every = 0.7, 3
    run = make_live([f"live.sample_rate={rate}", f"training.checkpoint_every={every}",
                     "training.log_every=1"])  # fmt: skip
    run.start_intake(wait=False)
    run.start_serve(wait=False)
    run.trainers(2)
    run.wait_intake()
    url = run.wait_serve()
    prompts = prompts_of(run)
    tokens = [1, 2, 3, 10, 14, 16]  # 1-2 generated tokens: too short to capture

    ids1 = [f"a-{i}" for i in range(36)]
    usage, errors = asyncio.run(send(url, prompts, ids1, lambda i: tokens[i % 6]))
    assert not errors
    wait_until(lambda: checkpoint_step(run) >= every, 180, "a first checkpoint",
               run.procs["trainer-0"], run.log_path("trainer-0"))  # fmt: skip

    ids2 = [f"b-{i}" for i in range(36)]
    accepted = run.wait_sink_idle()["counts"]["accepted"]
    phase2 = Background(send(url, prompts, ids2, lambda i: tokens[i % 6], concurrency=2))

    def one_step_past_a_checkpoint() -> bool:
        # two steps (8 refs, two lockstep rounds) stand between this and the next checkpoint:
        # the kill cannot miss a step trained after the last one
        assert not phase2.done(), "the traffic ended before the kill"
        flowing = run.sink()["counts"]["accepted"] >= accepted + 3
        return flowing and trained_step(run) == checkpoint_step(run) + 1

    wait_until(one_step_past_a_checkpoint, 180, "phase-2 captures to flow, one step past a "
               "checkpoint", run.procs["trainer-0"], run.log_path("trainer-0"))  # fmt: skip
    # rank 0 first: nobody writes a checkpoint after this (a rank 0 that outlives its peer
    # saves the last step alone), so the refs trained after the checkpoint stay uncovered
    run.kill("trainer-0")
    run.kill("trainer-1")
    before, killed_at = run.checkpoint_state()["step"], trained_step(run)
    assert before >= every and killed_at > before, (before, killed_at)
    run.trainers(2, "--resume")
    usage2, errors2 = phase2.join(300)
    assert not errors2
    usage.update(usage2)
    run.wait_sink_idle()

    refs = refs_of(run.url, run.cfg.run)
    published = [r.sample_id for r in refs]
    assert len(published) == len(set(published)), "a capture was published twice"
    live = run.cfg.live
    assert set(published) == expected_captures(usage, rate, live.min_num_tokens, 128)
    assert all(r.task_id.startswith("live:") for r in refs)

    # the lag means something only once the resumed rank 0 has rewound the consumer to its
    # checkpoint (before, it is the killed run's: refs it acked after that checkpoint count
    # as consumed, and a stop then would leave them for the next resume)
    wait_until(lambda: "replaying trainers from stream seq" in run.log("trainer-0"), 180,
               "the resumed trainers to rewind to the checkpoint", run.procs["trainer-0"],
               run.log_path("trainer-0"))  # fmt: skip
    wait_until(lambda: (trainers_lag(run.url, run.cfg.run) or WINDOW) < WINDOW, 240,
               "the trainers to train every full window", run.procs["trainer-0"],
               run.log_path("trainer-0"))  # fmt: skip
    for name in ("trainer-0", "trainer-1"):  # the end of a live run: a stop signal (as torchrun)
        run.procs[name].send_signal(signal.SIGTERM)
    run.assert_ok(run.wait("trainer-0", "trainer-1", timeout=120))
    state = run.checkpoint_state()
    lineage = state["lineage"]
    assert state["step"] > killed_at
    assert len(lineage) == len(set(lineage)), "a sample was trained twice"
    # exactly once: every published ref is in the lineage, but the last partial window's
    dead = [(d.reason, SampleRef.from_bytes(d.data).sample_id if d.data else None)
            for d in dead_letters_of(run)]  # fmt: skip
    assert dead == [], f"dead letters (a trained ref's tensors freed before a checkpoint?): {dead}"
    untrained = set(published) - set(lineage)
    assert set(lineage) <= set(published) and len(untrained) < WINDOW, untrained
    assert len(lineage) == state["step"] * WINDOW
    log0 = run.log("trainer-0")
    assert f"rank 0 resumed at step {before}" in log0 and "training stopped" in log0
    # nothing trained is left in the store; the partial window's tensors wait for a resume
    store = open_store(run.cfg.store)
    try:
        for ref in refs:
            if ref.sample_id in untrained:
                store.adopt(ref)
        assert store.usage().resident_bytes == sum(
            r.nbytes for r in refs if r.sample_id in untrained
        )
    finally:
        store.close()


def test_overload_sheds_keeps_the_store_bounded_and_users_see_no_error(make_live):
    from specbus.ops.traffic import run_traffic

    # no trainer consumes: the lag only grows, past 4 refs every capture is shed
    run = make_live(["live.max_lag_refs=4", "live.max_new_tokens=12"])
    run.start_intake(wait=False)
    run.start_serve(wait=False)
    run.wait_intake()
    url = run.wait_serve()
    report = asyncio.run(run_traffic(url + "/v1", prompts_of(run), qps=20, concurrency=4,
                                     requests=24, max_tokens=12))  # fmt: skip
    assert report.errors == {} and report.ok == 24
    sink = run.wait_sink_idle()["counts"]
    intake = run.intake_metrics()
    shed = intake.get(("429", "trainers_lag"), 0)
    assert intake.get(("200", "accepted")) == 4 == sink["accepted"]
    assert shed >= 10 and sink["shed"] == shed and sink["keys_removed"] == shed
    refs = refs_of(run.url, run.cfg.run)
    store = open_store(run.cfg.store)
    try:
        usage = store.usage()
        assert usage.num_samples == 4 and usage.resident_bytes == sum(r.nbytes for r in refs)
        assert usage.peak_bytes <= run.cfg.store.budget_bytes
        for ref in refs:
            store.adopt(ref)
    finally:
        store.close()


def test_intake_killed_mid_traffic_then_restarted(make_live):
    from specbus.ops.traffic import run_traffic

    run = make_live(["live.max_new_tokens=12"])
    run.start_intake(wait=False)
    run.start_serve(wait=False)
    run.wait_intake()
    url = run.wait_serve()
    stop = threading.Event()
    traffic = Background(run_traffic(url + "/v1", prompts_of(run), qps=4, concurrency=2, loop=True,
                                     stop=stop, max_tokens=12, request_id_prefix="k-"))  # fmt: skip
    wait_until(lambda: run.sink()["counts"].get("accepted", 0) >= 5, 60, "captures to flow")
    assert not traffic.done()
    run.kill("intake")
    wait_until(lambda: run.sink()["counts"].get("unreachable", 0) >= 3, 60,
               "captures during the outage")  # fmt: skip
    assert not traffic.done()
    accepted_before = run.sink()["counts"]["accepted"]
    run.start_intake()  # same port, same token (<run_dir>/live/intake.json)
    wait_until(lambda: run.sink()["counts"]["accepted"] > accepted_before + 2, 120,
               "captures accepted by the restarted intake")  # fmt: skip
    stop.set()
    report = traffic.join(300)
    assert report.errors == {} and report.ok == report.sent > 10  # users saw nothing
    counts = run.wait_sink_idle()["counts"]
    assert counts["keys_removed"] == counts["unreachable"] + counts.get("unavailable", 0)

    refs = refs_of(run.url, run.cfg.run)
    published = [r.sample_id for r in refs]
    assert len(published) == len(set(published)), "a capture was published twice"
    store = open_store(run.cfg.store)
    try:
        present = []
        for ref in refs:
            try:
                store.adopt(ref)
                present.append(ref)
            except Exception:  # noqa: BLE001 - a kill between publish and answer (see docs)
                pass
        # every stored byte belongs to a published ref: dropped captures left no keys
        assert store.usage().resident_bytes == sum(r.nbytes for r in present)
        assert len(refs) - len(present) <= 1
    finally:
        store.close()


@pytest.mark.parametrize("name", ["dflash", "domino", "dspark"])
def test_every_dflash_family_strategy_trains_from_live_traffic(make_live, name):
    """Issue 15: every mode trains every strategy. The live wiring has no strategy of its own
    (the handshake declares the strategy's features, the server captures the aux layers and
    the final norm's output as declared); eagle3 is the test above."""
    run = make_live(["training.max_steps=2", "training.total_steps=4", "training.log_every=1",
                     "training.checkpoint_every=1", "live.max_new_tokens=16"], strategy=name)  # fmt: skip
    run.start_intake(wait=False)
    run.start_serve(wait=False)
    run.trainers(1)
    run.wait_intake()
    url = run.wait_serve()
    ids = [f"{name}-{i}" for i in range(8)]
    usage, errors = asyncio.run(send(url, prompts_of(run), ids, lambda i: 16, concurrency=2))
    assert not errors
    run.assert_ok(run.wait("trainer-0", timeout=300))  # max_steps ends a live run
    refs = refs_of(run.url, run.cfg.run)
    assert refs and {r.strategy for r in refs} == {name}
    assert set(refs[0].features) == set(run.endpoint_features())
    state = run.checkpoint_state()
    assert state["step"] == 2 and len(state["lineage"]) == 4  # 1 rank x micro-batch 2 x 2 steps
    assert set(state["lineage"]) <= {r.sample_id for r in refs}
    rows = state["history"]
    assert len(rows) == 2 and all(row["loss"] > 0 for row in rows)
    if name == "domino":  # the step context reached the loss: lambda decays from 1
        assert rows[0]["lambda_base"] == 1.0 and rows[-1]["lambda_base"] < 1.0

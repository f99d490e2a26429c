"""A live run holds a trained ref's tensors until a checkpoint covers it (docs/live.md, Failures).

A live capture cannot be captured again, so the world a trainer kill leaves behind must find
the tensors of every ref it replays from its checkpoint's cursor: the killed world's refs
trained after its last checkpoint were acked, and must not have been released. Driven by hand
against a real nats-server and a real `mem://` store: trainer ranks' loaders over a
`LiveSource`, and a `Trainer` with a real checkpoint manager (on a toy strategy: what is
tested is when tensors are freed, not what is learnt).
"""

from __future__ import annotations

import time

import pytest
import torch
from specbus.bus.connection import connect
from specbus.bus.publisher import Publisher
from specbus.bus.replay import reposition
from specbus.bus.run import declare
from specbus.bus.subjects import TRAINERS, Names
from specbus.consumers.bus_source import LiveSource
from specbus.consumers.checkpoint import CheckpointManager
from specbus.consumers.ledger import Ledger
from specbus.consumers.loader import Loader
from specbus.consumers.loop_thread import LoopThread
from specbus.consumers.trainer import Trainer, TrainerHooks, TrainParts
from specbus.core.config import TrainingConfig
from specbus.core.contracts import Provenance, SampleRef
from specbus.core.errors import FeatureMissing
from specbus.core.store import open_store
from specbus.core.strategies.base import TrainBatch

FEATURES = ("hidden_states", "input_ids")


def publish(url: str, cfg, run: str, store, n: int) -> list[SampleRef]:
    """`n` live refs (task_seq 0: no task to capture again), their tensors put into `store`."""
    loop = LoopThread(f"pub-{run}")
    try:
        bus = loop.call(connect(cfg, url, name=f"pub-{run}"))
        loop.call(declare(bus, cfg, run))
        refs = []
        for i in range(n):
            tensors = {"hidden_states": torch.full((4,), float(i)),
                       "input_ids": torch.arange(4) + i}  # fmt: skip
            specs = store.put(f"live-{i}", tensors)
            refs.append(SampleRef(
                sample_id=f"live-{i}", run_id=run, task_id=f"live:{i}", task_seq=0,
                store_uri=store.uri, features=specs, nbytes=sum(s.nbytes for s in specs.values()),
                num_tokens=4, strategy="eagle3", target_fingerprint="fp",
                tokenizer_fingerprint="fp",
                provenance=Provenance(producer_id="test", engine="hf", created_at=0.0),
            ))  # fmt: skip
        publisher = Publisher(bus)
        for ref in refs:
            loop.call(publisher.publish(Names(run).samples, ref))
        loop.call(bus.close())
    finally:
        loop.close()
    return refs


def present(store, refs) -> set[str]:
    """The sample ids among `refs` whose tensors the store still holds."""
    out = set()
    for ref in refs:
        try:
            store.get(ref)
        except FeatureMissing:
            continue
        out.add(ref.sample_id)
    return out


class World:
    """One trainer rank of a live run: its connection, a member of "trainers", its ledger (a
    checkpoint's, when resumed: the consumer replays from its floor), `LiveSource`, loader."""

    def __init__(self, url: str, cfg, run: str, *, saved: dict | None = None,
                 hold_limit_bytes: int | None = None, collate=lambda samples: samples,
                 prefetch: int = 1):  # fmt: skip
        self.loop = LoopThread(f"world-{run}")
        self.bus = self.loop.call(connect(cfg, url, name=f"world-{run}"))
        self.run = self.loop.call(declare(self.bus, cfg, run))
        self.ledger = Ledger()
        if saved is not None:  # resume = replay: what ops/train.py's rank 0 does
            self.ledger.load_state_dict(saved)
            self.loop.call(self.run.reposition(TRAINERS, self.ledger.cursor.floor + 1))
        self.source = LiveSource(
            self.run, self.loop.call(self.run.join(TRAINERS)), strategy="eagle3",
            features=FEATURES, target_fingerprint="fp", tokenizer_fingerprint="fp",
            trained=self.ledger,
        )  # fmt: skip
        self.loader = Loader(
            self.source, self.loop, collate, micro_batch=2, accumulation=1, ledger=self.ledger,
            prefetch=prefetch, poll_s=0.05, fetch_timeout_s=0.2, heartbeat_s=0.5,
            hold_limit_bytes=hold_limit_bytes,
        )  # fmt: skip
        self.alive = True

    def train(self) -> list[str]:
        """One window, stepped (commit = after optimizer.step()): its sample ids."""
        window = self.loader.next_window()
        assert window is not None
        self.loader.commit(window)
        return [item.sample_id for item in window.items]

    def kill(self) -> None:
        """kill -9: nothing given back, nothing released, no checkpoint."""
        self.alive = False
        self.loop.call(self.bus.nc.close())
        self.loop.close()

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self.loader.close()
            self.source.close()
            self.loop.call(self.bus.close())
            self.loop.close()


@pytest.fixture
def live(nats_server, bus_cfg, run_id):
    store = open_store(f"mem://{run_id}")
    worlds: list[World] = []

    def world(**kw) -> World:
        worlds.append(World(nats_server.url, bus_cfg, run_id, **kw))
        return worlds[-1]

    world.refs = lambda n: publish(nats_server.url, bus_cfg, run_id, store, n)
    world.store = store
    yield world
    for w in worlds:
        w.close()
    store.close()


def test_a_world_killed_after_its_checkpoint_leaves_its_resume_the_tensors_to_train(live):
    refs = live.refs(8)
    nbytes = refs[0].nbytes
    first = live(hold_limit_bytes=4 * nbytes)  # two windows of two
    w1 = first.train()
    assert first.loader.held_bytes == 2 * nbytes and not first.loader.checkpoint_due
    # acked (the broker's ack floor passed them), still held: no checkpoint covers them yet
    assert first.loop.call(first.run.ack_floor(TRAINERS)) >= 2
    assert set(w1) <= present(live.store, refs)
    saved = first.ledger.state_dict()  # the checkpoint of step 1 ...
    first.loader.checkpointed()  # ... is on disk: its refs' tensors are freed
    assert not set(w1) & present(live.store, refs) and first.loader.held_bytes == 0
    w2 = first.train()  # trained and acked after the checkpoint
    assert set(w2) <= present(live.store, refs)
    first.kill()

    resumed = live(saved=saved, hold_limit_bytes=4 * nbytes)
    windows = [resumed.train()]
    assert not resumed.loader.checkpoint_due
    windows.append(resumed.train())
    assert resumed.loader.held_bytes == 4 * nbytes and resumed.loader.checkpoint_due
    windows.append(resumed.train())
    trained = [sid for window in windows for sid in window]
    # the killed world's refs after its checkpoint train again, from their own tensors; none is
    # lost, none of the checkpoint's trains twice
    assert set(w2) <= set(trained)
    assert resumed.ledger.lineage == w1 + trained
    assert sorted(resumed.ledger.lineage) == sorted(r.sample_id for r in refs)
    assert resumed.source.stats["dead_letters"] == 0, resumed.source.stats
    # a stop: nothing trained is freed before the checkpoint that the stop writes ...
    resumed.loader.stop.set()
    assert resumed.loader.next_window() is None and resumed.loader.stopped
    assert present(live.store, refs) == set(trained)
    resumed.loader.checkpointed()  # ... and everything once it is written
    assert present(live.store, refs) == set()
    assert live.store.usage().resident_bytes == 0


def test_a_redelivered_ref_trained_since_the_checkpoint_keeps_its_tensors(live):
    # 4 refs: after one window of 2 the loader (capacity 4) leases at most the other 2, so it
    # has room to fetch the redeliveries (with 6 its prefetch could fill up before the
    # reposition and never fetch again: the duplicates would never be seen)
    refs = live.refs(4)
    world = live()
    trained = world.train()
    # the broker loses its place (a restart flushes consumer state asynchronously): the
    # trained refs come again as first deliveries and are skipped at take time
    world.loop.call(reposition(world.bus, world.run.run, TRAINERS, 1))
    deadline = time.monotonic() + 20
    while world.source.stats["skipped"] + world.loader.stats["duplicates"] < 2:
        assert time.monotonic() < deadline, (world.source.stats, world.loader.stats)
        time.sleep(0.01)
    assert set(trained) <= present(live.store, refs)  # skipped, acked, not freed
    world.loader.checkpointed()
    assert not set(trained) & present(live.store, refs)


class _Toy:
    """A strategy of one linear layer on `hidden_states` (no target, no algorithm)."""

    name = "eagle3"

    def collate(self, samples, max_length=None) -> TrainBatch:
        tensors = {name: torch.stack([s[name] for s in samples]) for name in FEATURES}
        n = tensors["input_ids"].numel()
        return TrainBatch(tensors, len(samples), n, n)

    def forward_loss(self, model, batch, step):
        loss = model(batch.tensors["hidden_states"]).pow(2).mean()
        return loss, {"loss": loss.detach()}


def test_the_trainer_frees_held_tensors_at_each_checkpoint_early_by_bytes_and_at_a_stop(
    live, tmp_path
):
    refs = live.refs(12)
    strategy = _Toy()
    world = live(hold_limit_bytes=4 * refs[0].nbytes, collate=strategy.collate)
    model = torch.nn.Linear(4, 1)
    parts = TrainParts(model, strategy, torch.optim.AdamW(model.parameters(), lr=1e-2), None,
                       torch.device("cpu"))  # fmt: skip
    seen: dict[int, set[str]] = {}  # step -> sample ids still in the store, before its checkpoint

    def on_log(row) -> None:
        step = int(row["step"])
        seen[step] = present(live.store, refs)
        if step == 5:
            world.loader.stop.set()  # SIGTERM

    cfg = TrainingConfig(micro_batch=2, checkpoint_every=100, log_every=1)
    checkpoints = CheckpointManager(tmp_path / "ckpt", plan={}, keep=10)
    result = Trainer(parts, world.loader, cfg, total_steps=10, checkpoints=checkpoints,
                     hooks=TrainerHooks(on_log=on_log)).fit()  # fmt: skip
    assert result.stopped and result.steps == 5
    w = [set(result.lineage[i : i + 2]) for i in range(0, 10, 2)]
    # checkpoint_every=100: the two early checkpoints come from the bytes held (two windows)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [
        "step-00000002", "step-00000004", "step-00000005"
    ]  # fmt: skip
    assert w[0] <= seen[1]
    assert w[0] | w[1] <= seen[2]  # held up to the checkpoint of step 2
    assert not (w[0] | w[1]) & seen[3] and w[2] <= seen[3]
    assert w[2] | w[3] <= seen[4]
    assert not (w[2] | w[3]) & seen[5] and w[4] <= seen[5]
    # the stop's checkpoint freed the rest; the two refs never trained keep their tensors
    assert present(live.store, refs) == {r.sample_id for r in refs} - set(result.lineage)


SYNC_ORDER = [
    ("step", 1), ("commit", 1), ("release", 1),
    ("step", 2), ("commit", 2), ("release", 2), ("row", 2),
    ("step", 3), ("commit", 3), ("release", 3),
    ("step", 4), ("commit", 4), ("release", 4), ("row", 4),
]  # fmt: skip


@pytest.mark.parametrize(
    ("overlap", "prefetch"),
    [(True, 3), (False, 1), (True, 0)],
    ids=["overlapped", "synchronised", "overlapped-needs-the-room"],
)
def test_an_overlapped_trainer_frees_each_window_once_the_next_step_is_queued(
    live, overlap, prefetch
):
    """`training.overlap_steps`: step k+1 is queued before step k's figures are waited for; so
    window k is freed, and the row closing at step k is emitted, only after step k+1's commit.
    A committed window still counts against the loader's capacity until it is freed: with
    `prefetch=0` (one window) the next window needs that room, and the trainer settles the
    step before waiting for it (no deadlock, one window resident). The rows hold the same
    figures either way, every window is freed once, nothing leaks."""
    refs = live.refs(8)
    events: list[tuple[str, int]] = []
    losses: list[float] = []

    class Recorded(_Toy):
        def forward_loss(self, model, batch, step):
            loss, metrics = super().forward_loss(model, batch, step)
            events.append(("step", step.global_step + 1))
            losses.append(float(loss.detach()))
            return loss, metrics

    strategy = Recorded()
    world = live(collate=strategy.collate, prefetch=prefetch)
    if prefetch == 3:  # every window taken before the first step: the order is the trainer's
        deadline = time.monotonic() + 20
        while world.loader._ready.qsize() < 8:
            assert time.monotonic() < deadline, world.loader._ready.qsize()
            time.sleep(0.01)
    steps_of: dict[str, int] = {}  # sample id -> the step that trained it
    commit, release = world.loader.commit, world.loader.release

    def recorded_commit(window, **kw):
        n = 1 + max(steps_of.values(), default=0)
        steps_of.update({item.sample_id: n for item in window.items})
        events.append(("commit", n))
        commit(window, **kw)

    def recorded_release(window):
        (n,) = {steps_of[item.sample_id] for item in window.items}
        events.append(("release", n))
        release(window)

    world.loader.commit, world.loader.release = recorded_commit, recorded_release
    rows: list[dict] = []

    def on_log(row) -> None:
        events.append(("row", int(row["step"])))
        rows.append(row)

    model = torch.nn.Linear(4, 1)
    parts = TrainParts(model, strategy, torch.optim.AdamW(model.parameters(), lr=1e-2), None,
                       torch.device("cpu"))  # fmt: skip
    cfg = TrainingConfig(micro_batch=2, log_every=2, max_steps=4, overlap_steps=overlap)
    hooks = TrainerHooks(on_log=on_log)
    result = Trainer(parts, world.loader, cfg, total_steps=4, hooks=hooks).fit()
    assert result.steps == 4 and result.samples == 8
    assert sorted(steps_of) == sorted(r.sample_id for r in refs)
    if prefetch == 3:
        assert events == [
            ("step", 1), ("commit", 1),
            ("step", 2), ("commit", 2), ("release", 1),
            ("step", 3), ("commit", 3), ("release", 2), ("row", 2),
            ("step", 4), ("commit", 4), ("release", 3),
            ("release", 4), ("row", 4),
        ]  # fmt: skip
    else:
        assert events == SYNC_ORDER
    # each row: the mean of the figures of exactly the steps it closes
    assert [r["loss"] for r in rows] == pytest.approx(
        [sum(losses[:2]) / 2, sum(losses[2:]) / 2], rel=1e-6
    )
    assert all("grad_norm" in r and "samples_per_s" in r for r in rows)
    assert live.store.usage().resident_bytes == 0  # every trained window freed

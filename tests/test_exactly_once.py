"""Exactly once is structural: every lockstep window is filtered against the loader's ledger
after the gather and before the step, whatever the broker redelivers.

The broker tests drive one trainer rank's loader by hand against a real nats-server: the
duplicates come from the broker itself (a consumer rewound under held leases, as a broker
restart with an asynchronously flushed consumer state does; a dead member's leases)."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest
import torch
from specbus.bus.connection import connect
from specbus.bus.lease import Leases
from specbus.bus.publisher import Publisher
from specbus.bus.replay import reposition
from specbus.bus.run import declare
from specbus.bus.subjects import TRAINERS, Names
from specbus.consumers.bus_source import BusSource
from specbus.consumers.checkpoint import CheckpointManager
from specbus.consumers.ledger import Ledger, plan_round
from specbus.consumers.lineage import read_lineage
from specbus.consumers.loader import Loader
from specbus.consumers.lockstep import Decision, Status, decide
from specbus.consumers.loop_thread import LoopThread
from specbus.core.contracts import Provenance, SampleRef
from specbus.core.store import open_store

E, W, F, S = Status.ENDED, Status.WAITING, Status.FULL, Status.STOPPING


# ---------------------------------------------------------------- the pure parts
def test_plan_round_keeps_first_occurrences_and_settles_what_is_trained():
    ledger = Ledger()
    ledger.record([(1, "a"), (2, "b")])
    windows = [
        [(2, "b"), (3, "c"), (4, "d")],  # rank 0: seq 2 trained already
        [(3, "c"), (5, "e"), (6, "d")],  # rank 1: seq 3 is rank 0's; sample d again (new seq)
    ]
    plans = plan_round(ledger, windows)
    assert (plans[0].keep, plans[0].trained, plans[0].parked) == ([1, 2], [0], [])
    assert (plans[1].keep, plans[1].trained, plans[1].parked) == ([1], [], [0, 2])
    # the same inputs give the same plans (every rank computes them itself)
    assert plan_round(ledger, windows) == plans


def test_ledger_records_idempotently_and_round_trips():
    ledger = Ledger()
    assert ledger.record([(1, "a"), (2, "b")]) == 2
    assert ledger.record([(2, "b"), (3, "a")]) == 0  # same sample under a new seq: no new entry
    ledger.retire([5])
    assert ledger.lineage == ["a", "b"]
    assert ledger.contains(3, "zzz") and ledger.contains(99, "a") and not ledger.contains(4, "x")
    assert ledger.cursor.floor == 3 and ledger.cursor.done_above == {5}
    again = Ledger()
    again.load_state_dict(ledger.state_dict())
    assert again.state_dict() == ledger.state_dict() and again.contains(5, "y")


@pytest.mark.parametrize(
    "statuses, held, ack_pending, unsettled, decision",
    [
        ([F, S], [2, 2], [-1, -1], [2, 2], Decision.STOP),  # one rank asked: all stop
        ([E, E], [1, 0], [3, 3], [1, 0], Decision.WAIT),  # 2 deliveries held by nobody
        ([E, E], [1, 0], [1, 1], [1, 0], Decision.RAGGED),  # every delivery held: train it
        ([F, E], [2, 0], [-1, 2], [2, 0], Decision.RAGGED),  # a full rank has no view
        ([E, E], [0, 0], [0, 0], [0, 0], Decision.END),
    ],
)
def test_decide_stop_and_deliveries_held_by_nobody(
    statuses, held, ack_pending, unsettled, decision
):
    got = decide(statuses, held, need=2, ack_pending=ack_pending, unsettled=unsettled)
    assert got == decision


# ---------------------------------------------------------------- against a real broker
class _Rank:
    """One trainer rank's loader over the run's "trainers" group, driven by hand."""

    def __init__(self, url: str, cfg, run: str, n: int, ghost: int = 0, ledger=None):
        self.run, self.loop = run, LoopThread(f"test-{run}")
        self.bus = self.loop.call(connect(cfg, url, name=f"test-{run}"))
        self.topo = self.loop.call(declare(self.bus, cfg, run))
        self.store = open_store(f"mem://{run}")
        self.loop.call(self.publish([(i, i + 1) for i in range(n)]))
        self.loop.call(self.topo.kv.mark_feed_complete(n))
        if ghost:  # another member leases `ghost` refs and dies without a word (no nak)
            self.ghost_seqs = asyncio.run(self._ghost(url, cfg, ghost))
        self.group = self.loop.call(Leases.join(self.bus, run, TRAINERS))
        self.ledger = ledger if ledger is not None else Ledger()
        source = BusSource(
            self.topo, self.group, strategy="eagle3",
            features=("hidden_states",), target_fingerprint="fp", tokenizer_fingerprint="fp",
            trained=self.ledger,
        )  # fmt: skip
        self.loader = Loader(
            source, self.loop, lambda samples: samples, micro_batch=2, accumulation=1,
            ledger=self.ledger, prefetch=2, poll_s=0.05, fetch_timeout_s=0.2, heartbeat_s=0.5,
        )  # fmt: skip

    async def publish(self, refs: list[tuple[int, int]], msg_id: str = "") -> None:
        """Refs of samples `s<i>` captured from TASKS seq `task_seq`, for (i, task_seq) in
        `refs` (`msg_id`: a suffix of their dedup ids, for a republish past the window)."""
        publisher = Publisher(self.bus)
        for i, task_seq in refs:
            specs = self.store.put(f"s{i}", {"hidden_states": torch.full((4,), float(i))})
            ref = SampleRef(
                sample_id=f"s{i}", run_id=self.run, task_id=f"t{i}", task_seq=task_seq,
                store_uri=f"mem://{self.run}", features=specs,
                nbytes=sum(s.nbytes for s in specs.values()), num_tokens=4, strategy="eagle3",
                target_fingerprint="fp", tokenizer_fingerprint="fp",
                provenance=Provenance(producer_id="test", engine="hf", created_at=0.0),
            )  # fmt: skip
            await publisher.publish(Names(self.run).samples, ref, msg_id=ref.msg_id + msg_id)

    async def _ghost(self, url: str, cfg, n: int) -> list[int]:
        bus = await connect(cfg, url, name="ghost")
        group = await Leases.join(bus, self.run, TRAINERS)
        leases = await group.fetch(n, 5.0)
        await bus.nc.close()  # the leases lapse after ack_wait
        return [lease.seq for lease in leases]

    def wait_holding(self, n: int, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.loader._in_flight() < n:
            assert time.monotonic() < deadline, f"the loader never held {n} items"
            time.sleep(0.01)

    def train_to_end(self) -> list[list[str]]:
        """Run the windows to the end of data (commit = the optimizer step); the sample ids
        of each trained window."""
        windows = []
        while (window := self.loader.next_window()) is not None:
            windows.append([i.sample_id for i in window.items])
            for item in window.items:  # the tensors trained are the ref's own
                assert item.tensors["hidden_states"][0].item() == float(item.sample_id[1:])
            self.loader.commit(window)
        return windows

    def consumer(self):
        return self.loop.call(self.bus.js.consumer_info(Names(self.run).samples_stream, TRAINERS))

    def close(self) -> None:
        self.loader.close()
        self.store.close()
        self.loop.call(self.bus.close())
        self.loop.close()


@pytest.fixture
def rank_of(nats_server, bus_cfg, run_id):
    made = []

    def make(n: int, ghost: int = 0, ledger=None, **bus):
        rank = _Rank(nats_server.url, bus_cfg.model_copy(update=bus), run_id, n, ghost, ledger)
        made.append(rank)
        return rank

    yield make
    for rank in made:
        rank.close()


def test_refs_redelivered_while_held_are_trained_once(rank_of):
    """Regression (issue 12, defect 1): a broker restart with an asynchronously flushed
    consumer state delivers refs again as first deliveries while a rank still holds them.
    Here the consumer is rewound to seq 1 while the rank holds two windows."""
    rank = rank_of(8, ack_wait_s=30.0)
    first = rank.loader.next_window()
    rank.wait_holding(6)  # this window + two more (s2..s5), leased and loaded
    rank.loop.call(reposition(rank.bus, rank.run, TRAINERS, 1))  # every ref comes again
    rank.loader.commit(first)
    rank.wait_holding(6)  # s2, s3 delivered again next to their first copies (s0, s1 skipped)
    windows = [[i.sample_id for i in first.items], *rank.train_to_end()]
    lineage = rank.ledger.lineage
    assert sorted(lineage) == sorted(f"s{i}" for i in range(8)), windows
    assert len(lineage) == len(set(lineage)) == 8, f"a sample was trained twice: {windows}"
    assert rank.loader.stats["duplicates"] >= 2, rank.loader.stats  # filtered, never trained
    info = rank.consumer()
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


def test_the_end_waits_for_leases_held_by_a_dead_member(rank_of):
    """Regression (issue 12, defect 6): deliveries held by nobody (a dead member's leases, acks
    a restarted broker lost) are ack-pending, not pending; the run must not end before they
    come back and are trained, and nothing may be left ack-pending at the end."""
    rank = rank_of(6, ghost=2, ack_wait_s=2.0)
    assert len(rank.ghost_seqs) == 2
    windows = rank.train_to_end()
    assert sorted(rank.ledger.lineage) == [f"s{i}" for i in range(6)], windows
    info = rank.consumer()
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


def test_the_last_partial_window_is_trained_and_nothing_stays_ack_pending(rank_of):
    """Issue 33, item 2: 7 refs, windows of 2: the seventh is trained in a ragged last
    window and acked. (It was nak'd at the end, and a nak'd delivery stays ack-pending at the
    broker until it is delivered again: nobody fetched it again, so it stayed.)"""
    rank = rank_of(7, ack_wait_s=30.0)
    windows = rank.train_to_end()
    assert [len(w) for w in windows] == [2, 2, 2, 1], windows
    assert sorted(rank.ledger.lineage) == sorted(f"s{i}" for i in range(7))
    info = rank.consumer()
    assert (info.num_pending, info.num_ack_pending) == (0, 0)
    assert rank.store.usage().num_samples == 0  # every trained ref released


def test_a_stop_gives_back_what_the_rank_holds_at_once(rank_of):
    """A stop (as max_steps or a spent time budget) trains nothing more: what the rank holds
    is nak'd, so another member gets it at once, not after ack_wait."""
    rank = rank_of(8, ack_wait_s=30.0)
    rank.loader.commit(rank.loader.next_window())
    rank.wait_holding(4)
    rank.loader.stop.set()
    assert rank.loader.next_window() is None and rank.loader.stopped
    assert rank.loader.source.unsettled() == 0

    async def another_member():
        group = await Leases.join(rank.bus, rank.run, TRAINERS)
        t0 = time.monotonic()
        leases = await group.fetch(6, 5.0)
        took = time.monotonic() - t0
        await group.ack_all(leases)
        return [(lease.record.sample_id, lease.deliveries) for lease in leases], took

    got, took = rank.loop.call(another_member())
    assert sorted(sid for sid, _ in got) == [f"s{i}" for i in range(2, 8)] and took < 5.0
    assert any(deliveries > 1 for _, deliveries in got)  # the held ones came back
    assert rank.ledger.lineage == ["s0", "s1"]


def test_training_past_a_compaction_keeps_exactly_once_in_bounded_state(rank_of, tmp_path):
    """Issue 31: the ledger holds what is in flight, not the run. 40 refs train in steps of 2
    with checkpoints every 2 steps and a by-id memory of 4 samples: each checkpoint's ledger
    is the same size, the lineage is in the file beside the checkpoints. Then a producer's
    republish of task 1 past the broker's duplicate window (sample s0 at a new SAMPLES
    sequence, long out of the by-id memory) is filtered by its task, in the running ledger
    and in one restored from the checkpoint; the new sample next to it trains once."""
    checkpoints = CheckpointManager(tmp_path / "ckpt", plan={}, keep=100)
    ledger = Ledger(recent_ids=4, lineage_path=checkpoints.lineage_path)  # as the Trainer's
    rank = rank_of(40, ledger=ledger, ack_wait_s=30.0)
    sizes = []
    for step in range(1, 21):  # every ref: the last window is not followed by an end yet
        window = rank.loader.next_window()
        rank.loader.commit(window)
        if step % 2 == 0:
            path = checkpoints.save(step, rank.loader.state_dict())
            rank.loader.checkpointed()
            state = torch.load(path / "state.pt", weights_only=False)
            sizes.append(len(pickle.dumps(state)))
    assert len(ledger) == 40 and ledger.size() == {
        "done_above": 0, "task_ranges": 1, "recent_ids": 4, "pending_ids": 0
    }  # fmt: skip
    assert state["cursor"] == {"floor": 40, "done_above": []}
    assert state["ledger"]["tasks"] == [[1, 40]] and len(state["ledger"]["recent"]) == 4
    assert max(sizes) - min(sizes) < 16, sizes  # a count and a length grow, nothing else
    assert read_lineage(path) == [f"s{i}" for i in range(40)] == ledger.lineage

    restored = Ledger(recent_ids=4)
    restored.load_state_dict(checkpoints.load())
    republished, new = (0, 1), (40, 41)  # (sample, task seq): s0 again from task 1; s40
    assert restored.contains(41, "s0", 1) and not restored.contains(42, "s40", 41)
    rank.loop.call(rank.publish([republished, new], msg_id=":again"))
    windows = rank.train_to_end()
    assert windows == [["s40"]], windows  # the ragged last step: s40 alone, s0 settled
    assert ledger.lineage == [f"s{i}" for i in range(41)]
    assert ledger.cursor.floor == 42 and ledger.size()["task_ranges"] == 1
    info = rank.consumer()
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


def test_trained_tensors_are_freed_after_the_next_lockstep_exchange(rank_of):
    """A rank frees what it trained only once every rank has recorded it (past the next
    lockstep exchange), so another rank that reads a duplicate delivery and finds the
    tensors gone knows from its own ledger that they were trained and never recaptures
    them (a recapture of a trained sample would train it twice)."""
    rank = rank_of(4, ack_wait_s=30.0)
    first = rank.loader.next_window()
    rank.loader.commit(first)
    ids = [item.sample_id for item in first.items]
    assert rank.store.usage().num_samples == 4  # committed, still held
    second = rank.loader.next_window()  # its exchange comes after every rank's commit
    assert rank.store.usage().num_samples == 2 and ids == ["s0", "s1"]
    rank.loader.commit(second)
    assert rank.loader.next_window() is None  # the end frees the rest
    assert rank.store.usage().num_samples == 0

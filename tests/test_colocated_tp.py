"""Colocated mode with target-TP islands (CPU, gloo): 2 ranks, target.tp_size=2, one island.

The leader leases, both ranks capture the same batches with the sharded target, each trains
its own slice; every planned sample is trained exactly once, poisoned tasks are settled once.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from specbus.bus.connection import connect
from specbus.bus.dead import list_dead
from specbus.bus.lease import Leases
from specbus.bus.subjects import PRODUCERS, Names
from specbus.core.errors import ConfigError
from specbus.core.models.target import load_target_info
from specbus.ops.modes import check_colocated

from tests.fixtures.pipeline import VOCAB, Cluster, pipeline_config, write_tokenised_data

TP = ["deployment.mode=colocated", "target.tp_size=2", "training.log_every=1"]


def consumer_state(cfg, url: str) -> tuple[int, int]:
    """(num_ack_pending, num_pending) of the run's producers group."""

    async def query():
        bus = await connect(cfg.bus, url)
        try:
            info = await bus.js.consumer_info(Names(cfg.run).stream_of(PRODUCERS), PRODUCERS)
            return info.num_ack_pending, info.num_pending
        finally:
            await bus.close()

    return asyncio.run(query())


def given_back(cfg, url: str) -> list[str]:
    """Sample ids a new member of the producers group gets well within one ack_wait."""

    async def query():
        bus = await connect(cfg.bus, url)
        try:
            group = await Leases.join(bus, cfg.run, PRODUCERS)
            leases = await group.fetch(100, timeout_s=cfg.bus.ack_wait_s / 4)
            await group.nak_all(leases, 0)
            return [f"{x.record.task_id}-e{x.record.epoch}" for x in leases]
        finally:
            await bus.close()

    return asyncio.run(query())


def dead_letters(cfg, url: str):
    async def query():
        bus = await connect(cfg.bus, url)
        try:
            return await list_dead(bus, cfg.run)
        finally:
            await bus.close()

    return asyncio.run(query())


def poison(path: Path, at: int) -> Path:
    """Record `at` gets a token id beyond the target's vocabulary in its unsupervised half:
    the feeder passes it, its capture always fails (colocated mode refuses the fixture's
    over-long poison: data.max_length must fit the target's context)."""
    lines = path.read_text().splitlines()
    record = json.loads(lines[at])
    record["input_ids"][0] = VOCAB + 1000
    lines[at] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_tp_island_trains_every_sample_once(tmp_path, tiny_target, nats_server, run_id):
    data = write_tokenised_data(tmp_path / "data.jsonl", 16)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=TP)  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    cluster.run_colocated(2, timeout=120)
    state = cluster.checkpoint_state()
    lineage = state["lineage"]
    assert len(lineage) == len(set(lineage)) == 16  # island batch 4 x 4 steps, all of them
    assert state["step"] == 4
    assert all(math.isfinite(row["loss"]) for row in state["history"])
    assert consumer_state(cfg, nats_server.url) == (0, 0)


def test_tp_island_dead_letters_a_poisoned_task_once(tmp_path, tiny_target, nats_server, run_id):
    data = poison(write_tokenised_data(tmp_path / "data.jsonl", 16), at=1)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=TP)  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    cluster.run_colocated(2, timeout=120)
    dead = [d for d in dead_letters(cfg, nats_server.url) if d.reason == "capture_failed"]
    assert len(dead) == 1 and "outside the vocabulary" in dead[0].detail
    assert dead[0].deliveries == cfg.bus.max_deliver
    state = cluster.checkpoint_state()
    lineage = state["lineage"]
    # 15 good tasks: 3 complete island batches of 4, then 3 over, which the ragged last step
    # trains (the leader captures the last one as an uneven batch once nothing more can come)
    assert len(lineage) == len(set(lineage)) == 15 and "t1-e0" not in lineage
    assert state["step"] == 4 and all(math.isfinite(row["loss"]) for row in state["history"])
    # nothing left leased, pending or given back
    assert consumer_state(cfg, nats_server.url) == (0, 0)
    assert given_back(cfg, nats_server.url) == []


@pytest.mark.parametrize(
    "tp, world, extra, needle",
    [
        (4, 4, [], "target.tp_size=4 does not divide the target's num_key_value_heads=2"),
        (2, 3, [], "world size 3 is not a multiple of target.tp_size=2"),
        (2, 2, ["training.wrap=fsdp"], "use training.wrap=ddp"),
    ],
)
def test_tp_island_config_refusals(tmp_path, tiny_target, tp, world, extra, needle):
    data = write_tokenised_data(tmp_path / "data.jsonl", 4)
    cfg = pipeline_config("r", tmp_path, tiny_target, data, store_uri="mem://",
                          overrides=[*TP, f"target.tp_size={tp}", *extra])  # fmt: skip
    with pytest.raises(ConfigError, match=needle):
        check_colocated(cfg, load_target_info(tiny_target), world=world)


def test_tp_island_config_accepted(tmp_path, tiny_target):
    data = write_tokenised_data(tmp_path / "data.jsonl", 4)
    cfg = pipeline_config("r", tmp_path, tiny_target, data, store_uri="mem://", overrides=TP)
    plan = check_colocated(cfg, load_target_info(tiny_target), world=4)
    assert (plan.num_islands, plan.island_batch) == (2, 2 * cfg.training.micro_batch)

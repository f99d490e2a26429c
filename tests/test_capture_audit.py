"""The capture audit: a trainer recomputes sampled captures with the hf engine and dead-letters
those whose layers are not the target's (`capture_mismatch`), whatever engine captured them.

The engine under test is an engine route with an off-by-one layer id (`Shifted`: the hf engine
capturing every aux layer one deeper than the contract names, the bug of a server started with
another convention's ids); every other capture is right. Real: the trainer process (`specbus
train` with `audit.rate=1`), the broker, the shm store, the feeder and the `CaptureWorker`
producer (in this process, so that its engine can be the shifted one) and the audit's
reference (the hf engine in the trainer). Pinned: every shifted capture is
dead-lettered with its layer named, every right one is trained once, `specbus status` counts
them.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from specbus.bus.connection import connect
from specbus.bus.run import declare
from specbus.bus.status import run_status
from specbus.bus.subjects import PRODUCERS
from specbus.core.audit import AuditConfig, CaptureAudit, audit_decision, compare
from specbus.core.config import StrategyConfig, TargetConfig
from specbus.core.models.target import load_target_info
from specbus.core.store import open_store
from specbus.core.strategies.base import build_strategy
from specbus.ops.cli import format_status
from specbus.ops.produce import run_feeder
from specbus.producers.capture import CaptureWorker
from specbus.producers.engines.hf import HFEngine

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

N = 12


class Shifted:
    """The hf engine, every other capture call one layer too deep (records what it shifted)."""

    def __init__(self, engine: HFEngine):
        self.engine, self.calls, self.shifted = engine, 0, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def capture(self, input_ids, loss_masks, contract, *, device=None):
        self.calls += 1
        if self.calls % 2 == 0:
            self.shifted += [tuple(t.tolist()) for t in input_ids]
            contract = dataclasses.replace(
                contract, aux_layers=tuple(a + 1 for a in contract.aux_layers)
            )
        return self.engine.capture(input_ids, loss_masks, contract, device=device)


def test_a_shifted_layer_is_far_off_and_the_right_one_exact(tiny_target):
    info = load_target_info(tiny_target)
    strategy = StrategyConfig(ttt_length=2, draft={"draft_vocab_size": 64})
    contract = build_strategy(strategy, info, aux_layers=[0, 1, 2]).feature_contract(info)
    engine = HFEngine(TargetConfig(model=str(tiny_target), dtype="float32"))
    ids = torch.randint(3, 100, (30,), generator=torch.Generator().manual_seed(1))
    right = engine.capture([ids], None, contract)[0]
    assert compare(right, right, contract).ok
    wrong = Shifted(engine)
    wrong.calls = 1  # the next call shifts
    shifted = wrong.capture([ids], None, contract)[0]
    result = compare({k: v.clone() for k, v in shifted.items()}, right, contract)
    assert not result.ok
    errors = {e.layer: e.error for e in result.errors if e.feature == contract.aux_feature}
    assert set(errors) == {0, 1, 2} and min(errors.values()) > 0.1, errors  # a layer apart
    assert "hidden_states layer" in result.describe()
    # a bf16 capture of the right layers is within the bf16 tolerance
    bf16 = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in right.items()}
    assert compare(bf16, right, contract).ok
    # the sample decision is the sample id's alone
    assert [audit_decision(f"t{i}", 0.5) for i in range(64)] == [
        audit_decision(f"t{i}", 0.5) for i in range(64)
    ]
    assert sum(audit_decision(f"t{i}", 0.5) for i in range(1000)) in range(430, 570)
    # by default only a serving engine's captures are audited (an hf capture is the
    # reference's own code): the run config's default engines
    audit = CaptureAudit(1.0, lambda: None, contract, engines=tuple(AuditConfig().engines))
    assert audit.wants("t0", 0, "vllm") and audit.wants("t0", 0, "sglang_server")
    assert not audit.wants("t0", 0, "hf")
    assert CaptureAudit(1.0, lambda: None, contract).wants("t0", 0, "hf")  # engines None: any


async def produce(cfg, url, engine, store, contract, tasks: int) -> None:
    async with await connect(cfg.bus, url, name="test-producer") as bus:
        run = await declare(bus, cfg.bus, cfg.run)
        group = await run.join(PRODUCERS)
        worker = CaptureWorker(run, group, engine, store, contract, capture_batch=2)
        job = asyncio.create_task(worker.run())
        while worker.stats.tasks < tasks and not job.done():
            await asyncio.sleep(0.05)
        worker.stop()
        await job
        await group.close()


@pytest.mark.slow
def test_the_trainer_dead_letters_every_shifted_capture(tiny_target, nats_server, run_id, tmp_path):
    data = write_tokenised_data(tmp_path / "data.jsonl", N, lengths=(16, 24))
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri=f"shm://{run_id}",
                          overrides=["target.aux_layers=[0,1,2]", "audit.rate=1", "audit.engines=[hf]",
                                     "training.checkpoint_every=1", "target.dtype=float32"])  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    info = load_target_info(tiny_target)
    contract = build_strategy(
        cfg.strategy, info, aux_layers=cfg.target.aux_layers
    ).feature_contract(info)
    engine = Shifted(HFEngine(cfg.target))
    store = open_store(cfg.store)  # the producer's: its segments live while it is open
    try:
        assert asyncio.run(run_feeder(cfg, bus_url=nats_server.url)) == N  # `specbus feed`
        asyncio.run(produce(cfg, nats_server.url, engine, store, contract, N))
        assert len(engine.shifted) == N // 2
        cluster.start("trainer-0", "train")
        cluster.assert_ok(cluster.wait("trainer-0"))
    finally:
        cluster.stop()
        store.close()

    async def read():
        async with await connect(cfg.bus, nats_server.url, name="test-status") as bus:
            run = await declare(bus, cfg.bus, cfg.run)
            return await run_status(bus, cfg.run), await run.dead_letters()

    status, dead = asyncio.run(read())
    assert status["audit"]["audited"] == N and status["audit"]["mismatches"] == N // 2, status
    assert f"capture audit    {N} recomputed, {N // 2} mismatched" in format_status(status)
    mismatched = [d for d in dead if d.reason == "capture_mismatch"]
    assert len(mismatched) == N // 2 == len(dead)
    assert all("hidden_states layer" in d.detail and "engine hf" in d.detail for d in mismatched)
    # the right captures trained, each once; none of the shifted ones
    state = cluster.checkpoint_state()
    assert len(state["lineage"]) == N // 2 == len(set(state["lineage"]))

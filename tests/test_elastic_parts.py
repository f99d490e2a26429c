"""The pieces of elastic training (issue 27) one at a time: the schedule re-planned for a new
world, the checkpoint a surviving rank claims, the exit code that tells torchrun to re-form,
the world's record in the run KV (a real broker), the stop a dead agent sends, the torchrun
command of `specbus train --elastic`. The runs themselves: tests/test_elastic.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import time

import pytest
import torch
from specbus.bus.connection import connect
from specbus.bus.run import declare
from specbus.consumers.checkpoint import CheckpointManager
from specbus.consumers.loop_thread import LoopThread
from specbus.consumers.shutdown import stop_on_signals
from specbus.consumers.trainer import TrainResult
from specbus.core.config import BusConfig, TrainingConfig
from specbus.core.training import build_scheduler, lr_factor
from specbus.ops.elastic import (
    HISTORY,
    REFORM_EXIT,
    Formation,
    Member,
    member_exit,
    parse_nodes,
    peer_gone,
    torchrun_argv,
)
from specbus.ops.train import plan_schedule, schedule_length

TRAINING = TrainingConfig(micro_batch=2, accumulation=2, lr=1.0, warmup_ratio=0.1)
PLANNED = 1200


def lr_at(schedule, step: int, training: TrainingConfig = TRAINING) -> float:
    return lr_factor(max(0.0, step - schedule.offset), schedule.total_steps, training)


def test_a_world_of_the_checkpoints_size_keeps_its_schedule():
    """Offset 0 (the schedule built exactly as before) whenever the world is the one that
    trained the checkpoint, or nothing says otherwise."""
    total = schedule_length(TRAINING, PLANNED, 2)
    assert plan_schedule(TRAINING, PLANNED, 2).offset == 0
    assert plan_schedule(TRAINING, PLANNED, 2, {"step": 40, "samples": 40 * 8}).offset == 0
    assert plan_schedule(TRAINING, PLANNED, 2, {"step": 40}).total_steps == total  # old meta
    given = TRAINING.model_copy(update={"total_steps": 500})  # a schedule given in steps
    assert plan_schedule(given, PLANNED, 4, {"step": 40, "samples": 320}).offset == 0
    assert plan_schedule(TRAINING, None, 4, {"step": 40, "samples": 320}).offset == 0  # live


@pytest.mark.parametrize("old,new", [(2, 4), (4, 2), (2, 3)])
def test_a_new_world_goes_on_from_the_learning_rate_it_stopped_at(old, new):
    """Re-formed from a checkpoint of another world size at step s0: the learning rate goes on
    from where the old world's schedule was (the same fraction of the planned samples), and
    the schedule ends where the data does at the new size."""
    per_old, per_new = old * 4, new * 4
    s0 = 70  # steps of the old world
    samples = s0 * per_old
    before = plan_schedule(TRAINING, PLANNED, old)
    after = plan_schedule(TRAINING, PLANNED, new, {"step": s0, "samples": samples})
    assert after.offset == pytest.approx(s0 - samples / per_new)
    assert lr_at(after, s0) == pytest.approx(lr_at(before, s0), abs=0.02)
    left = math.ceil((PLANNED - samples) / per_new)
    assert abs(after.end_step - (s0 + left)) <= 1
    assert lr_at(after, after.end_step) == pytest.approx(0.0, abs=1e-9)
    lrs = [lr_at(after, s) for s in range(s0, after.end_step + 1)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False)), "cosine decays"


def test_the_scheduler_of_a_new_world_resumes_the_saved_position():
    """The LambdaLR built with the offset and loaded from the old world's state: its next
    learning rate is the re-planned schedule's at the next step."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    old = build_scheduler(opt, TRAINING, plan_schedule(TRAINING, PLANNED, 2).total_steps)
    for _ in range(70):
        opt.step()
        old.step()
    saved_opt, saved_sched = opt.state_dict(), old.state_dict()
    schedule = plan_schedule(TRAINING, PLANNED, 4, {"step": 70, "samples": 70 * 8})
    opt2 = torch.optim.AdamW(model.parameters(), lr=1.0)
    new = build_scheduler(opt2, TRAINING, schedule.total_steps, schedule.offset)
    opt2.load_state_dict(saved_opt)
    new.load_state_dict(saved_sched)
    assert opt2.param_groups[0]["lr"] == pytest.approx(saved_opt["param_groups"][0]["lr"])
    opt2.step()
    new.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(schedule, 71))


def test_one_survivor_claims_the_step_and_latest_never_goes_back(tmp_path):
    ckpt = CheckpointManager(tmp_path, {"plan": 1})
    assert ckpt.claim(5) and not ckpt.claim(5)  # exactly one of the survivors saves it
    ckpt.save(5, {"samples": 20})
    assert ckpt.latest_step() == 5 and ckpt.latest_meta()["samples"] == 20
    assert not ckpt.claim(4) and not ckpt.claim(5)  # a checkpoint at or past it exists
    ckpt.save(4, {"samples": 16})  # a survivor a step behind finishing last
    assert ckpt.latest_step() == 5
    assert ckpt.claim(6)
    ckpt.save(6, {"samples": 24})
    assert not list(tmp_path.glob(".claim-step-0000000[45]"))  # claims of saved steps go


def test_a_rank_whose_world_stopped_under_it_asks_to_re_form(capsys):
    def result(**kw) -> TrainResult:
        return TrainResult(steps=3, samples=12, history=[], checkpoint="c", **kw)

    assert member_exit(result(stopped=True, stopped_here=False)) == REFORM_EXIT
    assert "exit 75" in capsys.readouterr().out
    assert member_exit(result(stopped=True, stopped_here=True)) == 0  # its agent stops it
    assert member_exit(result()) == 0  # the data ended
    assert member_exit(None) == 0
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert peer_gone(gloo) and peer_gone(torch.distributed.DistStoreError("timeout"))
    assert not peer_gone(ValueError("a bug"))


def test_membership_comes_from_the_elastic_agent_only():
    env = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "100",
           "TORCHELASTIC_RESTART_COUNT": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}  # fmt: skip
    assert Member.from_env(env) == Member("r", 2, 100, 1, 2)
    assert Member.from_env({**env, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # static torchrun
    assert Member.from_env({}) is None


def test_the_agent_command_is_torchruns_with_the_ranks_resuming(tmp_path):
    args = argparse.Namespace(
        elastic="1:4", nproc_per_node=2, rdzv_endpoint="10.0.0.1:29400", max_restarts=7,
        join_timeout=300, config=str(tmp_path / "run.yaml"), overrides=["training.lr=1e-4"],
    )  # fmt: skip
    argv = torchrun_argv(args, "run1", "nats://10.0.0.9:4222")
    text = " ".join(argv)
    for part in ("--nnodes 1:4", "--nproc-per-node 2", "--rdzv-backend c10d",
                 "--rdzv-endpoint 10.0.0.1:29400", "--rdzv-id run1", "--max-restarts 7",
                 "-m specbus.ops.cli train --resume --url nats://10.0.0.9:4222",
                 f"--config {tmp_path / 'run.yaml'}", "training.lr=1e-4", "join_timeout=300"):  # fmt: skip
        assert part in text
    assert parse_nodes("3") == (3, 3)
    for bad in ("0:2", "4:2", "a:b"):
        with pytest.raises(ValueError, match="--elastic"):
            parse_nodes(bad)


def test_a_dead_agents_repeated_hangups_only_stop_the_rank():
    """SIGHUP (what a rank gets when its agent dies, once per agent thread) sets the stop and
    never escalates to "exit now" the way a second SIGTERM does."""
    with stop_on_signals() as stop:
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGHUP)
            deadline = time.monotonic() + 5
            while not stop.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
        assert stop.is_set()


def test_each_world_is_recorded_with_how_the_last_one_ended(tmp_path, nats_server, run_id):
    """Real broker: the first world is formation 1 (nothing before it); a world that ends
    records its step in the checkpoint directory; the next one's record says how long after
    that end its first step came and how many steps it trained again; history is bounded."""
    loop = LoopThread("test-formation")
    bus = loop.call(connect(BusConfig(), nats_server.url))
    try:
        run = loop.call(declare(bus, BusConfig(), run_id))
        first = Formation(loop, run, tmp_path, world=2, rank=0, from_step=0)
        assert first.number == 1 and first.previous is None and first.previous_end is None
        first.end(3, "never stepped")  # a world that never stepped records nothing
        assert not list((tmp_path / "worlds").glob("*.json"))
        first.first_step(1)
        for _ in range(100):
            if loop.call(run.kv.get_world()) is not None:
                break
            time.sleep(0.05)
        assert loop.call(run.kv.get_world())["world"] == 2
        first.end(40, "stopped")
        peer = Formation(loop, run, tmp_path, world=2, rank=1, from_step=0)
        peer.number, peer.stepped = 1, True
        peer.end(41, "stopped by a peer")  # the highest step any leaving rank reached counts
        second = Formation(loop, run, tmp_path, world=4, rank=0, from_step=40)
        assert second.number == 2
        rec = second.record(time.time() + 5)
        assert rec["world"] == 4 and rec["previous_world"] == 2 and rec["retrained"] == 1
        assert rec["cause"] == "stopped by a peer" and 5 <= rec["since_end_s"] < 60
        assert [h["formation"] for h in rec["history"]] == [1, 2]
        long = {**rec, "history": [{"formation": i} for i in range(50)]}
        loop.call(run.kv.put_world(long))
        third = Formation(loop, run, tmp_path, world=4, rank=0, from_step=41)
        assert len(third.record(time.time())["history"]) == HISTORY
        ends = [json.loads(p.read_text()) for p in (tmp_path / "worlds").glob("end-r*.json")]
        assert {e["rank"] for e in ends} == {0, 1}
    finally:
        loop.call(bus.close())
        loop.close()


def test_status_and_top_show_the_world_and_its_re_formations(nats_server, run_id, capsys):
    from specbus.ops.cli import main

    async def setup():
        bus = await connect(BusConfig(), nats_server.url)
        run = await declare(bus, BusConfig(), run_id)
        now = time.time()
        first = {
            "formation": 1,
            "world": 2,
            "from_step": 0,
            "at": now - 60,
            "previous_world": None,
            "since_end_s": None,
            "retrained": None,
            "cause": None,
        }
        grown = {**first, "formation": 2, "world": 4, "from_step": 131, "at": now - 30,
                 "previous_world": 2, "since_end_s": 47.1, "retrained": 0, "cause": "stopped"}  # fmt: skip
        await run.kv.put_world({**grown, "history": [first, grown]})
        await bus.close()

    asyncio.run(setup())
    for command in (["status"], ["top", "--once"]):
        assert main([*command, "--url", nats_server.url, "-o", f"run={run_id}"]) == 0
        out = capsys.readouterr().out
        assert "world      4 rank(s) (formation 2, training from step 131" in out, out
        assert "2 -> 4 at step 131" in out and "first step 47.1s after" in out, out
        assert "0 step(s) retrained" in out, out

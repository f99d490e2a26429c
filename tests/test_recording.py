"""W1, offline: capture a run once into file:// (`specbus capture`), then train several epochs
from the recording (`specbus train --from-recording`): from the broker, from the recording's
directory and from the same samples in SpecForge's dump layout."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
import torch
from specbus.bus.connection import connect
from specbus.bus.topology import open_kv
from specbus.consumers.recording import epoch_permutation
from specbus.core.config import BusConfig
from specbus.core.contracts import SampleRef
from specbus.core.store import open_store

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

N = 48  # recorded samples


def capture(tmp_path, target, url, run_id, n=N, overrides=()):
    data = write_tokenised_data(tmp_path / "data.jsonl", n, lengths=(30, 40))
    rec = tmp_path / "rec"
    cfg = pipeline_config(run_id, tmp_path / "run", target, data, store_uri=f"file://{rec}",
                          overrides=["store.budget_bytes=1000000000", *overrides])  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", url)
    try:
        cluster.start("capture", "capture")
        cluster.assert_ok(cluster.wait("capture"))
    finally:
        cluster.stop()
    return cfg, rec


@pytest.fixture(scope="module")
def recording(tmp_path_factory, tiny_target, nats_server):
    """One recording of N samples shared by this module's tests (they only read it)."""
    run = "rec" + uuid.uuid4().hex[:8]
    cfg, rec = capture(tmp_path_factory.mktemp("recording"), tiny_target, nats_server.url, run)
    return run, cfg, rec


def recorded_ids(rec: Path) -> list[str]:
    lines = (rec / "refs.jsonl").read_bytes().splitlines()
    return [SampleRef.from_bytes(line).sample_id for line in lines]


def expected_lineage(ids: list[str], epochs: int, seed: int = 0) -> list[str]:
    return [f"{ids[i]}/e{e}" for e in range(epochs) for i in epoch_permutation(len(ids), seed, e)]


def trainer_cluster(cfg, work: Path, url: str, run: str, *overrides: str) -> Cluster:
    from specbus.core.config import build_config

    tree = cfg.model_dump(mode="json")
    tree["run"] = run
    tree["run_dir"] = str(work / "run")
    return Cluster(build_config(tree, list(overrides)), work, url)


def latest_step(cluster: Cluster) -> int:
    pointer = cluster.cfg.resolved_run_dir / "checkpoints" / "latest"
    try:
        return int(pointer.read_text().strip().split("-")[1])
    except (FileNotFoundError, IndexError, ValueError):
        return 0


def test_capture_writes_a_complete_recording(recording, nats_server):
    run_id, cfg, rec = recording
    marker = json.loads((rec / "recording.json").read_text())
    assert marker["samples"] == N and marker["fed_tasks"] == N and marker["crc"] is False
    assert marker["manifest"]["plan_hash"] == marker["plan_hash"]
    assert sorted(recorded_ids(rec)) == sorted(f"t{i}-e0" for i in range(N))
    assert set(marker["features"]) == {"input_ids", "loss_mask", "hidden_states", "target"}

    async def kv_marker():
        async with await connect(BusConfig(), nats_server.url) as bus:
            kv = await open_kv(bus, run_id)
            return await kv.recording(), await kv.train_complete()

    on_bus, complete = asyncio.run(kv_marker())
    assert on_bus["samples"] == N and on_bus["last_seq"] >= N and complete["recording"]
    store = open_store(marker["store_uri"])  # the features stay: nothing consumed them
    assert store.usage().num_samples == N
    store.close()


def test_three_epochs_exactly_once_per_epoch_through_kill_and_resume(
    tmp_path, recording, nats_server
):
    """Record 48 samples, train 3 epochs on 2 ranks from the broker's recording, kill -9 both
    ranks once a checkpoint lies inside epoch 1, resume: every recorded sample is trained
    exactly once per epoch, epoch 0 in recorded order, later epochs in their seeded order."""
    run_id, cfg, rec = recording
    ids = recorded_ids(rec)
    assert len(ids) == N
    train = trainer_cluster(cfg, tmp_path / "train", nats_server.url, run_id + "w1",
                            "data.epochs=3", "training.checkpoint_every=5")  # fmt: skip
    steps_per_epoch = N // 4  # 2 ranks x micro-batch 2
    try:
        train.trainers(2, "--from-recording", run_id)
        deadline = time.monotonic() + 180
        while latest_step(train) < steps_per_epoch + 1 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in train.procs.values()), "a rank ended early"
            time.sleep(0.01)
        train.kill("trainer-0")
        train.kill("trainer-1")
        killed = train.checkpoint_state()
        floor = killed["cursor"]["floor"]
        assert N < floor < 3 * N and floor % N, f"the kill did not land mid-epoch ({floor})"
        train.trainers(2, "--from-recording", run_id, "--resume")
        train.assert_ok(train.wait("trainer-0", "trainer-1"))
    finally:
        train.stop()
    state = train.checkpoint_state()
    lineage = state["lineage"]
    assert state["step"] == 3 * steps_per_epoch
    assert lineage == expected_lineage(ids, 3)  # exactly once per epoch, in the planned order
    for e in range(3):
        assert sorted(x for x in lineage if x.endswith(f"/e{e}")) == sorted(
            f"{i}/e{e}" for i in ids
        )
    assert "resumed at step" in train.log("trainer-0") and "epoch 1" in train.log("trainer-0")


@pytest.mark.slow
def test_a_remainder_is_trained_in_a_ragged_last_step_and_never_again(
    tmp_path, recording, nats_server
):
    """2 epochs of the 48 recorded samples on 2 ranks x micro-batch 1 x accumulation 5: steps
    of 10 run across the epoch boundary, so 9 full steps and a ragged last one of 6 (rank 0
    holds 5, rank 1 one). Stopped at max_steps, resumed to the end, resumed again: every
    sample is trained exactly once per epoch in the planned order, the ragged step's samples
    included, and the last resume trains nothing."""
    run_id, cfg, rec = recording
    ids = recorded_ids(rec)
    train = trainer_cluster(cfg, tmp_path / "train", nats_server.url, run_id + "rg",
                            "data.epochs=2", "training.micro_batch=1",
                            "training.accumulation=5")  # fmt: skip
    try:
        train.trainers(2, "--from-recording", run_id, "training.max_steps=4")
        train.assert_ok(train.wait("trainer-0", "trainer-1"))
        assert train.checkpoint_state()["cursor"]["floor"] == 40
        train.trainers(2, "--from-recording", run_id, "--resume")
        train.assert_ok(train.wait("trainer-0", "trainer-1"))
        done = train.checkpoint_state()
        assert "per rank: [5, 1]" in train.log("trainer-0")
        train.trainers(2, "--from-recording", run_id, "--resume")
        train.assert_ok(train.wait("trainer-0", "trainer-1"))
    finally:
        train.stop()
    assert done["step"] == 10 and done["cursor"] == {"floor": 2 * N, "done_above": []}
    assert done["lineage"] == expected_lineage(ids, 2)  # once per epoch, in the planned order
    again = train.checkpoint_state()
    assert (again["step"], again["lineage"]) == (done["step"], done["lineage"])
    assert train.log("trainer-0").count("a last ragged step") == 1


def test_directory_and_specforge_dump_train_the_same_steps(tmp_path, recording, nats_server):
    """The same recording read from its directory (no broker) and the same samples written in
    SpecForge's dump layout (data_<i>.ckpt dicts with aux_hidden_state / hidden_state) give
    bitwise-equal per-step losses over one epoch."""
    _, cfg, rec = recording
    from_dir = trainer_cluster(cfg, tmp_path / "dir", nats_server.url, "fromdir",
                               "training.log_every=1")  # fmt: skip
    from_dir.start("trainer-0", "train", "--from-recording", str(rec))
    # the same samples in SpecForge's layout, in the recorded order (its readers sort paths)
    marker = json.loads((rec / "recording.json").read_text())
    store = open_store(marker["store_uri"])
    dump = tmp_path / "dump"
    (dump / "rows_0-5000").mkdir(parents=True)
    for i, line in enumerate((rec / "refs.jsonl").read_bytes().splitlines()):
        t = store.get(SampleRef.from_bytes(line))
        torch.save(
            {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"],
             "hidden_state": t["target"][None].clone(),
             "aux_hidden_state": t["hidden_states"][None].clone()},
            dump / "rows_0-5000" / f"data_{i:03d}.ckpt",
        )  # fmt: skip
    store.close()
    d2t = torch.tensor(marker["manifest"]["vocab"]["d2t"])
    torch.save({"d2t": d2t}, dump / "vocab_mapping.pt")  # SpecForge's mapping file
    from_dump = trainer_cluster(cfg, tmp_path / "sf", nats_server.url, "fromsf",
                                "training.log_every=1")  # fmt: skip
    from_dump.start("trainer-0", "train", "--from-recording", str(dump))
    from_dir.assert_ok(from_dir.wait("trainer-0"))
    from_dump.assert_ok(from_dump.wait("trainer-0"))
    a = [row["loss"] for row in from_dir.checkpoint_state()["history"]]
    b = [row["loss"] for row in from_dump.checkpoint_state()["history"]]
    assert len(a) == N // 2 and a == b
    assert [x.split("/")[0] for x in from_dump.checkpoint_state()["lineage"]] == [
        f"rows_0-5000:data_{i:03d}.ckpt" for i in range(N)
    ]


def test_a_recording_of_another_strategy_is_refused(tmp_path, recording, nats_server):
    _, cfg, rec = recording
    other = trainer_cluster(cfg, tmp_path / "o", nats_server.url, "other", "strategy.name=dflash")
    other.start("trainer-0", "train", "--from-recording", str(rec))
    assert other.wait("trainer-0")["trainer-0"] != 0
    assert "holds 'eagle3' features" in other.log("trainer-0")


def test_an_unknown_recording_is_named(tmp_path, tiny_target, nats_server, run_id):
    data = write_tokenised_data(tmp_path / "data.jsonl", 2)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://")
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    cluster.start("trainer-0", "train", "--from-recording", "nothing-here")
    assert cluster.wait("trainer-0")["trainer-0"] != 0
    assert "not a complete recording" in cluster.log("trainer-0")


@pytest.mark.slow
def test_a_recording_directory_trains_with_no_broker_running(tmp_path, recording):
    """Issue 34: `specbus train --from-recording DIR` looked for a broker (here the run's own,
    stopped: its url file names a port nobody serves) and said it waited for samples from
    `specbus produce` and tasks from `specbus feed`. A directory needs no broker: none is looked
    for, and rank 0 says what it trains from."""
    import os
    import subprocess
    import sys

    from specbus.core.config import build_config, dump_config
    from specbus.ops.services.common import free_port

    _, cfg, rec = recording
    tree = cfg.model_dump(mode="json")
    tree.update(run="offline", run_dir=str(tmp_path / "run"))
    tree["bus"]["url"] = None
    config = tmp_path / "offline.yaml"
    config.write_text(dump_config(build_config(tree, [])))
    stopped = tmp_path / "run" / "nats"
    stopped.mkdir(parents=True)
    (stopped / "url").write_text(f"nats://127.0.0.1:{free_port()}\n")
    env = {**os.environ, "SPECBUS_STATE_DIR": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "specbus.ops.cli", "train", "--config", str(config),
         "--from-recording", str(rec), "training.max_steps=3"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert f"from the recording {rec} (a directory: no broker needed)" in out, out
    assert "specbus produce" not in out and "training on" not in out, out
    assert "training done: 3 steps" in out, out

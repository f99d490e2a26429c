"""Colocated mode: a trainer rank captures its own tasks; same loader, trainer and checkpoints.

The equivalence gate: the same tasks, seed and model through the colocated and the
disaggregated paths give bitwise-identical per-step losses on CPU.
"""

from __future__ import annotations

import pytest
from specbus.core.errors import ConfigError
from specbus.core.models.target import load_target_info
from specbus.ops.modes import check_colocated

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

GATE = [
    "training.log_every=1",
    "training.micro_batch=2",
    "target.capture_batch=1",
    "training.prefetch=0",
    "training.total_steps=12",  # one schedule for every path, W1's two epochs included
]


def losses(cluster: Cluster) -> list[float]:
    return [row["loss"] for row in cluster.checkpoint_state()["history"]]


# One sample of 40 tokens: ids + mask (int64) + hidden_states [40, 3*32] + target [40, 32] (fp32)
sample_bytes = 40 * 8 * 2 + 40 * 96 * 4 + 40 * 32 * 4


def run_two_colocated_ranks(tmp_path, target, server, run_id, n: int, *overrides: str):
    """Feed `n` samples of 40 tokens and run 2 colocated ranks to the end of the data."""
    data = write_tokenised_data(tmp_path / "data.jsonl", n, lengths=(40, 40))
    cfg = pipeline_config(run_id, tmp_path / "run", target, data, store_uri="mem://",
                          overrides=["deployment.mode=colocated", "training.log_every=1",
                                     *overrides])  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", server.url)
    cluster.run_colocated(2)
    return cfg, cluster


@pytest.mark.slow
def test_equivalence_gate_colocated_equals_disaggregated(tmp_path, tiny_target, nats_server):
    """The same 12 tasks through colocated, disaggregated (shm://), W3' (features over HTTP)
    and W1 (a recording captured into file://, trained for two epochs: its first epoch) train
    the same six steps, bitwise."""
    data = write_tokenised_data(tmp_path / "data.jsonl", 12)

    def cluster(run: str, store_uri: str, *overrides: str) -> Cluster:
        cfg = pipeline_config(run, tmp_path / run, tiny_target, data, store_uri=store_uri,
                              overrides=[*GATE, *overrides])  # fmt: skip
        return Cluster(cfg, tmp_path / f"{run}-procs", nats_server.url)

    dis = cluster("gate_dis", "shm://gate_dis")
    col = cluster("gate_col", "mem://", "deployment.mode=colocated")
    rec = cluster("gate_rec", f"file://{tmp_path}/gate_rec")
    w1 = cluster("gate_w1", "mem://", "data.epochs=2")
    w3 = cluster("gate_w3", "http://127.0.0.1:0")
    try:
        for c in (dis, w3):
            c.start("feeder", "feed")
            c.start("producer-0", "produce")
            c.trainers(1)
        col.start("feeder", "feed")
        col.trainers(1)
        rec.start("capture", "capture")
        rec.assert_ok(rec.wait("capture"))
        w1.start("trainer-0", "train", "--from-recording", "gate_rec")
        for c in (dis, w3):
            c.assert_ok(c.wait("feeder", "producer-0", "trainer-0"))
        col.assert_ok(col.wait("feeder", "trainer-0"))
        w1.assert_ok(w1.wait("trainer-0"))
    finally:
        for c in (dis, col, rec, w1, w3):
            c.stop()
    a, b, c, d = losses(dis), losses(col), losses(w1), losses(w3)
    assert len(a) == 6 and len(c) == 12
    assert a == b == c[:6] == d  # bitwise: float equality of every step's loss
    lineage = dis.checkpoint_state()["lineage"]
    assert lineage == col.checkpoint_state()["lineage"] == w3.checkpoint_state()["lineage"]
    assert [f"{x}/e0" for x in lineage] == w1.checkpoint_state()["lineage"][: 6 * 2]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["synchronised", "overlapped"])
def test_colocated_residency_never_exceeds_one_window(
    tmp_path, tiny_target, nats_server, run_id, overlap
):
    """colocated_prefetch=0: one window resident, also when the trainer queues a step before
    the last one is settled (`training.overlap_steps`, CUDA's default, forced on here): a
    committed window holds its room until it is freed."""
    cfg, cluster = run_two_colocated_ranks(
        tmp_path, tiny_target, nats_server, run_id, 16, f"training.overlap_steps={overlap}"
    )
    history = cluster.checkpoint_state()["history"]
    assert (
        max(row["store_peak_bytes"] for row in history) <= cfg.training.micro_batch * sample_bytes
    )
    for row in history:  # rank 0's rows: the world's rate is both ranks' (lockstep)
        assert row["world_samples_per_s"] == pytest.approx(2 * row["samples_per_s"])
    assert len(cluster.checkpoint_state()["lineage"]) == 16


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["synchronised", "overlapped"])
def test_colocated_rank_killed_then_resumed_exactly_once(
    tmp_path, tiny_target, nats_server, run_id, overlap
):
    """kill -9 of both ranks past a checkpoint, then a resume: every task trained once; also
    with the steps overlapped (`training.overlap_steps`, CUDA's default, forced on here: a
    killed rank's last window is acked and not yet freed, its capacity still held)."""
    n = 200
    data = write_tokenised_data(tmp_path / "data.jsonl", n)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=["deployment.mode=colocated", "training.checkpoint_every=5",
                                     f"training.overlap_steps={overlap}"])  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    try:
        cluster.start("feeder", "feed")
        cluster.trainers(2)
        cluster.wait_past_checkpoint()  # mid-run, steps past the checkpoint
        cluster.kill("trainer-0")
        cluster.kill("trainer-1")
        cluster.trainers(2, "--resume")
        cluster.assert_ok(cluster.wait("feeder", "trainer-0", "trainer-1"))
    finally:
        cluster.stop()
    lineage = cluster.checkpoint_state()["lineage"]
    assert len(lineage) == len(set(lineage)) == n


@pytest.mark.slow
def test_colocated_ranks_train_the_last_partial_window(tmp_path, tiny_target, nats_server, run_id):
    """13 tasks on 2 colocated ranks x micro-batch 2: 3 full steps and a ragged last one; every
    task trained once, none left leased or pending at the broker."""
    from tests.test_colocated_tp import consumer_state, dead_letters

    cfg, cluster = run_two_colocated_ranks(tmp_path, tiny_target, nats_server, run_id, 13)
    state = cluster.checkpoint_state()
    assert sorted(state["lineage"]) == sorted(f"t{i}-e0" for i in range(13))
    assert state["step"] == 4
    assert consumer_state(cfg, nats_server.url) == (0, 0)
    assert dead_letters(cfg, nats_server.url) == []


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["deployment.sequence_parallel=2"], "deployment.sequence_parallel=2"),
        (["deployment.target_ep=2"], "deployment.target_ep=2"),
        (["data.max_length=300"], "headroom"),
        (
            ["target.tp_size=2", "target.engine=sglang"],
            "runs on the hf engine, not target.engine='sglang'",
        ),
        (["target.tp_size=2", "deployment.colocated_prefetch=1"], "colocated_prefetch=1"),
        (["target.max_total_tokens=10"], "max_total_tokens=10"),
    ],
)
def test_colocated_config_refusals(tmp_path, tiny_target, overrides, needle):
    """Refused at load (the config alone says it) or by the mode's check (the target's shapes)."""
    data = write_tokenised_data(tmp_path / "data.jsonl", 4)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        cfg = pipeline_config("r", tmp_path, tiny_target, data, store_uri="mem://",
                              overrides=["deployment.mode=colocated", *overrides])  # fmt: skip
        check_colocated(cfg, load_target_info(tiny_target), world=2)


def test_colocated_prefetch_overlaps_capture_and_bounds_residency(
    tmp_path, tiny_target, nats_server, run_id
):
    """deployment.colocated_prefetch=1: the next window is captured during the step; residency
    stays within two windows and every sample is trained once."""
    cfg, cluster = run_two_colocated_ranks(
        tmp_path, tiny_target, nats_server, run_id, 24, "deployment.colocated_prefetch=1"
    )
    window = cfg.training.micro_batch * cfg.training.accumulation
    peaks = [row["store_peak_bytes"] for row in cluster.checkpoint_state()["history"]]
    assert window * sample_bytes < max(peaks) <= 2 * window * sample_bytes
    lineage = cluster.checkpoint_state()["lineage"]
    assert len(lineage) == len(set(lineage)) == 24


@pytest.mark.slow
def test_colocated_capture_waits_leased_for_room_in_a_full_store(
    tmp_path, tiny_target, nats_server, run_id
):
    """Issue 33: a budget of 1.5 windows with colocated_prefetch=1: the next window's second
    capture does not fit while the step trains the first. It waits, leased, until the step
    releases its window (no delivery spent, nothing dead); before, the put's StoreFull ended
    the rank."""
    budget = 3 * sample_bytes  # a window is 2 samples: one and a half windows
    cfg, cluster = run_two_colocated_ranks(
        tmp_path, tiny_target, nats_server, run_id, 24, "deployment.colocated_prefetch=1",
        f"store.budget_bytes={budget}", "training.overlap_steps=true",  # CUDA's default
    )  # fmt: skip
    lineage = cluster.checkpoint_state()["lineage"]
    assert len(lineage) == len(set(lineage)) == 24
    peaks = [row["store_peak_bytes"] for row in cluster.checkpoint_state()["history"]]
    assert max(peaks) <= budget
    logs = cluster.log("trainer-0") + cluster.log("trainer-1")
    assert "room in the rank's store after" in logs  # the store was full, mid-run
    assert "24 samples, 0 dead letters" in cluster.log("trainer-0")


@pytest.mark.slow
def test_colocated_budget_below_one_window_is_refused(tmp_path, tiny_target, nats_server, run_id):
    """A store that cannot hold one window could never train: refused, naming the setting."""
    data = write_tokenised_data(tmp_path / "data.jsonl", 8, lengths=(40, 40))
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=["deployment.mode=colocated",
                                     f"store.budget_bytes={3 * sample_bytes // 2}"])  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    try:
        cluster.start("feeder", "feed")
        cluster.trainers(2)
        codes = cluster.wait("feeder", "trainer-0", "trainer-1", timeout=180)
    finally:
        cluster.stop()
    assert codes["trainer-0"] != 0 or codes["trainer-1"] != 0
    logs = cluster.log("trainer-0") + cluster.log("trainer-1")
    assert "cannot hold one window of 2 samples" in logs and "store.budget_bytes" in logs

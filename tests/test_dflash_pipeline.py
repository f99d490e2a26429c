"""DFlash-family strategies through the real pipeline (processes, broker, store), with no
pipeline change: one colocated run per strategy, and the colocated == disaggregated bitwise
gate for DFlash (anchors come from generators seeded by step and rank, so both runs draw the
same ones)."""

from __future__ import annotations

import pytest
from specbus.core.config import build_config

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

DFLASH = {"block_size": 4, "num_anchors": 8, "chunk_blocks": 2}


def with_strategy(cfg, name: str, *overrides: str):
    """The pipeline test config with its EAGLE3 keys replaced by a DFlash-family strategy."""
    tree = cfg.model_dump(mode="json")
    tree["strategy"] = {"name": name, **DFLASH}
    if name == "dspark":
        tree["strategy"]["dspark"] = {"markov_rank": 8}
    return build_config(tree, list(overrides))


@pytest.mark.parametrize("name", ["dflash", "domino", "dspark"])
def test_each_strategy_trains_colocated_and_exports(tmp_path, tiny_target, nats_server, name):
    data = write_tokenised_data(tmp_path / "data.jsonl", 8, lengths=(24, 40))
    base = pipeline_config(f"col_{name}", tmp_path / "run", tiny_target, data, store_uri="mem://")
    cfg = with_strategy(base, name, "deployment.mode=colocated", "training.log_every=1")
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    cluster.run_colocated(1)
    state = cluster.checkpoint_state()
    assert len(state["lineage"]) == 8 and state["step"] == 4
    rows = state["history"]
    assert all(row["loss"] > 0 for row in rows) and "accept_len" in rows[0]
    if name == "domino":  # the schedule reached the loss: lambda decays from 1
        assert rows[0]["lambda_base"] == 1.0 and rows[-1]["lambda_base"] < 1.0
    from specbus.ops.evaluate import compare_drafts
    from specbus.ops.export import export_checkpoint

    out = export_checkpoint(cfg, "latest", tmp_path / "export")
    assert (out / "model.safetensors").exists()
    held = cfg.model_copy(update={"data": cfg.data.model_copy(update={"holdout": 2})})
    report = compare_drafts(held, num_prompts=2, max_new_tokens=8)  # block decoding, lossless
    assert report.trained.lossless and report.trained.rounds > 0
    assert report.num_draft_tokens == (4 if name == "dspark" else 3)


@pytest.mark.slow
def test_equivalence_gate_dflash_colocated_equals_disaggregated(tmp_path, tiny_target, nats_server):
    data = write_tokenised_data(tmp_path / "data.jsonl", 8, lengths=(24, 40))
    gate = ["training.log_every=1", "training.micro_batch=2", "target.capture_batch=1",
            "training.prefetch=0"]  # fmt: skip
    dis_cfg = with_strategy(
        pipeline_config("dgate_dis", tmp_path / "dis", tiny_target, data, store_uri="shm://dgate_dis"),
        "dflash", *gate,
    )  # fmt: skip
    col_cfg = with_strategy(
        pipeline_config("dgate_col", tmp_path / "col", tiny_target, data, store_uri="mem://"),
        "dflash", *gate, "deployment.mode=colocated",
    )  # fmt: skip
    dis = Cluster(dis_cfg, tmp_path / "dis-procs", nats_server.url)
    col = Cluster(col_cfg, tmp_path / "col-procs", nats_server.url)
    try:
        dis.start("feeder", "feed")
        dis.start("producer-0", "produce")
        dis.trainers(1)
        dis.assert_ok(dis.wait("feeder", "producer-0", "trainer-0"))
        col.start("feeder", "feed")
        col.trainers(1)
        col.assert_ok(col.wait("feeder", "trainer-0"))
    finally:
        dis.stop()
        col.stop()
    a = [row["loss"] for row in dis.checkpoint_state()["history"]]
    b = [row["loss"] for row in col.checkpoint_state()["history"]]
    assert len(a) == 4 and a == b  # bitwise
    assert dis.checkpoint_state()["lineage"] == col.checkpoint_state()["lineage"]

"""P-EAGLE through the real pipeline (processes, broker, store) with no pipeline change: a colocated
run trains it, `specbus export`'s path writes the speculators directory, and the evaluation
decodes it live (parallel drafting, lossless)."""

from __future__ import annotations

import json

import pytest
from specbus.core.config import build_config

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data


@pytest.mark.slow  # a colocated run, an export and live decoding: > 15 s on 2 cores
def test_peagle_trains_colocated_exports_and_decodes(tmp_path, tiny_target, nats_server):
    data = write_tokenised_data(tmp_path / "data.jsonl", 8, lengths=(24, 40))
    base = pipeline_config("col_peagle", tmp_path / "run", tiny_target, data, store_uri="mem://")
    tree = base.model_dump(mode="json")
    tree["strategy"] = {"name": "peagle", "draft": {"draft_vocab_size": 64},
                        "peagle": {"num_depths": 3, "max_anchors": 16}}  # fmt: skip
    tree["target"]["aux_layers"] = [2, 0, 1]  # the tiny target's default repeats a layer
    cfg = build_config(tree, ["deployment.mode=colocated", "training.log_every=1"])
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    cluster.run_colocated(1)
    state = cluster.checkpoint_state()
    assert len(state["lineage"]) == 8 and state["step"] == 4
    rows = state["history"]
    assert all(row["loss"] > 0 for row in rows) and "acc_2" in rows[0]
    from specbus.ops.evaluate import compare_drafts
    from specbus.ops.export import export_checkpoint

    out = export_checkpoint(cfg, "latest", tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target)
    held = cfg.model_copy(update={"data": cfg.data.model_copy(update={"holdout": 2})})
    report = compare_drafts(held, num_prompts=2, max_new_tokens=8)  # parallel drafting, live
    assert report.trained.lossless and report.trained.rounds > 0
    assert report.num_draft_tokens == 3


def test_serve_speculative_refuses_a_peagle_run_naming_vllm():
    """The live server's decoder drafts EAGLE3 chains and DFlash-family blocks; a P-EAGLE run
    is refused at start, before any draft or reload thread, pointing at vLLM."""
    from specbus.core.config import build_config
    from specbus.core.errors import ConfigError
    from specbus.ops.live import SpecOptions, Speculation

    cfg = build_config({}, ["strategy.name=peagle", "deployment.mode=live"])
    with pytest.raises(ConfigError, match="P-EAGLE draft is served by vLLM"):
        Speculation(cfg, engine=None, metrics=None, bus_url=None, opts=SpecOptions())

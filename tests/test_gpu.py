"""The pipeline on CUDA: bf16 autocast loss vs fp32, the hf engine's bf16 capture vs fp32 on
CPU, colocated and disaggregated runs through real processes, the benchmark's random target.

Run on the lent H200 by ops/bench/gpu.sh (`pytest -m gpu`); skipped without CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
from specbus.core.config import DraftConfig, StrategyConfig, TargetConfig
from specbus.core.models.target import TargetHeads, TargetInfo
from specbus.core.strategies import StepContext, build_strategy

from tests.fixtures.pipeline import Cluster, pipeline_config, write_tokenised_data

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / b.norm())


def tiny_info(hidden: int = 64, vocab: int = 512) -> TargetInfo:
    return TargetInfo(
        name="t", path=".", model_type="llama", num_layers=8, hidden_size=hidden,
        vocab_size=vocab, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, rms_norm_eps=1e-5, hidden_act="silu",
        max_position_embeddings=4096, rope_theta=1e4,
    )  # fmt: skip


def bf16_vs_fp32(device: str):
    """(loss16, loss32, metrics16, metrics32, draft16, draft32) after one backward each."""
    torch.manual_seed(0)
    info = tiny_info()
    heads = TargetHeads(torch.randn(512, 64) * 0.05, torch.randn(512, 64) * 0.05)
    strategy = build_strategy(
        StrategyConfig(ttt_length=4, draft=DraftConfig(draft_vocab_size=512)), info, heads=heads
    )
    samples = [
        {
            "input_ids": torch.randint(0, 512, (n,)),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "hidden_states": torch.randn(n, 3 * 64).to(torch.bfloat16),
            "target": torch.randn(n, 64).to(torch.bfloat16),
        }
        for n in (96, 64)
    ]
    draft32 = strategy.build_model().to(device)
    draft16 = copy.deepcopy(draft32)
    batch16 = strategy.collate(samples).to(device)
    batch32 = strategy.collate([{k: v.float() if v.is_floating_point() else v for k, v in s.items()}
                                for s in samples]).to(device)  # fmt: skip

    loss32, m32 = strategy.forward_loss(draft32, batch32, StepContext())
    loss32.backward()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss16, m16 = strategy.forward_loss(draft16, batch16, StepContext())
    loss16.backward()
    return loss16, loss32, m16, m32, draft16, draft32


def test_eagle3_loss_bf16_autocast_matches_fp32_on_cuda():
    loss16, loss32, m16, m32, draft16, draft32 = bf16_vs_fp32("cuda")
    assert torch.isfinite(loss16) and torch.isfinite(loss32)
    assert abs(float(loss16) - float(loss32)) / abs(float(loss32)) < 2e-2
    pairs = list(zip(draft16.parameters(), draft32.parameters(), strict=True))
    assert all(p16.dtype == torch.float32 for p16, _ in pairs)  # fp32 master weights
    g16 = torch.cat([a.grad.flatten() for a, b in pairs if b.grad is not None])
    g32 = torch.cat([b.grad.flatten() for a, b in pairs if b.grad is not None])
    assert torch.isfinite(g16).all() and rel(g16, g32) < 5e-2
    for k in range(4):
        assert abs(float(m16[f"acc_{k}"]) - float(m32[f"acc_{k}"])) < 0.05


def test_hf_engine_captures_bf16_on_cuda_close_to_fp32_on_cpu(tiny_target):
    from specbus.core.models.target import load_target_info
    from specbus.producers.engines.hf import HFEngine

    gpu = HFEngine(TargetConfig(model=str(tiny_target), device="cuda", capture_batch=2))
    cpu = HFEngine(TargetConfig(model=str(tiny_target), device="cpu", capture_batch=2))
    assert gpu.dtype == torch.bfloat16 and cpu.dtype == torch.float32
    info = load_target_info(tiny_target)
    contract = build_strategy(StrategyConfig(), info).feature_contract(info)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 128, (n,), generator=g) for n in (40, 17)]  # padded batch
    on_gpu = gpu.capture(ids, None, contract, device="cuda")
    on_host = gpu.capture(ids, None, contract)
    ref = cpu.capture(ids, None, contract)
    for a, h, r, n in zip(on_gpu, on_host, ref, (40, 17), strict=True):
        assert a["hidden_states"].device.type == "cuda" and h["hidden_states"].device.type == "cpu"
        assert a["hidden_states"].dtype == torch.bfloat16
        assert a["hidden_states"].shape == (n, 3 * info.hidden_size)
        assert torch.equal(a["hidden_states"].cpu(), h["hidden_states"])
        assert rel(a["hidden_states"], r["hidden_states"]) < 2e-2
        assert rel(a["target"], r["target"]) < 2e-2
    gpu.close()
    cpu.close()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_pipeline_trains_on_cuda(mode, tmp_path, tiny_target, nats_server, run_id):
    data = write_tokenised_data(tmp_path / "data.jsonl", 12)
    store = "mem://" if mode == "colocated" else f"shm://{run_id}"
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri=store,
                          overrides=[f"deployment.mode={mode}", "training.log_every=1"])  # fmt: skip
    cluster = Cluster(cfg, tmp_path / "procs", nats_server.url)
    try:
        cluster.start("feeder", "feed")
        names = ["feeder", "trainer-0"]
        if mode == "disaggregated":
            cluster.start("producer-0", "produce")
            names.append("producer-0")
        cluster.trainers(1)
        cluster.assert_ok(cluster.wait(*names, timeout=300))
    finally:
        cluster.stop()
    state = cluster.checkpoint_state()
    assert state["step"] == 6 and len(state["lineage"]) == 12
    rows = state["history"]
    assert all(row["gpu_peak_gib"] > 0 for row in rows)  # the trainer ran on the GPU
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in rows)
    weights = state["model"]
    assert all(v.dtype == torch.float32 for v in weights.values() if v.is_floating_point())


def test_bench_random_target_is_seeded_and_carries_the_heads(tmp_path):
    from specbus.core.models.target import load_target_heads, target_fingerprint
    from specbus.ops.bench.random_target import build_random_target, write_target

    small = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16}  # fmt: skip
    path = write_target(tmp_path / "t", small)
    a, b = build_random_target(path, "cuda"), build_random_target(path, "cuda")
    heads = load_target_heads(path, dtype=torch.bfloat16)
    assert next(a.parameters()).device.type == "cuda"
    assert torch.equal(a.get_input_embeddings().weight.cpu(), heads.embed_tokens)
    assert torch.equal(a.get_output_embeddings().weight.cpu(), heads.lm_head)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert pa.dtype == torch.bfloat16 and not pa.requires_grad
    assert len(target_fingerprint(path)) == 32

"""Target tensor parallelism in the hf engine: TP=2 (2 processes, gloo, CPU) captures the same
features as TP=1, and shapes that do not divide are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from specbus.core.config import StrategyConfig, TargetConfig
from specbus.core.errors import ConfigError
from specbus.core.strategies.base import build_strategy
from specbus.ops.services.common import free_port
from specbus.producers.engines.hf import HFEngine
from specbus.producers.engines.tp import check_tp_shapes

from tests.fixtures.pipeline import VOCAB


def _sequences() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, VOCAB, (n,), generator=g) for n in (17, 40, 5)]
    return ids, [torch.ones_like(i) for i in ids]


def _contract(engine: HFEngine):
    strategy = build_strategy(StrategyConfig(), engine.info)
    return strategy.feature_contract(engine.info)


def _tp_worker(rank: int, world: int, port: int, target: str, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # A different seed per rank: the engine must make the ranks' weights agree itself.
        torch.manual_seed(100 + rank)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        if rank == 1:  # perturb the replicated and sharded weights of the non-source rank
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("island", "tp"))["tp"]
        cfg = TargetConfig(model=target, device="cpu", tp_size=world, capture_batch=2)
        engine = HFEngine(cfg, model=model.eval().requires_grad_(False), tp_mesh=mesh)
        q_proj = engine.model.model.layers[0].self_attn.q_proj.weight  # a DTensor shard
        assert q_proj.to_local().shape[0] == q_proj.shape[0] // world
        ids, masks = _sequences()
        samples = engine.capture(ids, masks, _contract(engine))
        torch.save(samples, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_tp2_features_equal_tp1(tmp_path, tiny_target):
    engine = HFEngine(TargetConfig(model=str(tiny_target), device="cpu", capture_batch=2))
    ids, masks = _sequences()
    reference = engine.capture(ids, masks, _contract(engine))
    out = str(tmp_path / "features")
    mp.start_processes(_tp_worker, args=(2, free_port(), str(tiny_target), out), nprocs=2,
                       start_method="spawn")  # fmt: skip
    for rank in range(2):
        samples = torch.load(f"{out}.{rank}", weights_only=True)
        assert len(samples) == len(reference)
        for got, want in zip(samples, reference, strict=True):
            assert got.keys() == want.keys()
            for key in want:
                assert got[key].shape == want[key].shape, key
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_tp_engine_needs_its_mesh(tiny_target):
    with pytest.raises(ConfigError, match="target.tp_size=2 needs the island's TP mesh"):
        HFEngine(TargetConfig(model=str(tiny_target), device="cpu", tp_size=2))


@pytest.mark.parametrize(
    "shape, needle",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4, "intermediate_size": 64},
         "num_attention_heads=6"),
        ({"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 64},
         "num_key_value_heads=2"),
        ({"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 90},
         "intermediate_size=90"),
    ],
)  # fmt: skip
def test_tp_shapes_that_do_not_divide_are_refused(shape, needle):
    with pytest.raises(
        ConfigError, match=f"target.tp_size=4 does not divide the target's {needle}"
    ):
        check_tp_shapes(4, **shape)
    check_tp_shapes(2, **{k: v * 2 for k, v in shape.items()})

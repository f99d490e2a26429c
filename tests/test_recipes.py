"""examples/recipes: each YAML loads as a run config, names the reference recipe it mirrors and
what differs, and builds its strategy (config refusals included) for the reference's target."""

from __future__ import annotations

from pathlib import Path

import pytest
from specbus.core.config import load_config
from specbus.core.models.target import TargetInfo
from specbus.core.strategies.base import build_strategy

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "recipes"
EXPECTED = {  # file -> (strategy, reference)
    "eagle3-llama3.1-8b.yaml": ("eagle3", "SpecForge 0.2.0"),
    "eagle3-qwen3-8b.yaml": ("eagle3", "SpecForge 0.2.0"),
    "dflash-qwen3-8b.yaml": ("dflash", "SpecForge 0.2.0"),
    "domino-qwen3-8b.yaml": ("domino", "SpecForge 0.2.0"),
    "dspark-qwen3-8b.yaml": ("dspark", "SpecForge 0.2.0"),
    "peagle-qwen3-8b.yaml": ("peagle", "speculators 0.9.0"),
}
TARGETS = {  # the references' targets, described (nothing is downloaded)
    "llama3.1-8b": dict(model_type="llama", num_layers=32, hidden_size=4096, vocab_size=128256,
                        intermediate_size=14336, rope_theta=500000.0, rms_norm_eps=1e-5),
    "qwen3-8b": dict(model_type="qwen3", num_layers=36, hidden_size=4096, vocab_size=151936,
                     intermediate_size=12288, rope_theta=1e6, rms_norm_eps=1e-6),
}  # fmt: skip


def test_there_is_one_recipe_per_reference_recipe():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_recipe_loads_names_its_reference_and_builds_its_strategy(name):
    path = RECIPES / name
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    strategy, reference = EXPECTED[name]
    assert header[0].startswith(f"# Mirrors {reference}'s")
    assert any("Differs, and why:" in line for line in header)
    cfg = load_config(path)
    assert cfg.strategy.name == strategy
    target = next(t for key, t in TARGETS.items() if key in name)
    info = TargetInfo(name=name, path=Path("."), num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, hidden_act="silu", max_position_embeddings=40960,
                      **target)  # fmt: skip
    built = build_strategy(cfg.strategy, info, aux_layers=cfg.target.aux_layers)
    if strategy == "eagle3":
        from specbus.core.models.registry import eagle3_config

        arch = eagle3_config(cfg.strategy.draft, info, built.aux_layers)
        assert arch.draft_vocab_size == 32000 and built.aux_layers == info.default_aux_layers
    else:
        arch = built.model_config(info)  # validated, no weights allocated
        assert arch.num_layers == cfg.strategy.draft.num_layers

"""`target.compile`: the hf engine captures through `torch.compile`d decoder layers.

The features equal the eager engine's (padded batches and a sequence alone, several lengths),
one graph serves every layer (no per-layer or per-length recompiles past the dynamic one), and
outside capture the layers run their eager forward again (the live server's cached decode)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from specbus.core.config import StrategyConfig, TargetConfig
from specbus.core.models.target import decoder_layers, load_target_info
from specbus.core.strategies.base import build_strategy
from specbus.producers.engines import hf


def test_compiled_capture_equals_eager_with_one_graph_for_every_layer(tiny_target):
    from torch._dynamo.utils import counters

    eager = hf.HFEngine(TargetConfig(model=str(tiny_target), device="cpu", capture_batch=3))
    compiled = hf.HFEngine(TargetConfig(model=str(tiny_target), device="cpu", capture_batch=3,
                                        compile=True), model=eager.model)  # fmt: skip
    contract = build_strategy(StrategyConfig(), load_target_info(tiny_target)).feature_contract()
    layers = decoder_layers(eager.model)
    assert len(layers) >= 2
    g = torch.Generator().manual_seed(0)
    rounds = [[40, 17, 33], [64], [25, 51], [70, 9, 12]]  # padded batches and one alone
    graphs_before = counters["stats"]["unique_graphs"]
    for lengths in rounds:
        seqs = [torch.randint(3, 128, (n,), generator=g) for n in lengths]
        want = eager.capture(seqs, None, contract)
        got = compiled.capture(seqs, None, contract)
        assert not any("forward" in layer.__dict__ for layer in layers)  # eager again
        for w, c in zip(want, got, strict=True):
            assert w.keys() == c.keys()
            for name in w:
                torch.testing.assert_close(c[name], w[name], rtol=1e-4, atol=1e-5, msg=name)
    # a static graph, then dynamic ones in the length (with and without a padding mask): 3
    # here, for 4 layers and 4 rounds of lengths; a graph per layer would be 4 or more
    assert 1 <= counters["stats"]["unique_graphs"] - graphs_before < len(layers)
    compiled.close()


def test_compile_is_refused_where_it_does_not_apply():
    """Sharded layers run eager and other engines compile their own way: a config error."""
    for bad in ({"tp_size": 2}, {"engine": "sglang"}):
        with pytest.raises(ValidationError, match="target.compile"):
            TargetConfig(compile=True, **bad)

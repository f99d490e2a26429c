"""`target.cuda_graphs`: the capture's prefill, padded up to a length bucket and run without a
mask, then (on CUDA) replayed as one graph per (batch, bucket).

CPU: the bucketed maskless prefill gives the features of the masked one at every real
position (padded batches of mixed lengths, a sequence alone, lengths on and off a bucket's
edge), padding never passes the context length, and the config refuses it where it cannot
apply. CUDA (`-m gpu`, run by ops/bench/gpu.sh's gputests stage): replays equal the eager
capture, one graph serves every length of its bucket, and a capture thread on its own stream
captures and replays while another thread launches work."""

from __future__ import annotations

import threading

import pytest
import torch
from pydantic import ValidationError
from specbus.core.config import StrategyConfig, TargetConfig
from specbus.core.models.target import load_target_info
from specbus.core.strategies.base import build_strategy
from specbus.ops.bench.capture import largest_difference
from specbus.producers.engines import hf
from specbus.producers.engines.prefill_graphs import PrefillGraphs, full_attention_layers


def engines(target, device: str, **graphs):
    plain = hf.HFEngine(TargetConfig(model=str(target), device=device, capture_batch=3))
    graphed = hf.HFEngine(TargetConfig(model=str(target), device=device, capture_batch=3,
                                       cuda_graphs=True, **graphs), model=plain.model)  # fmt: skip
    contract = build_strategy(StrategyConfig(), load_target_info(target)).feature_contract()
    return plain, graphed, contract


def assert_same_features(want: list[dict], got: list[dict], relative: float | None = None,
                         **tol) -> None:  # fmt: skip
    """Equal features; `relative`: the largest difference over the feature's largest
    magnitude at most this (bf16 on the GPU: a masked and a maskless attention kernel round
    differently, 2^-8 = 3.9e-3 a rounding)."""
    assert len(want) == len(got)
    for w, g in zip(want, got, strict=True):
        assert w.keys() == g.keys()
        for name in w:
            assert g[name].shape == w[name].shape, name
            if relative is None or not torch.is_floating_point(w[name]):
                torch.testing.assert_close(g[name], w[name], msg=name, **tol)
            else:
                assert largest_difference({name: g[name]}, {name: w[name]}) <= relative, name


def test_the_bucketed_maskless_prefill_gives_the_masked_features(tiny_target):
    plain, graphed, contract = engines(tiny_target, "cpu", graph_bucket=16)
    graphs = graphed._graphs
    assert graphs is not None and not graphs.use_graphs  # the CPU: the same path, no graph
    g = torch.Generator().manual_seed(0)
    rounds = [[40, 17, 33], [64], [16, 1], [70, 9, 12]]  # padded batches, one alone, edges
    for lengths in rounds:
        seqs = [torch.randint(3, 128, (n,), generator=g) for n in lengths]
        assert_same_features(plain.capture(seqs, None, contract),
                             graphed.capture(seqs, None, contract), rtol=1e-4, atol=1e-5)  # fmt: skip
    assert graphs.eager == sum(len(range(0, len(r), 3)) for r in rounds)
    assert graphs.replays == graphs.captures == 0


def test_padding_stops_at_the_context_length():
    graphs = PrefillGraphs(lambda ids, layers: (ids, ids), torch.device("cpu"), pad_id=0,
                           bucket=256, max_length=1000)  # fmt: skip
    assert [graphs.bucket_length(n) for n in (1, 256, 257, 768, 769, 1000)] == [
        256, 256, 512, 768, 769, 1000]  # fmt: skip
    seen = []

    def forward(ids_BL, layers):
        seen.append(tuple(ids_BL.shape))
        return ids_BL[..., None].float(), ids_BL[..., None].float()

    graphs.forward = forward
    aux, final = graphs(torch.arange(1, 301).reshape(1, 300), (0,))
    assert seen == [(1, 512)] and aux.shape == final.shape == (1, 300, 1)
    assert aux[0, :, 0].tolist() == list(range(1, 301))  # the real positions, in order


def test_a_capture_that_fails_leaves_the_prefill_eager_with_one_warning(caplog):
    """What a GPU capture failure does (an op that cannot be captured), shown on the CPU where
    capturing fails for want of CUDA: the batch is still answered, correctly, and no later
    batch tries again."""
    calls = []

    def forward(ids_BL, layers):
        calls.append(tuple(ids_BL.shape))
        return ids_BL[..., None].float() * 2, ids_BL[..., None].float()

    graphs = PrefillGraphs(forward, torch.device("cpu"), pad_id=0, bucket=8)
    graphs.use_graphs = True  # as on CUDA
    with caplog.at_level("WARNING", logger="specbus.capture"):
        aux, final = graphs(torch.arange(1, 6).reshape(1, 5), (0,))
        again, _ = graphs(torch.arange(1, 8).reshape(1, 7), (0,))
    assert graphs.failed and graphs.captures == graphs.replays == 0 and graphs.eager == 2
    assert aux[0, :, 0].tolist() == [2, 4, 6, 8, 10] and final.shape == (1, 5, 1)
    assert again.shape == (1, 7, 1) and calls == [(1, 8), (1, 8)]  # no second attempt
    assert sum("capturing the prefill" in r.message for r in caplog.records) == 1


def test_cuda_graphs_are_refused_where_they_cannot_apply():
    for bad in ({"tp_size": 2}, {"engine": "sglang"}):
        with pytest.raises(ValidationError, match="target.cuda_graphs"):
            TargetConfig(cuda_graphs=True, **bad)
    with pytest.raises(ValidationError):
        TargetConfig(cuda_graphs=True, graph_bucket=0)


# CUDA graphs exist on CUDA only (gpu.sh's gputests stage runs these on the lent H200)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager_layers", "compiled_layers"])
@pytest.mark.gpu
@needs_cuda
def test_graph_replays_equal_the_eager_capture_one_graph_per_bucket(tiny_target, compiled):
    plain, graphed, contract = engines(tiny_target, "cuda", graph_bucket=64, compile=compiled)
    graphs = graphed._graphs
    assert graphs.use_graphs
    g = torch.Generator().manual_seed(0)
    # 40 and 60 share the 64 bucket (alone: B 1); 100 -> 128; [70, 9, 12] -> B 3 x 128
    rounds = [[40], [60], [100], [40], [70, 9, 12], [33, 50, 64]]
    for lengths in rounds:
        seqs = [torch.randint(3, 128, (n,), generator=g) for n in lengths]
        want = plain.capture(seqs, None, contract, device="cuda")
        got = graphed.capture(seqs, None, contract, device="cuda")
        assert_same_features(want, got, relative=2e-2)
    assert graphs.failed is None
    assert graphs.captures == 4  # (1, 64), (1, 128), (3, 128), (3, 64)
    assert graphs.replays == len(rounds) and graphs.eager == 0


@pytest.mark.gpu
@needs_cuda
def test_a_capture_thread_on_its_own_stream_graphs_beside_a_busy_thread(tiny_target):
    """As a colocated rank runs: the capture in a thread on a stream of its own, the step's
    kernels launched meanwhile by the main thread (capture_error_mode thread_local)."""
    plain, graphed, contract = engines(tiny_target, "cuda", graph_bucket=32)
    g = torch.Generator().manual_seed(1)
    seqs = [[torch.randint(3, 128, (n,), generator=g)] for n in (20, 30, 50, 64, 25)]
    want = [plain.capture(s, None, contract, device="cuda") for s in seqs]
    got, errors, stop = [], [], threading.Event()

    def capture():
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for s in seqs:
                    got.append(graphed.capture(s, None, contract, device="cuda"))
            stream.synchronize()
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)
        finally:
            stop.set()

    thread = threading.Thread(target=capture)
    x = torch.randn(1024, 1024, device="cuda")
    thread.start()
    launched = 0
    while not stop.is_set():
        x = torch.tanh(x @ x.T / 1024)  # allocations and launches on the default stream
        launched += 1
    thread.join()
    torch.cuda.synchronize()
    assert not errors, errors
    assert launched > 0
    for w, c in zip(want, got, strict=True):
        assert_same_features(w, c, relative=2e-2)
    assert graphed._graphs.captures == 2 and graphed._graphs.replays == len(seqs)


def test_maskless_layers_drop_the_mask_of_full_attention_layers_only(tiny_target):
    """The hook under the graphs' prefill: a layer of full attention gets no mask whatever the
    model built (here a 4D mask that attends everywhere, which the model passes as-is), so it
    runs causally; a config's windowed layers keep theirs."""
    from transformers import AutoConfig

    plain, graphed, _ = engines(tiny_target, "cpu")
    base = plain.model.model
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    everywhere = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    causal = base(input_ids=ids).last_hidden_state
    with torch.no_grad():
        unmasked = base(input_ids=ids, attention_mask=everywhere).last_hidden_state
        with graphed._maskless:
            dropped = base(input_ids=ids, attention_mask=everywhere).last_hidden_state
    torch.testing.assert_close(dropped, causal, rtol=1e-5, atol=1e-5)
    assert (unmasked - causal).abs().max() > 1e-3  # the mask would have mattered
    assert not graphed._maskless._handles  # removed on exit

    n = len(hf.decoder_layers(plain.model))
    assert full_attention_layers(plain.model.config, n) == [True] * n
    mixed = AutoConfig.for_model("qwen3", num_hidden_layers=4, use_sliding_window=True,
                                 sliding_window=64, max_window_layers=2)  # fmt: skip
    assert full_attention_layers(mixed, 4) == [t == "full_attention" for t in mixed.layer_types]
    assert not all(full_attention_layers(mixed, 4))
    windowed = AutoConfig.for_model("mistral", num_hidden_layers=3, sliding_window=64)
    assert full_attention_layers(windowed, 3) == [False] * 3


def test_a_compiled_prefill_sees_the_same_arguments_in_a_capture_as_in_its_warm_up(
    tiny_target, monkeypatch
):
    """What invalidated the compiled capture on an H200 (transformers 5.17): a capturing
    stream counts as tracing there, the model builds the causal mask it skipped in the
    warm-up, and the compiled layers recompiled inside the capture. Here the capture's
    condition is emulated on the CPU and any recompile fails."""
    _, graphed, contract = engines(tiny_target, "cpu", compile=True)
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(3))
    layers = tuple(contract.aux_layers)
    with torch.no_grad():
        want = graphed._forward(ids, layers)  # the warm-up: compiles
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with torch.compiler.set_stance("fail_on_recompile"):
            got = graphed._forward(ids, layers)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)

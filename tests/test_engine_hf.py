"""The hf target engine: capture shapes, padding, loud contract checks; the embedded SmolLM2."""

import threading
import time
from functools import lru_cache

import pytest
import torch
from specbus.core.config import StrategyConfig, TargetConfig
from specbus.core.errors import CaptureError
from specbus.core.models import target as target_mod
from specbus.core.strategies import build_strategy
from specbus.producers.engines.base import TargetEngine
from specbus.producers.engines.registry import build_engine
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-target")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def engine_for(path, **kw):
    return build_engine(TargetConfig(model=str(path), **kw))


def test_capture_shapes_dtypes_and_layers(tiny_dir):
    engine = engine_for(tiny_dir, capture_batch=2)
    assert isinstance(engine, TargetEngine)
    contract = build_strategy(StrategyConfig(), engine.info).feature_contract()
    assert contract.aux_layers == (1, 2, 2)  # [1, L//2 - 1, L - 4] for 6 layers
    seqs = [torch.randint(0, 128, (n,)) for n in (9, 4, 7)]
    masks = [torch.randint(0, 2, (n,)) for n in (9, 4, 7)]
    samples = engine.capture(seqs, masks, contract)
    with torch.no_grad():
        for ids, mask, sample in zip(seqs, masks, samples, strict=True):
            assert (
                sample["input_ids"].tolist() == ids.tolist()
                and sample["loss_mask"].tolist() == mask.tolist()
            )
            assert sample["hidden_states"].shape == (len(ids), 96) and sample["target"].shape == (
                len(ids),
                32,
            )
            assert (
                sample["hidden_states"].dtype == torch.float32
                and sample["input_ids"].dtype == torch.int64
            )
            # Unpadded reference: aux layer k's output is hidden_states[k + 1]; the final
            # feature is the post-norm last hidden state.
            ref = engine.model(input_ids=ids[None], output_hidden_states=True)
            expected_aux = torch.cat([ref.hidden_states[k + 1][0] for k in (1, 2, 2)], -1)
            torch.testing.assert_close(sample["hidden_states"], expected_aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                sample["target"], ref.hidden_states[-1][0], rtol=1e-5, atol=1e-5
            )


def test_capture_refuses_bad_inputs_loudly(tiny_dir):
    engine = engine_for(tiny_dir, context_length=16)
    contract = build_strategy(StrategyConfig(), engine.info).feature_contract()
    with pytest.raises(CaptureError, match="loss mask"):
        engine.capture([torch.arange(5)], [torch.ones(4)], contract)
    with pytest.raises(CaptureError, match="vocabulary"):
        engine.capture([torch.tensor([1, 500])], None, contract)
    with pytest.raises(CaptureError, match="tokens"):
        engine.capture([torch.arange(17)], None, contract)
    with pytest.raises(CaptureError, match="tokens"):
        engine.capture([torch.tensor([], dtype=torch.long)], None, contract)


def test_fingerprints_identify_weights(tiny_dir, tmp_path):
    first = engine_for(tiny_dir)
    assert first.target_fingerprint == engine_for(tiny_dir).target_fingerprint
    other = LlamaForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        other.lm_head.weight[0, 0] += 1.0
    other.save_pretrained(tmp_path / "changed")
    assert engine_for(tmp_path / "changed").target_fingerprint != first.target_fingerprint
    assert first.tokenizer is None and first.tokenizer_fingerprint == "none"


def test_concurrent_first_use_yields_one_complete_directory(tmp_path, monkeypatch):
    calls = []

    def slow_convert(gguf, out, progress=None):
        calls.append(out)
        (out / "config.json").write_text("{}")
        time.sleep(0.3)
        (out / target_mod._CONVERTED_MARKER).write_text('{"fingerprint": "x"}')

    monkeypatch.setattr(target_mod, "_convert_gguf", slow_convert)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(target_mod._ensure_smollm2(tmp_path)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = tmp_path / "targets" / "smollm2-135m-instruct-bf16"
    assert results == [final, final] and (final / target_mod._CONVERTED_MARKER).is_file()
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]  # no temp dir left
    calls.clear()
    assert target_mod._ensure_smollm2(tmp_path) == final and calls == []  # cached: no conversion


@lru_cache(maxsize=1)
def smollm2():
    return build_engine(TargetConfig(capture_batch=2))


def test_smollm2_capture_shapes_and_padding():
    engine = smollm2()
    assert (engine.info.num_layers, engine.info.hidden_size, engine.info.vocab_size) == (
        30,
        576,
        49152,
    )
    assert engine.default_aux_layers == [1, 14, 26]
    assert len(engine.target_fingerprint) == 32 and len(engine.tokenizer_fingerprint) == 32
    contract = build_strategy(StrategyConfig(), engine.info).feature_contract()
    texts = ["What is the capital of France?", "Hi", "Count: one two three four five six seven"]
    seqs = [torch.tensor(engine.tokenizer.encode(t)) for t in texts]
    batched = engine.capture(seqs, None, contract)  # batches of 2: padding in the first
    alone = [engine.capture([s], None, contract)[0] for s in seqs[:2]]
    for ids, sample in zip(seqs, batched, strict=True):
        assert sample["hidden_states"].shape == (len(ids), 3 * 576) and sample["target"].shape == (
            len(ids),
            576,
        )
        assert torch.isfinite(sample["hidden_states"]).all()
    for a, b in zip(alone, batched[:2], strict=True):
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a["target"], b["target"], rtol=1e-4, atol=1e-4)
    # The teacher recomputed from the captured final state is the model's own next-token choice.
    heads = target_mod.load_target_heads(engine.path)
    logits = batched[0]["target"] @ heads.lm_head.T
    with torch.no_grad():
        expected = engine.model(input_ids=seqs[0][None]).logits[0]
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_the_prefill_sdpa_backends_follow_the_environment(tiny_dir, monkeypatch):
    """`SPECBUS_SDPA_BACKENDS` picks the prefill's SDPA backends: math gives the default's
    features (fp32), a backend this device lacks makes the capture fail (so the setting took
    effect), and an unknown name is refused with the valid ones."""
    from specbus.core.errors import ConfigError
    from specbus.producers.engines.hf import SDPA_ENV

    engine = engine_for(tiny_dir, capture_batch=1)
    contract = build_strategy(StrategyConfig(), engine.info).feature_contract()
    seqs = [torch.randint(0, 128, (n,)) for n in (9, 5)]
    default = engine.capture(seqs, None, contract)
    monkeypatch.setenv(SDPA_ENV, "math")
    math = engine.capture(seqs, None, contract)
    for a, b in zip(default, math, strict=True):
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(SDPA_ENV, "cudnn")  # no cuDNN attention on the CPU
    with pytest.raises(RuntimeError):
        engine.capture(seqs, None, contract)
    monkeypatch.setenv(SDPA_ENV, "flash,fastest")
    with pytest.raises(ConfigError, match="fastest"):
        engine.capture(seqs, None, contract)


def test_the_gpu_prefill_prefers_flash_and_the_cpu_keeps_torchs_order(monkeypatch):
    """Unset, a CUDA engine's prefill runs under flash-first priorities (cuDNN plans per new
    length); the CPU, and `default`, keep torch's own order (a null context)."""
    import contextlib

    from specbus.producers.engines.hf import GPU_SDPA_ORDER, SDPA_ENV, sdpa_backends

    monkeypatch.delenv(SDPA_ENV, raising=False)
    assert GPU_SDPA_ORDER.split(",")[0] == "flash"
    assert isinstance(sdpa_backends(device=torch.device("cpu")), contextlib.nullcontext)
    assert not isinstance(sdpa_backends(device=torch.device("cuda")), contextlib.nullcontext)
    monkeypatch.setenv(SDPA_ENV, "default")
    assert isinstance(sdpa_backends(device=torch.device("cuda")), contextlib.nullcontext)


def test_a_long_gpu_prefill_puts_cudnn_first(monkeypatch):
    """From `kernels.CUDNN_ATTENTION_TOKENS` positions a CUDA prefill runs cuDNN first (its
    kernel ~1.7x flash's at 32k on an H200), flash first below it; the environment wins at
    any length; the CPU keeps torch's order."""
    from specbus.core.models import kernels
    from specbus.producers.engines.hf import GPU_SDPA_ORDER, LONG_SDPA_ORDER, SDPA_ENV, sdpa_order

    monkeypatch.delenv(SDPA_ENV, raising=False)
    cuda = torch.device("cuda")
    at = kernels.CUDNN_ATTENTION_TOKENS
    assert sdpa_order(cuda, at - 1) == GPU_SDPA_ORDER
    assert sdpa_order(cuda, at) == LONG_SDPA_ORDER
    assert LONG_SDPA_ORDER.split(",")[0] == "cudnn"
    assert sdpa_order(torch.device("cpu"), 1 << 20) == ""
    monkeypatch.setattr(kernels, "CUDNN_ATTENTION_TOKENS", 1 << 40)  # the override's effect
    assert sdpa_order(cuda, 1 << 20) == GPU_SDPA_ORDER
    monkeypatch.setenv(SDPA_ENV, "flash,math")
    assert sdpa_order(cuda, 1 << 41) == "flash,math"

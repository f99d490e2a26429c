"""`PackedSamples`: the feeder's dataset in flat buffers reads back as the samples it packed."""

import pytest
import torch
from specbus.core.data.packed import PackedSamples
from specbus.core.data.tokenize import TokenizedSample


def _samples(n: int, seed: int = 0) -> list[TokenizedSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(0, 40, (1,), generator=g))
        ids = torch.randint(0, 152_000, (length,), generator=g)
        mask = torch.randint(0, 2, (length,), generator=g)
        out.append(TokenizedSample(ids, mask))
    return out


def test_every_sample_reads_back_equal_as_int64():
    samples = _samples(300)
    packed = PackedSamples(iter(samples))  # built from an iterator, as the feeder does
    assert len(packed) == len(samples)
    for i, (got, want) in enumerate(zip(packed, samples, strict=True)):
        assert got.input_ids.dtype == got.loss_mask.dtype == torch.long
        assert torch.equal(got.input_ids, want.input_ids), i
        assert torch.equal(got.loss_mask, want.loss_mask), i
        assert packed.length(i) == len(want)
    assert torch.equal(packed[-1].input_ids, samples[-1].input_ids)
    tokens = sum(len(s) for s in samples)
    assert packed.nbytes == 5 * tokens + 8 * len(samples)


def test_out_of_range_and_unpackable_values_are_refused():
    packed = PackedSamples(_samples(3))
    with pytest.raises(IndexError):
        packed[3]
    with pytest.raises(ValueError, match="int32"):
        PackedSamples([TokenizedSample(torch.tensor([2**31]), torch.tensor([1]))])
    with pytest.raises(ValueError, match="0 or 1"):
        PackedSamples([TokenizedSample(torch.tensor([5]), torch.tensor([2]))])
    assert len(PackedSamples()) == 0 and not PackedSamples()


def test_short_samples_cost_bytes_not_tensor_objects():
    """What the feeder held for the scale bench's 1 M records: ~2.7 KB a record as tensors."""
    n = 100_000
    ids, mask = torch.arange(8), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    packed = PackedSamples(TokenizedSample(ids, mask) for _ in range(n))
    assert packed.nbytes == n * (8 * 5 + 8)  # 48 B a sample
    assert torch.equal(packed[n - 1].input_ids, ids)

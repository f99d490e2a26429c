"""The draft vocabulary mapping: top-N supervised tokens, padding, determinism, d2t/t2d."""

import subprocess
import sys
from collections import Counter

import pytest
import torch
from specbus.core.data.vocab import VocabMapping, build_vocab_mapping, count_tokens
from specbus.core.errors import ConfigError


def samples():
    return [
        (torch.tensor([5, 9, 9, 3, 7, 7, 7]), torch.tensor([0, 1, 1, 1, 1, 1, 0])),
        (torch.tensor([2, 9, 11, 3]), torch.tensor([1, 1, 1, 0])),
    ]


def test_counts_only_supervised_tokens():
    assert count_tokens(samples()) == Counter({9: 3, 7: 2, 3: 1, 2: 1, 11: 1})


def test_top_n_sorted_with_first_seen_tie_break_and_consistent_buffers():
    mapping = build_vocab_mapping(count_tokens(samples()), draft_vocab_size=3, target_vocab_size=16)
    # 9 (3) and 7 (2) win; 3, 2, 11 tie at 1 and 3 was seen first (sample 1, ids ascending).
    used = [3, 7, 9]
    assert (mapping.d2t + torch.arange(3)).tolist() == used
    assert mapping.t2d.nonzero().flatten().tolist() == used
    assert mapping.d2t.dtype == torch.int64 and mapping.t2d.dtype == torch.bool
    assert mapping.draft_to_target(torch.tensor([0, 1, 2])).tolist() == used


def test_fewer_distinct_tokens_than_the_draft_vocab_pads_with_unseen_low_ids():
    mapping = build_vocab_mapping(Counter({40: 5, 2: 1}), draft_vocab_size=6, target_vocab_size=64)
    used = (mapping.d2t + torch.arange(6)).tolist()
    assert used == sorted(used) and len(set(used)) == 6
    assert {40, 2} <= set(used) and set(used) - {40, 2} <= set(range(6))
    assert int(mapping.t2d.sum()) == 6
    full = build_vocab_mapping(Counter(), draft_vocab_size=8, target_vocab_size=8)
    assert full.d2t.tolist() == [0] * 8 and full.t2d.all()


def test_mapping_is_identical_across_processes():
    script = (
        "import torch\nfrom collections import Counter\nfrom core.data.vocab import build_vocab_mapping\n"
        "c = Counter({i * 37 % 1000: (i * 7) % 5 for i in range(600)})\n"
        "print(build_vocab_mapping(c, 300, 1000).fingerprint())\n"
    )
    other = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    here = build_vocab_mapping(
        Counter({i * 37 % 1000: (i * 7) % 5 for i in range(600)}), 300, 1000
    ).fingerprint()
    assert other == here + "\n"


def test_save_load_round_trip_and_errors(tmp_path):
    mapping = build_vocab_mapping(count_tokens(samples()), 4, 16)
    mapping.save(tmp_path / "vocab.safetensors")
    loaded = VocabMapping.load(tmp_path / "vocab.safetensors")
    assert torch.equal(loaded.d2t, mapping.d2t) and torch.equal(loaded.t2d, mapping.t2d)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        build_vocab_mapping(Counter(), 32, 16)
    with pytest.raises(ConfigError, match="outside"):
        build_vocab_mapping(Counter({99: 1}), 4, 16)
    with pytest.raises(ConfigError, match="unreadable"):
        VocabMapping.load(tmp_path / "missing.safetensors")

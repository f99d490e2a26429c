"""The draft vocabulary: which target tokens the draft can emit (`d2t`, `t2d`).

Semantics (SpecForge 0.2.0): count `input_ids[loss_mask == 1]` over the training samples in
order (a per-sample unique-count merged into one `Counter`, so ties keep first-seen order);
when fewer than N distinct tokens occur, add unseen ids from `range(N)` (in Python's set
iteration order of `set(range(N)) - seen`) with count 0 until there are N; keep the N most
common; sort ascending. `d2t[i] = used[i] - i` (draft id i -> target id i + d2t[i]),
`t2d[t] = t in used`. Deterministic for the same samples in every process.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from specbus.core.errors import ConfigError


@dataclass(frozen=True)
class VocabMapping:
    """`d2t [N]` int64 offsets and `t2d [V]` bool membership."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    @classmethod
    def from_d2t(cls, d2t: list[int] | tuple[int, ...], target_vocab_size: int) -> VocabMapping:
        """The mapping from its offsets (a manifest's `VocabTable`): t2d[i + d2t[i]] = True."""
        offsets = torch.tensor(d2t, dtype=torch.long)
        t2d = torch.zeros(int(target_vocab_size), dtype=torch.bool)
        t2d[torch.arange(offsets.numel()) + offsets] = True
        return cls(d2t=offsets, t2d=t2d)

    @property
    def draft_vocab_size(self) -> int:
        """Draft vocabulary size N."""
        return int(self.d2t.numel())

    @property
    def target_vocab_size(self) -> int:
        """Target vocabulary size V."""
        return int(self.t2d.numel())

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (any shape, on their device)."""
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def fingerprint(self) -> str:
        """A digest of the mapping: processes of one run must agree on it."""
        digest = hashlib.sha256(self.d2t.numpy().tobytes())
        digest.update(self.t2d.numpy().tobytes())
        return digest.hexdigest()[:32]

    def save(self, path: str | Path) -> None:
        """Write `d2t` and `t2d` as safetensors (the export's layout)."""
        from safetensors.torch import save_file

        save_file({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> VocabMapping:
        """Read a mapping `save` wrote."""
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
            return cls(d2t=tensors["d2t"].long(), t2d=tensors["t2d"].bool())
        except (OSError, KeyError) as e:
            raise ConfigError(f"vocab mapping {str(path)!r} is unreadable: {e}") from e


def count_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Counter:
    """Counter of supervised token ids over `(input_ids, loss_mask)` pairs, in sample order."""
    counts: Counter = Counter()
    for input_ids, loss_mask in samples:
        ids = torch.as_tensor(input_ids).flatten()
        mask = torch.as_tensor(loss_mask).flatten()
        unique, freq = ids[mask == 1].unique(return_counts=True)
        counts.update(dict(zip(unique.tolist(), freq.tolist(), strict=True)))
    return counts


def build_vocab_mapping(
    counts: Counter, draft_vocab_size: int, target_vocab_size: int
) -> VocabMapping:
    """Top-`draft_vocab_size` supervised tokens (padded with unseen ids) as a `VocabMapping`."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ConfigError(
            f"draft_vocab_size={draft_vocab_size} must be in 1..target vocab size {target_vocab_size}"
        )
    bad = [t for t in counts if not 0 <= t < target_vocab_size]
    if bad:
        raise ConfigError(
            f"token ids {sorted(bad)[:5]} are outside the target vocabulary of {target_vocab_size}"
        )
    counts = Counter(counts)
    if len(counts) < draft_vocab_size:
        for token in set(range(draft_vocab_size)) - set(counts):
            counts[token] = 0
            if len(counts) >= draft_vocab_size:
                break
    used = sorted(token for token, _ in counts.most_common(draft_vocab_size))
    d2t = torch.tensor([token - i for i, token in enumerate(used)], dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[torch.tensor(used, dtype=torch.long)] = True
    return VocabMapping(d2t=d2t, t2d=t2d)


def identity_mapping(vocab_size: int) -> VocabMapping:
    """Draft vocab == target vocab (every offset 0)."""
    return VocabMapping(
        d2t=torch.zeros(vocab_size, dtype=torch.long), t2d=torch.ones(vocab_size, dtype=torch.bool)
    )

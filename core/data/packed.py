"""Tokenised samples packed into flat buffers: what the feeder holds for a whole dataset.

A list of `TokenizedSample`s costs ~1 KB a sample in tensor objects whatever their length
(a feed of 1 M 8-token records held 2.6 GiB: docs/benchmarks.md, "Scale: one million refs");
`PackedSamples` keeps the token ids as int32, the loss mask as uint8 and one end offset a
sample: 5 B a token + 8 B a sample. Indexing gives a fresh `TokenizedSample` (int64 copies of
its slice), so code written for a list of samples reads it unchanged.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

import torch
from specbus.core.data.tokenize import TokenizedSample

_CHUNK_TOKENS = 1 << 16  # tokens checked and cast together


class PackedSamples:
    """An immutable sequence of `TokenizedSample`s (`len`, `[i]`, iteration, `length(i)`).

    Token ids must fit int32 and the mask must be 0/1 (`ValueError` otherwise: the packing
    would change them)."""

    def __init__(self, samples: Iterable[TokenizedSample] = ()):
        ids, mask, ends = array("i"), array("B"), array("q")
        pending: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        end = flushed = 0

        def flush() -> None:  # checks and casts a chunk at once: per-sample ops cost 3x more
            if not pending[0]:
                return
            a, m = torch.cat(pending[0]), torch.cat(pending[1])
            pending[0].clear(), pending[1].clear()
            if a.numel() and (int(a.min()) < -(2**31) or int(a.max()) >= 2**31):
                raise ValueError("a token id does not fit int32")
            if m.numel() and not bool(((m == 0) | (m == 1)).all()):
                raise ValueError("a loss mask value is not 0 or 1")
            ids.frombytes(a.to(torch.int32).numpy().tobytes())
            mask.frombytes(m.to(torch.uint8).numpy().tobytes())

        for s in samples:
            pending[0].append(s.input_ids.flatten())
            pending[1].append(s.loss_mask.flatten())
            end += pending[0][-1].numel()
            ends.append(end)
            if end - flushed >= _CHUNK_TOKENS:
                flush()
                flushed = end
        flush()
        # the arrays are never grown again: tensors over their buffers stay valid
        self._ids = (
            torch.frombuffer(ids, dtype=torch.int32) if ids else torch.empty(0, dtype=torch.int32)
        )
        self._mask = (
            torch.frombuffer(mask, dtype=torch.uint8) if mask else torch.empty(0, dtype=torch.uint8)
        )
        self._ends = ends

    def __len__(self) -> int:
        return len(self._ends)

    def _span(self, i: int) -> tuple[int, int]:
        if i < 0:
            i += len(self._ends)
        if not 0 <= i < len(self._ends):
            raise IndexError(f"sample {i} of {len(self._ends)}")
        return (self._ends[i - 1] if i else 0), self._ends[i]

    def length(self, i: int) -> int:
        """Tokens of sample `i`, without building it."""
        a, b = self._span(i)
        return b - a

    def __getitem__(self, i: int) -> TokenizedSample:
        a, b = self._span(i)
        return TokenizedSample(self._ids[a:b].long(), self._mask[a:b].long())

    def __iter__(self) -> Iterator[TokenizedSample]:
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        """Bytes of the packed buffers."""
        return self._ids.numel() * 4 + self._mask.numel() + len(self._ends) * 8

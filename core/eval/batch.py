"""Batched draft-and-verify: a wave's sequences verified in one target forward a round.

`SpecBatch` is `SpecSession` (`core.eval.speculative`, the batch-1 reference) for B sequences
decoded together, as `specbus serve --speculative` decodes a wave: each round drafts for every
sequence (a `BatchDrafter`: `ChainBatch`, one draft forward per chain step for the whole
batch; `RowDrafters`, any per-sequence `Drafter` row by row), runs every sequence's
[next_tok, d1..dk] through the target in ONE forward, and verifies each sequence with the
batch-1 session's own rules (`core.eval.verify`: greedy, or rejection sampling with the
sequence's `Sampling` and random stream). Acceptance is ragged: sequence i keeps a_i + 1 of
the round's positions, so each sequence's output is what it would be decoded alone.

Shape legend: B sequences in the batch, W cache columns, T positions fed a round (1 + the
round's most drafts), A aux width (len(aux layers) * target hidden), H draft hidden.

The caches (the target's transformers `DynamicCache`, the EAGLE3 draft's `DecodeCache`) are
laid out in columns: a row's verified positions are some of its W columns, in order, and
`valid_BW` says which (the left padding of a shorter prompt, drafts rejected in earlier
rounds). A round appends T columns to every row; after verification the columns past row
i's a_i + 1 kept ones turn invalid, nothing moves. Position ids are each row's own (n_i +
t) and the attention mask is `valid_BW`, so a row attends exactly to its verified prefix.
Once the dead columns exceed `slack` (or sequences leave the batch, `retire`) a cache is
compacted: each row's valid columns gathered to the right (`right_align`), one gather per
layer. Keys are cached after the rotary embedding, so moving a column changes nothing; for
the same reason sequences can join a running batch (`admit`, continuous batching): a batch
prefilled apart is stacked under this one, the narrower caches padded with invalid columns.

Host round trips: a greedy round waits for the device once (the target's argmax and the
drafts, fetched together, decide each row's acceptance on the host). The drafts stay on the
device from the chain to the verify forward, and what the host adds (the rows' next tokens,
positions, the emitted tokens the drafter extends with) goes over in one copy each, from
pinned memory without waiting. (The first batched server on an H200 waited ~65 times a
round and ran ~0.3 s a round; one wait did not change that: the time was the host building
a cuDNN attention plan for every new cache length, 42 ms a call, until decoding ran under the
flash/efficient-first SDPA order: `producers/live/generate.py`.) Sampled rows draw on the
host (the request's own CPU generator), one wait per draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from specbus.core.eval.speculative import (
    ChainDrafter,
    Drafter,
    _device,
    _forward_kw,
    _new_cache,
    _on_target_vocab,
    _to_target,
)
from specbus.core.eval.verify import Sampling, greedy_prefix, sampled_accept
from specbus.core.models.llama_eagle3 import DecodeCache
from specbus.core.models.target import AuxCapture
from torch import nn


@dataclass
class Proposals:
    """A round's drafts: row j's first `counts[j]` (<= its `k[j]`) entries of `drafts_BK` (the
    rest of the row is filler, never accepted) and, when row j samples, the distribution each
    of its drafts was drawn from (`q_probs[j]`; [] when greedy)."""

    drafts_BK: torch.Tensor
    counts: list[int]
    q_probs: list[list[torch.Tensor]]


class BatchDrafter(Protocol):
    """The draft's side of a `SpecBatch`: row j is the batch's j-th sequence."""

    def extend(self, aux_BTA: torch.Tensor, follow_BT: torch.Tensor, lengths: Sequence[int],
               start: Sequence[int]) -> None:  # fmt: skip
        """Per row j: forget context positions from `start[j]` on, then add its first
        `lengths[j]` positions p = start[j] + t: the target's aux features of token p
        (`aux_BTA[j, t]`) and token p + 1 (`follow_BT[j, t]`)."""

    def propose(self, next_tok: Sequence[int], n: Sequence[int], k: Sequence[int],
                sampling: Sequence[Sampling | None]) -> Proposals:  # fmt: skip
        """Per row, up to `k[j]` drafts after its `n[j]` verified tokens (`Drafter.propose`)."""

    def select(self, rows: Sequence[int]) -> None:
        """Keep these rows only, in this order (finished sequences leave the batch)."""

    def merge(self, other: BatchDrafter) -> None:
        """Append `other`'s rows (a drafter of the same kind and draft) after these."""


class NoDrafter:
    """The `BatchDrafter` that drafts nothing: a `SpecBatch` with it (and `aux=None`) decodes
    plainly, one token a row per target forward, with the batch's admission (`admit`) and
    retirement of finished rows (`retire`)."""

    def extend(self, aux_BTA, follow_BT, lengths, start) -> None:
        pass

    def propose(self, next_tok, n, k, sampling) -> Proposals:
        rows = len(next_tok)
        return Proposals(torch.zeros((rows, 0), dtype=torch.long), [0] * rows, [[]] * rows)

    def select(self, rows) -> None:
        pass

    def merge(self, other) -> None:
        pass


def to_device(values, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """Host numbers (a list, nested lists) as a tensor on `device`: on CUDA copied from pinned
    memory without waiting for the device (a pageable copy can wait for the whole stream)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def right_align(
    valid_BW: torch.Tensor, keep: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather that packs every row's valid columns to the right, order kept: (`index_BV`,
    `valid_BV`), V = `keep`, the most valid columns of a row (counted here when None: one
    wait for the device); the index of a padding column is 0."""
    width = valid_BW.shape[1]
    cols = torch.arange(width, device=valid_BW.device).expand_as(valid_BW)
    ordered = torch.where(valid_BW, cols, -1).sort(dim=1).values  # -1 (invalid) first
    if keep is None:
        keep = int(valid_BW.sum(1).max()) if valid_BW.numel() else 0
    index = ordered[:, width - keep :]
    return index.clamp(min=0), index >= 0


def _gather(x_BNWD: torch.Tensor, rows: torch.Tensor, index_BV: torch.Tensor) -> torch.Tensor:
    x = x_BNWD.index_select(0, rows)
    idx = index_BV[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return x.gather(2, idx)


def _forget_from(valid_BW: torch.Tensor, start: Sequence[int]) -> torch.Tensor:
    """`valid_BW` with each row's valid columns past its first `start[j]` turned invalid."""
    limit = to_device(list(start), valid_BW.device)[:, None]
    return valid_BW & (valid_BW.long().cumsum(1) <= limit)


def _stack_rows(a: torch.Tensor, b: torch.Tensor, axis: int, fill=0) -> torch.Tensor:
    """The rows of `a`, then those of `b` (dim 0), the narrower along `axis` (cache columns)
    padded on the left with `fill` (columns that are not valid: each row's positions and
    validity are its own, so where its columns sit does not matter)."""
    width = max(a.shape[axis], b.shape[axis])

    def pad(x: torch.Tensor) -> torch.Tensor:
        shape = list(x.shape)
        shape[axis] = width - x.shape[axis]
        return x if shape[axis] == 0 else torch.cat([x.new_full(shape, fill), x], dim=axis)

    return torch.cat([pad(a), pad(b)], dim=0)


def _pad_rows(rows: Sequence[torch.Tensor], width: int, fill=0) -> torch.Tensor:
    """Right-pad each row (`[T_j, ...]`) to `width`: `[B, width, ...]`."""
    out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), fill)
    for j, r in enumerate(rows):
        out[j, : r.shape[0]] = r
    return out


class RowDrafters:
    """Any per-sequence `Drafter`s behind `BatchDrafter`: each row drafts alone (batch 1)."""

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)

    def extend(self, aux_BTA, follow_BT, lengths, start) -> None:
        """Each row's `Drafter.extend`."""
        for j, (d, m, s) in enumerate(zip(self.drafters, lengths, start, strict=True)):
            d.extend(aux_BTA[j : j + 1, :m], follow_BT[j, :m], s)

    def propose(self, next_tok, n, k, sampling) -> Proposals:
        """Each row's `Drafter.propose`."""
        got = [d.propose(t, m, kk, s)
               for d, t, m, kk, s in zip(self.drafters, next_tok, n, k, sampling, strict=True)]  # fmt: skip
        width = max(k, default=0)
        rows = [(list(d[:kk]) + [0] * width)[:width] for (d, _), kk in zip(got, k, strict=True)]
        drafts = torch.tensor(rows, dtype=torch.long).view(len(rows), width)  # moved by the batch
        counts = [min(len(d), kk) for (d, _), kk in zip(got, k, strict=True)]
        return Proposals(drafts, counts, [q for _, q in got])

    def select(self, rows) -> None:
        """Keep these rows' drafters."""
        self.drafters = [self.drafters[j] for j in rows]

    def merge(self, other: RowDrafters) -> None:
        """`other`'s drafters after these."""
        self.drafters += other.drafters


class ChainBatch:
    """EAGLE3 chain drafting (`core.eval.speculative`'s `ChainDrafter`) for a whole batch: the
    draft's `DecodeCache` over every row's verified positions (module doc: columns, `valid`),
    each row's last pre-norm output; a chain step is one draft forward for every row."""

    def __init__(self, draft: nn.Module, slack: int = 32):
        self.draft, self.slack = draft, slack
        self.dtype = draft.fc.weight.dtype
        self.cache = DecodeCache()
        self.last_h: torch.Tensor | None = None  # [B, 1, H]
        self.n: list[int] = []  # verified positions of each row in the cache

    def extend(self, aux_BTA, follow_BT, lengths, start) -> None:
        """Drop each row's positions from `start[j]` on (the chain's own, a rejection's), add
        the new ones at positions start[j].. (ragged: the block's padding is invalid)."""
        rows, width = follow_BT.shape
        device = follow_BT.device
        cache = self.cache
        if cache.valid_BL is None:
            cache.valid_BL = torch.zeros((rows, 0), dtype=torch.bool, device=device)
        old = _forget_from(cache.valid_BL, start)
        lens_start = to_device([list(lengths), list(start)], device)
        t = torch.arange(width, device=device)
        cache.valid_BL = torch.cat([old, t[None] < lens_start[0][:, None]], dim=1)
        positions_BT = lens_start[1][:, None] + t[None]
        hidden = self.draft.backbone(self.draft.embed(follow_BT),
                                     self.draft.project(aux_BTA.to(self.dtype)), positions_BT,
                                     cache)  # fmt: skip
        self.last_h = hidden[torch.arange(rows, device=device), lens_start[0] - 1][:, None]
        self.n = [s + m for s, m in zip(start, lengths, strict=True)]
        if cache.valid_BL.shape[1] - max(self.n) > self.slack:
            self._compact(list(range(rows)))

    def propose(self, next_tok, n, k, sampling) -> Proposals:
        """Up to `k[j]` drafts per row (`ChainDrafter.propose`), the chain run as far as the
        longest (a greedy chain stays on the device: no wait); a sampling row past its own
        `k[j]` is fed a filler and draws nothing (its random stream is the batch-1
        session's). The chain's positions stay in the cache until the next `extend`."""
        del next_tok  # the chain starts from the output at n-1
        most = max(k, default=0)
        q_probs: list[list[torch.Tensor]] = [[] for _ in k]
        draft, cache, hidden = self.draft, self.cache, self.last_h
        device = hidden.device
        greedy = all(s is None for s in sampling)
        n_B = to_device(list(n), device)
        tokens: list[torch.Tensor] = []
        for i in range(1, most + 1):
            logits_BV = draft.compute_logits(hidden)[:, -1]
            ids = logits_BV.argmax(-1)
            fed = ids + draft.d2t[ids]
            if not greedy:
                fed = self._drawn(fed, logits_BV, i, k, sampling, q_probs)
            tokens.append(fed)
            if i < most:
                ones = torch.ones((len(k), 1), dtype=torch.bool, device=device)
                cache.valid_BL = torch.cat([cache.valid_BL, ones], dim=1)
                hidden = draft.backbone(draft.embed(fed[:, None]), hidden,
                                        (n_B - 1 + i)[:, None], cache)  # fmt: skip
        drafts = torch.stack(tokens, 1) if tokens else torch.zeros((len(k), 0), dtype=torch.long,
                                                                   device=device)  # fmt: skip
        return Proposals(drafts, list(k), q_probs)

    def _drawn(self, greedy_B, logits_BV, i: int, k, sampling, q_probs) -> torch.Tensor:
        """Chain step i with sampling rows: each draws from the draft at its temperature with
        its own generator (a row past its `k[j]` is fed its argmax and draws nothing)."""
        draft, fed = self.draft, greedy_B.tolist()
        for j, s in enumerate(sampling):
            if s is None or i > k[j]:
                continue
            q_d = s.draft_probs(logits_BV[j])
            fed[j] = _to_target(draft, torch.tensor(s.draw(q_d), device=logits_BV.device))
            q_probs[j].append(_on_target_vocab(draft, q_d))
        return to_device(fed, logits_BV.device)

    def select(self, rows) -> None:
        """Keep these rows (compacting the cache)."""
        self._compact(list(rows))
        self.last_h = self.last_h.index_select(0, to_device(list(rows), self.last_h.device))
        self.n = [self.n[j] for j in rows]

    def merge(self, other: ChainBatch) -> None:
        """`other`'s chains (the same draft, just extended with their prompts) after these."""
        a, b = self.cache, other.cache
        a.k, a.v = _stack_rows(a.k, b.k, 2), _stack_rows(a.v, b.v, 2)
        a.valid_BL = _stack_rows(a.valid_BL, b.valid_BL, 1, False)
        self.last_h = torch.cat([self.last_h, other.last_h])
        self.n += other.n

    def _compact(self, rows: list[int]) -> None:
        cache = self.cache
        index_rows = to_device(rows, cache.valid_BL.device)
        index, valid = right_align(cache.valid_BL.index_select(0, index_rows),
                                   keep=max(self.n[j] for j in rows))  # fmt: skip
        cache.k, cache.v = _gather(cache.k, index_rows, index), _gather(cache.v, index_rows, index)
        cache.valid_BL = valid


def batch_drafter(drafters: Sequence[Drafter]) -> BatchDrafter:
    """The batch form of per-sequence drafters: EAGLE3 chains of one draft batched
    (`ChainBatch`), anything else row by row (`RowDrafters`)."""
    first = drafters[0] if drafters else None
    if isinstance(first, ChainDrafter) and all(
        type(d) is ChainDrafter and d.draft is first.draft for d in drafters
    ):
        return ChainBatch(first.draft)
    return RowDrafters(drafters)


def _cache_tensors(cache):
    """(layer holder, attribute) of every key/value tensor of a transformers cache (4.x lists
    or 5.x layers)."""
    if hasattr(cache, "layers"):
        return [(layer, name) for layer in cache.layers for name in ("keys", "values")]
    return [(lst, i) for lst in (cache.key_cache, cache.value_cache) for i in range(len(lst))]


def _get(holder, name) -> torch.Tensor:
    """A `_cache_tensors` entry's tensor."""
    return getattr(holder, name) if isinstance(name, str) else holder[name]


def _put(holder, name, value: torch.Tensor) -> None:
    """Replace a `_cache_tensors` entry's tensor."""
    if isinstance(name, str):
        setattr(holder, name, value)
    else:
        holder[name] = value


class SpecBatch:
    """B sequences decoded by draft-and-verify together, a round at a time (module doc).

    Built from the prompts: one left-padded target prefill chooses each sequence's token n;
    the drafter's context is each prompt's aux features. `step(k)` drafts up to `k[j]` tokens
    for row j, verifies every row in one target forward, keeps each row's accepted prefix
    and returns, per row, (tokens emitted, drafts accepted). `rows` are the sequences still
    in the batch (indices into the prompts), in row order; `retire` drops finished ones.
    `aux`: an open `AuxCapture` on the target for the drafter's layers (None: a drafter that
    reads no features, `NoDrafter`; then no `keep_aux`). `swap(drafter)` hands
    every sequence to another drafter between rounds (needs `keep_aux`: the aux features of
    every verified position, kept). `sampling[i]`: sequence i's `Sampling`, None greedy.
    `pads[i]`: the left padding of prompt i in the prefill (its first rows are not its)."""

    def __init__(self, target: nn.Module, drafter: BatchDrafter, prompts: Sequence[torch.Tensor],
                 aux: AuxCapture | None, *, sampling: Sequence[Sampling | None] | None = None,
                 keep_aux: bool = False, pad_id: int = 0, slack: int = 32):  # fmt: skip
        self.target, self.drafter, self.aux, self.slack = target, drafter, aux, slack
        self.device = _device(target)
        self.sampling = list(sampling) if sampling is not None else [None] * len(prompts)
        lengths = [int(p.numel()) for p in prompts]
        width = max(lengths)
        self.pads = [width - n for n in lengths]
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        valid = torch.zeros((len(prompts), width), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, self.pads[i] :], valid[i, self.pads[i] :] = p.cpu(), True
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        self.cache = _new_cache()
        self.valid_BW = torch.zeros((len(prompts), 0), dtype=torch.bool, device=self.device)
        logits = self._forward(ids, positions, valid, last_only=True)
        self.rows = list(range(len(prompts)))
        self.n = lengths
        self.next_tok = [self._first(i, logits[i, -1]) for i in self.rows]
        self.tokens = [[t] for t in self.next_tok]  # generated so far (the prefill's first)
        self.accepted: list[list[int]] = [[] for _ in prompts]  # drafts accepted per round
        self._seq = [[*p.tolist(), t] for p, t in zip(prompts, self.next_tok, strict=True)]
        self._aux = None
        if aux is None:  # a drafter without features: no context to give it
            return
        aux_BWA = aux.concat()
        # the drafter's context: each prompt's positions, moved to the left of its row
        t = torch.arange(width)
        index = to_device((t[None] + torch.tensor(self.pads)[:, None]).clamp(max=width - 1).tolist(),
                          self.device)  # fmt: skip
        aux_BTA = aux_BWA.gather(1, index[..., None].expand(-1, -1, aux_BWA.shape[-1]))
        self._aux = [[aux_BTA[i, :n]] for i, n in enumerate(lengths)] if keep_aux else None
        follow = [self._seq[i][1 : n + 1] + [0] * (width - n) for i, n in enumerate(lengths)]
        drafter.extend(aux_BTA, to_device(follow, self.device), lengths, [0] * len(prompts))

    def _first(self, i: int, logits_V: torch.Tensor) -> int:
        s = self.sampling[i]
        return int(logits_V.argmax()) if s is None else s.draw(s.target_probs(logits_V))

    def _follow(self, i: int, start: int, count: int) -> torch.Tensor:
        """Tokens start+1..start+count of sequence i: what drafter positions start.. embed."""
        return torch.tensor(self._seq[i][start + 1 : start + 1 + count], device=self.device)

    def _forward(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor, new_BT: torch.Tensor,
                 *, last_only: bool = False):  # fmt: skip
        """The target over `ids_BT` appended to every row (`new_BT`: which of them are real);
        `last_only`: the last position's logits only (a prefill)."""
        self.valid_BW = torch.cat([self.valid_BW, new_BT.to(self.device)], dim=1)
        return self.target(input_ids=ids_BT.to(self.device), use_cache=True,
                           attention_mask=self.valid_BW.long(),
                           position_ids=positions_BT.to(self.device),
                           **_forward_kw(self.target, self.cache, last_only=last_only)).logits  # fmt: skip

    def step(self, k: Sequence[int]) -> list[tuple[list[int], int]]:
        """One round (class doc), `k[j]` drafts at most for row j: per row in `rows` order,
        (tokens emitted, drafts accepted)."""
        rows, k = self.rows, [max(int(x), 0) for x in k]
        old_n = [self.n[i] for i in rows]
        sampling = [self.sampling[i] for i in rows]
        prop = self.drafter.propose([self.next_tok[i] for i in rows], old_n, k, sampling)
        most = max(prop.counts, default=0)
        width = 1 + most
        host = to_device([[self.next_tok[i], *range(m, m + width)] for i, m in zip(rows, old_n, strict=True)],
                         self.device)  # next token, positions  # fmt: skip
        drafts_BK = prop.drafts_BK[:, :most].to(self.device, non_blocking=True)
        ids = torch.cat([host[:, :1], drafts_BK], dim=1)
        logits = self._forward(ids, host[:, 1:], torch.ones_like(ids, dtype=torch.bool))
        aux_BTA = self.aux.concat() if self.aux is not None else None
        seen = torch.cat([logits.argmax(-1), drafts_BK], dim=1).tolist()  # the one wait
        out = []
        for j, (i, s) in enumerate(zip(rows, sampling, strict=True)):
            drafts = seen[j][width : width + prop.counts[j]]
            if s is None:
                emitted, a = greedy_prefix(drafts, seen[j][:width])
            else:
                emitted, a = sampled_accept(drafts, prop.q_probs[j][: len(drafts)], logits[j], s)
            self._seq[i][old_n[j] + 1 :] = emitted
            if self._aux is not None:
                self._aux[i].append(aux_BTA[j, : a + 1])
            self.n[i], self.next_tok[i] = old_n[j] + a + 1, emitted[-1]
            self.tokens[i].extend(emitted)
            self.accepted[i].append(a)
            out.append((emitted, a))
        lengths = [a + 1 for _, a in out]
        longest = max(lengths)
        host = to_device([[len(e), *e, *[0] * (longest - len(e))] for e, _ in out], self.device)
        self.valid_BW[:, -width:] = torch.arange(width, device=self.device)[None] < host[:, :1]
        if aux_BTA is not None:
            self.drafter.extend(aux_BTA[:, :longest], host[:, 1:], lengths, old_n)
        if self.valid_BW.shape[1] - max(self.n[i] for i in rows) > self.slack:
            self._compact(list(range(len(rows))))
        return out

    def retire(self, done: Sequence[int]) -> None:
        """Sequences `done` (indices into the prompts) leave the batch (both caches shrink)."""
        gone = set(done) & set(self.rows)
        if not gone:
            return
        keep = [j for j, i in enumerate(self.rows) if i not in gone]
        if keep:
            self._compact(keep)
            self.drafter.select(keep)
        self.rows = [self.rows[j] for j in keep]

    def admit(self, other: SpecBatch) -> list[int]:
        """Continue `other`'s sequences in this batch's rounds: a batch just built (prefilled)
        on the same target, `AuxCapture` and `keep_aux`, with a drafter of this one's kind and
        draft. Their indices here follow this batch's (`other`'s i is `len(before) + i`);
        returns those still decoding. Each keeps the output it would have alone."""
        base = len(self.n)
        for (h1, n1), (h2, n2) in zip(_cache_tensors(self.cache), _cache_tensors(other.cache),
                                      strict=True):  # fmt: skip
            _put(h1, n1, _stack_rows(_get(h1, n1), _get(h2, n2), 2))
        self.valid_BW = _stack_rows(self.valid_BW, other.valid_BW, 1, False)
        self.drafter.merge(other.drafter)
        for name in ("sampling", "n", "next_tok", "tokens", "accepted", "_seq", "pads"):
            getattr(self, name).extend(getattr(other, name))
        if self._aux is not None:
            self._aux.extend(other._aux)
        joined = [base + r for r in other.rows]
        self.rows += joined
        return joined

    def swap(self, drafter: BatchDrafter) -> None:
        """Continue every sequence with `drafter` (class doc); needs `keep_aux`. If building
        its context raises, the batch goes on with the drafter it had."""
        if self._aux is None:
            raise ValueError("swap needs a batch built with keep_aux=True")
        for i in self.rows:
            if len(self._aux[i]) > 1:
                self._aux[i] = [torch.cat(self._aux[i], dim=0)]
        lengths = [self.n[i] for i in self.rows]
        width = max(lengths)
        follow = [
            self._seq[i][1 : n + 1] + [0] * (width - n)
            for i, n in zip(self.rows, lengths, strict=True)
        ]
        drafter.extend(_pad_rows([self._aux[i][0] for i in self.rows], width),
                       to_device(follow, self.device), lengths, [0] * len(self.rows))  # fmt: skip
        self.drafter = drafter

    def _compact(self, keep: Sequence[int]) -> None:
        """Keep rows `keep` of the target cache, their valid columns right-aligned."""
        rows = to_device(list(keep), self.device)
        index, self.valid_BW = right_align(self.valid_BW.index_select(0, rows),
                                           keep=max(self.n[self.rows[j]] for j in keep))  # fmt: skip
        for holder, name in _cache_tensors(self.cache):
            _put(holder, name, _gather(_get(holder, name), rows, index))

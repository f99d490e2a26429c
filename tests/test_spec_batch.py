"""Batched draft-and-verify (`core.eval.batch.SpecBatch`): a wave equals its sequences alone.

The tiny target of `test_spec_sampling` (vocab 10, peaked: drafts are accepted and rejected,
so the rows of one round accept different numbers of drafts) with a real EAGLE3 draft
(`ChainBatch`, the batched chain) and a real DFlash draft (`RowDrafters`). Prompts of
different lengths (left padding), per-row draft budgets shrinking to each row's end (as the
server drafts), rows finishing at different rounds (`retire`), a compaction every few rounds
(`slack` small) and a hand-over to a second draft mid-decode (`swap`): every row's tokens
and per-round acceptance equal the batch-1 `SpecSession` driven the same way, greedy and
sampled (each row's own seeded random stream).
"""

from __future__ import annotations

import pytest
import torch
from specbus.core.eval.batch import ChainBatch, RowDrafters, SpecBatch, batch_drafter, right_align
from specbus.core.eval.block import BlockDrafter
from specbus.core.eval.speculative import ChainDrafter, SpecSession
from specbus.core.eval.verify import Sampling
from specbus.core.models.target import AuxCapture

from tests.test_spec_sampling import _draft_of, tiny  # noqa: F401  (the fixture)

PROMPTS = [[1, 3, 5], [1, 4], [1, 6, 7, 8, 3, 5, 9], [1, 9, 3, 3], [1, 5, 5, 6, 2]]
MAX_NEW = [40, 23, 31, 12, 37]  # rows end at different rounds
K, SWAP_AT = 3, 4


def _drafter(strategy, draft, target):
    return BlockDrafter(draft, target) if strategy.name != "eagle3" else ChainDrafter(draft)


def _budget(tokens: list[int], max_new: int) -> int:
    """The server's rule: no drafting past the request's end."""
    return min(K, max_new - len(tokens) - 1)


def _sampling(i: int, temperature: float) -> Sampling | None:
    if temperature <= 0:
        return None
    return Sampling(temperature, 0.95, torch.Generator().manual_seed(100 + i))


def alone(target, layers, drafts, make, i: int, temperature: float):
    """Sequence i decoded by the batch-1 session: (tokens, accepted per round)."""
    with AuxCapture(target, layers) as aux:
        s = SpecSession(target, make(drafts[0]), torch.tensor(PROMPTS[i]), aux,
                        sampling=_sampling(i, temperature), keep_aux=True)  # fmt: skip
        rounds = 0
        while len(s.tokens) < MAX_NEW[i]:
            if rounds == SWAP_AT:
                s.swap(make(drafts[1]))
            s.step(_budget(s.tokens, MAX_NEW[i]))
            rounds += 1
    return s.tokens[: MAX_NEW[i]], s.accepted


def batched(target, layers, drafts, make, temperature: float):
    """Every sequence in one `SpecBatch`: (tokens, accepted per round) per sequence, and the
    per-round acceptance of the rows (to see that it was ragged)."""
    rounds: list[list[int]] = []
    n = len(PROMPTS)
    with AuxCapture(target, layers) as aux:
        batch = SpecBatch(target, batch_drafter([make(drafts[0]) for _ in PROMPTS]),
                          [torch.tensor(p) for p in PROMPTS], aux,
                          sampling=[_sampling(i, temperature) for i in range(n)],
                          keep_aux=True, slack=4)  # fmt: skip
        step = 0
        while batch.rows:
            if step == SWAP_AT:
                batch.swap(batch_drafter([make(drafts[1]) for _ in batch.rows]))
            ks = [_budget(batch.tokens[i], MAX_NEW[i]) for i in batch.rows]
            rounds.append([a for _, a in batch.step(ks)])
            batch.retire([i for i in batch.rows if len(batch.tokens[i]) >= MAX_NEW[i]])
            step += 1
    return [(batch.tokens[i][: MAX_NEW[i]], batch.accepted[i]) for i in range(n)], rounds


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_a_batched_wave_equals_each_sequence_decoded_alone(tiny, name, temperature):  # noqa: F811
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(tiny).eval()
    strategy, first = _draft_of(tiny, name)
    _, second = _draft_of(tiny, name)
    torch.manual_seed(9)  # the second draft differs from the first (a reload)
    for p in second.parameters():
        p.data += 0.05 * torch.randn_like(p)
    drafts = (first, second)
    layers = list(strategy.aux_layers)

    def make(d):
        return _drafter(strategy, d, target)

    with torch.no_grad():
        got, rounds = batched(target, layers, drafts, make, temperature)
        for i in range(len(PROMPTS)):
            want = alone(target, layers, drafts, make, i, temperature)
            assert got[i] == want, (i, got[i], want)
    assert isinstance(
        batch_drafter([make(first)] * 2), ChainBatch if name == "eagle3" else RowDrafters
    )
    ragged = [r for r in rounds if len(set(r)) > 1]
    assert len(ragged) >= 3, rounds  # rows of one round accepted different numbers of drafts
    assert any(a > 0 for r in rounds for a in r)


def test_right_align_packs_each_rows_valid_columns_to_the_right_in_order():
    valid = torch.tensor(
        [[0, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool
    )
    index, packed = right_align(valid)
    assert index.shape == (3, 5)
    assert packed.tolist() == [[False, False, True, True, True], [False] * 4 + [True], [True] * 5]
    assert (
        index[0, 2:].tolist() == [1, 2, 4]
        and index[1, 4] == 0
        and index[2].tolist() == [0, 1, 2, 3, 5]
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_sequences_admitted_into_a_running_batch_decode_as_alone(tiny, name, temperature):  # noqa: F811
    """Continuous batching (`SpecBatch.admit`): two sequences start, three more join after
    rounds 2 and 5 (prompts longer and shorter than the batch's cache, so both sides get
    padded), rows finish and leave meanwhile, compactions happen: every sequence's tokens and
    per-round acceptance equal its batch-1 decoding (no hand-over: `SWAP_AT` is past the end)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(tiny).eval()
    strategy, draft = _draft_of(tiny, name)
    layers = list(strategy.aux_layers)

    def make(d):
        return _drafter(strategy, d, target)

    def build(idx, aux):
        return SpecBatch(target, batch_drafter([make(draft) for _ in idx]),
                         [torch.tensor(PROMPTS[i]) for i in idx], aux,
                         sampling=[_sampling(i, temperature) for i in idx], keep_aux=True,
                         slack=4)  # fmt: skip

    joins = {2: [2, 3], 5: [4]}  # after round r, these prompts join
    order = [0, 1]  # prompt index of each sequence of the batch, in admission order
    with torch.no_grad(), AuxCapture(target, layers) as aux:
        batch = build(order, aux)
        step = 0
        while batch.rows:
            ks = [_budget(batch.tokens[s], MAX_NEW[order[s]]) for s in batch.rows]
            batch.step(ks)
            batch.retire([s for s in batch.rows if len(batch.tokens[s]) >= MAX_NEW[order[s]]])
            step += 1
            if step in joins:
                added = batch.admit(build(joins[step], aux))
                assert added == list(range(len(order), len(order) + len(joins[step])))
                order += joins[step]
        assert sorted(order) == list(range(len(PROMPTS)))
        for s, i in enumerate(order):
            want = alone(target, layers, (draft, draft), make, i, temperature)
            got = (batch.tokens[s][: MAX_NEW[i]], batch.accepted[s])
            assert got == want, (i, got, want)

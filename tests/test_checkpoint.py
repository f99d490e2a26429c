import pytest
import torch
from specbus.consumers.checkpoint import CheckpointManager
from specbus.consumers.cursor import SamplesCursor
from specbus.core.errors import CheckpointError

PLAN = {"strategy": {"name": "eagle3", "ttt_length": 7}, "micro_batch": 1, "world": 2}


def test_cursor_floor_advances_over_contiguous_runs():
    c = SamplesCursor()
    c.mark([2, 3, 5])
    assert (c.floor, c.done_above) == (0, {2, 3, 5})
    c.mark([1])
    assert (c.floor, c.done_above) == (3, {5})
    c.raise_floor(4)
    assert (c.floor, c.done_above) == (5, set())
    assert c.is_done(5) and not c.is_done(6)
    assert SamplesCursor.from_dict(c.to_dict()) == c


def test_save_load_rotation_latest_best(tmp_path):
    m = CheckpointManager(tmp_path, PLAN, keep=2)
    for step, score in [(1, 0.5), (2, 2.0), (3, 1.0), (4, 1.5)]:
        m.save(step, {"step": step, "w": torch.full((2,), float(step))}, score=score)
    kept = sorted(p.name for p in tmp_path.glob("step-*"))
    assert kept == ["step-00000002", "step-00000003", "step-00000004"]  # keep 2 + best
    assert m.load()["step"] == 4
    assert m.load("best")["step"] == 2


def test_mismatched_plan_is_refused_with_the_differing_keys(tmp_path):
    CheckpointManager(tmp_path, PLAN).save(1, {"step": 1})
    other = CheckpointManager(
        tmp_path, {**PLAN, "world": 4, "strategy": {"name": "eagle3", "ttt_length": 5}}
    )
    with pytest.raises(CheckpointError) as e:
        other.load()
    assert "world: checkpoint has 2, this run has 4" in str(e.value)
    assert "strategy.ttt_length" in str(e.value)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        CheckpointManager(tmp_path, PLAN).load()

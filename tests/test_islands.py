import pytest
from specbus.core.errors import ConfigError
from specbus.core.islands import IslandPlan


@pytest.mark.parametrize("world, tp", [(1, 1), (2, 2), (4, 2), (8, 4), (8, 1), (6, 3)])
def test_islands_are_contiguous_aligned_and_slices_disjoint(world, tp):
    plan = IslandPlan(world=world, tp=tp, micro_batch=2, accumulation=3)
    assert plan.num_islands * tp == world
    seen = set()
    for island in range(plan.num_islands):
        ranks = plan.ranks_of(island)
        assert ranks == list(range(ranks[0], ranks[0] + tp))  # contiguous TP peers
        assert plan.is_leader(ranks[0]) and not any(plan.is_leader(r) for r in ranks[1:])
        covered = []
        for rank in ranks:
            s = plan.slice_of(rank)
            covered += range(s.start, s.stop)
            assert s.stop - s.start == plan.per_rank
            seen.add(rank)
        # the peers' slices tile the island's aligned batch exactly once
        assert sorted(covered) == list(range(plan.island_batch))
    assert seen == set(range(world))
    assert plan.global_window == plan.num_islands * plan.island_batch


@pytest.mark.parametrize(
    "kw, needle", [({"world": 3, "tp": 2}, "multiple"), ({"world": 2, "tp": 0}, "tp=0")]
)
def test_bad_plans_are_refused_by_name(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        IslandPlan(micro_batch=1, accumulation=1, **kw)

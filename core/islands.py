"""Target tensor-parallel islands for colocated training: who captures what, who trains what.

With `world` ranks and a target TP width `tp`, the ranks form `world // tp` islands of `tp`
contiguous ranks (ranks 0..tp-1, tp..2tp-1, ...), as the seed's colocated runs do (a TP group
lives on neighbouring GPUs). Per optimizer step:
- each island's leader (its first rank) leases one aligned TP-wide batch of
  `tp * micro_batch * accumulation` tasks; its peers receive the same tasks (they run the
  same sharded target forward);
- peer `i` of an island trains the disjoint slice `[i * per_rank, (i + 1) * per_rank)` of it;
- islands are data-parallel: they lease disjoint tasks through the consumer group.
So every rank trains exactly `micro_batch * accumulation` samples per step and no sample is
trained twice. At the end of the data the tasks left over (fewer than a global window) are
trained too: a leader holding fewer than `tp` once nothing more can come captures them as its
island's last batch, cut unevenly, and the loader's ragged last step trains what every rank
holds (consumers/lockstep.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from specbus.core.errors import ConfigError


@dataclass(frozen=True)
class IslandPlan:
    """Target-TP islands of a colocated world (see the module doc); `ConfigError` for a world that is
    not a multiple of `tp`."""

    world: int
    tp: int
    micro_batch: int
    accumulation: int

    def __post_init__(self) -> None:
        for name in ("world", "tp", "micro_batch", "accumulation"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.world % self.tp:
            raise ConfigError(
                f"world size {self.world} is not a multiple of target.tp_size={self.tp}"
            )

    @property
    def num_islands(self) -> int:
        """How many islands the world forms."""
        return self.world // self.tp

    @property
    def per_rank(self) -> int:
        """Samples each rank trains per optimizer step."""
        return self.micro_batch * self.accumulation

    @property
    def island_batch(self) -> int:
        """Tasks one island captures per optimizer step (one aligned TP-wide batch)."""
        return self.tp * self.per_rank

    @property
    def global_window(self) -> int:
        """Samples trained per optimizer step by the whole world."""
        return self.world * self.per_rank

    def island_of(self, rank: int) -> int:
        """The island `rank` belongs to."""
        self._check_rank(rank)
        return rank // self.tp

    def ranks_of(self, island: int) -> list[int]:
        """The ranks of `island`, leader first."""
        if not 0 <= island < self.num_islands:
            raise ConfigError(f"island {island} is not in 0..{self.num_islands - 1}")
        return list(range(island * self.tp, (island + 1) * self.tp))

    def leader_of(self, rank: int) -> int:
        """The leader (first rank) of `rank`'s island."""
        return self.island_of(rank) * self.tp

    def is_leader(self, rank: int) -> bool:
        """True when `rank` leads its island."""
        return rank == self.leader_of(rank)

    def slice_of(self, rank: int) -> slice:
        """The part of its island's batch that `rank` trains."""
        peer = rank - self.leader_of(rank)
        return slice(peer * self.per_rank, (peer + 1) * self.per_rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is not in 0..{self.world - 1}")
